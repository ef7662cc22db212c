//! Enqueue through a tokio-postgres transaction (feature `tokio-postgres`).

use crate::common::migrated;
use handoff_test::{factory, TestDb};

async fn client(db: &TestDb) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port=5432 user=postgres dbname=test options='-c search_path={}'",
            db.schema()
        ),
        tokio_postgres::NoTls,
    )
    .await
    .expect("connect with tokio-postgres");
    tokio::spawn(connection);
    client
}

#[tokio::test]
async fn tokio_postgres_transactions_commit_and_roll_back_with_their_events() {
    let (db, outbox) = migrated("tokio_postgres_enqueue").await;
    let mut client = client(&db).await;
    client
        .batch_execute("CREATE TABLE things (id text PRIMARY KEY)")
        .await
        .unwrap();

    // Rolled back: neither the business row nor the event.
    let tx = client.transaction().await.unwrap();
    tx.execute("INSERT INTO things VALUES ('a')", &[])
        .await
        .unwrap();
    outbox
        .enqueue_tokio_postgres(&tx, &[factory::event("a", 1)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(db.count("things").await, 0);
    assert_eq!(db.count("outbox").await, 0);

    // Committed, with the business write and the enqueue pipelined on one connection.
    let tx = client.transaction().await.unwrap();
    let insert = tx.execute("INSERT INTO things VALUES ('a')", &[]);
    let events = [factory::event("a", 1), factory::event("a", 2)];
    let enqueue = outbox.enqueue_tokio_postgres(&tx, &events);
    let (_, enqueued) =
        tokio::try_join!(async { insert.await.map_err(|e| e.to_string()) }, async {
            enqueue.await.map_err(|e| e.to_string())
        })
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        enqueued
            .iter()
            .map(|e| e.aggregate_sequence)
            .collect::<Vec<_>>(),
        [1, 2]
    );
    assert_eq!(db.count("things").await, 1);

    // sqlx and tokio-postgres writers share one sequence per aggregate.
    let mut tx = db.pool.begin().await.unwrap();
    let next = outbox
        .enqueue(&mut tx, &[factory::event("a", 3)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(next[0].aggregate_sequence, 3);
}

#[tokio::test]
async fn tokio_postgres_versioned_enqueue_uses_the_callers_sequences() {
    let (db, outbox) = migrated("tokio_postgres_versioned").await;
    let mut client = client(&db).await;

    let tx = client.transaction().await.unwrap();
    let enqueued = outbox
        .enqueue_versioned_tokio_postgres(&tx, 1, &[factory::event("v", 1), factory::event("v", 2)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        enqueued
            .iter()
            .map(|e| e.aggregate_sequence)
            .collect::<Vec<_>>(),
        [1, 2]
    );

    let tx = client.transaction().await.unwrap();
    let err = outbox
        .enqueue_versioned_tokio_postgres(&tx, 2, &[factory::event("v", 3)])
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        handoff_postgres::EnqueueErrorKind::SequenceTaken
    );
    tx.rollback().await.unwrap();
    assert_eq!(db.count("outbox").await, 2);
}

/// Through a transaction pooler (a private PgBouncer, `pool_mode = transaction`, 4 server
/// connections): 16 tokio-postgres clients enqueue concurrently, each in its transactions, and
/// every event lands once at its place; `query_typed` prepares nothing under a name, so no
/// statement goes missing between server connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokio_postgres_enqueue_works_through_a_transaction_pooler() {
    use handoff_postgres::{Migrator, Outbox, OutboxConfig, Schema};
    use handoff_test::pgbouncer::{OwnDatabase, PgBouncer};
    use sqlx::Connection;

    let database = OwnDatabase::create("tokio_postgres_pooler").await;
    let mut direct = sqlx::PgConnection::connect(&database.url()).await.unwrap();
    Migrator::handoff(Schema::default())
        .run(&mut direct)
        .await
        .unwrap();
    let bouncer = PgBouncer::start_with_pool_size(&handoff_test::database_url(), 4).unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let url = format!(
        "host=127.0.0.1 port={} user=postgres dbname={}",
        bouncer.port(),
        database.name()
    );
    let writers: Vec<_> = (0..16)
        .map(|w| {
            let url = url.clone();
            let outbox = outbox.clone();
            tokio::spawn(async move {
                let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                    .await
                    .expect("connect through the pooler");
                tokio::spawn(connection);
                for n in 0..25u64 {
                    let tx = client.transaction().await.unwrap();
                    outbox
                        .enqueue_tokio_postgres(&tx, &[factory::event(&format!("w{w}"), n)])
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    let (events, aggregates, top): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT aggregate_id), max(aggregate_sequence) FROM outbox",
    )
    .fetch_one(&mut direct)
    .await
    .unwrap();
    assert_eq!((events, aggregates, top), (400, 16, 25));
}
