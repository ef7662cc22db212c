use std::time::Instant;

use crate::first_failure;

/// Seeds of the short run; `HANDOFF_SIM_SEEDS` overrides (the long run is
/// `handoff-sim run --seeds N`).
fn seeds() -> u64 {
    std::env::var("HANDOFF_SIM_SEEDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000)
}

#[test]
fn the_short_run_holds_every_invariant() {
    let seeds = seeds();
    let started = Instant::now();
    if let Some(report) = first_failure(seeds, None) {
        panic!(
            "seed {} failed: {}\n{}\nreplay: handoff-sim replay --seed {}",
            report.seed,
            report.violation.unwrap_or_default(),
            report.minimal.join("\n"),
            report.seed
        );
    }
    eprintln!("{seeds} seeds in {:.1} s", started.elapsed().as_secs_f64());
}
