//! `Inbox::admit_batch` against the real PostgreSQL: one statement admits the events next in
//! their aggregates' line, tells duplicates apart, and writes nothing for any other event.

use handoff_core::intake::ReceivedEvent;
use handoff_postgres::{Admission, BatchAdmission, Inbox, Schema};
use handoff_test::TestDb;
use uuid::Uuid;

fn event(aggregate: &str, sequence: i64) -> ReceivedEvent {
    ReceivedEvent {
        event_id: Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate.into(),
        sequence,
        event_type: "OrderCreated".into(),
        schema_version: 1,
        payload: "{}".into(),
        headers: Vec::new(),
        replayed: false,
    }
}

async fn processed(db: &TestDb) -> Vec<Uuid> {
    sqlx::query_scalar("SELECT event_id FROM processed_events ORDER BY event_id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

async fn sequences(db: &TestDb) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT aggregate_id, last_sequence FROM consumer_sequences ORDER BY aggregate_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_batch_admits_what_is_next_in_line_and_writes_nothing_for_the_rest() {
    let db = TestDb::migrated("inbox_admit_batch").await;
    let inbox = Inbox::new(Schema::default(), "c").unwrap();

    let a1 = event("a", 1);
    let b1 = event("b", 1);
    let c2 = event("c", 2);
    let a2 = event("a", 2);
    let mut tx = db.pool.begin().await.unwrap();
    let admitted = inbox
        .admit_batch(&mut tx, &[&a1, &b1, &c2, &a2])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        admitted,
        [
            BatchAdmission::Apply,
            BatchAdmission::Apply,
            // Ahead of its aggregate: for the gap policy, alone.
            BatchAdmission::Alone,
            // A second event of an aggregate already in the batch is not looked at.
            BatchAdmission::Alone,
        ]
    );
    let mut expected = vec![a1.event_id, b1.event_id];
    expected.sort();
    assert_eq!(
        processed(&db).await,
        expected,
        "dedup rows only for the applied"
    );
    assert_eq!(
        sequences(&db).await,
        [("a".to_owned(), 1), ("b".to_owned(), 1)]
    );

    // a1 again is a duplicate; c1 is next; a new event at b's applied place is stale.
    let c1 = event("c", 1);
    let b1_stale = event("b", 1);
    let mut tx = db.pool.begin().await.unwrap();
    let admitted = inbox
        .admit_batch(&mut tx, &[&a1, &c1, &b1_stale])
        .await
        .unwrap();
    assert_eq!(
        admitted,
        [
            BatchAdmission::Duplicate,
            BatchAdmission::Apply,
            BatchAdmission::Alone,
        ]
    );
    // Alone means alone: the per-event admission then judges it, in the same way as ever.
    assert_eq!(
        inbox.admit(&mut tx, &b1_stale).await.unwrap(),
        Admission::Stale { last_sequence: 1 }
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        processed(&db).await,
        expected,
        "the rollback took every row"
    );
    assert_eq!(
        sequences(&db).await,
        [("a".to_owned(), 1), ("b".to_owned(), 1)]
    );

    let mut tx = db.pool.begin().await.unwrap();
    assert!(inbox.admit_batch(&mut tx, &[]).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_batch_locks_its_aggregates_until_it_ends() {
    let db = TestDb::migrated("inbox_admit_batch_lock").await;
    let inbox = Inbox::new(Schema::default(), "c").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    inbox.admit_batch(&mut tx, &[&event("a", 1)]).await.unwrap();
    tx.commit().await.unwrap();

    let a2 = event("a", 2);
    let mut first = db.pool.begin().await.unwrap();
    assert_eq!(
        inbox.admit_batch(&mut first, &[&a2]).await.unwrap(),
        [BatchAdmission::Apply]
    );
    // A second instance with the same event waits for the first, then sees it applied.
    let application = format!("admit-batch-lock-{}", std::process::id());
    let options = db.connect_options().application_name(&application);
    let second = {
        let inbox = inbox.clone();
        let a2 = a2.clone();
        tokio::spawn(async move {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect_with(options)
                .await
                .unwrap();
            let mut tx = pool.begin().await.unwrap();
            let admitted = inbox.admit_batch(&mut tx, &[&a2]).await.unwrap();
            (tx, admitted)
        })
    };
    handoff_test::inbox::wait_count(
        &db.pool,
        &format!(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE application_name = '{application}' AND wait_event_type = 'Lock'"
        ),
        1,
    )
    .await;
    first.commit().await.unwrap();
    // Its statement began before the first committed, so it cannot see the dedup row; the
    // locked row, read after the wait, says a2's place is taken: alone, where the per-event
    // admission (a statement of its own) finds the duplicate.
    let (mut tx, admitted) = second.await.unwrap();
    assert_eq!(admitted, [BatchAdmission::Alone]);
    assert_eq!(
        inbox.admit(&mut tx, &a2).await.unwrap(),
        Admission::Duplicate
    );
    tx.rollback().await.unwrap();
    assert_eq!(processed(&db).await.len(), 2);
}
