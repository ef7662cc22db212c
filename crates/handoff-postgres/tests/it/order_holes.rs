//! Order fails closed (issue 21, migration 0011) against the real PostgreSQL: a later event is
//! never claimed while an earlier sequence of its aggregate is unpublished, held or missing,
//! unless an operator skipped it or cleanup removed it after it was published.

use crate::common;
use crate::common::claims;
use crate::common::previous_release;

use std::time::Duration;

use claims::{claimed, hold, mark_published};
use handoff_core::delivery::Source;
use handoff_postgres::{
    Cleanup, CleanupConfig, EnqueueErrorKind, Migrator, OrderMode, Outbox, OutboxConfig,
    PollingConfig, PollingSource, Quarantine, QuarantineErrorKind, Schema, Status,
};
use handoff_test::{factory, TestDb};
use tokio::sync::watch;
use uuid::Uuid;

fn source(db: &TestDb, order: OrderMode) -> PollingSource {
    let config = PollingConfig {
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: format!("relay-{order:?}"),
        order,
        ..PollingConfig::default()
    };
    PollingSource::new(db.pool.clone(), config).unwrap()
}

fn global_outbox() -> Outbox {
    let config = OutboxConfig {
        order: OrderMode::Global,
        ..OutboxConfig::default()
    };
    Outbox::new(config, factory::catalog()).unwrap()
}

async fn versioned(db: &TestDb, outbox: &Outbox, aggregate: &str, first: i64) {
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue_versioned(&mut tx, first, &[factory::event(aggregate, first as u64)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// `Outbox::enqueue` of `events` in a transaction of their own.
async fn enqueued(db: &TestDb, outbox: &Outbox, events: &[handoff_core::NewEvent]) {
    let mut tx = db.pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
}

/// An outside writer: a plain INSERT that bypasses the library, at any sequence.
async fn outside_insert(db: &TestDb, aggregate: &str, sequence: i64) {
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         SELECT $1, aggregate_type, aggregate_id, $3, event_type, schema_version, payload
         FROM outbox WHERE aggregate_id = $2 AND aggregate_sequence = 1",
    )
    .bind(Uuid::now_v7())
    .bind(aggregate)
    .bind(sequence)
    .execute(&db.pool)
    .await
    .unwrap();
}

async fn holes(db: &TestDb) -> i64 {
    let mut conn = db.pool.acquire().await.unwrap();
    Status::new(&Schema::named(db.schema()).unwrap())
        .read(&mut conn, Duration::from_secs(60), 10)
        .await
        .unwrap()
        .holes
}

#[tokio::test]
async fn a_hole_behind_a_held_event_is_not_overtaken_until_an_operator_skips_it() {
    let (db, outbox) = common::migrated("holes_behind_held").await;
    let relay = source(&db, OrderMode::Aggregate);
    versioned(&db, &outbox, "a", 1).await;

    // a#1 is held (the destination refused it for good).
    let first = relay.claim(100, usize::MAX).await.unwrap();
    assert_eq!(claimed(&first), vec![("a".into(), 1)]);
    hold(&relay, &first, first.events[0].event_id).await;
    assert_eq!(relay.backlog().await.unwrap().held, 1);

    // An outside writer writes a#3; a#2 never comes. Another aggregate keeps flowing.
    outside_insert(&db, "a", 3).await;
    versioned(&db, &outbox, "b", 1).await;
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    assert_eq!(
        claimed(&claim),
        vec![("b".into(), 1)],
        "a#3 overtook the held a#1 across the hole at a#2"
    );
    mark_published(&relay, &claim).await;
    assert_eq!(relay.backlog().await.unwrap().holes, 1);
    assert_eq!(holes(&db).await, 1, "handoff status reports the hole");

    // Only a real hole can be skipped by its place.
    let quarantine = Quarantine::new(&Schema::named(db.schema()).unwrap());
    let mut conn = db.pool.acquire().await.unwrap();
    for not_a_hole in [1, 3, 4] {
        let error = quarantine
            .skip_missing(
                &mut conn,
                factory::AGGREGATE_TYPE,
                "a",
                not_a_hole,
                "x",
                "op",
            )
            .await
            .unwrap_err();
        assert_eq!(error.kind(), QuarantineErrorKind::NotAHole, "{not_a_hole}");
    }
    quarantine
        .skip_missing(
            &mut conn,
            factory::AGGREGATE_TYPE,
            "a",
            2,
            "never written",
            "op",
        )
        .await
        .unwrap();
    assert_eq!(holes(&db).await, 0);
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_quarantine_actions
         WHERE action = 'skip' AND actor = 'op' AND reason = 'never written'
           AND (before->>'missing')::boolean AND (before->>'aggregate_sequence')::bigint = 2",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(audited, 1, "the skip of the missing sequence is audited");

    // The marker waits behind the held a#1 like any event.
    assert!(relay
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());

    // Released, a#1 goes first, then the marker at a#2, then a#3.
    quarantine
        .retry(&mut conn, first.events[0].event_id, "op")
        .await
        .unwrap();
    // One claim; the relay's lane publishes it in sequence order.
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    let mut got = claimed(&claim);
    got.sort();
    assert_eq!(got, vec![("a".into(), 1), ("a".into(), 2), ("a".into(), 3)]);
    let marker = claim
        .events
        .iter()
        .find(|e| e.aggregate_sequence == 2)
        .unwrap();
    assert_eq!(marker.payload, "null", "a#2 goes out as a skip marker");
    assert!(
        marker
            .headers
            .iter()
            .any(|(name, value)| name == "Handoff-Skipped" && value == "never written"),
        "{:?}",
        marker.headers
    );
    mark_published(&relay, &claim).await;
    assert_eq!(relay.backlog().await.unwrap().pending, 0);
}

#[tokio::test]
async fn enqueue_versioned_refuses_a_first_sequence_that_leaves_a_hole() {
    let (db, outbox) = common::migrated("holes_refused_at_write").await;
    versioned(&db, &outbox, "v", 1).await;

    for outbox in [outbox.clone(), global_outbox()] {
        let mut tx = db.pool.begin().await.unwrap();
        let error = outbox
            .enqueue_versioned(&mut tx, 3, &[factory::event("v", 3)])
            .await
            .unwrap_err();
        assert_eq!(error.kind(), EnqueueErrorKind::SequenceGap, "{error}");
        assert!(!error.is_retryable());
        tx.rollback().await.unwrap();
    }
    assert_eq!(
        db.count("outbox").await,
        1,
        "nothing of the refused call was written"
    );
    let global_head: i64 = sqlx::query_scalar("SELECT last_sequence FROM outbox_global_head")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(global_head, 0);

    // In order it is taken.
    versioned(&db, &outbox, "v", 2).await;
    versioned(&db, &outbox, "v", 3).await;

    // An aggregate the outbox has never seen may start anywhere (its history may have been
    // cleaned before migration 0011), and is then published.
    versioned(&db, &outbox, "w", 5).await;
    let relay = source(&db, OrderMode::Aggregate);
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    let mut got = claimed(&claim);
    got.sort();
    assert_eq!(
        got,
        vec![
            ("v".into(), 1),
            ("v".into(), 2),
            ("v".into(), 3),
            ("w".into(), 5)
        ]
    );
    // ...but not with a hole after its first write.
    let mut tx = db.pool.begin().await.unwrap();
    let error = outbox
        .enqueue_versioned(&mut tx, 7, &[factory::event("w", 7)])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), EnqueueErrorKind::SequenceGap, "{error}");
}

/// The sequences of `aggregate` in the outbox, in order.
async fn sequences(db: &TestDb, aggregate: &str) -> Vec<i64> {
    sqlx::query_scalar("SELECT aggregate_sequence FROM outbox WHERE aggregate_id = $1 ORDER BY 1")
        .bind(aggregate)
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// `enqueue_versioned` of `sequences` (one event each, from the first) for `aggregate` in a
/// transaction that is refused with `kind`, then rolled back.
async fn refused(
    db: &TestDb,
    outbox: &Outbox,
    aggregate: &str,
    sequences: &[u64],
    kind: EnqueueErrorKind,
) {
    let events: Vec<_> = sequences
        .iter()
        .map(|&sequence| factory::event(aggregate, sequence))
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    let error = outbox
        .enqueue_versioned(&mut tx, sequences[0] as i64, &events)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), kind, "{aggregate} {sequences:?}: {error}");
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn a_sequence_behind_one_already_written_is_refused_and_nothing_of_it_is_written() {
    let (db, outbox) = common::migrated("sequences_backwards").await;

    // A new aggregate may start at 2; 1 then comes after it.
    versioned(&db, &outbox, "a", 2).await;
    for writer in [outbox.clone(), global_outbox()] {
        let mut tx = db.pool.begin().await.unwrap();
        let error = writer
            .enqueue_versioned(&mut tx, 1, &[factory::event("a", 1)])
            .await
            .unwrap_err();
        assert_eq!(error.kind(), EnqueueErrorKind::SequenceBackwards, "{error}");
        assert!(!error.is_retryable());
        assert!(
            error.to_string().contains("behind sequence 2"),
            "the message says which: {error}"
        );
        tx.rollback().await.unwrap();
    }
    // Also spliced into the caller's own statement.
    let call = outbox.versioned_call(1, &[factory::event("a", 1)]).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let error = call
        .bind(sqlx::query_scalar::<_, i64>(&format!(
            "SELECT {}",
            call.sql(1)
        )))
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| outbox.classify(e))
        .unwrap_err();
    assert_eq!(error.kind(), EnqueueErrorKind::SequenceBackwards, "{error}");
    tx.rollback().await.unwrap();
    assert_eq!(sequences(&db, "a").await, [2]);
    let global_head: i64 = sqlx::query_scalar("SELECT last_sequence FROM outbox_global_head")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        global_head, 0,
        "the refused global call took no global sequence"
    );

    // 3 (a new aggregate), then 4 and 5 (a batch), then below them: a free sequence, a batch,
    // a batch that reaches a taken one.
    versioned(&db, &outbox, "b", 3).await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue_versioned(
            &mut tx,
            4,
            &[factory::event("b", 4), factory::event("b", 5)],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    refused(&db, &outbox, "b", &[1], EnqueueErrorKind::SequenceBackwards).await;
    refused(
        &db,
        &outbox,
        "b",
        &[1, 2],
        EnqueueErrorKind::SequenceBackwards,
    )
    .await;
    refused(
        &db,
        &outbox,
        "b",
        &[2, 3],
        EnqueueErrorKind::SequenceBackwards,
    )
    .await;
    // A taken first sequence is a stale version, as before: retryable.
    refused(&db, &outbox, "b", &[4], EnqueueErrorKind::SequenceTaken).await;
    refused(&db, &outbox, "b", &[5, 6], EnqueueErrorKind::SequenceTaken).await;
    assert_eq!(sequences(&db, "b").await, [3, 4, 5]);

    // Forward still works.
    versioned(&db, &outbox, "a", 3).await;
    versioned(&db, &outbox, "b", 6).await;
    assert_eq!(sequences(&db, "a").await, [2, 3]);
    assert_eq!(sequences(&db, "b").await, [3, 4, 5, 6]);
}

#[tokio::test]
async fn a_sequence_published_and_cleaned_up_is_not_written_again() {
    let (db, outbox) = common::migrated("sequences_cleaned_not_again").await;
    let relay = source(&db, OrderMode::Aggregate);
    versioned(&db, &outbox, "v", 1).await;
    versioned(&db, &outbox, "v", 2).await;
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    mark_published(&relay, &claim).await;
    sqlx::query("UPDATE outbox SET published_at = now() - interval '30 days'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let (_stop_tx, stop) = watch::channel(false);
    let config = CleanupConfig {
        schema: Schema::named(db.schema()).unwrap(),
        ..CleanupConfig::default()
    };
    Cleanup::new(config)
        .unwrap()
        .run(&mut conn, stop, |_| {})
        .await
        .unwrap();
    assert_eq!(db.count("outbox").await, 0);

    // 2 and 1 were published and cleaned: written again they would be published again, after 2.
    refused(&db, &outbox, "v", &[2], EnqueueErrorKind::SequenceBackwards).await;
    refused(&db, &outbox, "v", &[1], EnqueueErrorKind::SequenceBackwards).await;
    assert_eq!(db.count("outbox").await, 0);
    versioned(&db, &outbox, "v", 3).await;
    assert_eq!(sequences(&db, "v").await, [3]);
}

#[tokio::test]
async fn a_global_event_waits_for_its_per_aggregate_predecessor() {
    let (db, outbox) = common::migrated("holes_global_waits").await;
    let (aggregate_relay, global_relay) = (
        source(&db, OrderMode::Aggregate),
        source(&db, OrderMode::Global),
    );
    // g#1 in aggregate mode, g#2 in global mode (the global lane's first event).
    enqueued(&db, &outbox, &[factory::event("g", 1)]).await;
    enqueued(&db, &global_outbox(), &[factory::event("g", 2)]).await;

    assert!(
        global_relay
            .claim(100, usize::MAX)
            .await
            .unwrap()
            .events
            .is_empty(),
        "the global lane published g#2 before g#1"
    );

    let first = aggregate_relay.claim(100, usize::MAX).await.unwrap();
    assert_eq!(claimed(&first), vec![("g".into(), 1)]);
    // Leased is not published: still waiting.
    assert!(global_relay
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    mark_published(&aggregate_relay, &first).await;

    let second = global_relay.claim(100, usize::MAX).await.unwrap();
    assert_eq!(claimed(&second), vec![("g".into(), 2)]);
    assert_eq!(second.events[0].global_sequence, Some(1));
}

#[tokio::test]
async fn a_cleaned_aggregate_takes_new_events_through_its_watermark() {
    let (db, outbox) = common::migrated("holes_cleanup_watermark").await;
    let relay = source(&db, OrderMode::Aggregate);
    // "c" through Outbox::enqueue, "v" through caller versions; both fully published.
    enqueued(
        &db,
        &outbox,
        &[factory::event("c", 1), factory::event("c", 2)],
    )
    .await;
    versioned(&db, &outbox, "v", 1).await;
    versioned(&db, &outbox, "v", 2).await;
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    assert_eq!(claim.events.len(), 4);
    mark_published(&relay, &claim).await;

    // Past the retention horizon, then cleaned.
    sqlx::query("UPDATE outbox SET published_at = now() - interval '30 days'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let (_stop_tx, stop) = watch::channel(false);
    let config = CleanupConfig {
        schema: Schema::named(db.schema()).unwrap(),
        ..CleanupConfig::default()
    };
    let report = Cleanup::new(config)
        .unwrap()
        .run(&mut conn, stop, |_| {})
        .await
        .unwrap();
    assert_eq!(report.outbox_deleted, 4);
    assert_eq!(db.count("outbox").await, 0);

    // The next event of each is accepted and claimable: its missing predecessor was cleaned.
    enqueued(&db, &outbox, &[factory::event("c", 3)]).await;
    versioned(&db, &outbox, "v", 3).await;
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    let mut got = claimed(&claim);
    got.sort();
    assert_eq!(got, vec![("c".into(), 3), ("v".into(), 3)]);
    assert_eq!(relay.backlog().await.unwrap().holes, 0);
}

#[tokio::test]
async fn a_database_of_the_previous_release_upgrades_with_its_rows_flowing() {
    let db = TestDb::new("holes_upgrade").await;
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    // The schema as the previous release (migrations 0001 to 0010) left it.
    previous_release::migrated_through(&mut conn, 10).await;
    // "old": written with caller versions; 1..3 published and cleaned long ago, 4 pending.
    versioned(&db, &outbox, "old", 4).await;
    // "gone": written through Outbox::enqueue, all published and cleaned.
    // "held": 1 published, 2 held, 3 pending behind it.
    let gone: Vec<_> = (1..=5).map(|n| factory::event("gone", n)).collect();
    enqueued(&db, &outbox, &gone).await;
    let held: Vec<_> = (1..=3).map(|n| factory::event("held", n)).collect();
    enqueued(&db, &outbox, &held).await;
    sqlx::raw_sql(
        "DELETE FROM outbox WHERE aggregate_id = 'gone';
         UPDATE outbox SET published_at = now() WHERE aggregate_id = 'held' AND aggregate_sequence = 1;
         UPDATE outbox SET available_at = 'infinity', quarantined_at = now(), hold_reason = 'attempts'
         WHERE aggregate_id = 'held' AND aggregate_sequence = 2;",
    )
    .execute(&mut *conn)
    .await
    .unwrap();

    Migrator::handoff(Schema::default())
        .run(&mut conn)
        .await
        .unwrap();

    assert_eq!(db.pending_rows().await, 3, "pending rows intact");
    enqueued(&db, &outbox, &[factory::event("gone", 6)]).await;
    versioned(&db, &outbox, "old", 5).await;
    let relay = source(&db, OrderMode::Aggregate);
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    let mut got = claimed(&claim);
    got.sort();
    assert_eq!(
        got,
        vec![("gone".into(), 6), ("old".into(), 4), ("old".into(), 5)],
        "history cleaned before the upgrade does not hold its aggregates; held#3 still waits"
    );
    assert_eq!(relay.backlog().await.unwrap().holes, 0);
}
