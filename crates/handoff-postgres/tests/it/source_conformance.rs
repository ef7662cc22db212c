//! The source conformance suite (`handoff_test::source_conformance`) on this crate's two
//! sources: the polling source and the log source, each on a schema of its own per case.

use std::time::Duration;

use handoff_postgres::{LogConfig, LogSource, OrderMode, PollingConfig, PollingSource, Schema};
use handoff_test::source_conformance::SourceDriver;
use handoff_test::TestDb;

/// The relay settings both sources are opened with: the case's schema, no LISTEN (the cases
/// claim on their own schedule), `lease`.
fn polling_config(db: &TestDb, relay_id: &str, lease: Duration, order: OrderMode) -> PollingConfig {
    PollingConfig {
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: relay_id.into(),
        listen: false,
        lease,
        order,
        ..PollingConfig::default()
    }
}

mod polling {
    use super::*;

    struct Polling {
        db: TestDb,
    }

    impl SourceDriver for Polling {
        type Source = PollingSource;
        const NAME: &'static str = "polling";

        async fn start(case: &'static str) -> Self {
            Polling {
                db: TestDb::migrated(&format!("sc_polling_{case}")).await,
            }
        }

        fn db(&self) -> &TestDb {
            &self.db
        }

        async fn open(&self, relay_id: &str, lease: Duration) -> PollingSource {
            let config = polling_config(&self.db, relay_id, lease, OrderMode::Aggregate);
            PollingSource::new(self.db.pool.clone(), config).unwrap()
        }

        async fn open_global(&self, relay_id: &str) -> Option<PollingSource> {
            let lease = handoff_test::source_conformance::LONG_LEASE;
            let config = polling_config(&self.db, relay_id, lease, OrderMode::Global);
            Some(PollingSource::new(self.db.pool.clone(), config).unwrap())
        }
    }

    handoff_test::source_conformance_suite!(Polling;
        run: [
            order_per_aggregate_across_batches,
            late_commit_is_not_missed_and_rollback_never_comes_out,
            a_retry_comes_back_after_its_delay_and_holds_only_its_aggregate,
            a_held_aggregate_waits_for_an_operator_retry,
            released_events_come_out_again,
            a_second_instance_never_duplicates_or_reorders,
            a_dead_instance_is_taken_over_after_its_lease,
            a_hole_holds_its_aggregate_until_skipped,
            a_global_lane_comes_out_in_global_order,
        ],
        skip: []);
}

mod log {
    use super::*;

    struct Log {
        db: TestDb,
    }

    impl SourceDriver for Log {
        type Source = LogSource;
        const NAME: &'static str = "log";
        // LogConfig::advance_every: the cursor's row is written once a second at most.
        const PACES_PROGRESS: bool = true;

        async fn start(case: &'static str) -> Self {
            Log {
                db: TestDb::migrated(&format!("sc_log_{case}")).await,
            }
        }

        fn db(&self) -> &TestDb {
            &self.db
        }

        async fn open(&self, relay_id: &str, lease: Duration) -> LogSource {
            let config = LogConfig {
                polling: polling_config(&self.db, relay_id, lease, OrderMode::Aggregate),
                // Small pages: a range is read in several.
                page_size: 16,
                ..LogConfig::default()
            };
            LogSource::new(self.db.pool.clone(), config).unwrap()
        }
    }

    handoff_test::source_conformance_suite!(Log;
    run: [
        order_per_aggregate_across_batches,
        late_commit_is_not_missed_and_rollback_never_comes_out,
        a_retry_comes_back_after_its_delay_and_holds_only_its_aggregate,
        a_held_aggregate_waits_for_an_operator_retry,
        released_events_come_out_again,
        a_second_instance_never_duplicates_or_reorders,
        a_dead_instance_is_taken_over_after_its_lease,
        a_hole_holds_its_aggregate_until_skipped,
    ],
    skip: [
        a_global_lane_comes_out_in_global_order = "the log source publishes aggregate order only (LogConfig refuses OrderMode::Global): the global lane is a polling relay's",
    ]);
}
