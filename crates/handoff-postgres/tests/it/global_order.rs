//! Global order mode against the real PostgreSQL (design F3): the writers' global sequence and
//! the polling source's global lane.

use std::collections::HashMap;
use std::time::Duration;

use handoff_core::delivery::{Failure, Published, Source};
use handoff_postgres::{OrderMode, PollingConfig, PollingSource, Schema};
use handoff_test::{factory, TestDb};

fn source(db: &TestDb, relay_id: &str, order: OrderMode) -> PollingSource {
    let config = PollingConfig {
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: relay_id.into(),
        order,
        ..PollingConfig::default()
    };
    PollingSource::new(db.pool.clone(), config).unwrap()
}

/// `(global_sequence, aggregate_id, aggregate_sequence)` of every row, in global order (rows
/// without one last).
async fn rows(db: &TestDb) -> Vec<(Option<i64>, String, i64)> {
    sqlx::query_as(
        "SELECT global_sequence, aggregate_id, aggregate_sequence FROM outbox
         ORDER BY global_sequence NULLS LAST, aggregate_id, aggregate_sequence",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn concurrent_global_writers_get_gap_free_unique_numbers_in_commit_order() {
    const TASKS: usize = 8;
    const TXS: u64 = 50;
    let db = TestDb::migrated("global_concurrent").await;
    let global = factory::outbox(OrderMode::Global);
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let pool = db.pool.clone();
        let outbox = global.clone();
        tasks.push(tokio::spawn(async move {
            let mut written = 0u64;
            for n in 0..TXS {
                let mut tx = pool.begin().await.unwrap();
                if task >= 6 {
                    // The caller-versioned path, on an aggregate of this task's own.
                    let aggregate = format!("v{task}");
                    let events = [factory::event(&aggregate, n)];
                    let sequence = i64::try_from(n).unwrap() + 1;
                    outbox
                        .enqueue_versioned(&mut tx, sequence, &events)
                        .await
                        .unwrap();
                    written += 1;
                } else {
                    // Shared aggregates, and now and then a batch over two of them.
                    let first = format!("a{}", (n + task as u64) % 5);
                    let mut events = vec![factory::event(&first, n)];
                    if n % 7 == 0 {
                        events.push(factory::event(&format!("a{}", (n + 1) % 5), n));
                    }
                    outbox.enqueue(&mut tx, &events).await.unwrap();
                    written += events.len() as u64;
                }
                tx.commit().await.unwrap();
            }
            written
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }

    let rows = rows(&db).await;
    assert_eq!(rows.len() as u64, total);
    let globals: Vec<i64> = rows.iter().map(|r| r.0.expect("numbered")).collect();
    let want: Vec<i64> = (1..=i64::try_from(total).unwrap()).collect();
    assert_eq!(globals, want, "global sequences are exactly 1..=N, no gap");
    // Commit order is sequence order, so each aggregate's own sequence grows with the global
    // one.
    let mut last: HashMap<&str, i64> = HashMap::new();
    for (global, aggregate, sequence) in &rows {
        let previous = last.insert(aggregate, *sequence).unwrap_or(0);
        assert_eq!(
            *sequence,
            previous + 1,
            "{aggregate}#{sequence} at global {global:?} follows {previous}"
        );
    }
    let head: i64 = sqlx::query_scalar("SELECT last_sequence FROM outbox_global_head")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(head, i64::try_from(total).unwrap());
}

#[tokio::test]
async fn a_rolled_back_transaction_leaves_no_gap() {
    let db = TestDb::migrated("global_rollback").await;
    let global = factory::outbox(OrderMode::Global);
    db.enqueue_alone(&global, factory::event("a", 1)).await;
    let mut tx = db.pool.begin().await.unwrap();
    global
        .enqueue(&mut tx, &[factory::event("a", 2), factory::event("b", 2)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    db.enqueue_alone(&global, factory::event("b", 3)).await;

    let rows = rows(&db).await;
    assert_eq!(
        rows,
        vec![(Some(1), "a".to_owned(), 1), (Some(2), "b".to_owned(), 1)]
    );
}

#[tokio::test]
async fn aggregate_mode_events_stay_unnumbered_and_each_source_takes_only_its_own() {
    let db = TestDb::migrated("global_modes").await;
    db.enqueue_alone(
        &factory::outbox(OrderMode::Aggregate),
        factory::event("p", 1),
    )
    .await;
    db.enqueue_alone(&factory::outbox(OrderMode::Global), factory::event("g", 1))
        .await;
    db.enqueue_alone(
        &factory::outbox(OrderMode::Aggregate),
        factory::event("p", 2),
    )
    .await;

    let rows = rows(&db).await;
    assert_eq!(
        rows,
        vec![
            (Some(1), "g".to_owned(), 1),
            (None, "p".to_owned(), 1),
            (None, "p".to_owned(), 2),
        ]
    );

    let per_aggregate = source(&db, "relay-a", OrderMode::Aggregate);
    let claim = per_aggregate.claim(100, usize::MAX).await.unwrap();
    let claimed: Vec<(&str, Option<i64>)> = claim
        .events
        .iter()
        .map(|e| (e.aggregate_id.as_str(), e.global_sequence))
        .collect();
    assert_eq!(claimed, vec![("p", None), ("p", None)]);
    let lane = per_aggregate.other_lane().await.unwrap();
    assert_eq!(
        lane.pending, 1,
        "the global event is left for a global relay"
    );

    let global = source(&db, "relay-g", OrderMode::Global);
    let claim = global.claim(100, usize::MAX).await.unwrap();
    assert_eq!(claim.events.len(), 1);
    assert_eq!(claim.events[0].aggregate_id, "g");
    assert_eq!(claim.events[0].global_sequence, Some(1));
    let lane = global.other_lane().await.unwrap();
    assert_eq!(lane.pending, 2, "the per-aggregate events are left alone");
    assert_eq!(lane.global_front, Some(1));
    assert!(!lane.global_front_held);
}

#[tokio::test]
async fn the_global_lane_goes_to_one_relay_at_a_time_from_its_front() {
    let db = TestDb::migrated("global_lane").await;
    let global = factory::outbox(OrderMode::Global);
    for n in 0..10 {
        db.enqueue_alone(&global, factory::event(&format!("agg{}", n % 3), n))
            .await;
    }
    let (a, b) = (
        source(&db, "relay-a", OrderMode::Global),
        source(&db, "relay-b", OrderMode::Global),
    );

    let first = a.claim(4, usize::MAX).await.unwrap();
    let globals: Vec<Option<i64>> = first.events.iter().map(|e| e.global_sequence).collect();
    assert_eq!(globals, [Some(1), Some(2), Some(3), Some(4)]);
    assert!(
        b.claim(100, usize::MAX).await.unwrap().events.is_empty(),
        "the front is leased: nobody else may take any of the lane"
    );
    assert!(
        a.claim(100, usize::MAX).await.unwrap().events.is_empty(),
        "not even the holder, until its earlier claim is settled"
    );

    // Settle 1..3; 4 fails and backs off: the lane waits for it.
    let acked: Vec<Published> = first.events[..3]
        .iter()
        .map(|e| Published::id(e.event_id))
        .collect();
    a.mark_published(&acked).await.unwrap();
    a.record_failures(&[Failure {
        event_id: first.events[3].event_id,
        error: "timeout".into(),
        retry_after: Some(Duration::from_secs(3600)),
        counts_as_attempt: true,
        hold_reason: None,
        lease: first.lease,
    }])
    .await
    .unwrap();
    assert!(
        b.claim(100, usize::MAX).await.unwrap().events.is_empty(),
        "a front backing off holds the whole lane"
    );

    // Make 4 available again: the next claim starts there and runs on to the end.
    sqlx::query("UPDATE outbox SET available_at = now() WHERE global_sequence = 4")
        .execute(&db.pool)
        .await
        .unwrap();
    let rest = b.claim(100, usize::MAX).await.unwrap();
    let globals: Vec<i64> = rest
        .events
        .iter()
        .map(|e| e.global_sequence.unwrap())
        .collect();
    assert_eq!(globals, (4..=10).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_front_behind_a_held_event_of_its_aggregate_blocks_the_lane_and_says_so() {
    let db = TestDb::migrated("global_behind_held").await;
    // a#1 is written in aggregate order mode and held; a#2, written in global order mode, is
    // the global lane's front and waits behind it.
    db.enqueue_alone(
        &factory::outbox(OrderMode::Aggregate),
        factory::event("a", 0),
    )
    .await;
    let aggregate = source(&db, "relay-aggregate", OrderMode::Aggregate);
    let claim = aggregate.claim(10, usize::MAX).await.unwrap();
    assert_eq!(claim.events.len(), 1);
    aggregate
        .record_failures(&[Failure {
            event_id: claim.events[0].event_id,
            error: "refused".into(),
            retry_after: None,
            counts_as_attempt: true,
            hold_reason: Some("rejected"),
            lease: claim.lease,
        }])
        .await
        .unwrap();
    let global = factory::outbox(OrderMode::Global);
    db.enqueue_alone(&global, factory::event("a", 1)).await;
    db.enqueue_alone(&global, factory::event("b", 2)).await;

    let relay = source(&db, "relay-global", OrderMode::Global);
    assert!(relay
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    let lane = relay.other_lane().await.unwrap();
    assert_eq!(lane.global_front, Some(1));
    assert!(!lane.global_front_held, "the front itself is not held");
    assert!(lane.global_front_behind_held);
    assert!(lane.global_lane_blocked());

    let mut conn = db.pool.acquire().await.unwrap();
    let report = handoff_postgres::Status::new(&Schema::default())
        .read(&mut conn, Duration::from_secs(60), 5)
        .await
        .unwrap();
    assert!(report.global_lane_blocked);
}

#[tokio::test]
async fn a_held_front_blocks_the_lane_and_says_so() {
    let db = TestDb::migrated("global_held").await;
    let global = factory::outbox(OrderMode::Global);
    for n in 0..3 {
        db.enqueue_alone(&global, factory::event("a", n)).await;
    }
    let relay = source(&db, "relay-a", OrderMode::Global);
    let claim = relay.claim(1, usize::MAX).await.unwrap();
    assert_eq!(claim.events[0].global_sequence, Some(1));
    relay
        .record_failures(&[Failure {
            event_id: claim.events[0].event_id,
            error: "refused".into(),
            retry_after: None,
            counts_as_attempt: true,
            hold_reason: None,
            lease: claim.lease,
        }])
        .await
        .unwrap();

    assert!(relay
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    let lane = relay.other_lane().await.unwrap();
    assert!(lane.global_front_held);
    assert_eq!(lane.global_front, Some(1));

    let mut conn = db.pool.acquire().await.unwrap();
    let report = handoff_postgres::Status::new(&Schema::default())
        .read(&mut conn, Duration::from_secs(60), 5)
        .await
        .unwrap();
    assert!(report.global_lane_blocked);
    assert_eq!(report.global_pending, 3);
}
