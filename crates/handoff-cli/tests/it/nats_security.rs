//! The relay, a consumer, `handoff replay` and `handoff reconcile` end to end against private
//! nats-servers that demand credentials: (a) TLS with a client certificate and a password,
//! (b) an nkey user. Every binary's stderr is checked for the secrets.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::{enqueue_spread, migrated, wait_drained, RelayProcess, Target};
use handoff_consumer::{Consumer, ConsumerConfig, Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_nats::{ConnectSecurity, IntakeConfig, JetStreamIntake};
use handoff_test::nats::{read_stream, unique_name, NatsServer};
use handoff_test::tls::TestCa;
use handoff_test::TestDb;
use sqlx::PgConnection;

/// The business effect: one `applied` row per application.
struct Apply;

impl Handler for Apply {
    async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO applied (event_id) VALUES ($1)")
            .bind(e.event_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// What one `handoff` run printed and how it ended.
#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// `handoff <command> --nats-url ... <args>` with `env`, logging at debug (the most a
/// operator would turn on), at most 60 s.
async fn handoff(target: &Target, command: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_handoff"));
    cmd.arg(command)
        .args(["--nats-url", &target.nats_url, "--stream", &target.stream])
        .args(["--subject-prefix", &target.prefix])
        .args(args)
        .env("DATABASE_URL", &target.database_url)
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for (key, value) in env {
        cmd.env(key, value);
    }
    let output = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("handoff finished within 60 s")
        .expect("run handoff");
    Run {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn json(run: &Run) -> serde_json::Value {
    serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {run:?}"))
}

fn assert_no_secret(what: &str, log: &str, secrets: &[&str]) {
    for secret in secrets {
        assert!(
            !log.contains(secret),
            "{what} logged a secret ({} chars):\n{log}",
            secret.len()
        );
    }
}

/// How one end-to-end run reaches the server: the consumer's settings, the relay's flags and
/// environment, the commands' flags, and the secrets no log may hold.
struct Access<'a> {
    security: ConnectSecurity,
    relay_args: &'a [&'a str],
    relay_env: &'a [(&'a str, &'a str)],
    cli_args: &'a [&'a str],
    secrets: &'a [&'a str],
}

/// Publishes 12 events through the relay, consumes them, replays them, reconciles, with the
/// credentials in `access`.
async fn end_to_end(
    db: &TestDb,
    outbox: &handoff_postgres::Outbox,
    target: &Target,
    access: Access<'_>,
) {
    let Access {
        security,
        relay_args,
        relay_env,
        cli_args,
        secrets,
    } = access;
    sqlx::raw_sql("CREATE TABLE applied (n bigserial PRIMARY KEY, event_id uuid NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    enqueue_spread(&db.pool, outbox, 0, 12, 3).await;
    let mut env = relay_env.to_vec();
    // Everything the relay and its NATS client say, for the secret check.
    env.push(("RUST_LOG", "debug"));
    let mut relay = RelayProcess::start(target, "secure-relay", relay_args, &env);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;

    // A consumer through the JetStream intake with the same settings.
    let intake = JetStreamIntake::connect(
        &target.nats_url,
        IntakeConfig {
            stream: target.stream.clone(),
            subject_prefix: target.prefix.clone(),
            durable_name: "secure_consumer".into(),
            security,
            ..IntakeConfig::default()
        },
    )
    .await
    .expect("the consumer connects");
    let config = ConsumerConfig {
        name: "secure_consumer".into(),
        ..ConsumerConfig::default()
    };
    let consumer = Consumer::new(config, db.pool.clone(), Apply).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        consumer
            .run(intake, async {
                let _ = stopped.await;
            })
            .await;
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while db.count("applied").await < 12 {
        assert!(Instant::now() < deadline, "the 12 events were not applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Replay everything: 12 copies reach the stream, the inbox applies none of them again.
    let mut args = vec!["--since", "10m", "--json"];
    args.extend_from_slice(cli_args);
    let run = handoff(target, "replay", &args, &[]).await;
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(json(&run)["published"], 12, "{run:?}");
    assert_no_secret("handoff replay", &run.stderr, secrets);

    // Reconcile: nothing missing.
    let run = handoff(target, "reconcile", &args, &[]).await;
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(json(&run)["missing"], 0, "{run:?}");
    assert_no_secret("handoff reconcile", &run.stderr, secrets);

    // Without the credentials: refused, one clear failure, still no secret.
    let run = handoff(target, "reconcile", &["--since", "10m"], &[]).await;
    assert!(run.code.is_some_and(|c| c != 0), "{run:?}");
    assert_no_secret("handoff reconcile (refused)", &run.stderr, secrets);

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("consumer stopped")
        .unwrap();
    assert_eq!(db.count("applied").await, 12, "one effect per event");
    assert!(relay.terminate().success(), "{}", relay.log());
    let log = relay.log();
    assert!(log.contains("destination ready"), "{log}");
    assert_no_secret("handoff relay", &log, secrets);
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[tokio::test]
async fn tls_with_a_client_certificate_and_a_password_works_end_to_end_without_leaking() {
    const PASSWORD: &str = "tls-pa55word-7c1e";
    let ca = TestCa::new("nats-e2e").unwrap();
    let client = ca.client("handoff").unwrap();
    let server = NatsServer::start_tls(&ca, "handoff", PASSWORD, true).expect("start");
    let (db, outbox) = migrated("nats_tls_e2e").await;
    let stream = unique_name("nats_tls_e2e");
    let target = Target {
        database_url: db.url(),
        nats_url: format!("nats://handoff:{PASSWORD}@127.0.0.1:{}", server.port()),
        stream: stream.clone(),
        prefix: stream,
    };
    let key_pem = std::fs::read_to_string(&client.key).unwrap();
    let key_body = key_pem.lines().nth(1).unwrap().to_owned();
    let security = ConnectSecurity {
        tls_ca: Some(ca.ca_path()),
        tls_cert: Some(client.cert.clone()),
        tls_key: Some(client.key.clone()),
        ..ConnectSecurity::default()
    };
    let ca_path = ca.ca_path();
    // The relay takes the files from the environment, the commands from flags.
    let relay_env = [
        ("NATS_TLS_CA", path(&ca_path)),
        ("NATS_TLS_CERT", path(&client.cert)),
        ("NATS_TLS_KEY", path(&client.key)),
    ];
    let cli_args = [
        "--nats-tls-ca",
        path(&ca_path),
        "--nats-tls-cert",
        path(&client.cert),
        "--nats-tls-key",
        path(&client.key),
    ];
    let access = Access {
        security,
        relay_args: &[],
        relay_env: &relay_env,
        cli_args: &cli_args,
        secrets: &[PASSWORD, &key_body],
    };
    end_to_end(&db, &outbox, &target, access).await;
    let client =
        async_nats::ConnectOptions::with_user_and_password("handoff".into(), PASSWORD.into())
            .add_root_certificates(ca.ca_path())
            .add_client_certificate(client.cert.clone(), client.key.clone())
            .connect(server.url())
            .await
            .unwrap();
    assert_eq!(read_stream(&client, &target.stream).await.len(), 24);
}

#[tokio::test]
async fn an_nkey_user_works_end_to_end_without_leaking_its_seed() {
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
    let seed_file = dir.path().join("handoff.nk");
    std::fs::write(&seed_file, format!("{seed}\n")).unwrap();
    let (db, outbox) = migrated("nats_nkey_e2e").await;
    let stream = unique_name("nats_nkey_e2e");
    let target = Target {
        database_url: db.url(),
        nats_url: server.url(),
        stream: stream.clone(),
        prefix: stream,
    };
    let security = ConnectSecurity {
        nkey: Some(seed_file.clone()),
        ..ConnectSecurity::default()
    };
    // The relay takes the seed from a flag, the commands from theirs.
    let flags = ["--nats-nkey", path(&seed_file)];
    let access = Access {
        security,
        relay_args: &flags,
        relay_env: &[],
        cli_args: &flags,
        secrets: &[&seed],
    };
    end_to_end(&db, &outbox, &target, access).await;

    // A seed file that holds no seed: one line naming the file, nothing of its content.
    let bad = dir.path().join("bad.nk");
    std::fs::write(&bad, "SU-not-a-seed-but-secret-looking").unwrap();
    let run = handoff(
        &target,
        "reconcile",
        &["--since", "10m", "--nats-nkey", path(&bad)],
        &[],
    )
    .await;
    assert!(run.code.is_some_and(|c| c != 0), "{run:?}");
    assert!(run.stderr.contains(path(&bad)), "{run:?}");
    assert!(!run.stderr.contains("secret-looking"), "{run:?}");
}
