//! The relay's mark (`handoff_mark_published`) against the real PostgreSQL: what it reads
//! follows the events it marks, not the size the outbox had when the session first marked.

mod common;

use handoff_test::factory;
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
    let before = mark_cost(&mut conn, &grown[..MARKED as usize]).await;
    let pages_before = pages(&mut conn).await;
    let grown = insert(&mut conn, "grown-more", 200_000).await;
    let after = mark_cost(&mut conn, &grown[..MARKED as usize]).await;
    let pages_after = pages(&mut conn).await;

    // Index probes cost the same in both (one more btree level at most); a scan of the heap
    // costs its pages, three times as many.
    assert!(
        after <= before * 3 / 2,
        "marking {MARKED} events touched {before} buffers at {pages_before} pages, {after} at \
         {pages_after}"
    );
}
