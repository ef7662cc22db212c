//! Enqueue in the caller's transaction, against the real PostgreSQL (design W1, W3, W4, W6).

use std::collections::HashMap;

use handoff_core::{EventCatalog, Limits, NewEvent, ValidationErrorKind as V};
use handoff_postgres::{EnqueueErrorKind, Migrator, Outbox, OutboxConfig, Schema};
use handoff_test::{factory, TestDb};
use sqlx::Connection;

use crate::common::migrated;

async fn sequences(db: &TestDb, aggregate_id: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT aggregate_sequence FROM outbox WHERE aggregate_id = $1 ORDER BY aggregate_sequence",
    )
    .bind(aggregate_id)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn rollback_leaves_no_outbox_row() {
    let (db, outbox) = migrated("enqueue_rollback").await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("a", 1), factory::event("a", 2)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    assert_eq!(db.count("outbox").await, 0);
    // The head row went with the rollback too, so the next event is still number 1.
    let mut tx = db.pool.begin().await.unwrap();
    let enqueued = outbox
        .enqueue(&mut tx, &[factory::event("a", 3)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(enqueued[0].aggregate_sequence, 1);
}

#[tokio::test]
async fn commit_leaves_one_row_per_event_with_consecutive_sequences_in_the_given_order() {
    let (db, outbox) = migrated("enqueue_commit").await;
    let chosen_id = uuid::Uuid::now_v7();
    let events = [
        factory::event("order-1", 10).with_event_id(chosen_id),
        factory::event("order-1", 20).with_header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
        factory::event("order-1", 30),
    ];
    let mut tx = db.pool.begin().await.unwrap();
    let enqueued = outbox.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();

    assert_eq!(
        enqueued
            .iter()
            .map(|e| e.aggregate_sequence)
            .collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(
        enqueued[0].event_id, chosen_id,
        "a caller-supplied id is kept"
    );
    let rows: Vec<(
        uuid::Uuid,
        i64,
        serde_json::Value,
        serde_json::Value,
        i32,
        bool,
        bool,
    )> = sqlx::query_as(
        "SELECT event_id, aggregate_sequence, payload, headers, attempt_count,
                    published_at IS NULL, claimed_by IS NULL
             FROM outbox ORDER BY aggregate_sequence",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 3);
    for (row, event) in rows.iter().zip(&events) {
        assert_eq!(row.0, event.event_id());
        assert_eq!(
            row.2,
            serde_json::from_str::<serde_json::Value>(event.payload()).unwrap()
        );
        assert_eq!(
            (row.4, row.5, row.6),
            (0, true, true),
            "pending, unclaimed, no attempts"
        );
    }
    assert_eq!(
        rows[1].3["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
}

#[tokio::test]
async fn several_aggregates_in_one_call_each_get_their_own_sequence() {
    let (db, outbox) = migrated("enqueue_multi").await;
    let mut tx = db.pool.begin().await.unwrap();
    let enqueued = outbox
        .enqueue(
            &mut tx,
            &[
                factory::event("b", 1),
                factory::event("a", 1),
                factory::event("b", 2),
                factory::event("a", 2),
                factory::event("b", 3),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let seqs: Vec<i64> = enqueued.iter().map(|e| e.aggregate_sequence).collect();
    assert_eq!(
        seqs,
        [1, 1, 2, 2, 3],
        "results come back in the order given"
    );
    assert_eq!(sequences(&db, "a").await, [1, 2]);
    assert_eq!(sequences(&db, "b").await, [1, 2, 3]);
}

#[tokio::test]
async fn concurrent_writers_of_one_aggregate_get_exactly_one_to_n_times_m() {
    const WRITERS: u64 = 16;
    const EVENTS_EACH: u64 = 24;
    let (db, outbox) = migrated("enqueue_concurrent").await;

    let writers = (0..WRITERS).map(|w| {
        let pool = db.pool.clone();
        let outbox = outbox.clone();
        tokio::spawn(async move {
            let mut n = 0;
            let mut round = 0;
            while n < EVENTS_EACH {
                // Alternate batch sizes 1..=3, and roll back every fourth transaction: a
                // rolled-back transaction must not leave a hole.
                let size = (round % 3 + 1).min(EVENTS_EACH - n);
                let events: Vec<_> = (0..size)
                    .map(|i| factory::event("hot", w * 1000 + n + i))
                    .collect();
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue(&mut tx, &events).await.unwrap();
                if round % 4 == 3 {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                    n += size;
                }
                round += 1;
            }
        })
    });
    for writer in futures::future::join_all(writers).await {
        writer.expect("no writer saw an error");
    }

    let expected: Vec<i64> = (1..=(WRITERS * EVENTS_EACH) as i64).collect();
    assert_eq!(sequences(&db, "hot").await, expected);
    // Within each writer, later events got later sequences.
    let rows: Vec<(i64, serde_json::Value)> = sqlx::query_as(
        "SELECT aggregate_sequence, payload FROM outbox ORDER BY aggregate_sequence",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut last_n: HashMap<u64, u64> = HashMap::new();
    for (_, payload) in rows {
        let n = payload["n"].as_u64().unwrap();
        let (writer, i) = (n / 1000, n % 1000);
        if let Some(prev) = last_n.insert(writer, i) {
            assert!(
                prev < i,
                "writer {writer}: event {i} sequenced before {prev}"
            );
        }
    }
}

#[tokio::test]
async fn each_bad_input_is_refused_with_its_kind_and_writes_nothing() {
    let (db, _) = migrated("enqueue_bad_input").await;
    let catalog = factory::catalog();
    let limits = Limits {
        max_payload_bytes: 64,
        max_aggregate_id_bytes: 16,
    };
    let outbox = Outbox::new(
        OutboxConfig {
            limits,
            ..OutboxConfig::default()
        },
        catalog,
    )
    .unwrap();
    let ok = || factory::event("agg", 1);
    let t = factory::AGGREGATE_TYPE;
    let e = factory::EVENT_TYPE;
    let cases: Vec<(NewEvent, V)> = vec![
        (
            NewEvent::new(t, "agg", e, 1, "{not json"),
            V::PayloadNotJson,
        ),
        (NewEvent::new(t, "agg", e, 1, ""), V::PayloadNotJson),
        (
            NewEvent::new(t, "agg", e, 1, format!(r#"{{"big":"{}"}}"#, "x".repeat(64))),
            V::PayloadTooLarge,
        ),
        (
            NewEvent::new(t, "agg", e, 1, r#"{"s":"\u0000"}"#),
            V::PayloadHasNul,
        ),
        (NewEvent::new(t, "", e, 1, "{}"), V::EmptyAggregateId),
        (
            NewEvent::new(t, "x".repeat(17), e, 1, "{}"),
            V::AggregateIdTooLong,
        ),
        (NewEvent::new(t, "a\0b", e, 1, "{}"), V::AggregateIdHasNul),
        (
            NewEvent::new("bad.type", "agg", e, 1, "{}"),
            V::InvalidAggregateType,
        ),
        (
            NewEvent::new(t, "agg", "NoSuchEvent", 1, "{}"),
            V::UnknownEventType,
        ),
        (NewEvent::new(t, "agg", e, 2, "{}"), V::UnknownSchemaVersion),
        (NewEvent::new(t, "agg", e, 0, "{}"), V::InvalidSchemaVersion),
        (
            NewEvent::new(t, "agg", e, 1, "[1e-20000]"),
            V::PayloadNumberOutOfRange,
        ),
        (NewEvent::new(t, "agg", e, 1, "[1e100]"), V::PayloadTooLarge),
        (ok().with_header("ce-id", "spoofed"), V::InvalidHeader),
    ];
    for (bad, kind) in cases {
        let mut tx = db.pool.begin().await.unwrap();
        // A valid event first: the bad one must take the whole batch down with it.
        let err = outbox
            .enqueue(&mut tx, &[ok(), bad.clone()])
            .await
            .unwrap_err();
        assert_eq!(
            err.kind(),
            EnqueueErrorKind::Invalid(kind),
            "{bad:?}: {err}"
        );
        // Refused before any SQL: the caller's transaction is still usable.
        sqlx::query("SELECT 1")
            .execute(&mut *tx)
            .await
            .expect("transaction still usable");
        tx.commit().await.unwrap();
    }
    assert_eq!(db.count("outbox").await, 0);
    assert_eq!(db.count("outbox_heads").await, 0);
}

#[tokio::test]
async fn aggregate_ids_broker_subjects_cannot_carry_are_stored_verbatim() {
    let (db, outbox) = migrated("enqueue_odd_ids").await;
    let ids = [
        "eu.west.1",
        "a*b",
        "x>y",
        "with space",
        "tab\tand\nnewline",
        "ünï",
    ];
    let mut tx = db.pool.begin().await.unwrap();
    let events: Vec<_> = ids.iter().map(|id| factory::event(id, 1)).collect();
    outbox.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    for id in ids {
        assert_eq!(sequences(&db, id).await, [1], "{id:?}");
    }
}

#[tokio::test]
async fn a_reused_event_id_is_a_typed_error() {
    let (db, outbox) = migrated("enqueue_duplicate_id").await;
    let event = factory::event("a", 1);
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, std::slice::from_ref(&event))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let err = outbox.enqueue(&mut tx, &[event]).await.unwrap_err();
    assert_eq!(err.kind(), EnqueueErrorKind::DuplicateEventId);
    tx.rollback().await.unwrap();
    assert_eq!(db.count("outbox").await, 1);
    assert_eq!(sequences(&db, "a").await, [1]);
}

#[tokio::test]
async fn an_unmigrated_schema_is_a_typed_error() {
    let db = TestDb::new("enqueue_unmigrated").await;
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let err = outbox
        .enqueue(&mut tx, &[factory::event("a", 1)])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), EnqueueErrorKind::NotMigrated);
}

#[tokio::test]
async fn a_named_schema_is_used_whatever_the_search_path() {
    let db = TestDb::new("enqueue_named_schema").await;
    let named = format!("{}_ev", db.schema());
    let schema = Schema::named(named.clone()).unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    Migrator::handoff(schema.clone())
        .run(&mut conn)
        .await
        .unwrap();
    let outbox = Outbox::new(
        OutboxConfig {
            schema,
            ..OutboxConfig::default()
        },
        EventCatalog::new().declare("thing", "ThingHappened", 1),
    )
    .unwrap();

    let mut tx = conn.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("a", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The function the migrations installed finds its tables in the named schema too.
    let call = outbox.versioned_call(1, &[factory::event("b", 1)]).unwrap();
    let sql = format!("SELECT {}", call.sql(1));
    let last: Option<i64> = call
        .bind(sqlx::query_scalar(&sql))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(last, Some(1));
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{named}\".outbox"))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(n, 2);
    sqlx::raw_sql(&format!("DROP SCHEMA \"{named}\" CASCADE"))
        .execute(&mut *conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn an_accepted_payload_fits_the_limit_as_postgres_returns_it() {
    let (db, _) = migrated("enqueue_payload_bound").await;
    let limits = Limits {
        max_payload_bytes: 48,
        ..Limits::default()
    };
    let outbox = Outbox::new(
        OutboxConfig {
            limits,
            ..OutboxConfig::default()
        },
        factory::catalog(),
    )
    .unwrap();
    let candidates = [
        r#"{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6}"#,
        "[1e3,2e3,3e3,4e3,5e3,6e3]",
        "[1.50,2.50,3.50,4.50,5.50]",
        r#"{"s":"\u00e9\u00e9\u00e9\u00e9","t":[true,false,null]}"#,
        "[0.1e-5,2E2,-3.0e1]",
    ];
    let mut accepted = 0;
    for (i, payload) in candidates.iter().enumerate() {
        let event = NewEvent::new(
            factory::AGGREGATE_TYPE,
            format!("p{i}"),
            factory::EVENT_TYPE,
            1,
            *payload,
        );
        let mut tx = db.pool.begin().await.unwrap();
        if outbox.enqueue(&mut tx, &[event]).await.is_ok() {
            tx.commit().await.unwrap();
            accepted += 1;
        }
    }
    assert!(accepted >= 3, "most candidates fit: {accepted}");
    let longest: i32 = sqlx::query_scalar("SELECT max(octet_length(payload::text)) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        longest <= 48,
        "PostgreSQL returns {longest} bytes for a payload accepted at 48"
    );
}

#[tokio::test]
async fn versioned_enqueue_uses_the_callers_sequences_and_refuses_a_taken_one() {
    let (db, outbox) = migrated("enqueue_versioned").await;
    let mut tx = db.pool.begin().await.unwrap();
    let enqueued = outbox
        .enqueue_versioned(
            &mut tx,
            1,
            &[factory::event("v", 1), factory::event("v", 2)],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        enqueued
            .iter()
            .map(|e| e.aggregate_sequence)
            .collect::<Vec<_>>(),
        [1, 2]
    );
    assert_eq!(db.count("outbox_heads").await, 0, "no head row is written");

    // A stale version: the caller's lock rule was broken, and nothing is written.
    let mut tx = db.pool.begin().await.unwrap();
    let err = outbox
        .enqueue_versioned(&mut tx, 2, &[factory::event("v", 3)])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), EnqueueErrorKind::SequenceTaken);
    assert!(err.is_retryable());
    tx.rollback().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let mixed = [factory::event("v", 1), factory::event("w", 1)];
    let err = outbox
        .enqueue_versioned(&mut tx, 3, &mixed)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), EnqueueErrorKind::Misuse);
    let err = outbox
        .enqueue_versioned(&mut tx, 0, &[factory::event("v", 1)])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), EnqueueErrorKind::Misuse);
    tx.commit().await.unwrap();
    assert_eq!(sequences(&db, "v").await, [1, 2]);
}

#[tokio::test]
async fn under_repeatable_read_a_concurrent_writer_is_a_retryable_conflict() {
    let (db, outbox) = migrated("enqueue_repeatable_read").await;
    let mut seed = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut seed, &[factory::event("rr", 1)])
        .await
        .unwrap();
    seed.commit().await.unwrap();

    let mut late = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *late)
        .await
        .unwrap();
    // The snapshot is taken by the first query.
    sqlx::query("SELECT 1").execute(&mut *late).await.unwrap();
    let mut early = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut early, &[factory::event("rr", 2)])
        .await
        .unwrap();
    early.commit().await.unwrap();

    let err = outbox
        .enqueue(&mut late, &[factory::event("rr", 3)])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), EnqueueErrorKind::Conflict);
    assert!(err.is_retryable());
    late.rollback().await.unwrap();
    assert_eq!(sequences(&db, "rr").await, [1, 2], "no gap, no duplicate");
}

#[tokio::test]
async fn a_versioned_call_enqueues_in_the_callers_statement_only_when_the_write_happened() {
    let (db, outbox) = migrated("enqueue_call").await;
    sqlx::raw_sql("CREATE TABLE things (id text PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let write = |call: &handoff_postgres::EnqueueCall| {
        format!(
            "WITH new_thing AS (
                 INSERT INTO things (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING id)
             SELECT (SELECT {} FROM new_thing)",
            call.sql(2)
        )
    };
    let call = outbox
        .versioned_call(1, &[factory::event("t1", 1), factory::event("t1", 2)])
        .unwrap();
    let sql = write(&call);
    let mut tx = db.pool.begin().await.unwrap();
    let last: Option<i64> = call
        .bind(sqlx::query_scalar(&sql).bind("t1"))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(last, Some(2));
    assert_eq!(sequences(&db, "t1").await, [1, 2]);

    // The business write did nothing (the row exists): no event either.
    let call = outbox
        .versioned_call(3, &[factory::event("t1", 3)])
        .unwrap();
    let sql = write(&call);
    let last: Option<i64> = call
        .bind(sqlx::query_scalar(&sql).bind("t1"))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(last, None);
    assert_eq!(sequences(&db, "t1").await, [1, 2]);

    // A stale version is classified like enqueue_versioned's.
    sqlx::raw_sql("DELETE FROM things")
        .execute(&db.pool)
        .await
        .unwrap();
    let call = outbox
        .versioned_call(2, &[factory::event("t1", 9)])
        .unwrap();
    let sql = write(&call);
    let err = call
        .bind(sqlx::query_scalar::<_, Option<i64>>(&sql).bind("t1"))
        .fetch_one(&db.pool)
        .await
        .unwrap_err();
    assert_eq!(outbox.classify(err).kind(), EnqueueErrorKind::SequenceTaken);
    assert_eq!(
        db.count("things").await,
        0,
        "the statement failed as a whole"
    );

    // Refusals come before any SQL, as with every enqueue.
    let bad = NewEvent::new(factory::AGGREGATE_TYPE, "t1", "Nope", 1, "{}");
    assert!(matches!(
        outbox.versioned_call(1, &[bad]).unwrap_err().kind(),
        EnqueueErrorKind::Invalid(V::UnknownEventType)
    ));
}
