//! A skip marker (the relay's stand-in for an event an operator skipped with `handoff quarantine
//! skip`) is recorded and moves its aggregate on, and the handler never sees it.

use crate::common::{event, Recorder, Setup};

#[tokio::test]
async fn a_skip_marker_advances_the_aggregate_without_reaching_the_handler() {
    let setup = Setup::new("skip_marker").await;
    let first = event("o-1", 1);
    let mut skipped = event("o-1", 2);
    // What the relay publishes for a skipped row: a null body and the operator's reason.
    skipped.payload = "null".into();
    skipped.headers = vec![("Handoff-Skipped".into(), "corrupt blob".into())];
    let third = event("o-1", 3);
    for e in [&first, &skipped, &third] {
        setup.publish(e).await;
    }
    // Delivered again, the marker is a duplicate like any other event.
    setup.publish_again_with_new_msg_id(&skipped).await;

    let running = setup.start(setup.config("skipper"), Recorder::new()).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 3)
        .await;
    setup
        .wait_count(
            "SELECT count(*) FROM consumer_sequences WHERE last_sequence = 3",
            1,
        )
        .await;
    running.stop().await;

    let applied: Vec<_> = setup
        .applied()
        .await
        .into_iter()
        .map(|(id, _, sequence)| (id, sequence))
        .collect();
    assert_eq!(
        applied,
        [(first.event_id, 1), (third.event_id, 3)],
        "the handler saw 1 and 3, never the marker"
    );
    let recorded: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM processed_events WHERE event_id = $1)")
            .bind(skipped.event_id)
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert!(recorded, "the marker's event id is in the inbox");
}
