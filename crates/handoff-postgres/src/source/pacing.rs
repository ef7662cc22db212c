//! How often a relay polls while traffic flows: it lingers on polls instead of sleeping on
//! LISTEN, paced by what its recent claims took.

use std::time::Duration;

use super::PollingSource;

/// How long after its last non-empty claim a relay keeps polling, every [`BUSY_POLL`], instead
/// of registering for a notification.
///
/// A registered relay makes every committing writer notify, and notifying commits serialise on
/// a cluster-wide lock (migration 0002). Under steady traffic the relay runs dry between
/// commits all the time; were it to register each time, every writer would notify. So it
/// registers only once traffic has stopped for this long: at steady load no writer notifies,
/// and an idle relay still sleeps on LISTEN, costing at most its registration renewals.
pub(super) const LINGER: Duration = Duration::from_secs(1);

/// The poll interval while lingering, as long as claims are quick: what it adds to
/// commit-to-broker latency at steady load (at most this, half of it on average).
const BUSY_POLL: Duration = Duration::from_millis(5);

/// While lingering, the pause between claims is at least as long as the quickest of the last
/// this many claims ([`PollingSource::claim_costs`]), up to [`BUSY_POLL_MAX`].
///
/// A claim's cost is mostly per statement, not per event: planning it alone takes about a
/// millisecond. At a fixed 5 ms poll, a relay keeping up with writers that saturate the database
/// spent close to half a core of PostgreSQL on its claims and marks, taken from the writers
/// (`handoff-bench writers`: 0.67 of their throughput without a relay). Claims that are all
/// slow are the sign of a busy database: the relay then polls less often, so its claims occupy
/// at most half of a backend, and each claim carries more events for the same fixed cost (0.72
/// and 0.75 at 8 and 16 writers). On a database with room to spare claims take a millisecond
/// or two and the pause stays [`BUSY_POLL`].
///
/// The least of the last few claims, not their mean, and once it, not more: under a held xmin
/// horizon some claims are slow because they read dead row versions, not because the database
/// is busy, and a longer pause there only adds latency. Paced by twice the mean, the
/// commit-to-broker p99 of the last minute of a held horizon doubled (40.8 ms against 16.3 ms
/// clean); by the mean, 1.8 and 2.3 times the clean one in two runs; by 1.5 times the least,
/// 2.2 times; by the least, 1.95 and 1.74 times in two runs.
pub(super) const CLAIM_COSTS: usize = 4;

/// The longest pause between claims while lingering, however long claims take: bounds what a
/// busy database adds to commit-to-broker latency.
const BUSY_POLL_MAX: Duration = Duration::from_millis(20);

impl PollingSource {
    /// Keeps one claim's duration in [`PollingSource::claim_costs`], in place of the oldest.
    pub(super) fn record_claim_cost(&self, took: Duration) {
        let mut costs = self.claim_costs.lock().unwrap_or_else(|e| e.into_inner());
        let (last, next) = &mut *costs;
        last[*next] = took;
        *next = (*next + 1) % CLAIM_COSTS;
    }

    /// The pause between claims while lingering: [`BUSY_POLL`], or the quickest of the last
    /// [`CLAIM_COSTS`] claims when that is longer, at most [`BUSY_POLL_MAX`].
    pub(super) fn busy_poll(&self) -> Duration {
        let costs = self.claim_costs.lock().unwrap_or_else(|e| e.into_inner());
        let quickest = costs.0.iter().min().copied().unwrap_or_default();
        quickest.clamp(BUSY_POLL, BUSY_POLL_MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PollingConfig;

    /// The pause between polls while lingering follows the quickest of the last claims: one
    /// slow claim among quick ones (a claim reading dead row versions) does not lengthen it,
    /// claims that are all slow (a busy database) do, up to its bound.
    #[tokio::test]
    async fn the_pause_between_polls_follows_the_quickest_of_the_last_claims() {
        // Never connects: only the pacing is exercised.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let source = PollingSource::new(pool, PollingConfig::default()).unwrap();
        let ms = Duration::from_millis;
        assert_eq!(source.busy_poll(), BUSY_POLL, "no claim yet");

        for took in [ms(2), ms(40), ms(3), ms(1)] {
            source.record_claim_cost(took);
        }
        assert_eq!(source.busy_poll(), BUSY_POLL, "quick claims, one slow");

        for took in [ms(9), ms(12), ms(8), ms(30)] {
            source.record_claim_cost(took);
        }
        assert_eq!(source.busy_poll(), ms(8), "all slow: the quickest of them");

        for took in [ms(60), ms(45), ms(90), ms(50)] {
            source.record_claim_cost(took);
        }
        assert_eq!(source.busy_poll(), BUSY_POLL_MAX, "bounded");

        source.record_claim_cost(ms(1));
        assert_eq!(source.busy_poll(), BUSY_POLL, "one quick claim is enough");
    }
}
