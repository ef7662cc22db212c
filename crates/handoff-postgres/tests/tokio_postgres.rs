//! Enqueue through a tokio-postgres transaction (feature `tokio-postgres`).

mod common;
use common::migrated;
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
