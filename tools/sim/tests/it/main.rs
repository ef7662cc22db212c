//! handoff-sim's tests: a seed replays byte for byte, the short run holds every invariant, and
//! each planted bug is caught by a seed of the short run whose replay reproduces it.

mod planted;
mod replay;
mod short_run;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use handoff_sim::{run_seed, Plant, Report};

/// Runs seeds `0..seeds` on every core; the failing report with the lowest seed, if any.
pub fn first_failure(seeds: u64, plant: Option<Plant>) -> Option<Report> {
    let next = AtomicU64::new(0);
    let failed: Mutex<Option<Report>> = Mutex::new(None);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= seeds
                    || failed
                        .lock()
                        .unwrap()
                        .as_ref()
                        .is_some_and(|f| f.seed < seed)
                {
                    return;
                }
                let report = run_seed(seed, plant);
                if report.violation.is_some() {
                    let mut failed = failed.lock().unwrap();
                    if failed.as_ref().is_none_or(|f| f.seed > seed) {
                        *failed = Some(report);
                    }
                }
            });
        }
    });
    failed.into_inner().unwrap()
}
