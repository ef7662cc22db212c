//! The CDC source end to end: a logical-replication PostgreSQL of the test's own, the real
//! nats-server, and the relay loop in-process.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use crate::common::{eventually, Fixture};
use handoff_cdc::RowMode;
use handoff_test::nats::read_stream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committed_event_is_published_and_a_rolled_back_one_never_is() {
    let fx = Fixture::start("cdc_committed", RowMode::Keep, &[]).await;
    let relay = fx.relay().await;
    for aggregate in 0..20 {
        fx.enqueue(&format!("a{aggregate}"), 1, 5).await;
    }
    // A rolled-back transaction: its event must never reach the stream.
    let mut tx = fx.db.pool.begin().await.unwrap();
    fx.outbox
        .enqueue(&mut tx, &[handoff_test::factory::event("ghost", 1)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // Taken before the last write, not after: the relay marks rows published meanwhile, and
    // the WAL those (unpublished) updates add after the last commit is nothing the slot has to
    // confirm. Confirming the last transaction still takes the slot past this position.
    let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&fx.db.pool)
        .await
        .unwrap();
    fx.enqueue("last", 1, 1).await;

    eventually(
        "all 101 events published",
        Duration::from_secs(30),
        || async { read_stream(&fx.client, &fx.stream).await.len() >= 101 },
    )
    .await;
    let messages = read_stream(&fx.client, &fx.stream).await;
    let ids: HashSet<_> = messages
        .iter()
        .map(|m| m.header("Nats-Msg-Id").unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 101);
    assert!(messages.iter().all(|m| !m.subject.ends_with(".ghost")));
    let mut next: HashMap<String, i64> = HashMap::new();
    for message in &messages {
        let aggregate = message.subject.rsplit('.').next().unwrap().to_owned();
        let sequence: i64 = message.header("Handoff-Sequence").unwrap().parse().unwrap();
        let expected = next.entry(aggregate.clone()).or_insert(1);
        assert_eq!(sequence, *expected, "{aggregate} out of order");
        *expected += 1;
    }
    // Kept rows are marked published, and the slot confirms past them.
    eventually("rows marked published", Duration::from_secs(10), || async {
        fx.db.pending_rows().await == 0
    })
    .await;
    let source = relay.source.clone();
    let report = relay.stop().await;
    assert_eq!(report.published, 101);
    // Closing confirms what was settled: a restart would not stream these transactions again.
    source.close(Duration::from_secs(5)).await;
    assert!(
        fx.released_slot().await.confirmed_flush_lsn >= common::pg_lsn(&written),
        "the slot was not confirmed past the last write"
    );
}
