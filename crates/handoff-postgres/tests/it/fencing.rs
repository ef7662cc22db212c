//! Fencing: a failure or release is written only while its event is still held under the lease
//! it was claimed under, even by the very source that claimed it again since.

use crate::common;

use std::time::Duration;

use handoff_core::delivery::{Claim, Failure, Released, Source};
use handoff_postgres::{Outbox, PollingConfig, PollingSource, Schema};
use handoff_test::{eventually, factory, TestDb};

/// A source whose leases last a second, so a test can let one run out.
fn short_lease_source(db: &TestDb) -> PollingSource {
    let config = PollingConfig {
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: "relay-a".into(),
        lease: Duration::from_secs(1),
        ..PollingConfig::default()
    };
    PollingSource::new(db.pool.clone(), config).unwrap()
}

/// What a settling write would change of each row, in aggregate order: holder, lease end (as
/// microseconds since the epoch, the lease token's terms), availability, attempts, error.
type RowState = (
    Option<String>,
    Option<i64>,
    chrono::DateTime<chrono::Utc>,
    i32,
    Option<String>,
);

async fn rows(db: &TestDb) -> Vec<RowState> {
    sqlx::query_as(
        "SELECT claimed_by, (extract(epoch FROM claim_until) * 1000000)::int8, available_at, \
         attempt_count, last_error FROM outbox ORDER BY aggregate_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Claims `a#1` and `b#1` once, lets the lease run out and claims them again with the same
/// source: the two claims, in that order.
async fn claimed_twice(db: &TestDb, outbox: &Outbox, source: &PollingSource) -> (Claim, Claim) {
    for aggregate in ["a", "b"] {
        db.enqueue_alone(outbox, factory::event(aggregate, 0)).await;
    }
    let first = source.claim(100, usize::MAX).await.unwrap();
    assert_eq!(first.events.len(), 2);
    assert!(first.lease.is_some(), "a polling claim carries its lease");
    let second = eventually(
        "the first lease runs out and the same source claims the events again",
        Duration::from_secs(10),
        async || {
            let claim = source.claim(100, usize::MAX).await.unwrap();
            (claim.events.len() == 2).then_some(claim)
        },
    )
    .await;
    assert_eq!(second.taken_over, 2, "taken over from the first lease");
    assert_ne!(first.lease, second.lease, "a new claim, a new lease");
    (first, second)
}

#[tokio::test]
async fn a_failure_and_a_release_under_a_lease_that_ran_out_change_nothing() {
    let (db, outbox) = common::migrated("fencing_stale").await;
    let source = short_lease_source(&db);
    let (first, second) = claimed_twice(&db, &outbox, &source).await;
    let before = rows(&db).await;
    for (holder, lease, ..) in &before {
        assert_eq!(holder.as_deref(), Some("relay-a"));
        assert_eq!(
            *lease,
            second.lease.map(|l| l.token()),
            "the lease token is the row's claim_until, to the microsecond"
        );
    }

    // The outcomes the relay decided under the first lease land only now: a failure of a#1
    // (charged, backing off for an hour) and a release of b#1.
    let a1 = first.events.iter().find(|e| e.aggregate_id == "a").unwrap();
    let b1 = first.events.iter().find(|e| e.aggregate_id == "b").unwrap();
    let failed = source
        .record_failures(&[Failure {
            event_id: a1.event_id,
            error: "decided under the first lease".into(),
            retry_after: Some(Duration::from_secs(3600)),
            counts_as_attempt: true,
            hold_reason: None,
            lease: first.lease,
        }])
        .await
        .unwrap();
    let released = source
        .release(&[Released {
            event_id: b1.event_id,
            lease: first.lease,
        }])
        .await
        .unwrap();

    assert_eq!(
        rows(&db).await,
        before,
        "the rows keep the second lease: holder, lease end, availability, attempts and error \
         untouched"
    );
    assert_eq!(failed.stale, 1, "the failure's write is counted stale");
    assert_eq!(released.stale, 1, "the release's write is counted stale");

    // Under the lease the events are held by now, the same writes take effect.
    let failed = source
        .record_failures(&[Failure {
            event_id: a1.event_id,
            error: "decided under the second lease".into(),
            retry_after: Some(Duration::from_secs(3600)),
            counts_as_attempt: true,
            hold_reason: None,
            lease: second.lease,
        }])
        .await
        .unwrap();
    let released = source
        .release(&[Released {
            event_id: b1.event_id,
            lease: second.lease,
        }])
        .await
        .unwrap();
    assert_eq!((failed.stale, released.stale), (0, 0));
    let after = rows(&db).await;
    assert_eq!((after[0].0.as_deref(), after[0].3), (None, 1), "a#1 failed");
    assert_eq!(
        after[0].4.as_deref(),
        Some("decided under the second lease")
    );
    assert_eq!(
        (after[1].0.as_deref(), after[1].3),
        (None, 0),
        "b#1 released"
    );
}

#[tokio::test]
async fn an_outcome_without_a_lease_changes_nothing() {
    let (db, outbox) = common::migrated("fencing_no_lease").await;
    let source = short_lease_source(&db);
    let (_, second) = claimed_twice(&db, &outbox, &source).await;
    let before = rows(&db).await;
    let settled = source
        .release(&[Released {
            event_id: second.events[0].event_id,
            lease: None,
        }])
        .await
        .unwrap();
    assert_eq!(rows(&db).await, before);
    assert_eq!(settled.stale, 1);
}
