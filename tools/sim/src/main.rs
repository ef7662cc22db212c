//! `handoff-sim`: runs seeds of the deterministic simulation (`run`) or replays one (`replay`).

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use clap::{Parser, Subcommand};
use handoff_sim::{run_seed, Plant};

/// Deterministic simulation of handoff's relay under seeded faults in simulated time.
#[derive(Parser)]
#[command(name = "handoff-sim", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs seeds `from..from+seeds`; stops at the first failing seed and prints its minimal
    /// trace.
    Run {
        /// How many seeds.
        #[arg(long, default_value_t = 10_000)]
        seeds: u64,
        /// The first seed.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Threads running seeds (each seed is single-threaded and deterministic on its own).
        #[arg(long, default_value_t = std::thread::available_parallelism().map_or(1, |n| n.get()))]
        threads: usize,
        /// Plants a bug, to see the simulator catch it.
        #[arg(long, value_enum)]
        plant: Option<Plant>,
    },
    /// Runs one seed and prints its whole trace: the same run, byte for byte, every time.
    Replay {
        /// The seed.
        #[arg(long)]
        seed: u64,
        /// The bug planted in the run being replayed, if any.
        #[arg(long, value_enum)]
        plant: Option<Plant>,
        /// Print only the minimal trace (the failing aggregate's lines and the faults).
        #[arg(long)]
        minimal: bool,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Run {
            seeds,
            from,
            threads,
            plant,
        } => run(seeds, from, threads.max(1), plant),
        Command::Replay {
            seed,
            plant,
            minimal,
        } => {
            let report = run_seed(seed, plant);
            let lines = if minimal {
                &report.minimal
            } else {
                &report.trace
            };
            for line in lines {
                println!("{line}");
            }
            match report.violation {
                Some(_) => ExitCode::FAILURE,
                None => ExitCode::SUCCESS,
            }
        }
    }
}

fn run(seeds: u64, from: u64, threads: usize, plant: Option<Plant>) -> ExitCode {
    let started = Instant::now();
    let next = AtomicU64::new(from);
    let done = AtomicU64::new(0);
    let end = from.saturating_add(seeds);
    let failed = std::sync::Mutex::new(None::<handoff_sim::Report>);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                if failed.lock().map(|f| f.is_some()).unwrap_or(true) {
                    return;
                }
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= end {
                    return;
                }
                let report = run_seed(seed, plant);
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if report.violation.is_some() {
                    let mut failed = failed.lock().unwrap_or_else(|e| e.into_inner());
                    if failed.as_ref().is_none_or(|f| f.seed > seed) {
                        *failed = Some(report);
                    }
                } else if n.is_multiple_of(100_000) {
                    let rate = n as f64 / started.elapsed().as_secs_f64();
                    eprintln!("{n} seeds, {rate:.0} seeds/s");
                }
            });
        }
    });
    let n = done.load(Ordering::Relaxed);
    let secs = started.elapsed().as_secs_f64();
    let failed = failed.into_inner().unwrap_or_else(|e| e.into_inner());
    match failed {
        Some(report) => {
            for line in &report.minimal {
                println!("{line}");
            }
            println!(
                "seed {} FAILED: {}\nreplay: handoff-sim replay --seed {}{}",
                report.seed,
                report.violation.unwrap_or_default(),
                report.seed,
                plant.map_or(String::new(), |p| format!(
                    " --plant {}",
                    clap::ValueEnum::to_possible_value(&p)
                        .map_or(String::new(), |v| v.get_name().to_owned())
                )),
            );
            ExitCode::FAILURE
        }
        None => {
            println!(
                "{n} seeds from {from}: no violation ({secs:.1} s, {:.0} seeds/s, {threads} threads)",
                n as f64 / secs
            );
            ExitCode::SUCCESS
        }
    }
}
