//! `JetStreamTransport` against real servers: the shared one (each test with its own stream and
//! subject prefix, deleted at the end) and private ones for tests that stop or kill the broker.

use std::time::{Duration, Instant};

use handoff_core::delivery::{OutboxEvent, PublishErrorKind, Transport};
use handoff_core::subject::decode_token;
use handoff_nats::{
    ConfigError, ConnectError, ConnectErrorKind, JetStreamConfig, JetStreamTransport, StreamError,
    StreamErrorKind,
};
use handoff_test::factory;
use handoff_test::nats::{
    create_stream, prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
    NatsServer,
};

/// A config of its own for one test: the same unique name as stream and subject prefix.
fn config_for(test: &str) -> JetStreamConfig {
    let name = unique_name(test);
    JetStreamConfig {
        stream: name.clone(),
        subject_prefix: name,
        source: "handoff-nats-tests".to_owned(),
        ..JetStreamConfig::default()
    }
}

async fn connect_shared(config: &JetStreamConfig) -> (JetStreamTransport, DeleteStreamOnDrop) {
    prepare_shared_server().await;
    let cleanup = DeleteStreamOnDrop::new(&shared_url(), &config.stream);
    let transport = JetStreamTransport::connect(&shared_url(), config.clone())
        .await
        .unwrap_or_else(|e| panic!("connect to the shared nats server: {e}"));
    (transport, cleanup)
}

fn event_with_headers() -> OutboxEvent {
    let mut event = factory::outbox_event("eu.west 42/ü", 7);
    event.schema_version = 3;
    event.headers = vec![
        (
            "traceparent".to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        ),
        ("tracestate".to_owned(), "vendor=abc".to_owned()),
    ];
    event
}

fn start_private() -> NatsServer {
    NatsServer::start().unwrap_or_else(|e| panic!("start a private nats-server: {e}"))
}

#[tokio::test]
async fn publish_stores_subject_contract_headers_and_body() {
    let config = config_for("publish_contract");
    let (transport, _cleanup) = connect_shared(&config).await;
    let summary = transport.ensure_stream().await.expect("ensure stream");
    assert!(summary.created);
    assert_eq!(
        summary.subjects,
        vec![format!("{}.>", config.subject_prefix)]
    );
    assert_eq!(summary.duplicate_window, config.duplicate_window);

    let event = event_with_headers();
    transport.publish(&event).await.expect("publish");

    let messages = read_stream(transport.client(), &config.stream).await;
    assert_eq!(messages.len(), 1);
    let message = &messages[0];
    assert_eq!(message.sequence, 1);
    let token = "eu%2Ewest%2042%2F%C3%BC";
    assert_eq!(
        message.subject,
        format!(
            "{}.{}.{token}",
            config.subject_prefix,
            factory::AGGREGATE_TYPE
        )
    );
    assert_eq!(message.subject, transport.subject(&event));
    let id = event.event_id.hyphenated().to_string();
    let time = chrono::DateTime::<chrono::Utc>::from(event.occurred_at)
        .format("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string();
    let expected = [
        ("Nats-Msg-Id", id.as_str()),
        ("ce-specversion", "1.0"),
        ("ce-id", id.as_str()),
        ("ce-type", factory::EVENT_TYPE),
        ("ce-source", "handoff-nats-tests"),
        ("ce-time", time.as_str()),
        ("Content-Type", "application/json"),
        ("Handoff-Aggregate-Type", factory::AGGREGATE_TYPE),
        ("Handoff-Aggregate-Id", token),
        ("Handoff-Sequence", "7"),
        ("Handoff-Schema-Version", "3"),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        ("tracestate", "vendor=abc"),
    ];
    for (name, value) in expected {
        assert_eq!(message.header(name), Some(value), "header {name}");
    }
    assert_eq!(
        message.headers.len(),
        expected.len(),
        "{:?}",
        message.headers
    );
    assert_eq!(
        decode_token(message.header("Handoff-Aggregate-Id").unwrap()).unwrap(),
        event.aggregate_id
    );
    assert_eq!(message.payload, event.payload.as_bytes());
}

#[tokio::test]
async fn republishing_an_event_id_is_deduplicated() {
    let config = config_for("dedup");
    let (transport, _cleanup) = connect_shared(&config).await;
    transport.ensure_stream().await.expect("ensure stream");
    let first = factory::outbox_event("a-1", 1);
    let second = factory::outbox_event("a-1", 2);

    transport.publish(&first).await.expect("first publish");
    // As a relay whose lease expired would: the same event id again, after another event.
    transport.publish(&second).await.expect("second event");
    transport
        .publish(&first)
        .await
        .expect("republish is a success");

    let messages = read_stream(transport.client(), &config.stream).await;
    let ids: Vec<_> = messages.iter().map(|m| m.header("Nats-Msg-Id")).collect();
    let (first_id, second_id) = (first.event_id.to_string(), second.event_id.to_string());
    assert_eq!(ids, vec![Some(first_id.as_str()), Some(second_id.as_str())]);
}

#[tokio::test]
async fn ensure_stream_is_idempotent() {
    let config = config_for("idempotent");
    let (transport, _cleanup) = connect_shared(&config).await;
    let first = transport.ensure_stream().await.expect("create");
    transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .expect("publish");
    let second = transport.ensure_stream().await.expect("again");
    assert!(first.created);
    assert!(!second.created);
    assert_eq!(second.subjects, first.subjects);
    assert_eq!(second.messages, 1);
}

#[tokio::test]
async fn ensure_stream_refuses_an_existing_stream_that_does_not_capture_the_prefix() {
    let config = config_for("not_covered");
    let (transport, _cleanup) = connect_shared(&config).await;
    let other_prefix = unique_name("other");
    create_stream(transport.client(), &config.stream, &other_prefix).await;

    let error = transport.ensure_stream().await.unwrap_err();
    assert_eq!(error.kind(), StreamErrorKind::Conflict);
    match &error {
        StreamError::SubjectsNotCovered {
            subjects, wanted, ..
        } => {
            assert_eq!(subjects, &vec![format!("{other_prefix}.>")]);
            assert_eq!(wanted, &format!("{}.>", config.subject_prefix));
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(error.to_string().contains(&config.stream), "{error}");
}

#[tokio::test]
async fn ensure_stream_accepts_a_wider_existing_stream_as_it_is() {
    let wide = unique_name("wide");
    let config = JetStreamConfig {
        stream: wide.clone(),
        subject_prefix: format!("{wide}.events"),
        // Differs from the stream's (the server default): warned about, not changed.
        duplicate_window: Duration::from_secs(300),
        ..JetStreamConfig::default()
    };
    let (transport, _cleanup) = connect_shared(&config).await;
    create_stream(transport.client(), &wide, &wide).await;

    let summary = transport
        .ensure_stream()
        .await
        .expect("wide stream is fine");
    assert!(!summary.created);
    assert_eq!(summary.subjects, vec![format!("{wide}.>")]);
    assert_ne!(summary.duplicate_window, config.duplicate_window);
    transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .expect("publish into the wide stream");
}

#[tokio::test]
async fn ensure_stream_conflicts_with_another_stream_capturing_the_subjects() {
    let config = config_for("overlap");
    let (transport, _cleanup) = connect_shared(&config).await;
    let squatter = unique_name("squatter");
    let _squatter_cleanup = DeleteStreamOnDrop::new(&shared_url(), &squatter);
    create_stream(transport.client(), &squatter, &config.subject_prefix).await;

    let error = transport.ensure_stream().await.unwrap_err();
    assert_eq!(error.kind(), StreamErrorKind::Conflict, "{error}");
    assert!(matches!(error, StreamError::Create { .. }), "{error:?}");
}

#[tokio::test]
async fn publish_without_a_stream_is_unavailable() {
    let config = config_for("no_stream");
    let (transport, _cleanup) = connect_shared(&config).await;
    let error = transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Unavailable, "{error}");
}

#[tokio::test]
async fn payload_over_the_server_max_payload_is_rejected() {
    let config = config_for("too_big");
    let (transport, _cleanup) = connect_shared(&config).await;
    transport.ensure_stream().await.expect("ensure stream");
    let max = transport.client().server_info().max_payload;
    let mut event = factory::outbox_event("a", 1);
    event.payload = format!(r#"{{"blob":"{}"}}"#, "x".repeat(max));

    let error = transport.publish(&event).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Rejected, "{error}");
    assert!(read_stream(transport.client(), &config.stream)
        .await
        .is_empty());
}

#[tokio::test]
async fn invalid_config_and_urls_are_typed_errors() {
    let bad_stream = JetStreamConfig {
        stream: "a b".to_owned(),
        ..JetStreamConfig::default()
    };
    let error = JetStreamTransport::connect(&shared_url(), bad_stream)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::InvalidConfig);
    assert!(matches!(
        error,
        ConnectError::InvalidConfig(ConfigError::InvalidStreamName { .. })
    ));
    assert!(
        error.to_string().contains(r#"invalid stream name "a b""#),
        "{error}"
    );

    let bad_prefix = JetStreamConfig {
        subject_prefix: "outbox..x".to_owned(),
        ..JetStreamConfig::default()
    };
    let error = JetStreamTransport::connect(&shared_url(), bad_prefix)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::InvalidConfig);

    for url in [
        "http://127.0.0.1:4222",
        "nats://u:hunter2@127.0.0.1:notaport",
        "",
    ] {
        let error = JetStreamTransport::connect(url, JetStreamConfig::default())
            .await
            .unwrap_err();
        assert_eq!(
            error.kind(),
            ConnectErrorKind::InvalidUrl,
            "{url:?}: {error}"
        );
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }
}

#[tokio::test]
async fn unreachable_server_fails_fast_without_showing_credentials() {
    // A port nothing listens on: the private server is gone after the kill.
    let mut server = start_private();
    let port = server.port();
    server.kill().expect("kill");
    let url = format!("nats://alice:hunter2@127.0.0.1:{port}");

    let started = Instant::now();
    let error = JetStreamTransport::connect(&url, JetStreamConfig::default())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unreachable, "{error}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let mut chain = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        chain.push_str(&format!(" / {cause} / {cause:?}"));
        source = cause.source();
    }
    chain.push_str(&format!("{error:?}"));
    assert!(!chain.contains("hunter2"), "{chain}");
    assert!(
        error
            .to_string()
            .contains(&format!("nats://127.0.0.1:{port}")),
        "{error}"
    );
}

#[tokio::test]
async fn credentials_in_the_url_are_used_and_refusals_are_unauthorized() {
    let server = NatsServer::start_with_args(&["--user", "alice", "--pass", "s3cret"])
        .expect("start a private nats-server with a password");
    let good = format!("nats://alice:s3cret@127.0.0.1:{}", server.port());
    let transport = JetStreamTransport::connect(&good, JetStreamConfig::default())
        .await
        .expect("connect with the right password");
    transport.ensure_stream().await.expect("ensure stream");
    transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .expect("publish");

    let bad = format!("nats://alice:wr0ng@127.0.0.1:{}", server.port());
    let error = JetStreamTransport::connect(&bad, JetStreamConfig::default())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unauthorized, "{error}");
    assert!(!format!("{error} {error:?}").contains("wr0ng"), "{error:?}");
}

#[tokio::test]
async fn publish_fails_while_the_broker_is_down_and_succeeds_after_restart() {
    let mut server = start_private();
    let publish_timeout = Duration::from_millis(500);
    let config = JetStreamConfig {
        publish_timeout,
        ..JetStreamConfig::default()
    };
    let transport = JetStreamTransport::connect(&server.url(), config)
        .await
        .expect("connect");
    transport.ensure_stream().await.expect("ensure stream");
    transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .expect("publish before the outage");

    for outage in ["stop", "kill"] {
        match outage {
            "stop" => server.stop().expect("stop"),
            _ => server.kill().expect("kill"),
        }
        let started = Instant::now();
        let error = transport
            .publish(&factory::outbox_event("a", 2))
            .await
            .unwrap_err();
        assert!(
            matches!(
                error.kind(),
                PublishErrorKind::Unavailable | PublishErrorKind::Timeout
            ),
            "after {outage}: {error}"
        );
        assert!(
            started.elapsed() < publish_timeout + Duration::from_secs(1),
            "after {outage}: failed only after {:?}",
            started.elapsed()
        );
        assert!(!transport.wait_until_ready(Duration::from_millis(100)).await);

        server.start_again().expect("start again");
        assert!(
            transport.wait_until_ready(Duration::from_secs(30)).await,
            "the client did not reconnect after {outage}"
        );
        transport
            .publish(&factory::outbox_event("a", 3))
            .await
            .unwrap_or_else(|e| panic!("publish after {outage} and restart: {e}"));
    }

    // File storage: what was acknowledged before the outages is still there.
    let messages = read_stream(transport.client(), transport.stream_name()).await;
    let payloads: Vec<_> = messages
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    assert!(
        payloads.starts_with(&[r#"{"n":1}"#.to_owned()]),
        "{payloads:?}"
    );
    assert_eq!(
        payloads.iter().filter(|p| *p == r#"{"n":3}"#).count(),
        2,
        "{payloads:?}"
    );
}
