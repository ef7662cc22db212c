//! PostgreSQL over TLS, against a private server that takes `hostssl` connections only
//! (`PrivatePostgres::start_tls`): migrate, enqueue, relay, a consumer and `handoff status`
//! over `sslmode=verify-full`; a plain connection refused by the server; a wrong CA ending the
//! relay, `migrate` and `status` within seconds with one clear line and a non-zero exit.

use std::collections::HashSet;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{check_stream, enqueue_spread, wait_drained, RelayProcess, Target};
use handoff_consumer::{Consumer, ConsumerConfig, Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_nats::{IntakeConfig, JetStreamIntake};
use handoff_postgres::{Outbox, OutboxConfig};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::factory;
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use handoff_test::tls::TestCa;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// How long a command given a wrong CA may take to give up: "within seconds".
const FAIL_FAST: Duration = Duration::from_secs(10);

/// `handoff ARGS` with `DATABASE_URL=url`.
fn handoff(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run handoff")
}

fn text(output: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Starts a TLS-only private server; blocks the (multi-threaded) runtime's thread meanwhile.
fn start_tls(ca: &TestCa, settings: &[&str]) -> PrivatePostgres {
    tokio::task::block_in_place(|| PrivatePostgres::start_tls_with(ca, settings))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Whether the pool's connections are encrypted, as the server sees them.
async fn encrypted(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The consumer's business effect: one `applied` row per application.
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

#[tokio::test(flavor = "multi_thread")]
async fn migrate_enqueue_relay_consume_and_status_work_over_verify_full() {
    let ca = TestCa::new("pg-tls-e2e").unwrap();
    let server = start_tls(&ca, &[]);
    let url = server.tls_url("postgres");

    // A plain connection is refused by the server itself: the setup really requires TLS.
    let plain = handoff(
        &format!("{}?sslmode=disable", server.url("postgres")),
        &["migrate"],
    );
    assert_eq!(plain.status.code(), Some(1), "{}", text(&plain));
    assert!(
        String::from_utf8_lossy(&plain.stderr).contains("no encryption"),
        "{}",
        text(&plain)
    );

    let migrate = handoff(&url, &["migrate"]);
    assert!(migrate.status.success(), "{}", text(&migrate));

    // The library's pool, over verify-full.
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("a pool over verify-full");
    assert!(encrypted(&pool).await);
    sqlx::raw_sql("CREATE TABLE applied (event_id uuid PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    enqueue_spread(&pool, &outbox, 0, 20, 4).await;

    let client = prepare_shared_server().await;
    let stream = unique_name("pg_tls");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let target = Target {
        database_url: url.clone(),
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream.clone(),
    };
    let mut relay = RelayProcess::start(&target, "tls-relay", &[], &[]);
    wait_drained(&pool, Duration::from_secs(30), || relay.log()).await;
    assert!(relay.terminate().success(), "{}", relay.log());
    let relay_sessions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.application_name = 'handoff-relay' AND NOT s.ssl",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(relay_sessions, 0, "no unencrypted relay session");
    let messages = read_stream(&client, &stream).await;
    let report = check_stream(&pool, &messages).await;
    assert_eq!((report.messages, report.duplicates), (20, 0));

    // A consumer whose pool is over verify-full applies every event once.
    let intake = JetStreamIntake::connect(
        &target.nats_url,
        IntakeConfig {
            stream: stream.clone(),
            subject_prefix: stream.clone(),
            durable_name: "tls_consumer".into(),
            ..IntakeConfig::default()
        },
    )
    .await
    .unwrap();
    let config = ConsumerConfig {
        name: "tls_consumer".into(),
        ..ConsumerConfig::default()
    };
    let consumer = Consumer::new(config, pool.clone(), Apply).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        consumer
            .run(intake, async {
                let _ = stopped.await;
            })
            .await;
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let applied: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM applied")
            .fetch_all(&pool)
            .await
            .unwrap();
        if applied.len() == 20 {
            let outbox_ids: HashSet<Uuid> = sqlx::query_scalar("SELECT event_id FROM outbox")
                .fetch_all(&pool)
                .await
                .unwrap()
                .into_iter()
                .collect();
            assert_eq!(applied.into_iter().collect::<HashSet<_>>(), outbox_ids);
            break;
        }
        assert!(Instant::now() < deadline, "{} of 20 applied", applied.len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("consumer stopped")
        .unwrap();

    let status = handoff(&url, &["status", "--json"]);
    assert_eq!(status.status.code(), Some(0), "{}", text(&status));
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(report["pending"], 0, "{report}");

    pool.close().await;
    tokio::task::block_in_place(move || drop(server));
}

/// Runs `handoff ARGS` with `DATABASE_URL=url` and `RUST_LOG` at the default level, killing it
/// after [`FAIL_FAST`]; returns its output and how long it ran.
fn run_bounded(url: &str, args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn handoff");
    while child.try_wait().unwrap().is_none() && started.elapsed() < FAIL_FAST {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let output = child.wait_with_output().unwrap();
    (output, started.elapsed())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_ca_ends_relay_migrate_and_status_within_seconds_with_one_line() {
    let ca = TestCa::new("pg-tls-right").unwrap();
    let wrong = TestCa::new("pg-tls-wrong").unwrap();
    // Also on 127.0.0.2, an address the server's certificate does not name.
    let server = start_tls(&ca, &["listen_addresses=127.0.0.1,127.0.0.2"]);
    let url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        server.port(),
        wrong.ca_path().display()
    );
    // The right CA but the wrong host: the certificate names only localhost and 127.0.0.1.
    let ip_url = server.tls_url("postgres").replace("localhost", "127.0.0.2");
    let missing = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        server.port()
    );

    // The relay connects to its destination first: a stream of its own, removed afterwards.
    let stream = unique_name("pg_tls_wrong_ca");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let nats_url = shared_url();
    let relay_args = [
        "relay",
        "--nats-url",
        &nats_url,
        "--stream",
        &stream,
        "--subject-prefix",
        &stream,
    ];
    let cases: [(&str, &[&str], &str); 5] = [
        (&url, &relay_args, "TLS with PostgreSQL"),
        (&url, &["migrate"], "TLS with PostgreSQL"),
        (&url, &["status"], "TLS with PostgreSQL"),
        (&ip_url, &relay_args, "TLS with PostgreSQL"),
        (
            &missing,
            &relay_args,
            "cannot read sslrootcert /nonexistent/ca.pem",
        ),
    ];
    for (url, args, expected) in cases {
        let (output, took) = run_bounded(url, args);
        let what = format!("handoff {} ({url}): {}", args[0], text(&output));
        assert!(took < FAIL_FAST, "still running after {took:?}: {what}");
        assert_eq!(output.status.code(), Some(1), "{what}");
        // One error line, nothing retried or warned before it (the relay may log at INFO
        // that its destination is ready).
        let stderr = String::from_utf8_lossy(&output.stderr);
        let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
        assert_eq!(errors.len(), 1, "one error line: {what}");
        assert!(errors[0].starts_with("error: "), "{what}");
        assert!(errors[0].contains(expected), "{what}");
        assert!(!stderr.contains("WARN"), "{what}");
    }
    tokio::task::block_in_place(move || drop(server));
}
