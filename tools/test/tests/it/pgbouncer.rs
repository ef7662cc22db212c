//! The private PgBouncer pools in transaction mode: what sqlx sends with binds survives it only
//! as an unnamed statement inside a transaction (the measurement behind `Pooling`, see
//! docs/poolers.md), and `Pooling::detect` tells it from a direct connection.

use std::str::FromStr;

use handoff_postgres::Pooling;
use handoff_test::pgbouncer::{OwnDatabase, PgBouncer};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const STATEMENTS: usize = 2000;

/// Runs `STATEMENTS` bound statements over 32 clients; returns how many failed.
async fn failures(url: &str, persistent: bool, in_tx: bool) -> usize {
    let pool = PgPoolOptions::new()
        .max_connections(32)
        .connect_with(PgConnectOptions::from_str(url).unwrap())
        .await
        .unwrap();
    let tasks: Vec<_> = (0..STATEMENTS as i64)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let query = sqlx::query_scalar::<_, i64>("SELECT $1::int8 + 1")
                    .bind(i)
                    .persistent(persistent);
                let result = if in_tx {
                    match pool.begin().await {
                        Ok(mut tx) => match query.fetch_one(&mut *tx).await {
                            Ok(v) => tx.commit().await.map(|()| v),
                            Err(e) => Err(e),
                        },
                        Err(e) => Err(e),
                    }
                } else {
                    query.fetch_one(&pool).await
                };
                usize::from(result.is_err())
            })
        })
        .collect();
    let mut failed = 0;
    for task in tasks {
        failed += task.await.unwrap();
    }
    pool.close().await;
    failed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_unnamed_statements_in_a_transaction_pass_a_transaction_pooler() {
    let database = OwnDatabase::create("pgbouncer_statements").await;
    let bouncer = PgBouncer::start_with_pool_size(&handoff_test::database_url(), 4).unwrap();
    let url = bouncer.url(database.name());
    // Proves the setup: sqlx's cached named statements break behind it.
    let named = failures(&url, true, false).await;
    assert!(
        named > 0,
        "named statements all passed: is it pooling per transaction?"
    );
    assert_eq!(failures(&url, false, true).await, 0);
}

#[tokio::test]
async fn detect_tells_the_pooler_from_a_direct_connection() {
    let database = OwnDatabase::create("pgbouncer_detect").await;
    let bouncer = PgBouncer::start(&handoff_test::database_url()).unwrap();
    let pooled = PgConnectOptions::from_str(&bouncer.url(database.name())).unwrap();
    let direct = PgConnectOptions::from_str(&database.url()).unwrap();
    assert_eq!(
        Pooling::detect(&pooled).await.unwrap(),
        Pooling::Transaction
    );
    assert_eq!(Pooling::detect(&direct).await.unwrap(), Pooling::Session);
}
