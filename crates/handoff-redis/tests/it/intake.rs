//! The consumer-group intake against the local Redis: deliveries read back from the contract,
//! acknowledgement only on settle, a dead consumer's entries taken over, hand-back with a
//! delay, and entries that are not handoff's.

use std::future::Future;
use std::time::Duration;

use crate::common::{connection, intake_config, Scratch};
use handoff_core::delivery::Transport;
use handoff_core::intake::{Delivery, Intake, Settle};
use handoff_redis::redis;
use handoff_redis::{IntakeConfig, RedisIntake, RedisSettle, RedisTransport};
use handoff_test::factory::outbox_event;

/// The next delivery, failing the test after 10 s: the intake itself waits on the server.
async fn next(intake: &mut RedisIntake) -> Delivery<RedisSettle> {
    within(intake.next()).await.unwrap()
}

async fn within<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), future)
        .await
        .expect("no delivery within 10 s")
}

/// Takeover settings short enough for a test.
fn quick(config: IntakeConfig) -> IntakeConfig {
    IntakeConfig {
        block: Duration::from_millis(100),
        claim_idle: Duration::from_millis(300),
        ..config
    }
}

#[tokio::test]
async fn the_intake_delivers_the_contract_and_acknowledges_only_on_settle() {
    let scratch = Scratch::new("intake-deliver");
    let transport = RedisTransport::connect(scratch.config()).await.unwrap();
    let mut intake = RedisIntake::connect(intake_config(&scratch, "svc", "svc-1"))
        .await
        .unwrap();
    let events: Vec<_> = (1..=3).map(|n| outbox_event("o-1", n)).collect();
    for event in &events {
        transport.publish(event).await.unwrap();
    }

    let mut deliveries = Vec::new();
    for event in &events {
        let delivery = next(&mut intake).await;
        let received = delivery.event.as_ref().unwrap();
        assert_eq!(received.event_id, event.event_id);
        assert_eq!(received.aggregate_id, "o-1");
        assert_eq!(received.sequence, event.aggregate_sequence);
        assert_eq!(received.payload, event.payload);
        assert!(!received.replayed);
        assert_eq!(delivery.delivery_count, 1);
        deliveries.push(delivery);
    }
    assert_eq!(
        scratch.pending("svc"),
        3,
        "nothing acknowledged before settle"
    );
    for delivery in &deliveries {
        delivery.settle.ack().await.unwrap();
    }
    assert_eq!(scratch.pending("svc"), 0);
}

#[tokio::test]
async fn a_dead_consumers_unacknowledged_entry_is_taken_over_by_another() {
    let scratch = Scratch::new("intake-takeover");
    let transport = RedisTransport::connect(scratch.config()).await.unwrap();
    let first = outbox_event("o-1", 1);
    let second = outbox_event("o-1", 2);
    transport.publish(&first).await.unwrap();
    transport.publish(&second).await.unwrap();

    let mut dying = RedisIntake::connect(quick(intake_config(&scratch, "svc", "a")))
        .await
        .unwrap();
    next(&mut dying).await.settle.ack().await.unwrap();
    let unsettled = next(&mut dying).await;
    assert_eq!(unsettled.event.unwrap().event_id, second.event_id);
    drop(dying);

    let mut survivor = RedisIntake::connect(quick(intake_config(&scratch, "svc", "b")))
        .await
        .unwrap();
    let again = next(&mut survivor).await;
    assert_eq!(again.event.as_ref().unwrap().event_id, second.event_id);
    assert_eq!(again.delivery_count, 2);
    again.settle.ack().await.unwrap();
    assert_eq!(scratch.pending("svc"), 0);
}

#[tokio::test]
async fn a_restarted_consumer_reads_its_own_pending_entries_first() {
    let scratch = Scratch::new("intake-restart");
    let transport = RedisTransport::connect(scratch.config()).await.unwrap();
    let event = outbox_event("o-1", 1);
    transport.publish(&event).await.unwrap();
    let mut before = RedisIntake::connect(intake_config(&scratch, "svc", "a"))
        .await
        .unwrap();
    drop(next(&mut before).await);
    drop(before);

    // The default takeover wait is 30 s: only its own history can bring the entry back now.
    let mut after = RedisIntake::connect(intake_config(&scratch, "svc", "a"))
        .await
        .unwrap();
    let again = next(&mut after).await;
    assert_eq!(again.event.unwrap().event_id, event.event_id);
    assert!(again.delivery_count >= 2, "{}", again.delivery_count);
}

#[tokio::test]
async fn a_handed_back_entry_comes_again_and_a_terminated_one_never() {
    let scratch = Scratch::new("intake-nak");
    let transport = RedisTransport::connect(scratch.config()).await.unwrap();
    let event = outbox_event("o-1", 1);
    transport.publish(&event).await.unwrap();
    let mut intake = RedisIntake::connect(quick(intake_config(&scratch, "svc", "a")))
        .await
        .unwrap();

    let first = next(&mut intake).await;
    first.settle.in_progress().await.unwrap();
    first.settle.nak(Duration::from_millis(50)).await.unwrap();
    let second = next(&mut intake).await;
    assert_eq!(second.event.unwrap().event_id, event.event_id);
    assert_eq!(second.delivery_count, 2);
    second.settle.term().await.unwrap();
    assert_eq!(scratch.pending("svc"), 0);

    // The next delivery is a new event, not the terminated one.
    let later = outbox_event("o-1", 2);
    transport.publish(&later).await.unwrap();
    assert_eq!(
        next(&mut intake).await.event.unwrap().event_id,
        later.event_id
    );
}

#[tokio::test]
async fn an_entry_without_the_contract_is_delivered_as_malformed() {
    let scratch = Scratch::new("intake-malformed");
    let _: String = redis::cmd("XADD")
        .arg(scratch.key())
        .arg("*")
        .arg("payload")
        .arg("{}")
        .query(&mut connection())
        .unwrap();
    let mut intake = RedisIntake::connect(intake_config(&scratch, "svc", "a"))
        .await
        .unwrap();
    let delivery = next(&mut intake).await;
    let malformed = delivery.event.unwrap_err();
    assert_eq!(malformed.reason, "header ce-id is missing");
    assert!(
        malformed.location.contains(scratch.key()),
        "{}",
        malformed.location
    );
}

#[tokio::test]
async fn a_group_deleted_with_its_stream_is_created_again() {
    let scratch = Scratch::new("intake-recreate");
    let transport = RedisTransport::connect(scratch.config()).await.unwrap();
    let mut intake = RedisIntake::connect(quick(intake_config(&scratch, "svc", "a")))
        .await
        .unwrap();
    let first = outbox_event("o-1", 1);
    transport.publish(&first).await.unwrap();
    next(&mut intake).await.settle.ack().await.unwrap();

    let _: i64 = redis::cmd("DEL")
        .arg(scratch.key())
        .query(&mut connection())
        .unwrap();
    let second = outbox_event("o-1", 2);
    transport.publish(&second).await.unwrap();
    let again = next(&mut intake).await;
    assert_eq!(again.event.unwrap().event_id, second.event_id);
}
