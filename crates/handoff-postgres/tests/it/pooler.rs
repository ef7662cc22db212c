//! The library through a transaction pooler (a private PgBouncer, `pool_mode = transaction`,
//! 4 server connections shared by 16 writers): with `Pooling::Transaction` the sqlx enqueue,
//! the inbox (its admission in the consumer's transaction, and the dedup purge outside one) and
//! the polling source's claim and acknowledgement all work.

use std::time::Duration;

use handoff_core::delivery::{Published, Source};
use handoff_core::intake::ReceivedEvent;
use handoff_postgres::{
    Admission, Inbox, Migrator, Outbox, OutboxConfig, PollingConfig, PollingSource, Pooling, Schema,
};
use handoff_test::factory;
use handoff_test::pgbouncer::{OwnDatabase, PgBouncer};
use sqlx::postgres::PgPoolOptions;
use sqlx::Connection;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enqueue_inbox_and_source_work_through_a_transaction_pooler() {
    let database = OwnDatabase::create("postgres_pooler").await;
    let mut direct = sqlx::PgConnection::connect(&database.url()).await.unwrap();
    Migrator::handoff(Schema::default())
        .run(&mut direct)
        .await
        .unwrap();
    let bouncer = PgBouncer::start_with_pool_size(&handoff_test::database_url(), 4).unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&bouncer.url(database.name()))
        .await
        .unwrap();
    let outbox = Outbox::new(
        OutboxConfig {
            pooling: Pooling::Transaction,
            ..OutboxConfig::default()
        },
        factory::catalog(),
    )
    .unwrap();

    let writers: Vec<_> = (0..16)
        .map(|w| {
            let (pool, outbox) = (pool.clone(), outbox.clone());
            tokio::spawn(async move {
                for n in 0..25u64 {
                    let mut tx = pool.begin().await.unwrap();
                    let event = factory::event(&format!("w{w}"), n);
                    outbox.enqueue(&mut tx, &[event]).await.unwrap();
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }

    // The relay's side: claim and acknowledge everything, each statement through the pooler.
    let source = PollingSource::new(
        pool.clone(),
        PollingConfig {
            pooling: Pooling::Transaction,
            ..PollingConfig::default()
        },
    )
    .unwrap();
    assert!(!source.listens(), "LISTEN needs a direct connection");
    let mut claimed = 0;
    loop {
        let claim = source.claim(100, usize::MAX).await.unwrap();
        if claim.events.is_empty() {
            break;
        }
        claimed += claim.events.len();
        let published: Vec<Published> = claim
            .events
            .iter()
            .map(|e| Published::id(e.event_id))
            .collect();
        source.mark_published(&published).await.unwrap();
    }
    assert_eq!(claimed, 400);
    source.backlog().await.unwrap();
    source
        .wait_for_work(Duration::from_millis(10))
        .await
        .unwrap();

    // The consumer's side: admissions in transactions, then the purge outside any.
    let inbox = Inbox::new(Schema::default(), "pooled")
        .unwrap()
        .with_pooling(Pooling::Transaction);
    for sequence in 1..=20 {
        let mut tx = pool.begin().await.unwrap();
        let event = ReceivedEvent {
            event_id: Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            sequence,
            event_type: "OrderCreated".into(),
            schema_version: 1,
            payload: "{}".into(),
            headers: Vec::new(),
            replayed: false,
        };
        assert_eq!(
            inbox.admit(&mut tx, &event).await.unwrap(),
            Admission::Apply
        );
        tx.commit().await.unwrap();
    }
    let mut conn = pool.acquire().await.unwrap();
    let far_future = chrono::Utc::now() + chrono::Duration::days(1);
    assert_eq!(
        inbox
            .purge_processed(&mut conn, far_future, 100)
            .await
            .unwrap(),
        20
    );
}
