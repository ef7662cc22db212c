//! `TestDb`'s cleanup against the real PostgreSQL: a test that leaves a session idle in a
//! transaction holding locks in its schema still gets its schema dropped, and does not hang.

use std::time::Duration;

use handoff_test::TestDb;
use sqlx::Connection;

#[tokio::test]
async fn a_session_left_idle_in_a_transaction_does_not_stop_the_schema_from_going() {
    let db = TestDb::new("idle_in_transaction").await;
    let schema = db.schema().to_owned();
    sqlx::raw_sql(&format!("CREATE TABLE \"{schema}\".t (id int)"))
        .execute(&db.pool)
        .await
        .unwrap();
    // A pooled connection left in a transaction that holds a lock on the table, as a handler's
    // future cancelled mid-transaction leaves it; the pool stays open until the drop.
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::raw_sql(&format!("BEGIN; LOCK TABLE \"{schema}\".t"))
        .execute(&mut *conn)
        .await
        .unwrap();
    let options = db.pool.connect_options().as_ref().clone();
    drop(conn);

    tokio::time::timeout(Duration::from_secs(60), async move {
        tokio::task::spawn_blocking(move || drop(db)).await.unwrap()
    })
    .await
    .expect("the schema was dropped within 60 s");

    let mut check = sqlx::PgConnection::connect_with(&options).await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = $1")
        .bind(&schema)
        .fetch_one(&mut check)
        .await
        .unwrap();
    assert_eq!(left, 0, "schema {schema} is still there");
}
