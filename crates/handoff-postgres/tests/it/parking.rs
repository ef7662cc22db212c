//! Blocked events leave the claim's path (issue 21, migration 0012) against the real
//! PostgreSQL: a claim parks the events it meets waiting behind an unpublished predecessor, so
//! a held aggregate's growing tail does not raise what a claim reads, and the parked events
//! come back, in order, once their predecessor is published.

use crate::common;
use crate::common::claims;
use crate::common::previous_release;

use std::time::Duration;

use claims::{claimed, hold, mark_published};
use handoff_core::delivery::Source;
use handoff_core::EventId;
use handoff_postgres::{
    Migrator, PollingConfig, PollingSource, Quarantine, QuarantineErrorKind, Schema,
};
use handoff_test::{factory, TestDb};
use sqlx::Row;

const BATCH: usize = 100;

const CLAIM_SQL: &str = include_str!("../../queries/claim.sql");

fn source(db: &TestDb) -> PollingSource {
    let config = PollingConfig {
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: "relay-parking".into(),
        ..PollingConfig::default()
    };
    PollingSource::new(db.pool.clone(), config).unwrap()
}

/// Appends `count` events to `aggregate` after its last sequence, as an outside writer would
/// (one INSERT, so a 20,000-event tail takes a moment, not a minute).
async fn append(db: &TestDb, aggregate: &str, count: i64) {
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         SELECT gen_random_uuid(), $1, $2, last.seq + n, $3, 1, '{}'
         FROM (SELECT coalesce(max(aggregate_sequence), 0) AS seq FROM outbox
               WHERE aggregate_type = $1 AND aggregate_id = $2) last,
              generate_series(1, $4::bigint) n",
    )
    .bind(factory::AGGREGATE_TYPE)
    .bind(aggregate)
    .bind(factory::EVENT_TYPE)
    .bind(count)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// One claim, marked published at once; returns what it published, in claim order.
async fn publish_one_claim(relay: &PollingSource) -> Vec<(String, i64)> {
    let claim = relay.claim(BATCH, usize::MAX).await.unwrap();
    mark_published(relay, &claim).await;
    // A relay publishes each aggregate's events in sequence order.
    let mut published = claimed(&claim);
    published.sort();
    published
}

/// Writes `aggregate`'s first event and holds it (the destination refused it for good), so that
/// whatever is appended behind it waits; returns its id.
async fn hold_first_event(db: &TestDb, relay: &PollingSource, aggregate: &str) -> EventId {
    append(db, aggregate, 1).await;
    let first = relay.claim(BATCH, usize::MAX).await.unwrap();
    let event_id = first.events[0].event_id;
    hold(relay, &first, event_id).await;
    event_id
}

/// Publishes the healthy aggregates' events (one claim: they are BATCH heads).
async fn drain_healthy(relay: &PollingSource) {
    let published = publish_one_claim(relay).await;
    assert_eq!(published.len(), BATCH, "{published:?}");
    assert!(published.iter().all(|(aggregate, _)| aggregate != "h"));
}

/// Publishes claim after claim until nothing is pending. A claim that finds nothing while
/// events are pending fails the test: they would be parked behind a published event.
async fn drain_all(relay: &PollingSource) -> Vec<(String, i64)> {
    let mut published = Vec::new();
    while relay.backlog().await.unwrap().pending > 0 {
        let batch = publish_one_claim(relay).await;
        assert!(
            !batch.is_empty(),
            "stuck after {} published",
            published.len()
        );
        published.extend(batch);
    }
    published
}

/// Binds `claim.sql`'s parameters as the relay does for a claim of `BATCH` by `relay`, with the
/// front depth `front` (`$7`; none: four batches).
fn bind_claim<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    relay: &'q str,
    front: Option<i64>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    query
        .bind(relay)
        .bind(BATCH as i64)
        .bind(30.0_f64)
        .bind(5_i32)
        .bind(2_i32)
        // A full scan of the index, not only its last seconds: the tail is older.
        .bind(None::<chrono::DateTime<chrono::Utc>>)
        .bind(front)
        // No session: leases as a relay that does not register writes them.
        .bind(None::<uuid::Uuid>)
        // No byte budget ($9).
        .bind(i64::MAX)
}

/// What one claim of `BATCH` reads, run under EXPLAIN (ANALYZE, BUFFERS) in a transaction that
/// is rolled back: the buffers it touched, and the rows its scan of outbox_ready_idx returned.
async fn claim_cost(db: &TestDb) -> (i64, i64) {
    claim_cost_with_front(db, None).await
}

/// As [`claim_cost`], with the front's depth the relay passes (`$7`; none: four batches).
async fn claim_cost_with_front(db: &TestDb, front: Option<i64>) -> (i64, i64) {
    let explain = format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}",
        CLAIM_SQL.replace("{schema}", "")
    );
    let mut tx = db.pool.begin().await.unwrap();
    let plan: serde_json::Value = bind_claim(sqlx::query(&explain), "probe", front)
        .fetch_one(&mut *tx)
        .await
        .unwrap()
        .get(0);
    tx.rollback().await.unwrap();
    let top = &plan[0]["Plan"];
    let buffers =
        top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap();
    let mut front_rows = None;
    find_scan(top, "outbox_ready_idx", &mut front_rows);
    (
        buffers,
        front_rows.unwrap_or_else(|| panic!("the claim does not scan outbox_ready_idx: {plan:#}")),
    )
}

fn find_scan(node: &serde_json::Value, index: &str, rows: &mut Option<i64>) {
    if node["Index Name"] == index {
        *rows = Some(rows.unwrap_or(0) + node["Actual Rows"].as_i64().unwrap());
    }
    for child in node["Plans"].as_array().into_iter().flatten() {
        find_scan(child, index, rows);
    }
}

/// The rows one claim of `BATCH` read from the parts of its own statement (its CTE scans),
/// on the plan a relay caches: the generic plan of the prepared claim, which knows neither the
/// batch nor the front's bounds. Run under EXPLAIN ANALYZE in a transaction rolled back.
async fn cached_plan_reads(db: &TestDb) -> i64 {
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL plan_cache_mode = force_generic_plan")
        .execute(&mut *tx)
        .await
        .unwrap();
    let prepare = format!(
        "PREPARE cached_claim (text, bigint, float8, int, int, timestamptz, bigint, uuid, bigint) \
         AS {}",
        CLAIM_SQL.replace("{schema}", "")
    );
    sqlx::raw_sql(&prepare).execute(&mut *tx).await.unwrap();
    let explain = format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE cached_claim('probe', {BATCH}, 30, 5, 2, NULL, NULL, \
         NULL, {})",
        i64::MAX
    );
    let plan: serde_json::Value = sqlx::query_scalar(&explain)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    sqlx::raw_sql("DEALLOCATE cached_claim")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    cte_rows(&plan[0]["Plan"])
}

/// Rows read by the CTE scans under `node`: what each returned and filtered out, per loop,
/// times its loops.
fn cte_rows(node: &serde_json::Value) -> i64 {
    let own = if node["Node Type"] == "CTE Scan" {
        let per_loop = [
            "Actual Rows",
            "Rows Removed by Filter",
            "Rows Removed by Join Filter",
        ]
        .iter()
        .map(|key| node[key].as_i64().unwrap_or(0))
        .sum::<i64>();
        per_loop * node["Actual Loops"].as_i64().unwrap_or(0)
    } else {
        0
    };
    own + node["Plans"]
        .as_array()
        .into_iter()
        .flatten()
        .map(cte_rows)
        .sum::<i64>()
}

/// Parks the tail (claims until a claim parks nothing new), then vacuums and analyses, as
/// autovacuum would: the dead row versions the parking left go, and the planner knows the
/// table's size, so both measurements start alike.
async fn settle(db: &TestDb, relay: &PollingSource) {
    loop {
        let claim = relay.claim(BATCH, usize::MAX).await.unwrap();
        assert!(
            claim.events.is_empty(),
            "only the held aggregate has events: {:?}",
            claim.events
        );
        let unparked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox
             WHERE published_at IS NULL AND NOT blocked AND available_at <> 'infinity'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if unparked == 0 {
            break;
        }
    }
    sqlx::query(&format!("VACUUM ANALYZE {}.outbox", db.schema()))
        .execute(&db.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_held_aggregate_with_a_growing_tail_does_not_raise_what_a_claim_reads() {
    let (db, _outbox) = common::migrated("parking_growing_tail").await;
    let relay = source(&db);

    // h#1 is held.
    let held = hold_first_event(&db, &relay, "h").await;

    // A short tail, parked; then a claim among healthy traffic.
    append(&db, "h", 200).await;
    settle(&db, &relay).await;
    for n in 0..BATCH {
        append(&db, &format!("short-{n}"), 1).await;
    }
    let (short_buffers, short_rows) = claim_cost(&db).await;
    drain_healthy(&relay).await;

    // The tail grows a hundredfold while the aggregate is held.
    append(&db, "h", 20_000).await;
    settle(&db, &relay).await;
    for n in 0..BATCH {
        append(&db, &format!("long-{n}"), 1).await;
    }
    let (long_buffers, long_rows) = claim_cost(&db).await;

    eprintln!(
        "claim of {BATCH}: 200-event tail {short_buffers} buffers, {short_rows} rows scanned; \
         20,200-event tail {long_buffers} buffers, {long_rows} rows scanned"
    );
    // Before migration 0012 the claim walked the whole tail: 20,200 rows and ~20,000 more
    // buffers here. Now it reads the healthy front and nothing of the tail. Rows, not buffers,
    // are asserted: the buffers also count dead row versions a VACUUM could not remove yet
    // while another session's snapshot was open (tests run in parallel on one server); they
    // are printed above for the record.
    assert!(
        long_rows <= 2 * BATCH as i64,
        "the claim scanned {long_rows} rows"
    );
    assert_eq!(
        long_rows, short_rows,
        "rows scanned: 200-event tail vs 20,200"
    );
    drain_healthy(&relay).await;

    // Released, the held event goes first and its parked tail follows, in order, in batches
    // smaller than the tail: each batch's mark frees the next one.
    let quarantine = Quarantine::new(&Schema::named(db.schema()).unwrap());
    let mut conn = db.pool.acquire().await.unwrap();
    quarantine.retry(&mut conn, held, "op").await.unwrap();
    let published = tokio::time::timeout(Duration::from_secs(120), drain_all(&relay))
        .await
        .expect("the tail drains");
    let sequences: Vec<i64> = published.iter().map(|(_, s)| *s).collect();
    assert_eq!(sequences, (1..=20_201).collect::<Vec<_>>());
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "nothing is left parked");
}

#[tokio::test]
async fn a_parked_event_an_operator_holds_stays_held_when_its_predecessor_is_published() {
    let (db, _outbox) = common::migrated("parking_operator_hold").await;
    let relay = source(&db);
    let quarantine = Quarantine::new(&Schema::named(db.schema()).unwrap());
    let mut conn = db.pool.acquire().await.unwrap();

    // p#1 held by the relay; p#2 behind it, parked by the next claim.
    let first = hold_first_event(&db, &relay, "p").await;
    append(&db, "p", 1).await;
    assert!(relay
        .claim(BATCH, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    let second: (EventId, bool) = sqlx::query_as(
        "SELECT event_id, blocked FROM outbox WHERE aggregate_id = 'p' AND aggregate_sequence = 2",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(second.1, "p#2 is parked");

    // The operator holds p#2, then releases p#1, which is published: p#2 stays held (the mark
    // frees a parked successor by making it available now).
    quarantine
        .hold(&mut conn, second.0, "bad data, fix pending", "op")
        .await
        .unwrap();
    quarantine.retry(&mut conn, first, "op").await.unwrap();
    let claim = relay.claim(BATCH, usize::MAX).await.unwrap();
    assert_eq!(claimed(&claim), [("p".to_owned(), 1)]);
    mark_published(&relay, &claim).await;
    assert!(relay
        .claim(BATCH, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    let listed = quarantine.list(&mut conn, 10).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].event_id, second.0);
    assert_eq!(listed[0].hold_reason.as_deref(), Some("operator"));

    // Held already, and published: refused, nothing changed.
    for (event_id, state) in [(second.0, "quarantined"), (first, "published")] {
        let error = quarantine
            .hold(&mut conn, event_id, "again", "op")
            .await
            .unwrap_err();
        assert_eq!(error.kind(), QuarantineErrorKind::NotHoldable, "{error}");
        assert!(error.to_string().contains(state), "{error}");
    }
    let unknown = quarantine
        .hold(&mut conn, uuid::Uuid::now_v7(), "stuck", "op")
        .await
        .unwrap_err();
    assert_eq!(
        unknown.kind(),
        QuarantineErrorKind::UnknownEvent,
        "{unknown}"
    );

    // Skipped, it goes out as a skip marker.
    quarantine
        .skip(&mut conn, second.0, "never apply", "op")
        .await
        .unwrap();
    let claim = relay.claim(BATCH, usize::MAX).await.unwrap();
    assert_eq!(claimed(&claim), [("p".to_owned(), 2)]);
}

#[tokio::test]
async fn a_claim_tells_whether_anything_waits_on_the_events_in_flight() {
    // The relay claims again right after a mark only when this says so: at steady load, with
    // nothing behind the events in flight, a claim after every mark would cost a query each.
    let (db, _outbox) = common::migrated("parking_waiting").await;
    let relay = source(&db);

    append(&db, "x", 1).await;
    append(&db, "y", 1).await;
    let first = relay.claim(BATCH, usize::MAX).await.unwrap();
    assert_eq!(first.events.len(), 2);
    assert!(
        !first.waiting_on_in_flight,
        "nothing waits behind x#1 or y#1"
    );

    // x#2 arrives while x#1 is in flight: not claimable, not parked, waiting on it.
    append(&db, "x", 1).await;
    let second = relay.claim(BATCH, usize::MAX).await.unwrap();
    assert!(second.events.is_empty());
    assert!(second.waiting_on_in_flight, "x#2 waits on x#1 in flight");

    // Settled, x#1 frees x#2, and then nothing waits any more.
    mark_published(&relay, &first).await;
    let third = relay.claim(BATCH, usize::MAX).await.unwrap();
    assert_eq!(claimed(&third), [("x".to_string(), 2)]);
    assert!(!third.waiting_on_in_flight);
}

#[tokio::test]
async fn a_database_of_the_previous_release_upgrades_with_its_held_and_pending_rows_flowing() {
    let db = TestDb::new("parking_upgrade").await;
    let mut conn = db.pool.acquire().await.unwrap();
    // The schema as the previous release (migrations 0001 to 0011) left it.
    previous_release::migrated_through(&mut conn, 11).await;
    // "h": 1 held, 500 pending behind it; "a": three pending events.
    append(&db, "h", 501).await;
    append(&db, "a", 3).await;
    sqlx::query(
        "UPDATE outbox SET available_at = 'infinity', quarantined_at = now(), hold_reason = 'attempts'
         WHERE aggregate_id = 'h' AND aggregate_sequence = 1",
    )
    .execute(&mut *conn)
    .await
    .unwrap();

    Migrator::handoff(Schema::default())
        .run(&mut conn)
        .await
        .unwrap();
    assert_eq!(db.pending_rows().await, 504, "pending rows intact");

    // The first claims park h's tail as they meet it and publish a's events.
    let relay = source(&db);
    let mut published = Vec::new();
    while published.len() < 3 {
        published.extend(publish_one_claim(&relay).await);
    }
    assert_eq!(
        published,
        vec![("a".into(), 1), ("a".into(), 2), ("a".into(), 3)]
    );

    // Released, h#1 goes first and the rest follows in order.
    let held: uuid::Uuid = sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE aggregate_id = 'h' AND aggregate_sequence = 1",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    Quarantine::new(&Schema::default())
        .retry(&mut conn, held, "op")
        .await
        .unwrap();
    let sequences: Vec<i64> = drain_all(&relay).await.iter().map(|(_, s)| *s).collect();
    assert_eq!(sequences, (1..=501).collect::<Vec<_>>());
}

/// Runs one claim of `BATCH` for relay `relay` with the front depth `front` and commits it:
/// the events it leased and the `next_front` it returned.
async fn claim_with_front(db: &TestDb, relay: &str, front: Option<i64>) -> (i64, i64) {
    let claim = CLAIM_SQL.replace("{schema}", "");
    let rows = bind_claim(sqlx::query(&claim), relay, front)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let leased = rows
        .iter()
        .filter(|row| row.get::<Option<uuid::Uuid>, _>("event_id").is_some())
        .count();
    (leased as i64, rows[0].get("next_front"))
}

#[tokio::test]
async fn a_claim_locks_only_what_it_leases_and_reads_the_front_the_last_one_needed() {
    let (db, _outbox) = common::migrated("parking_front_depth").await;
    // Forty batches of heads: one event for each of 40 × BATCH aggregates, analysed, so that
    // the planner reads the front from the index (on a table it thinks tiny it reads it all).
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         SELECT gen_random_uuid(), $1, 'a-' || n, 1, $2, 1, '{}'
         FROM generate_series(1, $3::bigint) n",
    )
    .bind(factory::AGGREGATE_TYPE)
    .bind(factory::EVENT_TYPE)
    .bind(40 * BATCH as i64)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(&format!("VACUUM ANALYZE {}.outbox", db.schema()))
        .execute(&db.pool)
        .await
        .unwrap();

    // A relay's first claim reads four batches to lease one.
    let (leased, next_front) = claim_with_front(&db, "relay-a", None).await;
    assert_eq!(leased, BATCH as i64);

    // It locked only the rows it leased: a front locked whole wrote a row lock into the three
    // batches it read and left (their xmax names the claim).
    let locked_not_leased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE claimed_by IS NULL AND xmax::text <> '0'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(locked_not_leased, 0, "front rows locked but not leased");
    // (Measured after that check: EXPLAIN ANALYZE runs the claim, in a transaction rolled back.)
    let (_, first_rows) = claim_cost_with_front(&db, None).await;
    assert_eq!(
        first_rows,
        4 * BATCH as i64,
        "rows a front of four batches read"
    );

    // Its heads filled the batch from the first BATCH rows of its front, so the next claim
    // reads that deep, a quarter more and 16 rows: not four batches.
    assert_eq!(next_front, BATCH as i64 * 5 / 4 + 16);
    let (_, next_rows) = claim_cost_with_front(&db, Some(next_front)).await;
    assert_eq!(next_rows, next_front, "rows the next front read");
    let (leased, _) = claim_with_front(&db, "relay-a", Some(next_front)).await;
    assert_eq!(
        leased, BATCH as i64,
        "the shallower front still fills the batch"
    );

    // A second relay whose heads are held by another claim's locks leases the next ones: the
    // front is read without locks, and the heads are locked one by one, skipping held ones.
    let mut blocker = db.pool.begin().await.unwrap();
    let held: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE claimed_by IS NULL
         ORDER BY available_at, occurred_at LIMIT $1 FOR UPDATE",
    )
    .bind(BATCH as i64)
    .fetch_all(&mut *blocker)
    .await
    .unwrap();
    assert_eq!(held.len(), BATCH);
    let (leased, next_front) = claim_with_front(&db, "relay-b", None).await;
    assert_eq!(leased, BATCH as i64, "a claim beside another's locks");
    blocker.rollback().await.unwrap();
    // Its heads were the second batch of its front, so the next front is two batches deep.
    assert_eq!(next_front, 2 * BATCH as i64 * 5 / 4 + 16);
    let (leased_total, held_leased): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE claimed_by IS NOT NULL),
                count(*) FILTER (WHERE claimed_by IS NOT NULL AND event_id = ANY ($1))
         FROM outbox",
    )
    .bind(&held)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(leased_total, 3 * BATCH as i64);
    assert_eq!(held_leased, 0, "a row another transaction held was leased");
}

#[tokio::test]
async fn the_cached_claim_plan_parks_a_blocked_front_without_rereading_it_for_every_row() {
    // A relay runs its claim on a generic plan, which guesses every part of the statement
    // small; parts compared with NOT EXISTS then became nested loops, each front row reading
    // the front again: 6 million CTE rows for a front of 2,000 rows behind held events.
    let (db, _outbox) = common::migrated("parking_cached_plan").await;
    let relay = source(&db);
    hold_first_event(&db, &relay, "h").await;
    // A whole front (four batches) waiting behind the held event, none of it parked yet.
    let front = 4 * BATCH as i64;
    append(&db, "h", front).await;
    sqlx::query(&format!("ANALYZE {}.outbox", db.schema()))
        .execute(&db.pool)
        .await
        .unwrap();

    let read = cached_plan_reads(&db).await;
    eprintln!("a claim parking a front of {front} rows read {read} rows of its own parts");
    // Each part of the statement reads the front a few times over (head, park, hole, the
    // counts), not once per front row (that would be front × front, 160,000 here).
    assert!(
        read <= 20 * front,
        "the claim read {read} rows of its own parts for a front of {front}"
    );
    // And a claim by the relay, on its cached plan, parks that front.
    let claim = relay.claim(BATCH, usize::MAX).await.unwrap();
    assert!(claim.events.is_empty(), "{:?}", claim.events);
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE blocked")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(parked, front);
}
