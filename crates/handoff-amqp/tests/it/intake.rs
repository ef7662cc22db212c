//! The AMQP intake under handoff-consumer against the real RabbitMQ: a duplicated publish is
//! applied once, retries count deliveries up to the cap on classic and quorum queues, and the
//! intake comes back after the broker closed its connection.

use std::time::Duration;

use crate::common::{close_connections_named, config, event, unique_name, url, Broker};
use handoff_amqp::{AmqpIntake, AmqpTransport, IntakeConfig, QueueDeclaration};
use handoff_consumer::{Consumer, ConsumerConfig, HandlerError};
use handoff_core::delivery::Transport;
use handoff_test::inbox::{self, Recorder, Running};
use handoff_test::{eventually, TestDb};
use uuid::Uuid;

/// A migrated schema with an `applied` table, an exchange and a queue of the test's own, the
/// relay's transport onto the exchange.
struct Setup {
    db: TestDb,
    broker: Broker,
    exchange: String,
    transport: AmqpTransport,
}

impl Setup {
    async fn new(name: &str, quorum: bool) -> Self {
        let db = inbox::applied_db(name).await;
        let exchange = unique_name(name);
        let mut broker = Broker::new().await;
        broker.owns_exchange(&exchange);
        broker.owns_queue(&exchange);
        AmqpIntake::declare_queue(
            &intake_config(&exchange),
            &QueueDeclaration {
                exchange: exchange.clone(),
                binding_key: "order.*".into(),
                quorum,
                single_active_consumer: true,
            },
        )
        .await
        .unwrap();
        let transport = AmqpTransport::connect(config(&exchange)).await.unwrap();
        Self {
            db,
            broker,
            exchange,
            transport,
        }
    }

    fn start(&self, handler: Recorder, max_deliveries: u64) -> Running {
        let config = ConsumerConfig {
            name: "amqp-test".into(),
            max_deliveries,
            retry_backoff: handoff_core::Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_millis(200),
            },
            ..ConsumerConfig::default()
        };
        let consumer = Consumer::new(config, self.db.pool.clone(), handler).unwrap();
        let intake_config = intake_config(&self.exchange);
        Running::spawn(consumer, async move {
            AmqpIntake::connect(intake_config).await.unwrap()
        })
    }

    async fn wait_count(&self, query: &str, n: i64) {
        inbox::wait_count(&self.db.pool, query, n).await;
    }

    async fn applied(&self) -> Vec<(Uuid, String, i64)> {
        inbox::applied(&self.db.pool).await
    }
}

fn intake_config(queue: &str) -> IntakeConfig {
    IntakeConfig {
        url: url(),
        queue: queue.to_owned(),
        connection_name: format!("{queue}-consumer"),
        ..IntakeConfig::default()
    }
}

#[tokio::test]
async fn a_duplicated_publish_is_applied_once_and_in_order() {
    let setup = Setup::new("amqp_duplicates", false).await;
    let mut events = Vec::new();
    for sequence in 1..=5 {
        for a in 0..4 {
            events.push(event(&format!("o-{a}"), sequence));
        }
    }
    for e in &events {
        setup.transport.publish(e).await.unwrap();
    }
    // The relay republishes after a lost confirm or a lease expiry: RabbitMQ keeps both copies.
    for e in &events {
        setup.transport.publish(e).await.unwrap();
    }
    // Every third first application fails once (rolled back), so deliveries are nacked with a
    // delay and come back.
    let recorder = Recorder::new(|e, call| {
        if call == 1 && e.sequence % 3 == 0 {
            Err(HandlerError::retryable("not yet"))
        } else {
            Ok(())
        }
    });
    let running = setup.start(recorder, 10);
    setup
        .wait_count("SELECT count(*) FROM processed_events", 20)
        .await;
    // Both copies of every event have been settled once the queue is empty and nothing is
    // unacknowledged.
    eventually(
        "the queue drained",
        Duration::from_secs(30),
        async || match setup.broker.depth(&setup.exchange).await {
            0 => Ok(()),
            depth => Err(depth),
        },
    )
    .await;
    running.stop().await;

    inbox::assert_applied_once_in_order(&setup.applied().await, 20);
}

async fn a_failing_event_reaches_the_delivery_cap(quorum: bool) {
    let name = if quorum {
        "amqp_cap_quorum"
    } else {
        "amqp_cap_classic"
    };
    let setup = Setup::new(name, quorum).await;
    let poison = event("poison", 1);
    setup.transport.publish(&poison).await.unwrap();
    let recorder = Recorder::new(|_, _| Err(HandlerError::retryable("always")));
    let running = setup.start(recorder, 3);
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 1)
        .await;
    running.stop().await;
    let quarantined: Uuid = sqlx::query_scalar("SELECT event_id FROM consumer_quarantine")
        .fetch_one(&setup.db.pool)
        .await
        .unwrap();
    assert_eq!(quarantined, poison.event_id);
    assert!(setup.applied().await.is_empty());
    // Quarantined means rejected without requeue: the queue no longer holds it.
    assert_eq!(setup.broker.depth(&setup.exchange).await, 0);
}

async fn a_nul_id_and_a_panicking_handler_are_quarantined_within_the_cap(quorum: bool) {
    let name = if quorum {
        "amqp_poison_quorum"
    } else {
        "amqp_poison_classic"
    };
    let setup = Setup::new(name, quorum).await;
    // Published as the relay would publish a NUL id: Handoff-Aggregate-Id is `a%00b`.
    let nul = event("a\0b", 1);
    let panics = event("panics", 1);
    setup.transport.publish(&nul).await.unwrap();
    setup.transport.publish(&panics).await.unwrap();
    let fine: Vec<_> = (0..4).map(|n| event(&format!("fine-{n}"), 1)).collect();
    for e in &fine {
        setup.transport.publish(e).await.unwrap();
    }
    let recorder = Recorder::new(|e, _| {
        if e.aggregate_id == "panics" {
            panic!("injected: the handler cannot cope");
        }
        Ok(())
    });
    let running = setup.start(recorder.clone(), 3);
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 2)
        .await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 4)
        .await;
    running.stop().await;

    let rows: Vec<(Uuid, String, String, i64)> =
        sqlx::query_as("SELECT event_id, reason_kind, reason, deliveries FROM consumer_quarantine")
            .fetch_all(&setup.db.pool)
            .await
            .unwrap();
    let row = |id: Uuid| rows.iter().find(|r| r.0 == id).cloned().unwrap();
    let (_, kind, reason, deliveries) = row(nul.event_id);
    assert_eq!(kind, "malformed");
    assert!(reason.contains("holds a NUL byte"), "{reason}");
    assert_eq!(deliveries, 1);
    let (_, kind, reason, deliveries) = row(panics.event_id);
    assert_eq!(kind, "handler_panic");
    assert!(reason.contains("injected"), "{reason}");
    assert_eq!(deliveries, 3, "tried up to the cap, no further");
    // Each delivery calls the handler once; the delivery whose batch the panic ended calls it
    // once more, alone (the batch inbox, on by default, isolates the culprit that way).
    let calls = recorder.calls()[&panics.event_id];
    assert!(
        (3..=4).contains(&calls),
        "{calls} handler calls for 3 deliveries"
    );
    assert_eq!(setup.applied().await.len(), fine.len(), "the others flowed");
    // Both rejected without requeue: the queue holds nothing.
    assert_eq!(setup.broker.depth(&setup.exchange).await, 0);
}

#[tokio::test]
async fn a_nul_id_and_a_panicking_handler_are_quarantined_on_a_classic_queue() {
    a_nul_id_and_a_panicking_handler_are_quarantined_within_the_cap(false).await;
}

#[tokio::test]
async fn a_nul_id_and_a_panicking_handler_are_quarantined_on_a_quorum_queue() {
    a_nul_id_and_a_panicking_handler_are_quarantined_within_the_cap(true).await;
}

#[tokio::test]
async fn a_failing_event_reaches_the_delivery_cap_on_a_classic_queue() {
    a_failing_event_reaches_the_delivery_cap(false).await;
}

#[tokio::test]
async fn a_failing_event_reaches_the_delivery_cap_on_a_quorum_queue() {
    a_failing_event_reaches_the_delivery_cap(true).await;
}

#[tokio::test]
async fn the_intake_consumes_again_after_the_broker_closes_its_connection() {
    let setup = Setup::new("amqp_intake_reconnect", false).await;
    let running = setup.start(Recorder::ok(), 10);
    for sequence in 1..=3 {
        setup
            .transport
            .publish(&event("o-1", sequence))
            .await
            .unwrap();
    }
    setup
        .wait_count("SELECT count(*) FROM processed_events", 3)
        .await;
    let name = format!("{}-consumer", setup.exchange);
    assert_eq!(close_connections_named(&name), 1);
    for sequence in 4..=6 {
        setup
            .transport
            .publish(&event("o-1", sequence))
            .await
            .unwrap();
    }
    setup
        .wait_count("SELECT count(*) FROM processed_events", 6)
        .await;
    running.stop().await;
    let sequences: Vec<i64> = setup
        .applied()
        .await
        .into_iter()
        .map(|(_, _, s)| s)
        .collect();
    assert_eq!(sequences, vec![1, 2, 3, 4, 5, 6]);
}
