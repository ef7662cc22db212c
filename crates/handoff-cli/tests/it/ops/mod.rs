//! Support for the operator-command tests (`replay`, `reconcile`): a migrated schema with
//! published events in a stream of the test's own, and `handoff` runs.

#![allow(dead_code)] // each test binary uses a part

use std::process::Stdio;
use std::time::Duration;

use chrono::{DateTime, Utc};
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::TestDb;
use sqlx::PgPool;

use crate::common::Target;

/// One test's stream on the shared server (deleted on drop) and the client to read it.
pub struct Broker {
    pub target: Target,
    pub client: async_nats::Client,
    _cleanup: DeleteStreamOnDrop,
}

impl Broker {
    pub async fn new(db: &TestDb, name: &str) -> Self {
        let client = prepare_shared_server().await;
        let stream = unique_name(name);
        let cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
        let target = Target {
            database_url: db.url(),
            nats_url: shared_url(),
            stream: stream.clone(),
            prefix: stream,
        };
        Self {
            target,
            client,
            _cleanup: cleanup,
        }
    }

    /// Creates the stream as the relay would.
    pub async fn ensure_stream(&self) {
        let transport = handoff_nats::JetStreamTransport::connect(
            &self.target.nats_url,
            handoff_nats::JetStreamConfig {
                stream: self.target.stream.clone(),
                subject_prefix: self.target.prefix.clone(),
                ..handoff_nats::JetStreamConfig::default()
            },
        )
        .await
        .unwrap();
        transport.ensure_stream().await.unwrap();
    }
}

/// What a `handoff` run printed and how it ended.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// stdout as the one JSON object `--json` prints.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{self:?}"))
    }
}

/// Runs `handoff <command> <args>` against `target` (database, NATS, stream, prefix), with at
/// most 60 s to finish. Async, so consumers running in the test's runtime keep going.
pub async fn handoff(target: &Target, command: &str, args: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
        .arg(command)
        .args(["--nats-url", &target.nats_url, "--stream", &target.stream])
        .args(["--subject-prefix", &target.prefix])
        .args(args)
        .env("DATABASE_URL", &target.database_url)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .expect("handoff finished within 60 s")
        .expect("run handoff");
    Run {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// The database's clock, as an RFC 3339 argument.
pub async fn db_now(pool: &PgPool) -> String {
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .unwrap();
    now.to_rfc3339()
}

/// The events the reconcile tests have the destination lose (of `enqueue_spread`'s 24 over four
/// aggregates): sequences 2, 3 and 5 of agg-1, so the republish order within one aggregate
/// shows, 1 of agg-2 and 4 of agg-3.
pub fn is_lost(aggregate: &str, sequence: &str) -> bool {
    match aggregate {
        "agg-1" => ["2", "3", "5"].contains(&sequence),
        "agg-2" => sequence == "1",
        "agg-3" => sequence == "4",
        _ => false,
    }
}

/// The event ids of a reconcile summary's `missing_events`.
pub fn missing_ids(summary: &serde_json::Value) -> std::collections::HashSet<uuid::Uuid> {
    summary["missing_events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// Asserts that republished copies, given as `(aggregate, sequence)` in stored order, come in
/// sequence order per aggregate, and that the last of agg-1 is its 5th (see [`is_lost`]).
pub fn assert_in_order_per_aggregate<'a>(copies: impl IntoIterator<Item = (&'a str, &'a str)>) {
    let mut last: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for (aggregate, sequence) in copies {
        let sequence: i64 = sequence.parse().unwrap();
        let previous = last.insert(aggregate, sequence).unwrap_or(0);
        assert!(
            sequence > previous,
            "{aggregate}: {sequence} republished after {previous}"
        );
    }
    assert_eq!(last["agg-1"], 5);
}
