//! `handoff-chaos run` as a user runs it: the built binary, its own private PostgreSQL and
//! nats-server, the workspace's service binaries as child processes, SIGKILLs from the seed,
//! then the checker. The other binaries must have been built next to it (`cargo build
//! --workspace`, or `cargo nextest run --workspace`, which builds every binary).

use std::path::{Path, PathBuf};
use std::process::Command;

use std::time::Duration;

use handoff_chaos::run::{schedule_for, Destination, BINARIES};

const CHAOS: &str = env!("CARGO_BIN_EXE_handoff-chaos");

/// The directory of the built binaries, after checking that the run's binaries are all there.
fn bin_dir() -> PathBuf {
    let dir = Path::new(CHAOS)
        .parent()
        .expect("the handoff-chaos binary has a directory")
        .to_owned();
    let missing: Vec<&str> = BINARIES
        .iter()
        .copied()
        .filter(|name| !dir.join(name).is_file())
        .collect();
    assert!(
        missing.is_empty(),
        "the chaos run needs {} next to {CHAOS}; build them first: cargo build --workspace",
        missing.join(", ")
    );
    dir
}

/// The CI's chaos run: about two minutes with start-up and settling, seed 7.
const CI_DURATION: Duration = Duration::from_secs(100);

/// The CI's chaos run with the logical replication source: shorter, since the polling run
/// already covers the consumers' side at length.
const CI_LOGICAL_DURATION: Duration = Duration::from_secs(60);

#[test]
fn a_short_chaos_run_kills_processes_and_every_invariant_holds() {
    let report = chaos_run(CI_DURATION, Destination::Nats, &[]);
    assert_eq!(report["relay_source"], "polling");
}

#[test]
fn a_chaos_run_with_the_logical_source_kills_the_streaming_relay_and_every_invariant_holds() {
    let report = chaos_run(
        CI_LOGICAL_DURATION,
        Destination::Nats,
        &["--relay-source", "logical"],
    );
    assert_eq!(report["relay_source"], "logical");
    // One relay streams the slot and two stand by: killing relays makes a standby take over.
    assert!(
        report["kills"]["relay"].as_u64().is_some_and(|n| n > 0),
        "no relay was killed: {report}"
    );
}

#[test]
fn a_chaos_run_with_the_log_source_kills_the_cursor_reader_and_every_invariant_holds() {
    let report = chaos_run(
        CI_LOGICAL_DURATION,
        Destination::Nats,
        &["--relay-source", "log"],
    );
    assert_eq!(report["relay_source"], "log");
    // One relay reads the default cursor and two stand by: killing relays makes a standby
    // take the cursor over once the killed reader's lease runs out.
    assert!(
        report["kills"]["relay"].as_u64().is_some_and(|n| n > 0),
        "no relay was killed: {report}"
    );
}

/// Runs `handoff-chaos run` for `duration` with seed 7 and `extra` arguments, asserts what
/// every run must show (the seed's schedule followed, every kind killed, settled, no
/// violation, every intent checked), and returns the report.
fn chaos_run(duration: Duration, destination: Destination, extra: &[&str]) -> serde_json::Value {
    let _ = bin_dir();
    let seconds = format!("{}s", duration.as_secs());
    let name = serde_json::to_value(destination).expect("destination as JSON");
    let output = Command::new(CHAOS)
        .args(["run", "--duration", &seconds, "--seed", "7", "--json"])
        .args(["--destination", name.as_str().expect("a name")])
        .args(extra)
        .output()
        .expect("run handoff-chaos");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(0),
        "handoff-chaos run failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"));
    assert_eq!(report["seed"], 7);
    assert_eq!(report["destination"], name);
    assert_eq!(
        report["violations"],
        serde_json::json!([]),
        "violations: {stdout}"
    );
    let kills = report["kills"]
        .as_object()
        .unwrap_or_else(|| panic!("kills is not an object: {stdout}"));
    for kind in [
        "order-service",
        "relay",
        "inventory",
        "payments",
        "payment-provider",
        "nats-server",
        "postgres",
    ] {
        assert!(kills.contains_key(kind), "no {kind} in kills: {stdout}");
    }
    let total: u64 = kills.values().filter_map(serde_json::Value::as_u64).sum();
    assert!(total > 0, "nothing was killed: {stdout}");
    // The run followed the seed's schedule: the same seed, the same kills at the same times.
    let planned = schedule_for(7, duration, destination);
    assert_eq!(
        report["schedule"],
        serde_json::to_value(&planned).expect("schedule as JSON"),
        "the run's schedule is not seed 7's"
    );
    assert!(
        total <= planned.len() as u64,
        "more kills than planned: {stdout}"
    );
    assert!(
        report["events"].as_u64().is_some_and(|n| n > 0),
        "no events: {stdout}"
    );
    assert_eq!(report["settled"], true, "did not settle: {stdout}");
    // Settled: nothing behind, no lag left, and the load held at the default bound.
    assert_eq!(report["behind"], serde_json::json!({}), "{stdout}");
    assert_eq!(
        report["lag"],
        serde_json::json!({"inventory": 0, "payments": 0}),
        "{stdout}"
    );
    assert_eq!(report["max_lag"], 5000);
    // The time series covers the load, with each consumer's rate and lag.
    let series = report["series"]
        .as_array()
        .unwrap_or_else(|| panic!("no series: {stdout}"));
    assert!(
        series.iter().any(|i| i["phase"] == "load"
            && i["consumers"]["payments"]["applied_per_second"].is_number()
            && i["commands_per_second"].as_f64().is_some_and(|r| r > 0.0)),
        "no interval of load with commands and the payments consumer's rate: {stdout}"
    );
    // Every event reached the stream and both consumers: the checker's own counts agree.
    assert_eq!(report["check"]["intents"], report["events"]);
    report
}

/// The CI's chaos runs on Kafka and RabbitMQ: shorter, since the NATS run covers the services'
/// side at length; long enough that relays and consumers are killed more than once.
const CI_OTHER_DESTINATION_DURATION: Duration = Duration::from_secs(45);

/// Asserts that the broker was never killed and each of `killed` was.
fn assert_broker_spared(report: &serde_json::Value, killed: &[&str]) {
    let kills = &report["kills"];
    assert_eq!(kills["nats-server"], 0, "{report}");
    for kind in killed {
        assert!(
            kills[kind].as_u64().is_some_and(|n| n > 0),
            "no {kind} was killed: {kills}"
        );
    }
    assert_eq!(report["redeliveries"], serde_json::json!({}));
}

#[test]
fn a_chaos_run_on_kafka_kills_relays_and_servers_and_every_invariant_holds() {
    let report = chaos_run(CI_OTHER_DESTINATION_DURATION, Destination::Kafka, &[]);
    // The consumers are not fault targets on Kafka (see `Destination::Kafka`).
    assert_broker_spared(
        &report,
        &["relay", "postgres", "order-service", "payment-provider"],
    );
    assert_eq!(report["kills"]["inventory"], 0);
    assert_eq!(report["kills"]["payments"], 0);
}

#[test]
fn a_chaos_run_on_rabbitmq_kills_relays_and_consumers_and_every_invariant_holds() {
    let report = chaos_run(CI_OTHER_DESTINATION_DURATION, Destination::Amqp, &[]);
    assert_broker_spared(&report, &["relay", "inventory", "payments", "postgres"]);
}

#[test]
fn a_missing_service_binary_exits_1_and_names_it() {
    let _ = bin_dir();
    let dir = tempfile::tempdir().expect("temp dir");
    let lonely = dir.path().join("handoff-chaos");
    std::fs::copy(CHAOS, &lonely).expect("copy handoff-chaos");
    let output = Command::new(&lonely)
        .args(["run", "--duration", "1s", "--seed", "1"])
        .output()
        .expect("run the copied handoff-chaos");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("order-service binary is missing") && stderr.contains("cargo build"),
        "{stderr}"
    );
}

#[test]
fn a_soak_that_kills_fewer_processes_than_asked_fails_and_still_writes_its_report() {
    let _ = bin_dir();
    let dir = tempfile::tempdir().expect("temp dir");
    let report_path = dir.path().join("soak.json");
    let output = Command::new(CHAOS)
        .args([
            "soak",
            "--duration",
            "5s",
            "--seed",
            "3",
            "--min-kills",
            "1000",
        ])
        .arg("--report")
        .arg(&report_path)
        .output()
        .expect("run handoff-chaos soak");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("fewer than --min-kills 1000"), "{stderr}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report_path).expect("the soak wrote its report"))
            .expect("the report is JSON");
    assert_eq!(report["seed"], 3);
    assert_eq!(report["violations"], serde_json::json!([]), "{report}");
    let kills: u64 = report["kills"]
        .as_object()
        .expect("kills is an object")
        .values()
        .filter_map(serde_json::Value::as_u64)
        .sum();
    assert!(kills > 0 && kills < 1000, "kills {kills}");
}
