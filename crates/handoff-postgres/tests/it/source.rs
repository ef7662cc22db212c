//! The polling source against the real PostgreSQL: leases, per-aggregate order across relays,
//! failures and wake-ups.

use crate::common;

use std::time::{Duration, Instant};

use handoff_core::delivery::{Failure, Published, Receipt, Released, Source};
use handoff_postgres::{Outbox, PollingConfig, PollingSource, Schema};
use handoff_test::{eventually, factory, TestDb};

fn source(db: &TestDb, relay_id: &str) -> PollingSource {
    let config = PollingConfig {
        // Named, so the wake-up filter ignores the notifications of other tests' schemas.
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: relay_id.into(),
        ..PollingConfig::default()
    };
    PollingSource::new(db.pool.clone(), config).unwrap()
}

/// Enqueues `per_aggregate` events for each aggregate, each event in its own transaction,
/// round-robin across aggregates (so sequences of one aggregate are spread over the backlog).
async fn enqueue(db: &TestDb, outbox: &Outbox, aggregates: &[&str], per_aggregate: u64) {
    for n in 0..per_aggregate {
        for aggregate in aggregates {
            db.enqueue_alone(outbox, factory::event(aggregate, n)).await;
        }
    }
}

fn sequences_of<'a>(
    events: impl IntoIterator<Item = &'a handoff_core::delivery::OutboxEvent>,
    aggregate: &str,
) -> Vec<i64> {
    let mut seqs: Vec<i64> = events
        .into_iter()
        .filter(|e| e.aggregate_id == aggregate)
        .map(|e| e.aggregate_sequence)
        .collect();
    seqs.sort();
    seqs
}

#[tokio::test]
async fn a_claim_leases_rows_that_other_relays_then_skip() {
    let (db, outbox) = common::migrated("source_lease").await;
    enqueue(&db, &outbox, &["a", "b", "c"], 2).await;
    let (a, b) = (source(&db, "relay-a"), source(&db, "relay-b"));

    let claim = a.claim(100, usize::MAX).await.unwrap();
    assert_eq!(claim.events.len(), 6);
    assert!(claim.lease_deadline.is_some());
    let leased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE claimed_by = 'relay-a' AND claim_until > now()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(leased, 6, "every claimed row carries relay-a's lease");
    assert!(
        b.claim(100, usize::MAX).await.unwrap().events.is_empty(),
        "leased rows are not claimable"
    );
}

#[tokio::test]
async fn a_later_event_is_never_claimed_while_an_earlier_one_is_unpublished() {
    let (db, outbox) = common::migrated("source_order").await;
    enqueue(&db, &outbox, &["x", "y"], 3).await;
    let (a, b) = (source(&db, "relay-a"), source(&db, "relay-b"));

    // The two oldest rows: x#1 and y#1.
    let first = a.claim(2, usize::MAX).await.unwrap();
    assert_eq!(sequences_of(&first.events, "x"), vec![1]);
    assert_eq!(sequences_of(&first.events, "y"), vec![1]);
    // relay-b sees x#2.. and y#2.., whose predecessors relay-a holds: it must take none.
    let second = b.claim(100, usize::MAX).await.unwrap();
    assert!(
        second.events.is_empty(),
        "claimed past a leased predecessor: {:?}",
        second.events
    );

    // Once x#1 is published, x's rest is claimable, in one claim and in order; y still waits.
    let x1 = first
        .events
        .iter()
        .find(|e| e.aggregate_id == "x")
        .unwrap()
        .event_id;
    a.mark_published(&[Published {
        event_id: x1,
        receipt: Receipt::new("test ack 1"),
        lease: first.lease,
    }])
    .await
    .unwrap();
    // The destination's answer is kept with the event.
    let receipt: Option<String> =
        sqlx::query_scalar("SELECT delivery_receipt FROM outbox WHERE event_id = $1")
            .bind(x1)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(receipt.as_deref(), Some("test ack 1"));
    let third = b.claim(100, usize::MAX).await.unwrap();
    assert_eq!(sequences_of(&third.events, "x"), vec![2, 3]);
    assert!(sequences_of(&third.events, "y").is_empty());
}

#[tokio::test]
async fn an_expired_lease_lets_another_relay_take_the_rows_over() {
    let (db, outbox) = common::migrated("source_expiry").await;
    enqueue(&db, &outbox, &["a"], 2).await;
    let (a, b) = (source(&db, "relay-a"), source(&db, "relay-b"));
    let first = a.claim(100, usize::MAX).await.unwrap();
    assert_eq!(first.events.len(), 2);
    assert_eq!(first.taken_over, 0, "fresh rows are not a takeover");

    // relay-a dies; its lease runs out (moved into the past rather than waited for).
    sqlx::query(
        "UPDATE outbox SET claim_until = now() - interval '1 second', \
         available_at = now() - interval '1 second' WHERE claimed_by = 'relay-a'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let taken = b.claim(100, usize::MAX).await.unwrap();
    assert_eq!(sequences_of(&taken.events, "a"), vec![1, 2]);
    assert_eq!(
        taken.taken_over, 2,
        "both rows came from relay-a's expired lease"
    );
    // relay-a, back from the dead, cannot record failures over relay-b's lease.
    let failure = Failure {
        event_id: taken.events[0].event_id,
        error: "late".into(),
        retry_after: Some(Duration::from_secs(60)),
        counts_as_attempt: true,
        hold_reason: None,
        lease: first.lease,
    };
    let settled = a.record_failures(&[failure]).await.unwrap();
    assert_eq!(settled.stale, 1, "the late write is counted stale");
    let owners: Vec<String> =
        sqlx::query_scalar("SELECT claimed_by FROM outbox ORDER BY aggregate_sequence")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(owners, vec!["relay-b", "relay-b"]);
}

#[tokio::test]
async fn a_failure_backs_off_counts_the_attempt_and_blocks_the_aggregate() {
    let (db, outbox) = common::migrated("source_failure").await;
    enqueue(&db, &outbox, &["a", "b"], 2).await;
    let relay = source(&db, "relay-a");
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    let a1 = claim
        .events
        .iter()
        .find(|e| e.aggregate_id == "a" && e.aggregate_sequence == 1);
    let a1 = a1.unwrap().event_id;
    let rest: Vec<Released> = claim
        .events
        .iter()
        .filter(|e| e.event_id != a1)
        .map(|e| Released {
            event_id: e.event_id,
            lease: claim.lease,
        })
        .collect();

    relay
        .record_failures(&[Failure {
            event_id: a1,
            error: "broker said no".into(),
            retry_after: Some(Duration::from_secs(3600)),
            counts_as_attempt: true,
            hold_reason: None,
            lease: claim.lease,
        }])
        .await
        .unwrap();
    let settled = relay.release(&rest).await.unwrap();
    assert_eq!(settled.stale, 0, "every release held its lease");

    let (attempts, error, later): (i32, Option<String>, bool) = sqlx::query_as(
        "SELECT attempt_count, last_error, available_at > now() + interval '59 minutes' \
         FROM outbox WHERE event_id = $1",
    )
    .bind(a1)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (attempts, error.as_deref(), later),
        (1, Some("broker said no"), true)
    );

    // b's events come back at once; a#2 stays behind a#1's backoff.
    let again = relay.claim(100, usize::MAX).await.unwrap();
    assert_eq!(sequences_of(&again.events, "b"), vec![1, 2]);
    assert!(sequences_of(&again.events, "a").is_empty());

    let backlog = relay.backlog().await.unwrap();
    assert_eq!(backlog.pending, 4);
    assert_eq!(backlog.held, 0);
}

#[tokio::test]
async fn a_held_event_stays_out_of_every_claim() {
    let (db, outbox) = common::migrated("source_held").await;
    enqueue(&db, &outbox, &["a"], 2).await;
    let relay = source(&db, "relay-a");
    let claim = relay.claim(1, usize::MAX).await.unwrap();
    let failure = Failure {
        event_id: claim.events[0].event_id,
        error: "payload refused".into(),
        retry_after: None,
        counts_as_attempt: true,
        hold_reason: None,
        lease: claim.lease,
    };
    relay.record_failures(&[failure]).await.unwrap();
    assert!(relay
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    let backlog = relay.backlog().await.unwrap();
    assert_eq!((backlog.pending, backlog.held), (2, 1));
}

#[tokio::test]
async fn rolled_back_events_are_never_claimed() {
    let (db, outbox) = common::migrated("source_rollback").await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("a", 1)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(source(&db, "relay-a")
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
}

#[tokio::test]
async fn a_commit_wakes_a_waiting_relay() {
    let (db, outbox) = common::migrated("source_wake").await;
    let relay = source(&db, "relay-a");
    // The first waits connect the listener and register the relay as waiting; each returns
    // early on purpose (see PollingSource::wait_for_work), so the next one truly sleeps.
    relay.wait_for_work(Duration::from_secs(60)).await.unwrap();
    relay.wait_for_work(Duration::from_secs(60)).await.unwrap();
    let registered: i64 = db.count("outbox_relay_waits").await;
    assert_eq!(registered, 1);

    let writer = {
        let (pool, outbox) = (db.pool.clone(), outbox.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            outbox
                .enqueue(&mut tx, &[factory::event("a", 1)])
                .await
                .unwrap();
            tx.commit().await.unwrap();
        })
    };
    let started = Instant::now();
    relay.wait_for_work(Duration::from_secs(60)).await.unwrap();
    writer.await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "woken by the commit, not the timeout"
    );
    assert_eq!(relay.claim(100, usize::MAX).await.unwrap().events.len(), 1);
}

#[tokio::test]
async fn events_stuck_behind_a_failed_head_never_starve_other_aggregates() {
    let (db, outbox) = common::migrated("source_starvation").await;
    enqueue(&db, &outbox, &["a"], 3).await;
    enqueue(&db, &outbox, &["b"], 1).await;
    let relay = source(&db, "relay-a");
    let head = relay.claim(1, usize::MAX).await.unwrap();
    assert_eq!(sequences_of(&head.events, "a"), vec![1]);
    relay
        .record_failures(&[Failure {
            event_id: head.events[0].event_id,
            error: "timeout".into(),
            retry_after: Some(Duration::from_secs(3600)),
            counts_as_attempt: true,
            hold_reason: None,
            lease: head.lease,
        }])
        .await
        .unwrap();
    // a#2 and a#3 are the oldest available rows, but wait behind a#1: a batch of one must
    // still reach b#1 past them.
    let next = relay.claim(1, usize::MAX).await.unwrap();
    assert_eq!(
        sequences_of(&next.events, "b"),
        vec![1],
        "{:?}",
        next.events
    );
}

#[tokio::test]
async fn a_busy_aggregate_moves_a_whole_run_per_claim_in_order() {
    let (db, outbox) = common::migrated("source_run").await;
    let mut tx = db.pool.begin().await.unwrap();
    let events: Vec<_> = (0..50).map(|n| factory::event("hot", n)).collect();
    outbox.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let relay = source(&db, "relay-a");
    let claim = relay.claim(20, usize::MAX).await.unwrap();
    assert_eq!(
        sequences_of(&claim.events, "hot"),
        (1..=20).collect::<Vec<_>>()
    );
    // The rest waits behind the leased run, for this relay and any other.
    assert!(source(&db, "relay-b")
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
}

/// A claim reads only half a second below where the previous claim's front began (cheap under
/// a held xmin horizon); a row that commits further back, as one whose writer kept its
/// transaction open for 1.5 s, is found by the deep claim that reads 2 s back every 250 ms.
/// Not by the sweep: it works below those 2 s, so without the deep claims this row would wait
/// for ever (its front stays where it was while nothing else arrives).
#[tokio::test]
async fn a_row_whose_writer_kept_its_transaction_open_past_the_front_is_claimed_soon() {
    let (db, outbox) = common::migrated("source_deep_lookback").await;
    let relay = source(&db, "relay-deep");
    enqueue(&db, &outbox, &["front"], 1).await;
    // Where the claim's front begins (the lease then moves the row's available_at).
    let front_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT available_at FROM outbox WHERE aggregate_id = 'front'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let front = relay.claim(10, usize::MAX).await.unwrap();
    assert_eq!(sequences_of(&front.events, "front"), vec![1]);
    let acks: Vec<Published> = front
        .events
        .iter()
        .map(|e| Published::id(e.event_id))
        .collect();
    relay.mark_published(&acks).await.unwrap();
    // Claims of an empty outbox: the deep one due first among them is spent here.
    for _ in 0..3 {
        assert!(relay.claim(10, usize::MAX).await.unwrap().events.is_empty());
    }

    // Committed now, available from 1.5 s before the front began: its writer's transaction
    // started then (the column's default is the transaction's start).
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("late", 0)])
        .await
        .unwrap();
    sqlx::query(
        "UPDATE outbox SET available_at = $1 - interval '1.5 seconds',
                           occurred_at = $1 - interval '1.5 seconds'
         WHERE aggregate_id = 'late'",
    )
    .bind(front_at)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // Polled as the relay polls, for well under the sweep's 10 s.
    let late = eventually(
        "the row 1.5 s behind the front claimed",
        Duration::from_secs(5),
        async || {
            let claim = relay.claim(10, usize::MAX).await.unwrap();
            (!claim.events.is_empty()).then_some(claim)
        },
    )
    .await;
    assert_eq!(sequences_of(&late.events, "late"), vec![1]);
}
