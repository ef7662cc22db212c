//! Kafka options for TLS and SASL against private tansu brokers.
//!
//! tansu 0.6 with `--authentication` requires SASL on every connection. It offers SCRAM-SHA-256
//! and SCRAM-SHA-512 (not PLAIN: "no shared mechanism"), checked against stored credentials. A
//! fresh in-memory broker has none, and creating one is itself a request that needs
//! authentication, so every SCRAM login is refused (`unknown-user`): that is the wrong-password
//! case, end to end through librdkafka's SCRAM exchange. No SASL login can succeed against it.
//! tansu 0.6 takes `--cert` and `--key` but serves no TLS, and never answers a TLS ClientHello, so
//! "TLS client on a plaintext listener" is shown against a listener that closes the connection,
//! as Kafka's plaintext listener does.

use std::time::{Duration, Instant};

use handoff_kafka::{ConnectError, ConnectErrorKind, KafkaConfig, KafkaOptions, KafkaTransport};
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
async fn a_broker_that_requires_sasl_gives_a_client_without_it_no_answer() {
    // Proof of the setup: the broker does require authentication.
    let broker = start_authenticating().await;
    let topic = unique_topic("sasl_required");
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
        assert!(error.to_string().contains("unknown-user"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(10), "{error}");
        assert_no_password(&error);
    }
}

#[tokio::test]
async fn sasl_ssl_to_a_plaintext_listener_fails_as_a_refusal_instead_of_waiting() {
    // A plaintext Kafka listener reads a TLS ClientHello as a request far over its size limit
    // and closes the connection; this listener closes every connection after its first bytes.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut first = [0u8; 4];
            let _ = std::io::Read::read(&mut stream, &mut first);
        }
    });
    let started = Instant::now();
    let error = KafkaTransport::connect(KafkaConfig {
        brokers: address.to_string(),
        topic: unique_topic("sasl_ssl"),
        options: options(&[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "relay"),
            ("sasl.password", PASSWORD),
        ]),
        ..KafkaConfig::default()
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Refused, "{error}");
    assert!(
        error.to_string().contains("SSL handshake failed"),
        "{error}"
    );
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
