//! The demo end to end for each `--destination`: the built `handoff-demo` binary runs against
//! the real servers (PostgreSQL, NATS, RabbitMQ, and a private tansu for Kafka) and must exit 0
//! with its reconciliation line saying OK.
//!
//! The demo runs the workspace's other binaries (`handoff`, `order-service`, `inventory`,
//! `payments`, `payment-provider`) from its own directory, so they must be built first, e.g.
//! `cargo build -p handoff-cli -p order-service -p reference-consumers --all-features`; the demo
//! says which one is missing otherwise. Kafka needs tansu (`cargo install tansu@0.6.0 --locked
//! --features dynostore`).

use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::process::Command;

/// Longest one run may take: the demo takes seconds, and each of its own waits gives up
/// within 30 s.
const RUN_TIMEOUT: Duration = Duration::from_secs(100);

/// How long a run interrupted at [`RUN_TIMEOUT`] gets to clean up after SIGINT.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(15);

/// Runs `handoff-demo` with `args` and returns its output; fails the test (after an
/// interrupted run has cleaned up) when it takes longer than [`RUN_TIMEOUT`].
async fn run_demo(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff-demo"))
        .args(args)
        // The demo's own defaults (servers on 127.0.0.1), whatever this shell says.
        .env_remove("HANDOFF_DESTINATION")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start handoff-demo");
    let pid = child.id().expect("the demo's pid");
    let stdout = child.stdout.take().expect("stdout pipe");
    let stderr = child.stderr.take().expect("stderr pipe");
    let read = |mut pipe: Box<dyn tokio::io::AsyncRead + Unpin + Send>| {
        tokio::spawn(async move {
            let mut text = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut pipe, &mut text).await;
            text
        })
    };
    let (stdout, stderr) = (read(Box::new(stdout)), read(Box::new(stderr)));
    let status = match tokio::time::timeout(RUN_TIMEOUT, child.wait()).await {
        Ok(status) => status.expect("wait for handoff-demo"),
        Err(_) => {
            // SIGINT, as a user's Ctrl-C: the demo removes what it created before it exits.
            let _ = Command::new("kill")
                .args(["-INT", &pid.to_string()])
                .status()
                .await;
            let _ = tokio::time::timeout(CLEANUP_TIMEOUT, child.wait()).await;
            let out = stdout.await.unwrap_or_default();
            let err = stderr.await.unwrap_or_default();
            panic!(
                "handoff-demo {args:?} took longer than {RUN_TIMEOUT:?}; its output:\n{}\n{}",
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&err)
            );
        }
    };
    Output {
        status,
        stdout: stdout.await.expect("read stdout"),
        stderr: stderr.await.expect("read stderr"),
    }
}

/// Asserts that the run exited 0 and ended with an OK reconciliation; returns its stdout.
fn assert_reconciled(args: &[&str], output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "handoff-demo {args:?} exited with {}:\n{stdout}\n{stderr}",
        output.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("reconciliation: ") && last.ends_with(": OK"),
        "handoff-demo {args:?} did not end with an OK reconciliation line, but with {last:?}:\n\
         {stdout}\n{stderr}"
    );
    stdout
}

/// The checks every destination shares: every step ran, and what was created was removed.
/// `cleaned`: the broker's clean-up line starts with one of these.
fn assert_steps_and_cleanup(stdout: &str, cleaned: &[&str]) {
    for step in 1..=13 {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("{step}. "))),
            "step {step} is missing:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("redelivered events:") && stdout.contains("nothing twice"),
        "no redelivery summary:\n{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|line| cleaned.iter().any(|c| line.starts_with(c))),
        "no clean-up line {cleaned:?}:\n{stdout}"
    );
    assert!(
        stdout.contains("cleaned up: dropped the databases"),
        "the databases were not dropped:\n{stdout}"
    );
}

#[tokio::test]
async fn kafka_destination_runs_the_whole_demo_and_reconciles() {
    let args = ["--destination", "kafka"];
    let stdout = assert_reconciled(&args, &run_demo(&args).await);
    assert_steps_and_cleanup(&stdout, &["cleaned up: stopped the private tansu broker"]);
    assert!(
        stdout.contains("2. Kafka") && stdout.contains("7. What reached Kafka"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("JetStream"),
        "a Kafka run speaks of JetStream:\n{stdout}"
    );
}

#[tokio::test]
async fn amqp_destination_runs_the_whole_demo_and_reconciles() {
    let args = ["--destination", "amqp"];
    let stdout = assert_reconciled(&args, &run_demo(&args).await);
    assert_steps_and_cleanup(&stdout, &["cleaned up: deleted the exchange handoff_demo_"]);
    assert!(
        stdout.contains("2. RabbitMQ") && stdout.contains("7. What reached RabbitMQ"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("JetStream"),
        "a RabbitMQ run speaks of JetStream:\n{stdout}"
    );
}

#[tokio::test]
async fn nats_is_the_default_destination() {
    let stdout = assert_reconciled(&[], &run_demo(&[]).await);
    let cleaned = [
        "cleaned up: deleted the stream HANDOFF_DEMO_",
        "cleaned up: stopped the private NATS server",
    ];
    assert_steps_and_cleanup(&stdout, &cleaned);
    assert!(
        stdout.contains("2. NATS JetStream") && stdout.contains("7. What reached JetStream"),
        "{stdout}"
    );
}

#[tokio::test]
async fn an_unknown_destination_is_refused_before_anything_is_created() {
    let args = ["--destination", "carrier-pigeon"];
    let output = run_demo(&args).await;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("carrier-pigeon") && stderr.contains("nats, kafka, amqp"),
        "{stderr}"
    );
    assert!(output.stdout.is_empty(), "it printed steps: {:?}", output);
}

#[tokio::test]
async fn the_saga_demo_walks_every_path_and_reconciles() {
    let args = ["--saga"];
    let output = run_demo(&args).await;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "handoff-demo --saga exited with {}:\n{stdout}\n{stderr}",
        output.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("saga reconciliation: 6 sagas ended, 3 orders confirmed")
            && last.ends_with(": OK"),
        "no OK saga reconciliation line, but {last:?}:\n{stdout}"
    );
    for step in 1..=9 {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("{step}. "))),
            "step {step} is missing:\n{stdout}"
        );
    }
    for path in [
        "card ok -> saga completed, order confirmed",
        "card declined -> saga compensated, order cancelled",
        "made 1 charge",
        "book x3, card ok -> saga compensated, order cancelled",
        "cursed-lamp x1, card declined -> saga stuck, order pending",
        "ALERT stuck_sagas",
        "(stuck -> resolved)",
        "cleaned up: dropped the databases",
    ] {
        assert!(stdout.contains(path), "{path:?} is missing:\n{stdout}");
    }
}

#[tokio::test]
async fn the_saga_demo_runs_on_nats_only() {
    let output = run_demo(&["--saga", "--destination", "kafka"]).await;
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot be used with"));
}
