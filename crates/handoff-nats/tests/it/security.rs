//! `ConnectSecurity` against private servers: TLS with a password and client certificates,
//! nkey users, and a 3-node cluster where the transport creates a replicated stream.

use handoff_core::delivery::Transport;
use handoff_nats::{
    ConnectErrorKind, ConnectSecurity, IntakeConfig, JetStreamConfig, JetStreamIntake,
    JetStreamTransport,
};
use handoff_test::factory;
use handoff_test::nats::{NatsCluster, NatsServer};
use handoff_test::tls::TestCa;

/// Every message of an error and its sources, with their `Debug`.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = format!("{error} {error:?}");
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(" / {cause} / {cause:?}"));
        source = cause.source();
    }
    text
}

fn tls_security(ca: &TestCa) -> ConnectSecurity {
    let client = ca.client("relay").expect("client certificate");
    ConnectSecurity {
        tls_ca: Some(ca.ca_path()),
        tls_cert: Some(client.cert),
        tls_key: Some(client.key),
        ..ConnectSecurity::default()
    }
}

#[tokio::test]
async fn tls_with_a_client_certificate_and_a_password_connects_and_publishes() {
    let ca = TestCa::new("nats").unwrap();
    let server = NatsServer::start_tls(&ca, "relay", "tl5-s3cret", true).expect("start");
    let url = format!("nats://relay:tl5-s3cret@127.0.0.1:{}", server.port());
    let config = JetStreamConfig {
        security: tls_security(&ca),
        ..JetStreamConfig::default()
    };
    let transport = JetStreamTransport::connect(&url, config.clone())
        .await
        .expect("connect over TLS");
    transport.ensure_stream().await.expect("stream");
    transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .expect("publish");

    // The intake takes the same settings.
    let mut intake = JetStreamIntake::connect(
        &url,
        IntakeConfig {
            durable_name: "tls".into(),
            security: config.security.clone(),
            ..IntakeConfig::default()
        },
    )
    .await
    .expect("intake over TLS");
    let delivery = handoff_core::intake::Intake::next(&mut intake)
        .await
        .expect("a delivery");
    assert_eq!(delivery.event.unwrap().aggregate_id, "a");

    // Without the client certificate the server refuses the handshake.
    let no_cert = JetStreamConfig {
        security: ConnectSecurity {
            tls_ca: Some(ca.ca_path()),
            ..ConnectSecurity::default()
        },
        ..JetStreamConfig::default()
    };
    assert!(JetStreamTransport::connect(&url, no_cert).await.is_err());

    // A CA that did not sign the server's certificate: refused, and no secret in the error.
    let other = TestCa::new("other").unwrap();
    let wrong_ca = JetStreamConfig {
        security: ConnectSecurity {
            tls_ca: Some(other.ca_path()),
            ..tls_security(&ca)
        },
        ..JetStreamConfig::default()
    };
    let error = JetStreamTransport::connect(&url, wrong_ca)
        .await
        .unwrap_err();
    // Permanent: the relay must stop at once instead of retrying a certificate forever.
    assert_eq!(error.kind(), ConnectErrorKind::Tls, "{}", chain(&error));
    assert!(!chain(&error).contains("tl5-s3cret"), "{}", chain(&error));

    // The right certificates and a wrong password.
    let bad = format!("nats://relay:wr0ng@127.0.0.1:{}", server.port());
    let error = JetStreamTransport::connect(&bad, config).await.unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unauthorized, "{error}");
    assert!(!chain(&error).contains("wr0ng"), "{}", chain(&error));
}

#[tokio::test]
async fn a_missing_tls_file_is_a_configuration_error_naming_it() {
    let config = JetStreamConfig {
        security: ConnectSecurity {
            tls_ca: Some("/nonexistent/nats-ca.pem".into()),
            ..ConnectSecurity::default()
        },
        ..JetStreamConfig::default()
    };
    let error = JetStreamTransport::connect("nats://127.0.0.1:1", config)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::InvalidConfig);
    assert!(
        error.to_string().contains("/nonexistent/nats-ca.pem"),
        "{error}"
    );
}

#[tokio::test]
async fn nkey_users_connect_with_their_seed_and_others_are_refused() {
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let server = NatsServer::start_with_config(
        &format!(
            "authorization {{ users = [ {{ nkey: \"{}\" }} ] }}\n",
            user.public_key()
        ),
        &[],
    )
    .expect("start");
    let dir = tempfile::tempdir().unwrap();
    let seed_file = dir.path().join("relay.nk");
    std::fs::write(&seed_file, format!("{seed}\n")).unwrap();
    let config = JetStreamConfig {
        security: ConnectSecurity {
            nkey: Some(seed_file),
            ..ConnectSecurity::default()
        },
        ..JetStreamConfig::default()
    };
    let transport = JetStreamTransport::connect(&server.url(), config)
        .await
        .expect("connect with the nkey");
    transport.ensure_stream().await.expect("stream");
    transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .expect("publish");

    // Another user's seed, and none at all: refused.
    let stranger = nkeys::KeyPair::new_user().seed().unwrap();
    let other_file = dir.path().join("stranger.nk");
    std::fs::write(&other_file, &stranger).unwrap();
    let config = JetStreamConfig {
        security: ConnectSecurity {
            nkey: Some(other_file),
            ..ConnectSecurity::default()
        },
        ..JetStreamConfig::default()
    };
    let error = JetStreamTransport::connect(&server.url(), config)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unauthorized, "{error}");
    assert!(
        !chain(&error).contains(&stranger[..12]),
        "{}",
        chain(&error)
    );
    let error = JetStreamTransport::connect(&server.url(), JetStreamConfig::default())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unauthorized, "{error}");
}

#[tokio::test]
async fn a_created_stream_gets_the_configured_replicas_on_a_cluster() {
    let cluster = NatsCluster::start(3).await.expect("cluster");
    let config = JetStreamConfig {
        stream: "R3".into(),
        subject_prefix: "r3".into(),
        replicas: 3,
        ..JetStreamConfig::default()
    };
    let transport = JetStreamTransport::connect(&cluster.url(), config.clone())
        .await
        .expect("connect");
    let summary = transport.ensure_stream().await.expect("stream");
    assert!(summary.created);
    assert_eq!(summary.replicas, 3);

    // An existing stream weaker than configured is kept (with a warning), not refused.
    let weaker = JetStreamConfig {
        stream: "R1".into(),
        subject_prefix: "r1".into(),
        ..JetStreamConfig::default()
    };
    JetStreamTransport::connect(&cluster.url(), weaker.clone())
        .await
        .unwrap()
        .ensure_stream()
        .await
        .unwrap();
    let stronger = JetStreamConfig {
        replicas: 3,
        ..weaker
    };
    let summary = JetStreamTransport::connect(&cluster.url(), stronger)
        .await
        .unwrap()
        .ensure_stream()
        .await
        .expect("an existing R1 stream is used");
    assert!(!summary.created);
    assert_eq!(summary.replicas, 1);
}

#[tokio::test]
async fn a_user_the_server_will_not_let_publish_is_misconfigured_not_slow() {
    let server = NatsServer::start_with_config(
        r#"authorization { users = [
            { user: admin, password: adm1n }
            { user: relay, password: r3lay, permissions: { publish: { deny: ["locked.>"] } } }
        ] }"#,
        &[],
    )
    .expect("start");
    let config = JetStreamConfig {
        stream: "LOCKED".into(),
        subject_prefix: "locked".into(),
        publish_timeout: std::time::Duration::from_secs(1),
        ..JetStreamConfig::default()
    };
    // The stream exists; the relay's user may read it but not write its subjects.
    let admin = format!("nats://admin:adm1n@127.0.0.1:{}", server.port());
    JetStreamTransport::connect(&admin, config.clone())
        .await
        .expect("connect as admin")
        .ensure_stream()
        .await
        .expect("stream");
    let relay = format!("nats://relay:r3lay@127.0.0.1:{}", server.port());
    let transport = JetStreamTransport::connect(&relay, config)
        .await
        .expect("connect as relay");
    // The server answers the publish with an error of its own and never acks it: the relay's
    // setup, not a slow stream, so the relay pauses instead of charging the event.
    let error = transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .unwrap_err();
    assert_eq!(
        error.kind(),
        handoff_core::delivery::PublishErrorKind::Misconfigured,
        "{error}"
    );
    assert!(
        error.to_string().contains("Permissions Violation"),
        "{error}"
    );
    assert!(!error.to_string().contains("r3lay"), "{error}");
}
