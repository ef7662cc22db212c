//! The relay's mark (`handoff_mark_published`) against the real PostgreSQL: what it reads
//! follows the events it marks, not the size the outbox had when the session first marked; and
//! who may call it is kept when migration 0017 puts a new function in its place.

use crate::common;
use crate::common::previous_release;

use handoff_postgres::{Migrator, Schema};
use handoff_test::{factory, TestDb};
use sqlx::pool::PoolConnection;
use sqlx::Postgres;

/// Events the measured mark marks.
const MARKED: i64 = 10;

/// Inserts `count` events, each the first of an aggregate of its own named `<prefix>-<n>`,
/// in one statement; returns their ids in insertion order.
async fn insert(conn: &mut PoolConnection<Postgres>, prefix: &str, count: i64) -> Vec<uuid::Uuid> {
    sqlx::query_scalar(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         SELECT gen_random_uuid(), $1, $2 || '-' || n, 1, $3, 1, '{}'
         FROM generate_series(1, $4::bigint) n
         RETURNING event_id",
    )
    .bind(factory::AGGREGATE_TYPE)
    .bind(prefix)
    .bind(factory::EVENT_TYPE)
    .bind(count)
    .fetch_all(&mut **conn)
    .await
    .unwrap()
}

/// Marks `ids` published on `conn`, as the relay does (one call of the function).
async fn mark(conn: &mut PoolConnection<Postgres>, ids: &[uuid::Uuid]) {
    let receipts: Vec<String> = ids.iter().map(|_| "test ack".to_owned()).collect();
    sqlx::query("SELECT handoff_mark_published($1::uuid[], $2::text[])")
        .bind(ids)
        .bind(&receipts)
        .execute(&mut **conn)
        .await
        .unwrap();
}

/// What marking [`MARKED`] of `ids` touches on `conn`: the shared buffers of the call, its
/// statements and their planning included.
async fn mark_cost(conn: &mut PoolConnection<Postgres>, ids: &[uuid::Uuid]) -> i64 {
    let receipts: Vec<String> = ids.iter().map(|_| "test ack".to_owned()).collect();
    let plan: serde_json::Value = sqlx::query_scalar(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
         SELECT handoff_mark_published($1::uuid[], $2::text[])",
    )
    .bind(ids)
    .bind(&receipts)
    .fetch_one(&mut **conn)
    .await
    .unwrap();
    let marked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE event_id = ANY($1) AND published_at IS NOT NULL",
    )
    .bind(ids)
    .fetch_one(&mut **conn)
    .await
    .unwrap();
    assert_eq!(marked, ids.len() as i64);
    let top = &plan[0]["Plan"];
    top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap()
}

/// The least of three [`mark_cost`]s, each of [`MARKED`] other events of `ids`. The buffers of
/// a call count the planning of its statements, which reads the catalogues again whenever
/// another session's DDL (tests running beside it create schemas) invalidated their caches: a
/// single call is sometimes hundreds of buffers above what the mark itself reads.
async fn least_mark_cost(conn: &mut PoolConnection<Postgres>, ids: &[uuid::Uuid]) -> i64 {
    let mut least = i64::MAX;
    for chunk in ids.chunks(MARKED as usize).take(3) {
        least = least.min(mark_cost(conn, chunk).await);
    }
    least
}

/// The outbox's heap, in pages.
async fn pages(conn: &mut PoolConnection<Postgres>) -> i64 {
    sqlx::query_scalar("SELECT pg_relation_size('outbox') / current_setting('block_size')::int8")
        .fetch_one(&mut **conn)
        .await
        .unwrap()
}

/// PL/pgSQL keeps a generic plan of each statement of a function once it has run five times in
/// a session. A relay that started on a small outbox (a new deployment, a table just cleaned
/// up) used to keep the plans made for it: the mark then read the whole table on every call, a
/// sequential scan that grew with the outbox (in `handoff-bench writers`, 38 to 48 buffers per
/// marked event after ten seconds, against 20 with plans made per call). Migration 0014 plans
/// the mark's statements on every call.
#[tokio::test]
async fn what_a_mark_reads_does_not_grow_with_the_table_whatever_it_was_when_the_session_began() {
    let (db, _outbox) = common::migrated("mark_plan_per_call").await;
    let mut conn = db.pool.acquire().await.unwrap();

    // A small outbox, and a relay session marking its events one by one: more than the five
    // calls after which PL/pgSQL may settle on a generic plan.
    for id in insert(&mut conn, "small", 8).await {
        mark(&mut conn, &[id]).await;
    }

    // The outbox grows (no ANALYZE in between, as within autovacuum's naptime), and the same
    // session marks ten of its events; then it grows three times as large and the session
    // marks ten more.
    let grown = insert(&mut conn, "grown", 100_000).await;
    let before = least_mark_cost(&mut conn, &grown).await;
    let pages_before = pages(&mut conn).await;
    let grown = insert(&mut conn, "grown-more", 200_000).await;
    let after = least_mark_cost(&mut conn, &grown).await;
    let pages_after = pages(&mut conn).await;

    // Index probes cost the same in both (one more btree level at most); a scan of the heap
    // costs its pages, three times as many.
    assert!(
        after <= before * 3 / 2,
        "marking {MARKED} events touched {before} buffers at {pages_before} pages, {after} at \
         {pages_after}"
    );
}

/// Migration 0015 frees parked successors through `outbox_parked_idx`, an index of the parked
/// events only. An index the planner may also choose to read whole: with statistics taken while
/// nothing was parked, it looks empty, and a mark that filtered it on the array of freed events
/// would read every parked event on every call (a held aggregate's tail of a million). The
/// mark's statements are written so that they probe per marked event whatever the statistics
/// say; this holds them to it.
#[tokio::test]
async fn a_mark_beside_a_parked_tail_reads_what_it_marks_whatever_the_statistics_say() {
    let (db, _outbox) = common::migrated("mark_parked_tail").await;
    let mut conn = db.pool.acquire().await.unwrap();
    // Statistics stay as taken below, as between two runs of autovacuum.
    sqlx::query("ALTER TABLE outbox SET (autovacuum_enabled = false)")
        .execute(&mut *conn)
        .await
        .unwrap();

    // Thirty heads with a successor each, thirty more without, and a held aggregate's tail of
    // 50,000 events; analysed while nothing is parked.
    let heads = insert(&mut conn, "head", 3 * MARKED).await;
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         SELECT gen_random_uuid(), aggregate_type, aggregate_id, 2, event_type, 1, '{}'
         FROM outbox WHERE aggregate_id LIKE 'head-%'",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let alone = insert(&mut conn, "alone", 3 * MARKED).await;
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         SELECT gen_random_uuid(), $1, 'held', n, $2, 1, '{}'
         FROM generate_series(2, 50001) n",
    )
    .bind(factory::AGGREGATE_TYPE)
    .bind(factory::EVENT_TYPE)
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox")
        .execute(&mut *conn)
        .await
        .unwrap();

    // Nothing parked: the baseline.
    let baseline = least_mark_cost(&mut conn, &alone).await;

    // The tail and the heads' successors are parked, as claims park them.
    sqlx::query(
        "UPDATE outbox SET blocked = true
         WHERE aggregate_id = 'held' OR (aggregate_id LIKE 'head-%' AND aggregate_sequence = 2)",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let cost = least_mark_cost(&mut conn, &heads).await;

    let freed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox
         WHERE aggregate_id LIKE 'head-%' AND aggregate_sequence = 2 AND NOT blocked",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(freed, 3 * MARKED, "each marked head's successor is freed");
    let still_parked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'held' AND blocked")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert_eq!(still_parked, 50_000, "the held tail stays parked");
    // Freeing ten successors costs a few buffers each; reading the parked index whole would
    // cost hundreds of pages and a heap read per parked event.
    assert!(
        cost <= baseline * 3,
        "marking {MARKED} events touched {baseline} buffers with nothing parked, {cost} beside \
         50,000 parked events"
    );
}

/// Migration 0017 renames the mark's body and puts a new `handoff_mark_published` in its place:
/// whoever could call the mark before still can, and nobody else can, where a deployment
/// revoked EXECUTE from PUBLIC and granted it to its relay's role.
#[tokio::test]
async fn the_mark_upgraded_in_place_keeps_who_may_call_it() {
    let db = TestDb::new("mark_grants").await;
    let mut conn = db.pool.acquire().await.unwrap();
    previous_release::migrated_through(&mut conn, 16).await;
    // Roles are the cluster's: named after the test's schema, dropped at the end.
    let relay = format!("{}_relay", db.schema());
    let other = format!("{}_other", db.schema());
    for statement in [
        format!("CREATE ROLE {relay}"),
        format!("CREATE ROLE {other}"),
        "REVOKE EXECUTE ON FUNCTION handoff_mark_published(uuid[], text[]) FROM PUBLIC".into(),
        format!("GRANT EXECUTE ON FUNCTION handoff_mark_published(uuid[], text[]) TO {relay}"),
    ] {
        sqlx::query(&statement).execute(&mut *conn).await.unwrap();
    }

    Migrator::handoff(Schema::default())
        .run(&mut conn)
        .await
        .unwrap();
    let may_call = |role: &str, function: &str| {
        sqlx::query_scalar::<_, bool>("SELECT has_function_privilege($1, $2, 'EXECUTE')")
            .bind(role.to_owned())
            .bind(format!("{}.{function}(uuid[], text[])", db.schema()))
    };
    let mut grants = Vec::new();
    for role in [&relay, &other] {
        for function in [
            "handoff_mark_published",
            "handoff_mark_published_session_plans",
        ] {
            let granted = may_call(role, function)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            grants.push((role == &relay, function, granted));
        }
    }
    for statement in [
        format!("DROP OWNED BY {relay}, {other}"),
        format!("DROP ROLE {relay}, {other}"),
    ] {
        sqlx::query(&statement).execute(&mut *conn).await.unwrap();
    }
    assert_eq!(
        grants,
        [
            (true, "handoff_mark_published", true),
            (true, "handoff_mark_published_session_plans", true),
            (false, "handoff_mark_published", false),
            (false, "handoff_mark_published_session_plans", false),
        ],
        "(the relay's role, function, may call it) after migration 0017"
    );
}
