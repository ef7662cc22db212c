//! `handoff relay --order global` as a real process against the real PostgreSQL and
//! nats-server (design F3): one subject, one strictly increasing global sequence with no gap,
//! through SIGKILLs of the relay; an aggregate-mode relay leaves the lane alone; a schema
//! without migration 0006 is refused.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::{check_stream, shared_target, wait_drained, RelayProcess, Writers};
use handoff_postgres::{Migrator, OrderMode, Schema};
use handoff_test::nats::{read_stream, StoredMessage};
use handoff_test::{factory, TestDb};
use sqlx::PgPool;

const GLOBAL_SEQUENCE: &str = handoff_core::contract::header::GLOBAL_SEQUENCE;

async fn published(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits until more than `at_least` events are published, or panics with the relay's log.
async fn wait_published(pool: &PgPool, at_least: i64, relay: &RelayProcess) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while published(pool).await <= at_least {
        assert!(
            Instant::now() < deadline,
            "no more than {at_least} published:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The global sequence each message carries, in stream order.
fn global_sequences(messages: &[StoredMessage]) -> Vec<i64> {
    messages
        .iter()
        .map(|m| {
            m.header(GLOBAL_SEQUENCE)
                .unwrap_or_else(|| panic!("message {} has no {GLOBAL_SEQUENCE}", m.sequence))
                .parse()
                .unwrap()
        })
        .collect()
}

#[tokio::test]
async fn the_global_subject_holds_one_gap_free_sequence_through_relay_kills() {
    let db = TestDb::migrated("global_cli_kills").await;
    let (target, client, _cleanup) = shared_target(&db, "global_kills").await;
    let global = factory::outbox(OrderMode::Global);
    let flags = ["--order", "global", "--batch-size", "25"];

    // Writers of many aggregates at once, every 9th transaction rolled back.
    let writers = Writers {
        connections: 8,
        transactions: 480,
        aggregates: 40,
        rollback_every: 9,
    }
    .spawn(&db.pool, &global);

    // The relay is SIGKILLed three times while it drains, each time after it made progress,
    // and restarted at once; the successor waits out the dead relay's lease (4 s).
    let mut relay = RelayProcess::start(&target, "global-0", &flags, &[]);
    let mut old_logs = String::new();
    for kill in 1..=3 {
        let seen = published(&db.pool).await;
        wait_published(&db.pool, seen + 30, &relay).await;
        relay.kill();
        old_logs.push_str(&format!("--- {}\n{}", relay.id, relay.log()));
        relay = RelayProcess::start(&target, &format!("global-{kill}"), &flags, &[]);
    }
    let rolled_back: HashSet<uuid::Uuid> = writers.await.unwrap();
    assert!(!rolled_back.is_empty());
    wait_drained(&db.pool, Duration::from_secs(120), || {
        format!("{old_logs}--- {}\n{}", relay.id, relay.log())
    })
    .await;
    assert!(relay.terminate().success(), "{}", relay.log());

    let messages = read_stream(&client, &target.stream).await;
    let subject = format!("{}.global", target.prefix);
    for message in &messages {
        assert_eq!(message.subject, subject, "message {}", message.sequence);
    }
    // Every committed event exactly once (JetStream dropped the republished copies by
    // Nats-Msg-Id), none rolled back, per-aggregate order kept.
    let report = check_stream(&db.pool, &messages).await;
    assert_eq!(
        report.duplicates, 0,
        "a republish got past the duplicate window"
    );
    let ids: HashSet<&str> = messages
        .iter()
        .map(|m| m.header("Nats-Msg-Id").unwrap())
        .collect();
    assert!(ids
        .iter()
        .all(|id| !rolled_back.contains(&id.parse().unwrap())));

    // One strictly increasing global sequence, 1..=N, no gap, in stream order.
    let rows = db.count("outbox").await;
    let want: Vec<i64> = (1..=rows).collect();
    assert_eq!(global_sequences(&messages), want);
    // And it is the sequence the writers were given.
    let stored: Vec<(uuid::Uuid, i64)> =
        sqlx::query_as("SELECT event_id, global_sequence FROM outbox ORDER BY global_sequence")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    for (message, (event_id, global)) in messages.iter().zip(&stored) {
        assert_eq!(message.header("ce-id"), Some(event_id.to_string().as_str()));
        assert_eq!(
            message.header(GLOBAL_SEQUENCE),
            Some(global.to_string().as_str())
        );
    }
}

#[tokio::test]
async fn an_aggregate_relay_leaves_global_events_to_a_global_relay() {
    let db = TestDb::migrated("global_cli_modes").await;
    let (target, client, _cleanup) = shared_target(&db, "global_modes").await;
    // Aggregates of their own per mode: an aggregate written in both modes has its later
    // per-aggregate events wait behind its unpublished global ones (the predecessor rule).
    for (order, aggregate, count) in [
        (OrderMode::Global, "lane", 6),
        (OrderMode::Aggregate, "plain", 4),
    ] {
        let outbox = factory::outbox(order);
        for n in 0..count {
            let mut tx = db.pool.begin().await.unwrap();
            let event = factory::event(&format!("{aggregate}-{}", n % 2), n);
            outbox.enqueue(&mut tx, &[event]).await.unwrap();
            tx.commit().await.unwrap();
        }
    }

    let mut per_aggregate = RelayProcess::start(&target, "per-aggregate", &[], &[]);
    per_aggregate
        .wait_for_log(
            "events of the global lane are pending",
            Duration::from_secs(30),
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while published(&db.pool).await < 4 {
        assert!(Instant::now() < deadline, "{}", per_aggregate.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(per_aggregate.terminate().success());
    let unpublished_global: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE global_sequence IS NOT NULL AND published_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        unpublished_global, 6,
        "the aggregate relay published a global event"
    );
    let messages = read_stream(&client, &target.stream).await;
    assert_eq!(messages.len(), 4);
    assert!(messages.iter().all(|m| m.header(GLOBAL_SEQUENCE).is_none()));

    let mut lane = RelayProcess::start(&target, "global", &["--order", "global"], &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || lane.log()).await;
    assert!(lane.terminate().success());
    let messages = read_stream(&client, &target.stream).await;
    assert_eq!(global_sequences(&messages[4..]), [1, 2, 3, 4, 5, 6]);
    check_stream(&db.pool, &messages).await;
}

#[tokio::test]
async fn a_global_relay_refuses_a_schema_without_migration_0006() {
    let db = TestDb::migrated("global_cli_unmigrated").await;
    let (target, _client, _cleanup) = shared_target(&db, "global_unmigrated").await;
    let mut conn = db.pool.acquire().await.unwrap();
    Migrator::handoff(Schema::default())
        .revert(&mut conn, 5)
        .await
        .unwrap();
    drop(conn);

    let mut relay = RelayProcess::start(&target, "too-early", &["--order", "global"], &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = relay.try_status() {
            break status;
        }
        assert!(Instant::now() < deadline, "still running:\n{}", relay.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!status.success(), "{}", relay.log());
    assert!(relay.log().contains("migration 0006"), "{}", relay.log());
}
