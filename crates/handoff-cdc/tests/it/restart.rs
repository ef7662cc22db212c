//! Restarts of the CDC relay with work left unconfirmed (design P4, P9, F4, V3): a graceful stop,
//! a kill in the middle of publishing (events accepted by the broker, outcomes never written),
//! events committed while no relay runs, and a hot standby on the same slot. Every event must
//! end up in the stream exactly once by id (JetStream's dedup absorbs the republishes) and in
//! order per aggregate, from the slot's last confirmed position.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{eventually, Fixture, Ledger};
use handoff_cdc::RowMode;
use handoff_core::NewEvent;
use handoff_relay::Backoff;
use handoff_test::factory;
use handoff_test::faults::{Fault, FaultStats, Faulty};

const AGGREGATES: u64 = 30;

/// Commits rounds `rounds` of the workload: per round, one transaction per aggregate with two
/// events of it, aggregates interleaved in commit order.
async fn write_rounds(fx: &Fixture, ledger: &mut Ledger, rounds: std::ops::Range<u64>) {
    for round in rounds {
        for aggregate in 0..AGGREGATES {
            let events: Vec<NewEvent> = (0..2)
                .map(|k| factory::event(&format!("r{aggregate}"), round * 2 + k))
                .collect();
            let enqueued = fx.commit(&events).await;
            ledger.record(&events, &enqueued);
        }
    }
}

/// Waits for the stream to hold the ledger, then checks it, the rows and the slot's position.
async fn assert_all_delivered_once(fx: &Fixture, ledger: &Ledger, rows: RowMode) {
    let wal_after = fx.current_wal_lsn().await;
    eventually(
        "every committed event in the stream",
        Duration::from_secs(20),
        || async { fx.delivered().await.ids.len() >= ledger.len() },
    )
    .await;
    fx.delivered().await.assert_exactly(ledger);
    eventually(
        "no row left unpublished",
        Duration::from_secs(10),
        || async { fx.unpublished().await == 0 },
    )
    .await;
    if rows == RowMode::Keep {
        assert_eq!(fx.db.count("outbox").await, ledger.len() as i64);
    }
    eventually(
        "the slot confirmed past every commit",
        Duration::from_secs(10),
        || async { fx.slot().await.confirmed_flush_lsn >= wal_after },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stopped_gracefully_resumes_and_publishes_what_was_committed_meanwhile() {
    let fx = Fixture::start("cdc_restart_graceful", RowMode::Keep, &[]).await;
    let mut ledger = Ledger::default();
    let first = fx.relay().await;
    write_rounds(&fx, &mut ledger, 0..3).await;
    eventually(
        "the first batch published",
        Duration::from_secs(15),
        || async { fx.delivered().await.ids.len() >= ledger.len() },
    )
    .await;
    first.stop().await;
    eventually("the slot released", Duration::from_secs(10), || async {
        fx.slot().await.active_pid.is_none()
    })
    .await;

    // Committed while no relay runs: only the slot (and the rows) remember them.
    write_rounds(&fx, &mut ledger, 3..6).await;
    let second = fx.relay().await;
    assert_all_delivered_once(&fx, &ledger, RowMode::Keep).await;
    second.stop().await;
}

async fn killed_mid_stream_then_restarted(name: &str, rows: RowMode) {
    let fx = Fixture::start(name, rows, &[]).await;
    let mut ledger = Ledger::default();
    let stats = Arc::new(FaultStats::default());
    // After 150 acknowledged publishes, every publish reaches the broker and never returns:
    // the relay dies with events accepted but neither marked nor settled.
    let first = fx
        .relay_over(|inner| {
            Faulty::new(inner)
                .after(150, Fault::Stall)
                .with_stats(stats.clone())
        })
        .await;
    write_rounds(&fx, &mut ledger, 0..10).await;
    eventually(
        "the first relay stuck mid-stream",
        Duration::from_secs(15),
        || async { stats.stalled() >= 10 },
    )
    .await;
    let in_stream = fx.delivered().await.ids.len();
    assert!(
        in_stream > 150 && in_stream < ledger.len(),
        "killed mid-stream: {in_stream} of {} in the stream",
        ledger.len()
    );
    let confirmed_at_kill = fx.slot().await.confirmed_flush_lsn;
    first.abort().await;

    write_rounds(&fx, &mut ledger, 10..13).await;
    let second = fx.relay().await;
    assert_all_delivered_once(&fx, &ledger, rows).await;
    assert!(fx.slot().await.confirmed_flush_lsn > confirmed_at_kill);
    let report = second.stop().await;
    // The killed relay's accepted-but-unsettled events are published again (deduplicated by
    // the stream), never skipped.
    assert!(
        report.published as usize >= ledger.len() - 150,
        "{} published after the restart",
        report.published
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_stream_with_kept_rows_loses_nothing_and_keeps_order() {
    killed_mid_stream_then_restarted("cdc_restart_kill_keep", RowMode::Keep).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_stream_with_deleted_rows_loses_nothing_and_keeps_order() {
    // The slot is the only copy of the unconfirmed events here: a position confirmed past any
    // of them would lose it for good.
    killed_mid_stream_then_restarted("cdc_restart_kill_delete", RowMode::Delete).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_relay_on_the_same_slot_stands_by_and_takes_over_when_the_first_stops() {
    let fx = Fixture::start("cdc_restart_standby", RowMode::Keep, &[]).await;
    let mut ledger = Ledger::default();
    let by_first = Arc::new(FaultStats::default());
    let by_second = Arc::new(FaultStats::default());
    let first = fx
        .relay_over(|inner| Faulty::new(inner).with_stats(by_first.clone()))
        .await;
    eventually(
        "the first relay streaming",
        Duration::from_secs(10),
        || async { fx.slot().await.active_pid.is_some() },
    )
    .await;
    let first_pid = fx.slot().await.active_pid;
    // The standby retries often, so the takeover is quick once the slot is free.
    let mut config = fx.logical_config();
    config.reconnect = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(300),
    };
    let second = fx
        .relay_with(config, |inner| {
            Faulty::new(inner).with_stats(by_second.clone())
        })
        .await;

    write_rounds(&fx, &mut ledger, 0..3).await;
    eventually(
        "the first batch published",
        Duration::from_secs(15),
        || async { fx.delivered().await.ids.len() >= ledger.len() },
    )
    .await;
    assert_eq!(
        fx.slot().await.active_pid,
        first_pid,
        "the slot stayed with the first relay"
    );
    assert_eq!(
        by_second.acknowledged(),
        0,
        "the standby published nothing while the first streamed"
    );
    assert!(by_first.acknowledged() as usize >= ledger.len());

    first.stop().await;
    write_rounds(&fx, &mut ledger, 3..6).await;
    assert_all_delivered_once(&fx, &ledger, RowMode::Keep).await;
    assert!(
        by_second.acknowledged() >= 3 * 2 * AGGREGATES,
        "the standby published the second batch"
    );
    let now = fx.slot().await.active_pid;
    assert!(
        now.is_some() && now != first_pid,
        "the standby holds the slot"
    );
    second.stop().await;
}

/// `blocked` and `published_at IS NOT NULL` of `aggregate`'s event `sequence`.
async fn parked_and_published(fx: &Fixture, aggregate: &str, sequence: i64) -> (bool, bool) {
    sqlx::query_as(
        "SELECT blocked, published_at IS NOT NULL FROM outbox
         WHERE aggregate_id = $1 AND aggregate_sequence = $2",
    )
    .bind(aggregate)
    .bind(sequence)
    .fetch_one(&fx.db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_polling_relay_parked_is_freed_by_the_logical_sources_mark() {
    use handoff_core::delivery::{Failure, Source};
    use handoff_postgres::{PollingConfig, PollingSource};

    let fx = Fixture::start("cdc_restart_unparks", RowMode::Keep, &[]).await;
    let polling = PollingSource::new(
        fx.db.pool.clone(),
        PollingConfig {
            schema: fx.schema(),
            relay_id: "polling-relay".into(),
            ..PollingConfig::default()
        },
    )
    .unwrap();

    // Polling: p#1 fails and backs off for an hour; p#2, written meanwhile, is parked behind
    // it by the next claim.
    fx.enqueue("p", 1, 1).await;
    let leased = polling.claim(10, usize::MAX).await.unwrap();
    assert_eq!(leased.events.len(), 1);
    polling
        .record_failures(&[Failure {
            event_id: leased.events[0].event_id,
            error: "broker unavailable".into(),
            retry_after: Some(Duration::from_secs(3600)),
            counts_as_attempt: true,
            hold_reason: None,
            lease: leased.lease,
        }])
        .await
        .unwrap();
    fx.enqueue("p", 2, 1).await;
    assert!(polling
        .claim(10, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    assert_eq!(parked_and_published(&fx, "p", 2).await, (true, false));

    // The logical source publishes and marks p#1; p#2's publish reaches the broker and never
    // returns, so it is neither marked nor settled when the relay is stopped.
    let p2 = sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE aggregate_id = 'p' AND aggregate_sequence = 2",
    )
    .fetch_one(&fx.db.pool)
    .await
    .unwrap();
    let stall = handoff_test::faults::Poison::default();
    stall.lock().unwrap().insert(p2);
    let stats = Arc::new(FaultStats::default());
    let logical = fx
        .relay_over(|inner| {
            Faulty::new(inner)
                .for_ids(stall.clone(), Fault::Stall)
                .with_stats(stats.clone())
        })
        .await;
    eventually(
        "p#1 marked and p#2's publish stalled",
        Duration::from_secs(15),
        || async { parked_and_published(&fx, "p", 1).await.1 && stats.stalled() >= 1 },
    )
    .await;
    logical.abort().await;

    // Back to polling: p#2 is claimable, not parked behind a predecessor published for good.
    assert_eq!(parked_and_published(&fx, "p", 2).await, (false, false));
    let claim = polling.claim(10, usize::MAX).await.unwrap();
    let claimed: Vec<_> = claim
        .events
        .iter()
        .map(|e| (e.aggregate_id.as_str(), e.aggregate_sequence))
        .collect();
    assert_eq!(claimed, [("p", 2)]);
}
