//! The `inventory` binary against the real PostgreSQL and NATS: every order event changes the
//! reserved stock exactly once, whether JetStream delivers it again, it is published again
//! under another message id, or the consumer dies between its commit and its acknowledgement.

use std::collections::{BTreeMap, BTreeSet};

use crate::common::{
    cancelled, created, free_addr, line, metric, order_event, orders, processed, run_to_exit,
    stock, wait_for, Bus, Process, INVENTORY,
};
use handoff_core::delivery::OutboxEvent;
use handoff_test::TestDb;
use sqlx::PgPool;
use uuid::Uuid;

async fn start(db: &TestDb, bus: &Bus, extra: &[&str], envs: &[(&str, String)]) -> Process {
    let mut args = bus.args();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let mut all_envs = vec![("DATABASE_URL", db.url())];
    all_envs.extend(envs.iter().cloned());
    Process::start(INVENTORY, &args, &all_envs, "consuming").await
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_counts_each_event_once_even_when_it_is_published_again() {
    let db = TestDb::new("inventory_once").await;
    let bus = Bus::new("inventory_once").await;
    let metrics = free_addr();
    let metrics_arg = metrics.to_string();
    let mut inventory = start(&db, &bus, &["--metrics-addr", &metrics_arg], &[]).await;
    assert_eq!(
        inventory.ready_line(),
        format!("consuming {} as inventory", bus.stream)
    );

    let (orders, expected) = orders(20);
    let events: Vec<&OutboxEvent> = orders.iter().flatten().collect();
    let total = i64::try_from(events.len()).unwrap();
    // Sequence by sequence across orders, so different orders are applied concurrently.
    for sequence in 0..3 {
        for order in &orders {
            if let Some(event) = order.get(sequence) {
                bus.publish(event).await;
            }
        }
    }
    wait_for("every event applied", || async {
        let n = processed(&db.pool).await.len();
        (n == events.len())
            .then_some(())
            .ok_or(format!("{n} of {total} processed"))
    })
    .await;
    assert_eq!(stock(&db.pool).await, expected);
    for order in &orders {
        let last: i64 = sqlx::query_scalar(
            "SELECT last_sequence FROM consumer_sequences
             WHERE consumer_name = 'inventory' AND aggregate_type = 'order' AND aggregate_id = $1",
        )
        .bind(&order[0].aggregate_id)
        .fetch_one(&db.pool)
        .await
        .expect("the order's sequence");
        assert_eq!(last, i64::try_from(order.len()).unwrap());
    }

    // The same events again as new messages: JetStream stores and delivers each, and only the
    // inbox can tell they were applied already.
    for event in &events {
        bus.publish_as_new_message(event).await;
    }
    let http = reqwest::Client::new();
    let duplicates = wait_for("every copy acknowledged as a duplicate", || async {
        let n = metric(&http, metrics, "handoff_consumer_duplicates_total").await?;
        (n >= total as f64)
            .then_some(n)
            .ok_or(format!("{n} duplicates of {total}"))
    })
    .await;
    assert_eq!(duplicates, total as f64);
    assert_eq!(
        metric(&http, metrics, "handoff_consumer_applied_total").await,
        Ok(total as f64)
    );
    assert_eq!(
        stock(&db.pool).await,
        expected,
        "the copies changed nothing"
    );
    let ids = processed(&db.pool).await;
    assert_eq!(ids.len(), events.len(), "one dedup row per event");
    assert_eq!(
        ids.into_iter().collect::<BTreeSet<_>>(),
        events.iter().map(|e| e.event_id).collect::<BTreeSet<_>>()
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM consumer_quarantine").await,
        0
    );

    let status = inventory.terminate().await;
    assert!(status.success(), "exit after SIGTERM: {status}");
    assert_eq!(inventory.log_count("consumer stopped"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_events_are_quarantined_and_unknown_ones_move_the_order_on() {
    let db = TestDb::new("inventory_quarantine").await;
    let bus = Bus::new("inventory_quarantine").await;
    let _inventory = start(&db, &bus, &[], &[]).await;

    // An order whose second event is of a type inventory does not know: applied as a no-op,
    // so the cancellation after it is next in line.
    let known = Uuid::now_v7();
    let lines = vec![line("apple", 3, 100)];
    bus.publish(&order_event(known, 1, &created(known, lines.clone())))
        .await;
    let mut shipped = order_event(known, 2, &cancelled(known, vec![]));
    shipped.event_type = "OrderShipped".to_owned();
    shipped.payload = r#"{"carrier":"snail"}"#.to_owned();
    bus.publish(&shipped).await;
    bus.publish(&order_event(known, 3, &cancelled(known, lines)))
        .await;
    // An OrderCreated whose payload is not one, and one in a version newer than inventory reads.
    let broken = Uuid::now_v7();
    let mut unreadable = order_event(broken, 1, &created(broken, vec![line("pear", 1, 1)]));
    unreadable.payload = r#"{"order_id":"not a uuid"}"#.to_owned();
    bus.publish(&unreadable).await;
    let newer = Uuid::now_v7();
    let mut version_three = order_event(newer, 1, &created(newer, vec![line("fig", 1, 1)]));
    version_three.schema_version = 3;
    bus.publish(&version_three).await;

    wait_for("both unreadable events quarantined", || async {
        let n = count(&db.pool, "SELECT count(*) FROM consumer_quarantine").await;
        (n == 2).then_some(()).ok_or(format!("{n} quarantined"))
    })
    .await;
    wait_for("the known order applied to its end", || async {
        let last: Option<i64> = sqlx::query_scalar(
            "SELECT last_sequence FROM consumer_sequences WHERE aggregate_id = $1",
        )
        .bind(known.to_string())
        .fetch_optional(&db.pool)
        .await
        .expect("read the sequence");
        (last == Some(3))
            .then_some(())
            .ok_or(format!("last sequence {last:?}"))
    })
    .await;
    assert_eq!(
        stock(&db.pool).await,
        BTreeMap::from([("apple".to_owned(), 0)]),
        "nothing of the unreadable orders was reserved"
    );
    let reasons: Vec<(Uuid, String, String)> = sqlx::query_as(
        "SELECT event_id, reason_kind, reason FROM consumer_quarantine ORDER BY reason",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read the quarantine");
    assert!(reasons
        .iter()
        .all(|(_, kind, _)| kind == "handler_permanent"));
    let by_id: BTreeMap<Uuid, String> = reasons.into_iter().map(|(id, _, r)| (id, r)).collect();
    assert!(by_id[&unreadable.event_id].contains("does not parse"));
    assert!(by_id[&version_three.event_id].contains("schema version 3"));
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_commit_and_ack_does_not_apply_the_event_twice() {
    let db = TestDb::new("inventory_crash").await;
    let bus = Bus::new("inventory_crash").await;
    // A short ack wait: the restarted consumer gets the unacknowledged message back soon.
    let args = ["--ack-wait", "2s"];
    let mut first = start(
        &db,
        &bus,
        &args,
        &[("FAILPOINTS", "consumer.after_commit=return".to_owned())],
    )
    .await;
    let order_id = Uuid::now_v7();
    let event = order_event(order_id, 1, &created(order_id, vec![line("crash", 4, 100)]));
    bus.publish(&event).await;

    // The effect and its dedup row are committed; the acknowledgement never goes out.
    first.wait_for_log("failpoint fired").await;
    assert_eq!(
        stock(&db.pool).await,
        BTreeMap::from([("crash".to_owned(), 4)])
    );
    assert_eq!(processed(&db.pool).await, [event.event_id]);
    first.kill().await;

    let second = start(&db, &bus, &args, &[]).await;
    let line = second
        .wait_for_log("duplicate delivery acknowledged without applying")
        .await;
    assert!(line.contains(&event.event_id.to_string()), "{line}");
    assert_eq!(
        stock(&db.pool).await,
        BTreeMap::from([("crash".to_owned(), 4)]),
        "the redelivery must not reserve again"
    );
    assert_eq!(processed(&db.pool).await, [event.event_id]);
    assert_eq!(
        count(
            &db.pool,
            "SELECT max(last_sequence) FROM consumer_sequences"
        )
        .await,
        1
    );
    assert_eq!(second.log_count("failpoint fired"), 0);
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_commit_leaves_nothing_and_the_redelivery_applies_once() {
    let db = TestDb::new("inventory_crash_before").await;
    let bus = Bus::new("inventory_crash_before").await;
    let args = ["--ack-wait", "2s"];
    let mut first = start(
        &db,
        &bus,
        &args,
        &[("FAILPOINTS", "consumer.before_commit=return".to_owned())],
    )
    .await;
    let order_id = Uuid::now_v7();
    let event = order_event(order_id, 1, &created(order_id, vec![line("early", 3, 100)]));
    bus.publish(&event).await;

    // The handler ran inside the transaction; the commit never happens.
    first.wait_for_log("failpoint fired").await;
    first.kill().await;
    assert!(
        stock(&db.pool).await.is_empty(),
        "the effect died with its transaction"
    );
    assert!(
        processed(&db.pool).await.is_empty(),
        "and so did the dedup row"
    );

    let _second = start(&db, &bus, &args, &[]).await;
    let expected = BTreeMap::from([("early".to_owned(), 3)]);
    wait_for("the redelivery is applied", || async {
        let now = stock(&db.pool).await;
        if now == expected {
            Ok(())
        } else {
            Err(format!("{now:?}"))
        }
    })
    .await;
    assert_eq!(processed(&db.pool).await, [event.event_id]);
}

#[tokio::test]
async fn a_dedup_retention_shorter_than_the_replay_horizon_is_refused() {
    let (status, stdout, stderr) = run_to_exit(
        INVENTORY,
        &["--dedup-retention", "1d", "--replay-horizon", "7d"],
        &[("DATABASE_URL", handoff_test::database_url())],
    )
    .await;
    assert_eq!(status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stdout, "", "never ready");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(lines[0].contains("dedup retention 1d"), "{stderr}");
    assert!(lines[0].contains("replay horizon 7d"), "{stderr}");
}
