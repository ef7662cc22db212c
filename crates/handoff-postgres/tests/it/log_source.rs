//! The log source against the real PostgreSQL: ranges by snapshot (late and rolled-back
//! transactions), order per aggregate when transaction ids and sequences disagree, no event
//! row rewritten on the happy path, the lane for failed and held aggregates, the cursor's
//! lease and its paced writes, and a cursor created over a polling relay's backlog.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use handoff_core::delivery::{Failure, OutboxEvent, Published, Released, Source};
use handoff_postgres::{LogConfig, LogSource, Outbox, PollingConfig, Schema, Status};
use handoff_test::{factory, TestDb};

fn config(db: &TestDb, relay_id: &str) -> LogConfig {
    LogConfig {
        polling: PollingConfig {
            schema: Schema::named(db.schema()).unwrap(),
            relay_id: relay_id.into(),
            listen: false,
            ..PollingConfig::default()
        },
        page_size: 50,
        // The cases read the cursor's row right after acknowledging: written at every
        // acknowledgement here; the default pacing has a case of its own.
        advance_every: Duration::ZERO,
        ..LogConfig::default()
    }
}

fn source(db: &TestDb, relay_id: &str) -> LogSource {
    LogSource::new(db.pool.clone(), config(db, relay_id)).unwrap()
}

/// A source whose first claim (of an empty outbox) created its cursor: the events written after
/// it are the cursor's, none a backlog from before it.
async fn reading(db: &TestDb, relay_id: &str) -> LogSource {
    reading_cursor(db, relay_id, handoff_postgres::DEFAULT_CURSOR).await
}

/// Claims and acknowledges until a claim comes back empty twice; returns what came out, in
/// the order it was handed out.
async fn drain(source: &LogSource) -> Vec<OutboxEvent> {
    let mut out = Vec::new();
    let mut empty = 0;
    while empty < 2 {
        let claim = source.claim(100, usize::MAX).await.unwrap();
        if claim.events.is_empty() {
            empty += 1;
            continue;
        }
        empty = 0;
        let acked: Vec<Published> = claim
            .events
            .iter()
            .map(|e| Published::id(e.event_id))
            .collect();
        source.mark_published(&acked).await.unwrap();
        out.extend(claim.events);
    }
    out
}

/// Each aggregate's sequences in the order they came out.
fn by_aggregate(events: &[OutboxEvent]) -> HashMap<String, Vec<i64>> {
    let mut seen: HashMap<String, Vec<i64>> = HashMap::new();
    for e in events {
        seen.entry(e.aggregate_id.clone())
            .or_default()
            .push(e.aggregate_sequence);
    }
    seen
}

async fn enqueue(db: &TestDb, outbox: &Outbox, aggregates: &[&str], per_aggregate: u64) {
    for n in 0..per_aggregate {
        for aggregate in aggregates {
            db.enqueue_alone(outbox, factory::event(aggregate, n)).await;
        }
    }
}

/// The default cursor's lag in events, as `handoff status` reports it.
async fn cursor_lag(db: &TestDb) -> i64 {
    let mut conn = db.pool.acquire().await.unwrap();
    let report = Status::new(&Schema::named(db.schema()).unwrap())
        .read(&mut conn, Duration::from_secs(60), 5)
        .await
        .unwrap();
    assert_eq!(report.cursors.len(), 1);
    assert_eq!(report.cursors[0].owner_relay.as_deref(), Some("relay-a"));
    report.cursors[0].lag_events
}

/// Rows whose current version is not the one their writer inserted: an update (a lease, a
/// mark) leaves the updating transaction's id in xmin.
async fn rewritten_rows(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox
         WHERE xmin::text::bigint <> (txid::text::bigint % 4294967296)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn every_event_comes_out_once_in_order_and_no_event_row_is_rewritten() {
    let (db, outbox) = common::migrated("log_drain").await;
    // The cursor exists before the events, so none of them is a polling backlog.
    let relay = reading(&db, "relay-a").await;
    enqueue(&db, &outbox, &["a", "b", "c", "d"], 60).await;
    assert_eq!(
        cursor_lag(&db).await,
        240,
        "status counts what the cursor has not passed"
    );

    let out = drain(&relay).await;
    assert_eq!(cursor_lag(&db).await, 0);
    assert_eq!(out.len(), 240, "every event once");
    for (aggregate, sequences) in by_aggregate(&out) {
        assert_eq!(
            sequences,
            (1..=60).collect::<Vec<_>>(),
            "order of {aggregate}"
        );
    }
    assert_eq!(
        rewritten_rows(&db).await,
        0,
        "the happy path writes no event row"
    );
    let published: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(published, 0);
    // Its progress is the cursor's row, written once per settled batch at most.
    let ranges = db.count("outbox_cursor_ranges").await;
    assert!((1..=240 / 50 + 3).contains(&ranges), "{ranges} range rows");
    // And the view says when each went out.
    let unpublished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_published WHERE published_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        unpublished, 0,
        "outbox_published dates every event the cursor settled"
    );
}

#[tokio::test]
async fn a_transaction_that_commits_late_comes_out_and_a_rolled_back_one_never_does() {
    let (db, outbox) = common::migrated("log_late").await;
    let relay = reading(&db, "relay-a").await;

    // A writer that began first and commits last, and one that rolls back.
    let mut late = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut late, &[factory::event("late", 0)])
        .await
        .unwrap();
    let mut undone = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut undone, &[factory::event("undone", 0)])
        .await
        .unwrap();
    enqueue(&db, &outbox, &["early"], 3).await;

    let first = drain(&relay).await;
    assert_eq!(
        by_aggregate(&first).keys().collect::<Vec<_>>(),
        vec!["early"]
    );
    undone.rollback().await.unwrap();
    late.commit().await.unwrap();
    let second = drain(&relay).await;
    assert_eq!(
        by_aggregate(&second),
        HashMap::from([("late".to_string(), vec![1])])
    );
}

#[tokio::test]
async fn a_later_sequence_with_an_older_transaction_id_still_comes_out_second() {
    let (db, outbox) = common::migrated("log_xid_order").await;
    let relay = reading(&db, "relay-a").await;
    sqlx::query("CREATE TABLE business (id int)")
        .execute(&db.pool)
        .await
        .unwrap();

    // The second writer takes its transaction id first (its business row), then waits for
    // the first writer's sequence before writing the next one.
    let mut second = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO business VALUES (1)")
        .execute(&mut *second)
        .await
        .unwrap();
    db.enqueue_alone(&outbox, factory::event("x", 0)).await;
    outbox
        .enqueue(&mut second, &[factory::event("x", 1)])
        .await
        .unwrap();
    second.commit().await.unwrap();
    let ids: Vec<(i64, String)> = sqlx::query_as(
        "SELECT aggregate_sequence, txid::text FROM outbox ORDER BY aggregate_sequence",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        ids[1].1.parse::<u64>().unwrap() < ids[0].1.parse::<u64>().unwrap(),
        "the setup gives sequence 2 the older transaction id: {ids:?}"
    );

    let out = drain(&relay).await;
    assert_eq!(by_aggregate(&out)["x"], vec![1, 2]);
}

#[tokio::test]
async fn a_failed_aggregate_goes_to_the_lane_and_the_others_never_wait_for_it() {
    let (db, outbox) = common::migrated("log_lane").await;
    let relay = reading(&db, "relay-a").await;
    enqueue(&db, &outbox, &["poison", "ok"], 3).await;

    let claim = relay.claim(100, usize::MAX).await.unwrap();
    let poison = claim
        .events
        .iter()
        .find(|e| e.aggregate_id == "poison" && e.aggregate_sequence == 1)
        .unwrap()
        .clone();
    let failure = Failure {
        event_id: poison.event_id,
        error: "refused".into(),
        retry_after: None,
        counts_as_attempt: true,
        hold_reason: Some("rejected"),
        lease: claim.lease,
    };
    relay.record_failures(&[failure]).await.unwrap();
    // As the relay does: the events behind the failed one in its lane go back unpublished.
    let behind: Vec<Released> = claim
        .events
        .iter()
        .filter(|e| e.aggregate_id == "poison" && e.aggregate_sequence > 1)
        .map(|e| Released {
            event_id: e.event_id,
            lease: claim.lease,
        })
        .collect();
    relay.release(&behind).await.unwrap();
    let acked: Vec<Published> = claim
        .events
        .iter()
        .filter(|e| e.aggregate_id == "ok")
        .map(|e| Published::id(e.event_id))
        .collect();
    relay.mark_published(&acked).await.unwrap();
    enqueue(&db, &outbox, &["poison", "ok"], 2).await;

    let out = drain(&relay).await;
    assert_eq!(
        by_aggregate(&out).get("poison"),
        None,
        "held: nothing of it goes out"
    );
    assert_eq!(by_aggregate(&out)["ok"], vec![4, 5]);
    let lane: (i64, String) = sqlx::query_as(
        "SELECT from_sequence, reason FROM outbox_cursor_lanes WHERE aggregate_id = 'poison'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(lane, (1, "failed".into()));
    let hold: Option<String> =
        sqlx::query_scalar("SELECT hold_reason FROM outbox WHERE event_id = $1")
            .bind(poison.event_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(hold.as_deref(), Some("rejected"));

    // An operator retries it: the lane publishes the whole aggregate in order, then gives it
    // back, and the cursor publishes what comes after.
    sqlx::query("UPDATE outbox SET available_at = now(), hold_reason = NULL WHERE event_id = $1")
        .bind(poison.event_id)
        .execute(&db.pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = drain_for(&relay, Duration::from_secs(2)).await;
    assert_eq!(by_aggregate(&out)["poison"], vec![1, 2, 3, 4, 5]);
    let released: Option<i64> = sqlx::query_scalar(
        "SELECT released_through FROM outbox_cursor_lanes WHERE aggregate_id = 'poison'",
    )
    .fetch_optional(&db.pool)
    .await
    .unwrap()
    .flatten();
    assert!(released.is_none_or(|through| through == 5));
    enqueue(&db, &outbox, &["poison"], 1).await;
    let out = drain_for(&relay, Duration::from_secs(1)).await;
    assert_eq!(
        by_aggregate(&out).get("poison"),
        Some(&vec![6]),
        "back in the cursor's stream: {out:?}"
    );
}

/// As [`drain`], for a while: the lane is looked at on its own schedule.
async fn drain_for(source: &LogSource, how_long: Duration) -> Vec<OutboxEvent> {
    let until = tokio::time::Instant::now() + how_long;
    let mut out = Vec::new();
    while tokio::time::Instant::now() < until {
        out.extend(drain(source).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    out
}

#[tokio::test]
async fn one_relay_reads_a_cursor_and_another_takes_over_where_it_stopped() {
    let (db, outbox) = common::migrated("log_takeover").await;
    let mut short = config(&db, "relay-a");
    short.polling.lease = Duration::from_secs(2);
    let a = LogSource::new(db.pool.clone(), short.clone()).unwrap();
    let b = LogSource::new(
        db.pool.clone(),
        LogConfig {
            polling: PollingConfig {
                relay_id: "relay-b".into(),
                ..short.polling.clone()
            },
            ..short
        },
    )
    .unwrap();
    assert!(a.claim(100, usize::MAX).await.unwrap().events.is_empty());
    enqueue(&db, &outbox, &["k"], 10).await;
    let first = a.claim(4, usize::MAX).await.unwrap();
    assert_eq!(first.events.len(), 4);
    assert!(
        b.claim(100, usize::MAX).await.unwrap().events.is_empty(),
        "b stands by"
    );
    let acked: Vec<Published> = first
        .events
        .iter()
        .map(|e| Published::id(e.event_id))
        .collect();
    a.mark_published(&acked).await.unwrap();
    // a stops claiming (it died); b takes over once a's lease has run out.
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.is_empty() && tokio::time::Instant::now() < until {
        out = drain(&b).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        by_aggregate(&out)["k"],
        (5..=10).collect::<Vec<_>>(),
        "from where a settled"
    );
    // A clean stop hands the cursor over at once: no lease to wait out.
    b.unregister().await.unwrap();
    enqueue(&db, &outbox, &["k"], 1).await;
    let c = LogSource::new(
        db.pool.clone(),
        LogConfig {
            polling: PollingConfig {
                relay_id: "relay-c".into(),
                lease: Duration::from_secs(30),
                ..config(&db, "relay-c").polling
            },
            ..config(&db, "relay-c")
        },
    )
    .unwrap();
    let handed = c.claim(100, usize::MAX).await.unwrap();
    assert_eq!(
        by_aggregate(&handed.events)["k"],
        vec![11],
        "taken over at the first claim after b let go"
    );
    // a's late writes are fenced off.
    assert!(
        a.mark_published(&acked).await.is_err()
            || a.claim(1, usize::MAX).await.unwrap().events.is_empty()
    );
}

/// The transaction that last wrote the default cursor's row: it changes at every write.
async fn cursor_version(db: &TestDb) -> String {
    sqlx::query_scalar("SELECT xmin::text FROM outbox_cursors WHERE cursor_name = 'default'")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_cursor_is_written_once_per_interval_and_a_clean_stop_writes_the_rest() {
    let (db, outbox) = common::migrated("log_paced").await;
    let paced = LogConfig {
        advance_every: Duration::from_secs(3_600),
        ..config(&db, "relay-a")
    };
    let a = LogSource::new(db.pool.clone(), paced.clone()).unwrap();
    assert!(a.claim(100, usize::MAX).await.unwrap().events.is_empty());
    enqueue(&db, &outbox, &["p", "q"], 30).await;
    let before = cursor_version(&db).await;
    // Sixty events acknowledged in claims of five: twelve acknowledgements, no write.
    let mut out = Vec::new();
    loop {
        let claim = a.claim(5, usize::MAX).await.unwrap();
        if claim.events.is_empty() {
            break;
        }
        let acked: Vec<Published> = claim
            .events
            .iter()
            .map(|e| Published::id(e.event_id))
            .collect();
        a.mark_published(&acked).await.unwrap();
        out.extend(claim.events);
    }
    assert_eq!(out.len(), 60);
    assert_eq!(
        cursor_version(&db).await,
        before,
        "no write of the cursor's row within the interval"
    );
    assert_eq!(cursor_lag(&db).await, 60, "the row still says where it was");
    // A clean stop writes what was acknowledged: the next reader publishes none of it again.
    a.unregister().await.unwrap();
    assert_eq!(cursor_lag_named(&db, "default").await, 0);
    enqueue(&db, &outbox, &["p"], 1).await;
    let b = LogSource::new(
        db.pool.clone(),
        LogConfig {
            polling: PollingConfig {
                relay_id: "relay-b".into(),
                ..paced.polling.clone()
            },
            ..paced
        },
    )
    .unwrap();
    let next = drain(&b).await;
    assert_eq!(by_aggregate(&next)["p"], vec![31], "only what came after");
    assert_eq!(next.len(), 1);
}

#[tokio::test]
async fn a_cursor_created_over_a_polling_backlog_publishes_it_first_through_its_lane() {
    let (db, outbox) = common::migrated("log_upgrade").await;
    // Written and partly published by a polling relay: q#1 published, q#2..3 and r#1 not.
    enqueue(&db, &outbox, &["q"], 3).await;
    enqueue(&db, &outbox, &["r"], 1).await;
    sqlx::query("UPDATE outbox SET published_at = now() WHERE aggregate_id = 'q' AND aggregate_sequence = 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let relay = source(&db, "relay-a");
    let mut out = drain_for(&relay, Duration::from_millis(600)).await;
    enqueue(&db, &outbox, &["q", "r"], 1).await;
    out.extend(drain_for(&relay, Duration::from_millis(800)).await);
    let seen = by_aggregate(&out);
    assert_eq!(
        seen["q"],
        vec![2, 3, 4],
        "the backlog, then the new event, nothing twice"
    );
    assert_eq!(seen["r"], vec![1, 2]);
}

#[tokio::test]
async fn reverting_0021_leaves_the_polling_source_only_what_the_cursor_had_not_published() {
    let (db, outbox) = common::migrated("log_revert").await;
    let relay = reading(&db, "relay-a").await;
    enqueue(&db, &outbox, &["v"], 3).await;
    let first = drain(&relay).await;
    assert_eq!(by_aggregate(&first)["v"], vec![1, 2, 3]);
    // Two more, read by nobody before the revert.
    enqueue(&db, &outbox, &["v"], 2).await;
    drop(relay);

    let mut conn = db.pool.acquire().await.unwrap();
    handoff_postgres::Migrator::handoff(Schema::default())
        .revert(&mut conn, 20)
        .await
        .unwrap();
    // This build's polling source stands in for the release before 0021, whose heartbeat did
    // not write the session columns 0022 added: give them back for it.
    sqlx::query(
        "ALTER TABLE outbox_relays ADD COLUMN published bigint NOT NULL DEFAULT 0,
             ADD COLUMN last_claim_at timestamptz, ADD COLUMN last_mark_at timestamptz",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    drop(conn);
    let polling = handoff_postgres::PollingSource::new(
        db.pool.clone(),
        PollingConfig {
            schema: Schema::named(db.schema()).unwrap(),
            relay_id: "relay-p".into(),
            listen: false,
            ..PollingConfig::default()
        },
    )
    .unwrap();
    let claim = polling.claim(100, usize::MAX).await.unwrap();
    let sequences: Vec<i64> = claim.events.iter().map(|e| e.aggregate_sequence).collect();
    assert_eq!(
        sequences,
        vec![4, 5],
        "what the cursor published is marked, the rest is not"
    );
}

/// A source reading `cursor`, created at the outbox's present by its first claim.
async fn reading_cursor(db: &TestDb, relay_id: &str, cursor: &str) -> LogSource {
    let relay = LogSource::new(
        db.pool.clone(),
        LogConfig {
            cursor: cursor.into(),
            ..config(db, relay_id)
        },
    )
    .unwrap();
    assert!(relay
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    relay
}

async fn cleanup_now(db: &TestDb) -> handoff_postgres::CleanupReport {
    cleanup_with(db, false).await
}

async fn cleanup_with(db: &TestDb, archive: bool) -> handoff_postgres::CleanupReport {
    let config = handoff_postgres::CleanupConfig {
        retention: Duration::from_millis(500),
        broker_durability_horizon: Duration::ZERO,
        archive,
        ..handoff_postgres::CleanupConfig::default()
    };
    let mut conn = db.pool.acquire().await.unwrap();
    let (_stop_tx, stop) = tokio::sync::watch::channel(false);
    handoff_postgres::Cleanup::new(config)
        .unwrap()
        .run(&mut conn, stop, |_| {})
        .await
        .unwrap()
}

/// What is left in the outbox, per aggregate.
async fn left(db: &TestDb) -> HashMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT aggregate_id, count(*) FROM outbox GROUP BY aggregate_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    rows.into_iter().collect()
}

#[tokio::test]
async fn cleanup_deletes_what_every_cursor_passed_before_the_retention_and_nothing_else() {
    let (db, outbox) = common::migrated("log_cleanup").await;
    let main = reading(&db, "relay-a").await;
    let audit = reading_cursor(&db, "relay-b", "audit").await;
    enqueue(&db, &outbox, &["a", "b"], 4).await;
    assert_eq!(drain(&main).await.len(), 8);
    assert_eq!(cursor_lag_named(&db, "default").await, 0);

    // Past the retention, but the audit cursor has read nothing: nothing goes.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let report = cleanup_now(&db).await;
    assert_eq!(report.outbox_deleted, 0, "audit has not passed any event");
    assert_eq!(report.cursor_horizons.len(), 2);

    // Once audit has passed them too (before the retention), they go.
    assert_eq!(drain(&audit).await.len(), 8);
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Events the cursors have not read: they stay however old the others are.
    enqueue(&db, &outbox, &["young"], 2).await;
    let ranges_before = db.count("outbox_cursor_ranges").await;
    let report = cleanup_now(&db).await;
    assert_eq!(report.outbox_deleted, 8);
    assert_eq!(left(&db).await, HashMap::from([("young".to_owned(), 2)]));
    // The ranges that dated only deleted events went with them.
    let ranges_after = db.count("outbox_cursor_ranges").await;
    assert!(
        ranges_after < ranges_before,
        "{ranges_before} ranges before the cleanup, {ranges_after} after"
    );
    let dating_nothing: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_cursor_ranges r
         WHERE NOT EXISTS (SELECT 1 FROM outbox o
                           WHERE o.txid IS NOT NULL
                             AND pg_snapshot_xmax(r.snapshot) > o.txid)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(dating_nothing, 0, "no range left that dates no event");
    // And the young events, once read, are dated by the ranges left.
    assert_eq!(drain(&main).await.len(), 2);
    let undated: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_published WHERE published_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(undated, 0);
}

#[tokio::test]
async fn cleanup_keeps_what_a_cursor_s_lane_holds_even_where_the_lane_published_it() {
    let (db, outbox) = common::migrated("log_cleanup_lane").await;
    let main = reading(&db, "relay-a").await;
    enqueue(&db, &outbox, &["a"], 2).await;
    // holed#1, then an outside writer's holed#3 with no holed#2: the aggregate goes to the
    // cursor's lane, which publishes holed#1 (writing its published_at) and holds holed#3
    // (order fails closed).
    enqueue(&db, &outbox, &["holed"], 1).await;
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         SELECT $1, aggregate_type, aggregate_id, 3, event_type, schema_version, payload
         FROM outbox WHERE aggregate_id = 'holed' AND aggregate_sequence = 1",
    )
    .bind(uuid::Uuid::now_v7())
    .execute(&db.pool)
    .await
    .unwrap();
    let published = drain_for(&main, Duration::from_millis(800)).await;
    assert_eq!(by_aggregate(&published)["holed"], vec![1]);
    assert_eq!(published.len(), 3, "all but holed#3");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let report = cleanup_now(&db).await;
    assert_eq!(report.outbox_deleted, 2, "a's");
    assert_eq!(left(&db).await, HashMap::from([("holed".to_owned(), 2)]));
}

/// A cursor's lag in events.
async fn cursor_lag_named(db: &TestDb, cursor: &str) -> i64 {
    let mut conn = db.pool.acquire().await.unwrap();
    let report = Status::new(&Schema::named(db.schema()).unwrap())
        .read(&mut conn, Duration::from_secs(60), 5)
        .await
        .unwrap();
    report
        .cursors
        .iter()
        .find(|c| c.cursor == cursor)
        .unwrap_or_else(|| panic!("no cursor {cursor}"))
        .lag_events
}

/// Buffers (hit and read) the page query touched, by EXPLAIN (ANALYZE, BUFFERS).
async fn page_buffers(db: &TestDb, from: &str, to: &str) -> (i64, usize) {
    let sql = include_str!("../../queries/log/page.sql").replace("{schema}", "");
    let plan: serde_json::Value =
        sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"))
            .bind(from)
            .bind(to)
            .bind(None::<String>)
            .bind(None::<uuid::Uuid>)
            .bind(1_000_i64)
            .bind(None::<String>)
            .bind(None::<uuid::Uuid>)
            .bind("default")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let top = &plan[0]["Plan"];
    let buffers =
        top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap();
    (buffers, top["Actual Rows"].as_u64().unwrap() as usize)
}

/// A page of the log reads what is new, however many events the outbox holds before it: the
/// keyset of its first page never starts the index scan at the index's first entry.
#[tokio::test]
async fn a_page_reads_the_new_events_not_the_index_before_them() {
    let (db, outbox) = common::migrated("log_page_cost").await;
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload, headers)
         SELECT gen_random_uuid(), 'order', 'bulk', s, 'OrderCreated', 1, '{}', '{}'
         FROM generate_series(1, 60000) AS s",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let index_pages: i64 = sqlx::query_scalar("SELECT pg_relation_size('outbox_txid_idx') / 8192")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let from: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    enqueue(&db, &outbox, &["new-a", "new-b"], 5).await;
    let to: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let (buffers, rows) = page_buffers(&db, &from, &to).await;
    assert_eq!(rows, 10, "the ten new events");
    assert!(index_pages > 200, "{index_pages} pages of outbox_txid_idx");
    // About eight a row (its key, its predecessor, its heap page); the old keyset walked every
    // page of the index first.
    assert!(
        buffers < index_pages / 3,
        "{buffers} buffers for a page of 10 events over {index_pages} index pages"
    );
}

#[tokio::test]
async fn archived_log_events_keep_the_time_their_cursor_settled_them() {
    let (db, outbox) = common::migrated("log_cleanup_archive").await;
    let main = reading(&db, "relay-a").await;
    enqueue(&db, &outbox, &["a"], 3).await;
    assert_eq!(drain(&main).await.len(), 3);
    let dated: Vec<(uuid::Uuid, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT event_id, published_at FROM outbox_published ORDER BY event_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(dated.len(), 3);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(cleanup_with(&db, true).await.outbox_deleted, 3);
    let archived: Vec<(uuid::Uuid, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT event_id, published_at FROM outbox_archive ORDER BY event_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        archived, dated,
        "the archive keeps outbox_published's dates"
    );
}
