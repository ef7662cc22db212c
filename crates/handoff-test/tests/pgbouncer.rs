//! The private PgBouncer: it pools in transaction mode, so what sqlx does with named and
//! unnamed statements outside and inside a transaction is measured here.

use std::str::FromStr;

use handoff_test::pgbouncer::{OwnDatabase, PgBouncer};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

async fn run(pool: &sqlx::PgPool, persistent: bool, in_tx: bool, n: usize) -> usize {
    let mut tasks = Vec::new();
    for i in 0..n {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let r: Result<i64, sqlx::Error> = async {
                if in_tx {
                    let mut tx = pool.begin().await?;
                    let v = sqlx::query_scalar("SELECT $1::int8 + 1")
                        .bind(i as i64)
                        .persistent(persistent)
                        .fetch_one(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(v)
                } else {
                    sqlx::query_scalar("SELECT $1::int8 + 1")
                        .bind(i as i64)
                        .persistent(persistent)
                        .fetch_one(&pool)
                        .await
                }
            }
            .await;
            match r {
                Ok(_) => 0,
                Err(e) => {
                    eprintln!("{e}");
                    1
                }
            }
        }));
    }
    let mut failed = 0;
    for t in tasks {
        failed += t.await.unwrap();
    }
    failed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn measure() {
    let db = OwnDatabase::create("measure").await;
    let bouncer = PgBouncer::start_with_pool_size(&handoff_test::database_url(), 4).unwrap();
    for (cap, persistent, in_tx) in [
        (100, true, false),
        (0, true, false),
        (0, false, false),
        (100, true, true),
        (0, false, true),
    ] {
        let options = PgConnectOptions::from_str(&bouncer.url(db.name()))
            .unwrap()
            .statement_cache_capacity(cap);
        let pool = PgPoolOptions::new()
            .max_connections(32)
            .connect_with(options)
            .await
            .unwrap();
        let failed = run(&pool, persistent, in_tx, 2000).await;
        println!("cap={cap} persistent={persistent} in_tx={in_tx}: {failed} of 2000 failed");
        pool.close().await;
    }
}
