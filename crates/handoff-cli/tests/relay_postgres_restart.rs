//! PostgreSQL crashes under a running relay: the relay backs off, reconnects by itself, and
//! publishes what was committed before and after (design P3).

mod common;

use std::time::Duration;

use common::{check_stream, enqueue_spread, wait_drained, RelayProcess, Target};
use handoff_postgres::{Migrator, Outbox, OutboxConfig, Schema};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::factory;
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use sqlx::postgres::PgPoolOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_crash_under_the_relay_is_ridden_out() {
    let mut server = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap()
        .unwrap();
    let url = server.url("postgres");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    Migrator::handoff(Schema::default())
        .run(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();

    let client = prepare_shared_server().await;
    let stream = unique_name("pg_restart");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let target = Target {
        database_url: url.clone(),
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream.clone(),
    };
    let mut relay = RelayProcess::start(&target, "pg-restart-relay", &[], &[]);

    enqueue_spread(&pool, &outbox, 0, 30, 7).await;
    wait_drained(&pool, Duration::from_secs(30), || relay.log()).await;
    pool.close().await;

    // The postmaster is SIGKILLed: every connection of the relay dies with it.
    server = tokio::task::spawn_blocking(move || {
        server.kill_postmaster().unwrap();
        server
    })
    .await
    .unwrap();
    relay.wait_for_log("failed", Duration::from_secs(30)).await;
    server = tokio::task::spawn_blocking(move || {
        server.start_again().unwrap();
        server
    })
    .await
    .unwrap();

    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    enqueue_spread(&pool, &outbox, 30, 30, 7).await;
    wait_drained(&pool, Duration::from_secs(60), || relay.log()).await;
    assert!(relay.terminate().success(), "{}", relay.log());
    let messages = read_stream(&client, &stream).await;
    let report = check_stream(&pool, &messages).await;
    assert_eq!(report.messages - report.duplicates, 60);
    pool.close().await;
    drop(server);
}
