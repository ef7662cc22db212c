//! `handoff-bench writers`: what a running relay costs the writers, and how fast it publishes
//! what they commit.
//!
//! Throughput: the order service's own write (an order row, its lines and idempotency record,
//! and the `OrderCreated` outbox row in one statement: the write-path bench's `with_outbox`)
//! back to back from `--clients` connections, with no relay (the baseline) and with one relay
//! with its defaults running and keeping up; the variants alternate within every round, and the
//! backlog left when the writers stop shows whether the relay kept up. Latency: the relay
//! bench's `notify` scenario (a paced writer, commit → broker) at fixed rates.

use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;
use sqlx::PgConnection;

use super::{ratio, setup, BrokerArgs};
use crate::harness::{median_run, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::machine::{commit_probe, Machine};
use crate::relay::cpu::{self, CpuShare};
use crate::relay::latency::{self, LatencyRun, SCENARIOS, SETTLE};
use crate::relay::live::LiveRelay;
use crate::relay::probe::SourceStats;
use crate::relay::workload;
use crate::relay::{met, Bench, Goal};
use crate::write_path::{self, Variant};

/// Goal of the issue: writer throughput with a relay at least this share of none.
const GOAL_THROUGHPUT: f64 = 0.7;

/// Goal of the issue: commit → broker p99 at every fixed rate, in ms.
const GOAL_P99_MS: f64 = 25.0;

/// Flags of `handoff-bench writers`.
#[derive(clap::Args)]
pub struct WritersArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    #[command(flatten)]
    broker: BrokerArgs,
    /// Writer client counts.
    #[arg(long, value_delimiter = ',', default_value = "8,16")]
    clients: Vec<usize>,
    /// Seconds per (variant, clients) cell per round.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Rounds; the median per cell is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Fixed rates (events/s) of the commit → broker measurement.
    #[arg(long, value_delimiter = ',', default_value = "500,1000")]
    rates: Vec<u32>,
    /// Seconds the paced writer runs per rate.
    #[arg(long, default_value_t = 20)]
    latency_seconds: u64,
    /// Writer connections of the paced writer.
    #[arg(long, default_value_t = 8)]
    latency_writers: usize,
    /// The relay's source: `polling` (the default) or `log` (the default cursor).
    #[arg(long, value_enum, default_value = "polling")]
    source: crate::relay::live::SourceKind,
    #[command(flatten)]
    report: ReportArgs,
}

/// One throughput cell.
#[derive(Debug, Clone, Serialize)]
struct Cell {
    /// Whether a relay ran beside the writers.
    relay: bool,
    /// The writers' figures.
    write: write_path::Cell,
    /// Unpublished events when the writers stopped (with a relay: how far behind it was).
    backlog_at_end: i64,
    /// Orders committed in the cell.
    orders: i64,
    /// Who used the CPU while the writers ran: with a relay, `relay_backends` is what its
    /// claims, marks and wake-up queries cost PostgreSQL.
    cpu: CpuShare,
    /// The relay's claims and marks while the writers ran (none without a relay): how many
    /// statements it spent on their events.
    source: Option<SourceStats>,
}

/// Per client count, the median cells and their ratio.
#[derive(Debug, Serialize)]
struct Row {
    clients: usize,
    no_relay: Cell,
    with_relay: Cell,
    goal: Goal,
}

/// The whole run, as written to `--json`.
#[derive(Serialize)]
struct Results {
    machine: Machine,
    seconds: u64,
    rounds: usize,
    throughput: Vec<Row>,
    latency: Vec<LatencyRun>,
    latency_goals: Vec<Goal>,
}

/// Runs the throughput cells and the latency rates, prints the tables, writes the JSON.
pub async fn writers(args: WritersArgs) -> Result<()> {
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(
        args.clients.iter().all(|&c| c > 0) && args.latency_writers > 0,
        "client counts must be at least 1"
    );
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        let (mut bench, mut admin, mut machine) =
            setup(scratch, &args.broker, None, true, Duration::ZERO).await?;
        bench.source = args.source;
        eprintln!(
            "writers: clients {:?}, {} s per cell, {} round(s); rates {:?} for {} s",
            args.clients, args.seconds, args.rounds, args.rates, args.latency_seconds
        );
        let mut throughput = Vec::new();
        for &clients in &args.clients {
            let mut cells: [Vec<Cell>; 2] = [Vec::new(), Vec::new()];
            for round in 0..args.rounds {
                let order = if round % 2 == 0 {
                    [false, true]
                } else {
                    [true, false]
                };
                for relay in order {
                    let cell = cell(&bench, &mut admin, relay, clients, args.seconds).await?;
                    eprintln!(
                        "  round {} x{clients} relay {relay}: {:.0} orders/s, backlog at the end {}; {}",
                        round + 1,
                        cell.write.orders_per_second,
                        cell.backlog_at_end,
                        cell.cost(args.seconds),
                    );
                    cells[usize::from(relay)].push(cell);
                }
            }
            let [no_relay, with_relay] =
                cells.map(|c| median_run(&c, |c| c.write.orders_per_second));
            let value = ratio(
                with_relay.write.orders_per_second,
                no_relay.write.orders_per_second,
            );
            throughput.push(Row {
                clients,
                goal: Goal {
                    goal: format!(
                        "orders/s with a relay / without, {clients} clients >= {GOAL_THROUGHPUT}"
                    ),
                    value,
                    met: value >= GOAL_THROUGHPUT,
                },
                no_relay,
                with_relay,
            });
        }

        let mut latency = Vec::new();
        for &rate in &args.rates {
            let run = latency::run(
                &bench,
                &mut admin,
                SCENARIOS[0],
                rate,
                Duration::from_secs(args.latency_seconds),
                args.latency_writers,
            )
            .await?;
            eprintln!(
                "  latency at {rate}/s: p50 {:.1} ms, p99 {:.1} ms ({} events, {} missing)",
                run.p50_ms, run.p99_ms, run.committed, run.missing
            );
            latency.push(run);
        }
        let latency_goals = latency
            .iter()
            .map(|r| Goal {
                goal: format!(
                    "commit -> broker p99 at {}/s <= {GOAL_P99_MS} ms",
                    r.target_rate
                ),
                value: r.p99_ms,
                met: r.p99_ms <= GOAL_P99_MS && r.missing == 0,
            })
            .collect();
        bench.delete_stream().await?;
        machine.commit_ms_at_end = commit_probe(&mut admin).await?;
        let results = Results {
            machine,
            seconds: args.seconds,
            rounds: args.rounds,
            throughput,
            latency,
            latency_goals,
        };
        print(&results);
        args.report.write(&results)
    })
    .await
}

/// One cell: the tables emptied, then `clients` writers for `seconds`, with or without a relay.
async fn cell(
    bench: &Bench,
    admin: &mut PgConnection,
    relay: bool,
    clients: usize,
    seconds: u64,
) -> Result<Cell> {
    write_path::reset(admin).await?;
    let transport = bench.transport().await?;
    bench.recreate_stream(&transport).await?;
    let mut running = None;
    if relay {
        let origin = Instant::now();
        let live =
            LiveRelay::start(bench, "bench-writers", SCENARIOS[0], transport, origin).await?;
        running = Some(live);
        // Asleep, registered for the writers' notifications, before the first order.
        tokio::time::sleep(SETTLE).await;
    }
    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let write = write_path::measure(
        &bench.options,
        Variant::WithOutbox,
        clients,
        Duration::from_secs(seconds),
    )
    .await?;
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    let backlog_at_end = workload::unpublished(admin).await?;
    let source = running.as_ref().map(|live| live.source.stats());
    if let Some(mut live) = running {
        live.stop().await?;
    }
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&mut *admin)
        .await?;
    Ok(Cell {
        relay,
        write,
        backlog_at_end,
        orders,
        cpu,
        source,
    })
}

impl Cell {
    /// What the cell cost, in a line: busy cores, PostgreSQL's share and the relay's part of
    /// it, and the relay's statements per second with their mean size and duration.
    fn cost(&self, seconds: u64) -> String {
        let mut line = format!(
            "cpu: machine {:.2}, postgres {:.2} (relay {:.2}), nats {:.2}, bench {:.2}",
            self.cpu.machine_busy.unwrap_or(f64::NAN),
            self.cpu.postgres_backends,
            self.cpu.relay_backends,
            self.cpu.nats_server.unwrap_or(f64::NAN),
            self.cpu.bench.unwrap_or(f64::NAN),
        );
        if let Some(source) = &self.source {
            let per_second = |calls: usize| calls as f64 / seconds.max(1) as f64;
            line.push_str(&format!(
                "; claims {:.0}/s x {:.1} events, p50 {:.2} ms; marks {:.0}/s x {:.1}, p50 {:.2} ms",
                per_second(source.claims.calls),
                source.claims.mean_items,
                source.claims.p50_ms,
                per_second(source.marks.calls),
                source.marks.mean_items,
                source.marks.p50_ms,
            ));
        }
        line
    }
}

fn print(results: &Results) {
    println!();
    println!("| clients | no relay (orders/s) | with relay (orders/s) | ratio | p99 ms no relay / relay | backlog at end with relay |");
    println!("|--------:|--------------------:|----------------------:|------:|------------------------:|--------------------------:|");
    for row in &results.throughput {
        println!(
            "| {} | {:.0} | {:.0} | {:.2} | {:.2} / {:.2} | {} |",
            row.clients,
            row.no_relay.write.orders_per_second,
            row.with_relay.write.orders_per_second,
            row.goal.value,
            row.no_relay.write.p99_ms,
            row.with_relay.write.p99_ms,
            row.with_relay.backlog_at_end,
        );
    }
    println!();
    println!("| rate (events/s) | achieved | events | p50 ms | p99 ms | max ms | missing | publish-ack p99 ms |");
    println!("|----------------:|---------:|-------:|-------:|-------:|-------:|--------:|-------------------:|");
    for run in &results.latency {
        println!(
            "| {} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {} | {:.2} |",
            run.target_rate,
            run.achieved_rate,
            run.committed,
            run.p50_ms,
            run.p99_ms,
            run.max_ms,
            run.missing,
            run.transport.ack_p99_ms,
        );
    }
    println!();
    for goal in results
        .throughput
        .iter()
        .map(|r| &r.goal)
        .chain(&results.latency_goals)
    {
        println!("{}: {:.2}, {}", goal.goal, goal.value, met(goal.met));
    }
}
