//! Where a claim starts reading the claim index (aggregate order): a little below the previous
//! claim's front, deeper now and then, with a sweep for what lands further back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::sweep::{self, SWEEP_EVERY};
use super::PollingSource;

/// How far below where its previous claim's front began a claim starts reading the claim
/// index (the first claim of a source reads it from its start), but for one claim every
/// [`DEEP_EVERY`], which reads from [`DEEP_LOOKBACK`] below it.
///
/// Every lease and every mark leaves a dead version of its row in the index, and while some
/// session holds the xmin horizon back (a forgotten `BEGIN` with an XID, a long report) no
/// vacuum can remove them: a scan from the index's start would walk every event processed
/// since, more with every minute, and even the part just below the front holds two dead
/// versions per event of that span (the row as written and its lease's end), each a heap
/// visit. Rows become claimable at or after the front almost always: a writer's row is
/// available from its transaction's start, a released, retried, backed-off or freed row from
/// when that happened. So a claim looks back this little; a writer's row whose transaction ran
/// longer is found by the next deep claim, and what lands further back still (a longer
/// transaction, a lease that ran out while no claim looked) by a sweep every [`SWEEP_EVERY`],
/// apart from the claims, which makes it available now.
///
/// handoff-bench held-xmin (800 events/s, 200 s held): with a 2 s look-back at every claim the
/// claim p50 rose from 4.8 to 7.7 ms and the last-minute commit → broker p99 was 2.1 to 2.2
/// times the clean phase's; with 500 ms, 5.0 ms and 1.07 times.
pub(super) const LOOKBACK: chrono::TimeDelta = chrono::TimeDelta::milliseconds(500);

/// How often a claim reads from [`DEEP_LOOKBACK`] below the front instead of [`LOOKBACK`]:
/// how much later a row whose writer's transaction ran longer than [`LOOKBACK`] can be
/// claimed.
const DEEP_EVERY: Duration = Duration::from_millis(250);

/// How far below the front a deep claim reads (see [`LOOKBACK`]); the sweep works below it.
const DEEP_LOOKBACK: chrono::TimeDelta = chrono::TimeDelta::seconds(2);

/// Where a claim starts reading the claim index (aggregate order; see [`LOOKBACK`]).
#[derive(Default)]
pub(super) struct ScanFrom {
    /// Where the previous claim's front began.
    pub(super) front_at: Option<DateTime<Utc>>,
    /// How many rows the next claim's front reads, as the previous claim found enough
    /// (`next_front` of `claim.sql`); none before the first claim (four batches).
    pub(super) front_rows: Option<i64>,
    /// When the last deep claim ([`DEEP_LOOKBACK`]) started.
    deep_at: Option<Instant>,
    /// When the last sweep for stragglers started.
    swept_at: Option<Instant>,
    /// Whether a sweep is running now.
    sweeping: Arc<AtomicBool>,
}

impl PollingSource {
    /// Where this claim reads the claim index from: the start for the first claim (aggregate
    /// order), a little below the previous claim's front afterwards ([`LOOKBACK`], or
    /// [`DEEP_LOOKBACK`] once every [`DEEP_EVERY`]). Starts a sweep for what lands below
    /// [`DEEP_LOOKBACK`] every [`SWEEP_EVERY`].
    pub(super) fn scan_from(&self) -> Option<DateTime<Utc>> {
        let mut scan = self.scan.lock().unwrap_or_else(|e| e.into_inner());
        let front_at = scan.front_at?;
        let from = front_at - DEEP_LOOKBACK;
        let deep = scan.deep_at.is_none_or(|at| at.elapsed() >= DEEP_EVERY);
        let scan_from = if deep {
            scan.deep_at = Some(Instant::now());
            from
        } else {
            front_at - LOOKBACK
        };
        let due = scan.swept_at.is_none_or(|at| at.elapsed() >= SWEEP_EVERY);
        if due && !scan.sweeping.swap(true, Ordering::AcqRel) {
            scan.swept_at = Some(Instant::now());
            let sweeping = Arc::clone(&scan.sweeping);
            sweep::start(
                self.pool.clone(),
                Arc::clone(&self.sql.sweep_stragglers),
                self.config.pooling,
                from,
                sweeping,
            );
        }
        Some(scan_from)
    }
}
