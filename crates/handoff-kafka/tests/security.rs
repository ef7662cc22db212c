//! Kafka options for TLS and SASL against private tansu brokers.
//!
//! tansu 0.6 with `--authentication` requires SASL on every connection. It checks SCRAM
//! logins against stored credentials and, a fresh in-memory broker having none, refuses every
//! one: that is the wrong-password case. It accepts PLAIN with any password, which shows that
//! the SASL options reach librdkafka and that an authenticated client publishes and reads. tansu
//! 0.6 serves no TLS, so TLS is shown failing cleanly against its plaintext listener (the
//! AMQP and PostgreSQL tests exercise TLS with certificates).

use std::time::{Duration, Instant};

use handoff_core::delivery::Transport;
use handoff_kafka::{
    read_topic_with, ConnectError, ConnectErrorKind, KafkaConfig, KafkaOptions, KafkaTransport,
};
use handoff_test::factory;
use handoff_test::tansu::{unique_topic, Tansu};

const PASSWORD: &str = "pa55-w0rd-never-shown";

fn options(pairs: &[(&str, &str)]) -> KafkaOptions {
    let mut options = KafkaOptions::default();
    for (key, value) in pairs {
        options.set(*key, *value).unwrap();
    }
    options
}

fn config(broker: &Tansu, topic: &str, options: KafkaOptions) -> KafkaConfig {
    KafkaConfig {
        brokers: broker.brokers(),
        topic: topic.to_owned(),
        partitions: 2,
        options,
        ..KafkaConfig::default()
    }
}

async fn start_authenticating() -> Tansu {
    tokio::task::spawn_blocking(Tansu::start_with_authentication)
        .await
        .unwrap()
        .unwrap()
}

fn assert_no_password(error: &ConnectError) {
    let shown = format!("{error} {error:?}");
    assert!(!shown.contains(PASSWORD), "{shown}");
}

#[tokio::test]
async fn sasl_plain_options_reach_librdkafka_and_an_authenticated_client_publishes() {
    let broker = start_authenticating().await;
    let topic = unique_topic("sasl_plain");
    let sasl = options(&[
        ("security.protocol", "SASL_PLAINTEXT"),
        ("sasl.mechanism", "PLAIN"),
        ("sasl.username", "relay"),
        ("sasl.password", PASSWORD),
    ]);
    let transport = KafkaTransport::connect(config(&broker, &topic, sasl.clone()))
        .await
        .unwrap();
    assert!(!format!("{transport:?}").contains(PASSWORD));
    transport.ensure_topic().await.unwrap();
    let event = factory::outbox_event("order-1", 1);
    transport.publish(&event).await.unwrap();
    let records = read_topic_with(&broker.brokers(), &topic, &sasl, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(
        records[0].header("ce-id"),
        Some(event.event_id.to_string().as_str())
    );

    // Proof that the broker does require authentication: without SASL, no answer.
    let error = KafkaTransport::connect(config(&broker, &topic, KafkaOptions::default()))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unreachable, "{error}");
}

#[tokio::test]
async fn a_wrong_scram_password_is_refused_with_a_clear_error_that_never_shows_it() {
    let broker = start_authenticating().await;
    let topic = unique_topic("sasl_scram");
    for mechanism in ["SCRAM-SHA-512", "SCRAM-SHA-256"] {
        let started = Instant::now();
        let error = KafkaTransport::connect(config(
            &broker,
            &topic,
            options(&[
                ("security.protocol", "SASL_PLAINTEXT"),
                ("sasl.mechanism", mechanism),
                ("sasl.username", "relay"),
                ("sasl.password", PASSWORD),
            ]),
        ))
        .await
        .unwrap_err();
        // Permanent: the relay ends instead of waiting for the brokers forever.
        assert_eq!(error.kind(), ConnectErrorKind::Refused, "{error}");
        assert!(
            error.to_string().contains("SASL authentication error"),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(10), "{error}");
        assert_no_password(&error);
    }
}

#[tokio::test]
async fn sasl_ssl_to_a_plaintext_listener_fails_as_a_refusal_instead_of_hanging() {
    let broker = tokio::task::spawn_blocking(Tansu::start)
        .await
        .unwrap()
        .unwrap();
    let topic = unique_topic("sasl_ssl");
    let started = Instant::now();
    let error = KafkaTransport::connect(config(
        &broker,
        &topic,
        options(&[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "relay"),
            ("sasl.password", PASSWORD),
        ]),
    ))
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Refused, "{error}");
    assert!(error.to_string().contains("SSL"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(10), "{error}");
    assert_no_password(&error);
}

#[tokio::test]
async fn options_librdkafka_refuses_end_the_connect_naming_the_key() {
    // No broker needed: the options are checked before any connection.
    let mut bad = KafkaOptions::default();
    bad.set("sasl.mechanisms.typo", "PLAIN").unwrap();
    let error = KafkaTransport::connect(KafkaConfig {
        options: bad,
        ..KafkaConfig::default()
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::InvalidConfig);
    assert!(
        error.to_string().contains("sasl.mechanisms.typo"),
        "{error}"
    );

    let error = KafkaTransport::connect(KafkaConfig {
        options: options(&[
            ("security.protocol", "SSL"),
            ("ssl.ca.location", "/nonexistent/ca.pem"),
        ]),
        ..KafkaConfig::default()
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::InvalidConfig);
    assert!(error.to_string().contains("ssl.ca.location"), "{error}");
}
