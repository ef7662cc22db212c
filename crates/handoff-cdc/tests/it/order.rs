//! Per-aggregate order through the CDC source under concurrent writers (design P5, W3, P9):
//! eight writers commit small transactions over a shared set of aggregates, so writers of one
//! aggregate interleave (serialised by its head-row lock), some transactions span several
//! aggregates and some roll back, while the relay streams. Once with the plain transport, once
//! with seeded transient errors and lost acks.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{eventually, Fixture, Ledger, Seeded};
use handoff_cdc::RowMode;
use handoff_core::delivery::PublishErrorKind;
use handoff_core::NewEvent;
use handoff_test::factory;
use handoff_test::faults::{Fault, FaultStats, Faulty};

const WRITERS: u64 = 8;
const TRANSACTIONS_PER_WRITER: u64 = 50;
const AGGREGATES: u64 = 30;

/// What the writers did: the committed events and the ids of rolled-back ones.
struct Written {
    committed: Ledger,
    rolled_back: Vec<String>,
    /// The server's WAL position once the last writer's last transaction had committed.
    wal_after: u64,
}

/// Runs the writers to completion and returns what they committed.
async fn write_concurrently(fx: &Fixture, seed: u64) -> Written {
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let pool = fx.db.pool.clone();
        let outbox = fx.outbox.clone();
        writers.push(tokio::spawn(async move {
            let mut rng = Seeded::new(seed * 1000 + writer);
            let mut committed = Ledger::default();
            let mut rolled_back = Vec::new();
            for _ in 0..TRANSACTIONS_PER_WRITER {
                // One to three distinct aggregates, one or two events each: one enqueue call
                // locks their head rows in a fixed order, so writers never deadlock.
                let touched = 1 + rng.below(3);
                let mut aggregates: Vec<u64> = Vec::new();
                while aggregates.len() < touched as usize {
                    let a = rng.below(AGGREGATES);
                    if !aggregates.contains(&a) {
                        aggregates.push(a);
                    }
                }
                let events: Vec<NewEvent> = aggregates
                    .iter()
                    .flat_map(|a| {
                        let count = 1 + rng.below(2);
                        (0..count).map(move |k| factory::event(&format!("agg{a}"), k))
                    })
                    .collect();
                let mut tx = pool.begin().await.unwrap();
                let enqueued = outbox.enqueue(&mut tx, &events).await.unwrap();
                // Let other writers run while this one holds its head-row locks.
                tokio::task::yield_now().await;
                if rng.below(10) == 0 {
                    tx.rollback().await.unwrap();
                    rolled_back.extend(enqueued.iter().map(|e| e.event_id.to_string()));
                } else {
                    tx.commit().await.unwrap();
                    committed.record(&events, &enqueued);
                }
            }
            (committed, rolled_back)
        }));
    }
    let mut written = Written {
        committed: Ledger::default(),
        rolled_back: Vec::new(),
        wal_after: 0,
    };
    for writer in writers {
        let (committed, rolled_back) = writer.await.unwrap();
        written.committed.merge(committed);
        written.rolled_back.extend(rolled_back);
    }
    written.wal_after = fx.current_wal_lsn().await;
    written
}

/// Waits for the relay to catch up, then checks the stream, the rows and the slot.
async fn assert_caught_up(fx: &Fixture, written: &Written) {
    let expected = written.committed.len();
    assert!(expected > 500, "a real workload: {expected} events");
    assert!(
        !written.rolled_back.is_empty(),
        "some transactions rolled back"
    );
    eventually(
        "every committed event in the stream",
        Duration::from_secs(25),
        || async { fx.delivered().await.ids.len() >= expected },
    )
    .await;
    let delivered = fx.delivered().await;
    for id in &written.rolled_back {
        assert!(
            !delivered.ids.contains(id),
            "rolled-back event {id} was published"
        );
    }
    delivered.assert_exactly(&written.committed);

    eventually("rows marked published", Duration::from_secs(10), || async {
        fx.unpublished().await == 0
    })
    .await;
    // The position moves past everything written: not stuck before some transaction.
    eventually(
        "the slot confirmed past the last commit",
        Duration::from_secs(10),
        || async { fx.slot().await.confirmed_flush_lsn >= written.wal_after },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_interleaving_on_shared_aggregates_keep_each_aggregates_order() {
    let fx = Fixture::start("cdc_order_writers", RowMode::Keep, &[]).await;
    let relay = fx.relay().await;
    let written = write_concurrently(&fx, 1).await;
    assert_caught_up(&fx, &written).await;
    let report = relay.stop().await;
    assert!(report.published as usize >= written.committed.len());
    assert_eq!(report.held, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn order_survives_transient_publish_errors_and_lost_acks() {
    let fx = Fixture::start("cdc_order_faults", RowMode::Keep, &[]).await;
    let stats = Arc::new(FaultStats::default());
    let relay = fx
        .relay_over(|inner| {
            Faulty::new(inner)
                .seeded(7)
                .sometimes(10, Fault::Fail(PublishErrorKind::Transient))
                .sometimes(10, Fault::AckLost)
                .with_stats(stats.clone())
        })
        .await;
    let written = write_concurrently(&fx, 2).await;
    assert_caught_up(&fx, &written).await;
    let report = relay.stop().await;
    assert!(
        stats.injected() > 50,
        "faults were injected: {}",
        stats.injected()
    );
    assert!(report.retried > 0, "and retried");
    assert_eq!(report.held, 0, "transient faults never hold an event");
}
