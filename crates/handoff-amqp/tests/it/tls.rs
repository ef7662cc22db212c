//! `amqps://` against a private RabbitMQ node with a TLS listener whose certificate a test CA
//! signed: the transport and the intake connect and carry events when they trust that CA
//! ([`AmqpConfig::tls_ca`]); trusting another CA, or only the public roots, fails at once with
//! a TLS error that names no credential; a CA for a plaintext URL is refused before any
//! connection.

use std::time::{Duration, Instant};

use crate::common::{config_at, event, unique_name, Broker};
use handoff_amqp::{
    AmqpConfig, AmqpIntake, AmqpTransport, ConnectErrorKind, IntakeConfig, QueueDeclaration,
};
use handoff_core::delivery::Transport;
use handoff_core::intake::{Intake, Settle};
use handoff_test::rabbitmq::RabbitMqNode;
use handoff_test::tls::TestCa;

/// A node with a TLS listener signed by a fresh CA (started on a blocking thread: it takes a
/// few seconds).
async fn tls_node() -> (TestCa, RabbitMqNode) {
    tokio::task::spawn_blocking(|| {
        let ca = TestCa::new("rabbitmq").unwrap();
        let node = RabbitMqNode::start_with_tls(&ca).unwrap();
        (ca, node)
    })
    .await
    .unwrap()
}

fn tls_config(node: &RabbitMqNode, ca: &TestCa, exchange: &str) -> AmqpConfig {
    AmqpConfig {
        tls_ca: Some(ca.ca_path()),
        ..config_at(&node.amqps_url().unwrap(), exchange)
    }
}

#[tokio::test]
async fn publishes_and_consumes_over_amqps_trusting_the_private_ca_and_refuses_other_cas() {
    let (ca, node) = tls_node().await;
    let exchange = unique_name("tls");
    let queue = unique_name("tls_q");

    // The intake declares its queue and consumes over TLS.
    let intake_config = IntakeConfig {
        url: node.amqps_url().unwrap(),
        queue: queue.clone(),
        tls_ca: Some(ca.ca_path()),
        ..IntakeConfig::default()
    };
    AmqpIntake::declare_queue(
        &intake_config,
        &QueueDeclaration {
            exchange: exchange.clone(),
            binding_key: "order.*".into(),
            quorum: false,
            single_active_consumer: false,
        },
    )
    .await
    .unwrap();
    let mut intake = AmqpIntake::connect(intake_config).await.unwrap();

    let transport = AmqpTransport::connect(tls_config(&node, &ca, &exchange))
        .await
        .unwrap();
    assert!(
        transport.server().starts_with("amqps://127.0.0.1:"),
        "{}",
        transport.server()
    );
    let sent = event("o-1", 1);
    transport.publish(&sent).await.unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(10), intake.next())
        .await
        .expect("the event arrives over TLS")
        .unwrap();
    let received = delivery.event.as_ref().unwrap();
    assert_eq!(received.event_id, sent.event_id);
    assert_eq!(received.payload, sent.payload);
    delivery.settle.ack().await.unwrap();

    // Another CA: the handshake fails at once, as a TLS error, not a wait for the broker.
    let wrong_ca = TestCa::new("wrong").unwrap();
    let started = Instant::now();
    let error = AmqpTransport::connect(AmqpConfig {
        tls_ca: Some(wrong_ca.ca_path()),
        ..tls_config(&node, &ca, &exchange)
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Tls, "{error}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let shown = format!("{error} {error:?}");
    assert!(!shown.contains("guest:guest"), "{shown}");
    assert!(error.to_string().contains("TLS handshake"), "{error}");

    // Only the public roots: the same.
    let error = AmqpTransport::connect(AmqpConfig {
        tls_ca: None,
        ..tls_config(&node, &ca, &exchange)
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Tls, "{error}");

    // Clean up what the test declared on its private node (dropped with it anyway).
    let mut broker = Broker::at(&node.url()).await;
    broker.owns_exchange(&exchange);
    broker.owns_queue(&queue);
}

#[tokio::test]
async fn a_tls_ca_for_a_plaintext_url_or_a_file_without_a_certificate_is_refused() {
    let ca = TestCa::new("misuse").unwrap();
    let plaintext = AmqpConfig {
        tls_ca: Some(ca.ca_path()),
        ..config_at("amqp://guest:guest@127.0.0.1:1/%2f", "x")
    };
    let error = AmqpTransport::connect(plaintext).await.unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Tls);
    assert!(error.to_string().contains("not an amqps:// url"), "{error}");

    let not_pem = ca.dir().join("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    for (path, wanted) in [
        (not_pem, "holds no PEM certificate"),
        (ca.dir().join("missing.pem"), "cannot be read"),
    ] {
        let error = AmqpTransport::connect(AmqpConfig {
            tls_ca: Some(path),
            ..config_at("amqps://guest:guest@127.0.0.1:1/%2f", "x")
        })
        .await
        .unwrap_err();
        assert!(error.to_string().contains(wanted), "{error}");
    }
}
