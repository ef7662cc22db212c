//! `handoff-chaos backlog` as a user runs it (design V3): the built binary stops every relay of
//! its private system under load, restarts them, and must see the backlog drain, `handoff
//! status` alert and then come back clean, Prometheus alerts fire and then clear, and every
//! invariant hold. Needs the workspace's binaries next to it (`cargo build --workspace`) and
//! Prometheus' server (`/usr/bin/prometheus`, Debian package prometheus, which .ci/run installs).

use std::path::Path;
use std::process::Command;

use handoff_chaos::run::BINARIES;

const CHAOS: &str = env!("CARGO_BIN_EXE_handoff-chaos");

const PROMETHEUS: &str = "/usr/bin/prometheus";

#[test]
fn a_short_outage_builds_a_backlog_that_drains_while_status_and_alerts_fire_and_clear() {
    let dir = Path::new(CHAOS).parent().expect("a directory");
    for name in BINARIES {
        assert!(
            dir.join(name).is_file(),
            "the drill needs {name} next to {CHAOS}: cargo build --workspace"
        );
    }
    assert!(
        Path::new(PROMETHEUS).is_file(),
        "the drill needs {PROMETHEUS}: apt-get install prometheus"
    );
    // 15 s down at 30 commands/s: a backlog of a few hundred events. --stuck-after 5s lets
    // `handoff status` (and the relays' stuck gauge) call aggregates stuck within the outage;
    // HandoffRelayDown fires within seconds of the stop with the rules' for: cut to 1 s.
    let output = Command::new(CHAOS)
        .args([
            "backlog",
            "--down-for",
            "15s",
            "--warmup",
            "5s",
            "--rate",
            "30",
            "--seed",
            "3",
            "--stuck-after",
            "5s",
            "--alert-for",
            "1s",
            "--expect-alert",
            "HandoffRelayDown",
            "--prometheus",
            PROMETHEUS,
            "--json",
        ])
        .output()
        .expect("run handoff-chaos backlog");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(0),
        "handoff-chaos backlog failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"));
    assert_eq!(report["seed"], 3);
    assert_eq!(report["violations"], serde_json::json!([]), "{stdout}");
    assert_eq!(report["failures"], serde_json::json!([]), "{stdout}");
    assert_eq!(report["relays_stopped"], 3, "{stdout}");

    // A backlog was built and drained, and the drain was measured.
    let backlog = report["backlog_events"].as_u64().expect("backlog_events");
    assert!(backlog > 50, "a backlog of {backlog} events: {stdout}");
    assert!(
        report["backlog_oldest_age_seconds"].as_f64() > Some(10.0),
        "{stdout}"
    );
    assert_eq!(report["drained"], true, "{stdout}");
    let drain = report["drain_seconds"].as_f64().expect("drain_seconds");
    assert!(drain > 0.0, "{stdout}");
    assert!(
        report["drain_rows_per_second"].as_f64() > Some(0.0),
        "{stdout}"
    );
    assert!(
        report["pg_transactions_per_second"]["mean"].as_f64() > Some(0.0),
        "no postgresql load measured while draining: {stdout}"
    );
    assert!(
        report["pg"]["drain"]["samples"].as_u64() > Some(2),
        "{stdout}"
    );
    assert!(
        report["longest_transaction_seconds"].is_number(),
        "{stdout}"
    );

    // handoff status alerted while the relays were down, and was clean after the drain.
    let during = report["status"]["during"].as_array().expect("status runs");
    assert!(
        during
            .iter()
            .any(|run| run["exit_code"] == 2 && run["alerts"] != serde_json::json!([])),
        "handoff status never alerted during the outage: {stdout}"
    );
    assert_eq!(report["status"]["after"]["exit_code"], 0, "{stdout}");
    assert_eq!(report["status"]["after"]["pending"], 0, "{stdout}");

    // Prometheus: HandoffRelayDown fired after the stop, and nothing was left active.
    let fired = report["alerts_fired"].as_array().expect("alerts_fired");
    let down = fired
        .iter()
        .find(|alert| alert["name"] == "HandoffRelayDown")
        .unwrap_or_else(|| panic!("HandoffRelayDown did not fire: {stdout}"));
    let first = down["first_firing_seconds"].as_f64().expect("seen firing");
    assert!(
        (0.0..15.0).contains(&first),
        "HandoffRelayDown first fired {first} s after the stop: {stdout}"
    );
    assert_eq!(report["alerts_cleared"], true, "{stdout}");
    assert_eq!(
        report["alerts_active_at_end"],
        serde_json::json!([]),
        "{stdout}"
    );
}
