//! The monitoring files under `deploy/` held against the code (design O1, O5): the Prometheus
//! rules pass promtool's checks and unit tests, the Grafana dashboard is well formed and its
//! queries are valid PromQL, every `handoff_*` metric they name is one the code exports, and a
//! real `handoff relay` serves those metrics over HTTP with the values the backlog has.
//!
//! promtool comes from the Debian package `prometheus` (`.ci/run` installs it); `PROMTOOL`
//! names another binary.

use std::collections::{BTreeSet, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{enqueue_spread, free_addr, migrated, RelayProcess, Target};
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use serde_json::Value;

/// The source files whose string literals are the exported metric names: the relay's counters
/// and histograms, the backlog gauges of `handoff relay`, the CDC source's gauges (a relay with
/// `--source logical` serves them; tests/it/cdc.rs scrapes one), and the consumer's metrics.
const METRIC_SOURCES: &[&str] = &[
    "crates/handoff-relay/src/metrics.rs",
    "crates/handoff-cli/src/relay/observe.rs",
    "crates/handoff-cdc/src/metrics.rs",
    "crates/handoff-consumer/src/metrics.rs",
    "crates/handoff-saga/src/metrics.rs",
];

/// The series a histogram adds to its name in the exposition format.
const HISTOGRAM_SUFFIXES: &[&str] = &["_bucket", "_sum", "_count"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(relative: &str) -> String {
    let path = workspace().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn promtool_path() -> String {
    std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".to_owned())
}

/// Runs promtool with `args` (and `stdin`, if any) in the workspace; panics with a clear message
/// when promtool is missing, since these tests cannot judge the files without it.
fn promtool(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let tool = promtool_path();
    let mut child = Command::new(&tool)
        .args(args)
        .current_dir(workspace())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {tool:?} ({e}): install promtool (Debian: `apt-get install -y \
                 prometheus`; .ci/run does it) or set PROMTOOL to its path"
            )
        });
    if let Some(input) = stdin {
        // Dropping the handle closes promtool's stdin, which ends its input.
        let mut pipe = child.stdin.take().expect("piped stdin");
        pipe.write_all(input).expect("write to promtool");
    }
    child.wait_with_output().expect("wait for promtool")
}

fn assert_success(what: &str, output: &Output) {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Every `handoff_*` token in `text`: metric names, as far as a metric name's characters go.
fn handoff_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("handoff_") {
        // Part of a longer identifier (`x_handoff_...`) is not a name of ours.
        let glued = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !glued {
            names.insert(tail[..len].to_owned());
        }
        rest = &tail[len..];
    }
    names
}

/// The metric names the code exports: every `"handoff_..."` string literal of
/// [`METRIC_SOURCES`]. Read from the source text, so a rename in code breaks the check below.
fn exported_names() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for file in METRIC_SOURCES {
        let text = read(file);
        for literal in text.split('"').skip(1).step_by(2) {
            if literal.starts_with("handoff_")
                && literal
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                names.insert(literal.to_owned());
            }
        }
    }
    names
}

/// Whether `name` is exported, directly or as a histogram's `_bucket`/`_sum`/`_count` series.
fn is_exported(exported: &BTreeSet<String>, name: &str) -> bool {
    exported.contains(name)
        || HISTOGRAM_SUFFIXES.iter().any(|suffix| {
            name.strip_suffix(suffix)
                .is_some_and(|base| exported.contains(base))
        })
}

fn dashboard() -> Value {
    serde_json::from_str(&read("deploy/grafana/handoff.json"))
        .unwrap_or_else(|e| panic!("deploy/grafana/handoff.json is not JSON: {e}"))
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in list.as_array().into_iter().flatten() {
            out.push(panel);
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// The PromQL of every dashboard query.
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    panels(dashboard)
        .into_iter()
        .flat_map(|panel| panel["targets"].as_array().into_iter().flatten())
        .filter_map(|target| target["expr"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    let check = promtool(&["check", "rules", "deploy/prometheus/alerts.yml"], None);
    assert_success("promtool check rules deploy/prometheus/alerts.yml", &check);
    let test = promtool(
        &["test", "rules", "deploy/prometheus/alerts.test.yml"],
        None,
    );
    assert_success(
        "promtool test rules deploy/prometheus/alerts.test.yml",
        &test,
    );
}

#[test]
fn every_alert_has_a_severity_a_runbook_command_and_a_unit_test() {
    let rules = read("deploy/prometheus/alerts.yml");
    let tests = read("deploy/prometheus/alerts.test.yml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
        .map(str::trim)
        .collect();
    assert!(alerts.len() >= 10, "only {} alerts found", alerts.len());
    let blocks: Vec<&str> = rules.split("- alert: ").skip(1).collect();
    for (alert, block) in alerts.iter().zip(&blocks) {
        assert!(
            block.contains("severity: warning") || block.contains("severity: critical"),
            "{alert} has no severity label"
        );
        assert!(
            block.contains("summary:") && block.contains("description:"),
            "{alert} lacks a summary or description"
        );
        assert!(
            block.contains("handoff status")
                || block.contains("handoff quarantine")
                || block.contains("handoff cdc")
                || block.contains("consumer_quarantine"),
            "{alert}'s description tells on-call nothing to run"
        );
        // A test that expects the alert to fire names it with its labels; one that expects
        // silence has `exp_alerts: []`. promtool runs both; here we check that each exists.
        let evaluations: Vec<&str> = tests
            .split("- eval_time:")
            .filter(|e| e.contains(&format!("alertname: {alert}\n")))
            .collect();
        assert!(
            evaluations.iter().any(|e| e.contains("exp_labels:")),
            "no unit test makes {alert} fire"
        );
        assert!(
            evaluations.iter().any(|e| e.contains("exp_alerts: []")),
            "no unit test keeps {alert} silent"
        );
    }
}

#[test]
fn the_dashboard_is_well_formed_and_its_queries_are_valid_promql() {
    let dashboard = dashboard();
    let schema = dashboard["schemaVersion"].as_i64().unwrap_or(0);
    assert!(
        schema >= 36,
        "schemaVersion {schema} is older than Grafana 9"
    );
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    assert!(
        variables
            .iter()
            .any(|v| v["type"] == "datasource" && v["name"] == "DS_PROMETHEUS"),
        "no datasource variable DS_PROMETHEUS"
    );

    let mut ids = HashSet::new();
    let mut queries = 0;
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or("?");
        let id = panel["id"]
            .as_i64()
            .unwrap_or_else(|| panic!("{title}: no id"));
        assert!(ids.insert(id), "panel id {id} ({title}) is not unique");
        // A row only groups panels; it queries nothing.
        if panel["type"] == "row" {
            continue;
        }
        let targets = panel["targets"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        assert!(!targets.is_empty(), "panel {title} has no target");
        for target in targets {
            let expr = target["expr"].as_str().unwrap_or("");
            assert!(
                !expr.trim().is_empty(),
                "panel {title} has a target without expr"
            );
            assert_eq!(
                target["datasource"]["uid"], "${DS_PROMETHEUS}",
                "panel {title} does not query through the datasource variable"
            );
            queries += 1;
        }
    }
    assert!(queries >= 20, "only {queries} queries");

    // promtool parses PromQL only inside rule files: one recording rule per query, with the
    // Grafana variables replaced by what they expand to.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (n, expr) in dashboard_exprs(&dashboard).iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$job", ".*")
            .replace("$consumer", ".*");
        let quoted = serde_json::to_string(&expr).expect("a string serialises");
        rules.push_str(&format!(
            "      - record: dashboard:query_{n}\n        expr: {quoted}\n"
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard.rules.yml");
    std::fs::write(&file, rules).unwrap();
    let check = promtool(&["check", "rules", file.to_str().unwrap()], None);
    assert_success("promtool check rules on the dashboard's queries", &check);
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_name_is_exported_by_the_code() {
    let exported = exported_names();
    // The scan itself must see the names it is meant to see, or the check below proves nothing.
    for name in [
        "handoff_outbox_pending",
        "handoff_outbox_oldest_pending_age_seconds",
        "handoff_events_published_total",
        "handoff_relay_ack_seconds",
        "handoff_consumer_applied_total",
        "handoff_consumer_apply_seconds",
        "handoff_cdc_slot_status",
        "handoff_cdc_safe_wal_bytes",
        "handoff_sagas",
    ] {
        assert!(
            exported.contains(name),
            "{name} not found in {METRIC_SOURCES:?}"
        );
    }

    let rules = read("deploy/prometheus/alerts.yml");
    let dashboard = dashboard();
    let sources = [
        ("deploy/prometheus/alerts.yml", handoff_names(&rules)),
        (
            "deploy/grafana/handoff.json",
            handoff_names(&dashboard_exprs(&dashboard).join("\n")),
        ),
    ];
    for (file, used) in &sources {
        assert!(used.len() >= 8, "{file}: only {used:?}");
        let unknown: Vec<_> = used.iter().filter(|n| !is_exported(&exported, n)).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics the code does not export: {unknown:?}\nexported: {exported:?}"
        );
    }
}

#[test]
fn histogram_series_count_as_their_histogram_and_nothing_else_does() {
    let exported: BTreeSet<String> = ["handoff_relay_ack_seconds".to_owned()].into();
    assert!(is_exported(&exported, "handoff_relay_ack_seconds_bucket"));
    assert!(is_exported(&exported, "handoff_relay_ack_seconds_count"));
    assert!(!is_exported(&exported, "handoff_relay_ack_second_bucket"));
    assert_eq!(
        handoff_names("rate(handoff_a_total[5m]) / x_handoff_b + handoff_c{job=\"d\"}"),
        ["handoff_a_total".to_owned(), "handoff_c".to_owned()].into()
    );
}

/// One sample of the text exposition format: name, labels as written, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: String,
    value: f64,
}

/// Reads the sample lines of a Prometheus text exposition; `Err` names the first line that is
/// not one. promtool lints the same text; this is only to read values.
fn parse_exposition(text: &str) -> Result<Vec<Sample>, String> {
    let mut samples = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, rest) = match line.find('{') {
            Some(_) => {
                let close = line
                    .rfind('}')
                    .ok_or_else(|| format!("unclosed labels: {line}"))?;
                (&line[..close + 1], &line[close + 1..])
            }
            None => line
                .split_once(' ')
                .ok_or_else(|| format!("no value: {line}"))?,
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, labels)) => (name, labels.trim_end_matches('}')),
            None => (series, ""),
        };
        let value = rest
            .split_whitespace()
            .next()
            .ok_or_else(|| format!("no value: {line}"))?;
        let value: f64 = value
            .parse()
            .map_err(|e| format!("bad value {value:?} ({e}): {line}"))?;
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            return Err(format!("bad metric name: {line}"));
        }
        samples.push(Sample {
            name: name.to_owned(),
            labels: labels.to_owned(),
            value,
        });
    }
    Ok(samples)
}

/// The sum over every series of `name`, or `None` when the exposition has none.
fn value(samples: &[Sample], name: &str) -> Option<f64> {
    let mut series = samples.iter().filter(|s| s.name == name).peekable();
    series.peek()?;
    Some(series.map(|s| s.value).sum())
}

#[tokio::test]
async fn a_running_relay_serves_the_backlog_and_publish_metrics_the_alerts_query() {
    let (db, outbox) = migrated("deploy_scrape").await;
    let _client = prepare_shared_server().await;
    let stream = unique_name("scrape");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream,
    };

    // Seven events over agg-0..agg-2; agg-0's first (event 3) is held for an operator, so it and
    // agg-0's second (event 6) stay pending and the other five are published.
    enqueue_spread(&db.pool, &outbox, 1, 7, 3).await;
    let held = sqlx::query(
        "UPDATE outbox SET available_at = 'infinity', last_error = 'held by the test'
         WHERE aggregate_id = 'agg-0' AND aggregate_sequence = 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(held.rows_affected(), 1);

    let addr = free_addr();
    let relay = RelayProcess::start(
        &target,
        "scrape-relay",
        &["--metrics-addr", &addr.to_string(), "--stuck-after", "1s"],
        &[],
    );
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/metrics");

    // The backlog gauges are read every 5 s, so wait for a scrape that shows the settled state.
    let deadline = Instant::now() + Duration::from_secs(45);
    let (text, samples) = loop {
        let last = match http.get(&url).send().await {
            Ok(response) if response.status().is_success() => {
                let text = response.text().await.unwrap();
                let samples = parse_exposition(&text)
                    .unwrap_or_else(|e| panic!("/metrics is not the text format: {e}\n{text}"));
                let settled = value(&samples, "handoff_events_published_total") == Some(5.0)
                    && value(&samples, "handoff_outbox_pending") == Some(2.0)
                    && value(&samples, "handoff_quarantined_events") == Some(1.0)
                    && value(&samples, "handoff_outbox_stuck_aggregates") == Some(1.0);
                if settled {
                    break (text, samples);
                }
                text
            }
            Ok(response) => format!("status {}", response.status()),
            Err(error) => error.to_string(),
        };
        assert!(
            Instant::now() < deadline,
            "the metrics never showed 5 published, 2 pending, 1 held, 1 stuck:\n{last}\n\
             relay log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let lint = promtool(&["check", "metrics"], Some(text.as_bytes()));
    assert_success(&format!("promtool check metrics on\n{text}\n"), &lint);

    let age = value(&samples, "handoff_outbox_oldest_pending_age_seconds")
        .expect("handoff_outbox_oldest_pending_age_seconds");
    assert!(age >= 1.0, "the held event's age is {age} s");
    assert_eq!(value(&samples, "handoff_outbox_expired_leases"), Some(0.0));
    assert_eq!(
        value(&samples, "handoff_relay_broker_up"),
        Some(1.0),
        "the broker gauge exists from the start, not only after an outage"
    );
    let bytes = value(&samples, "handoff_outbox_table_bytes").expect("handoff_outbox_table_bytes");
    assert!(bytes > 0.0, "the outbox table has a size: {bytes}");
    let acks = samples
        .iter()
        .find(|s| s.name == "handoff_relay_ack_seconds_count")
        .map(|s| s.value);
    assert_eq!(acks, Some(5.0), "one ack latency per published event");
    assert!(
        samples
            .iter()
            .any(|s| s.name == "handoff_relay_ack_seconds_bucket" && s.labels.contains("le=")),
        "the ack latency is a histogram with buckets, as the dashboard's quantiles need"
    );

    let published: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(published, 5, "the counter matches the outbox");

    // Every handoff_* series the relay serves is one the source scan knows, so the name check
    // above covers what a relay really exports.
    let exported = exported_names();
    let served: BTreeSet<&str> = samples.iter().map(|s| s.name.as_str()).collect();
    for name in served.iter().filter(|n| n.starts_with("handoff_")) {
        assert!(
            is_exported(&exported, name),
            "the relay serves {name}, which the source scan misses"
        );
    }
}

/// `deploy/relay.example.toml`, the sample relay config file, is one the relay accepts as it
/// is, and names every key of the config file (set or commented out).
#[test]
fn the_example_relay_config_is_accepted() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let output = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .current_dir(&root)
        .args([
            "relay",
            "--check-config",
            "--config",
            "deploy/relay.example.toml",
        ])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let example = std::fs::read_to_string(root.join("deploy/relay.example.toml")).unwrap();
    let reference = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .arg("reference")
        .env_clear()
        .output()
        .unwrap();
    let reference = String::from_utf8(reference.stdout).unwrap();
    // The relay's table rows: `| flag | env | `key` ... |`.
    let relay = reference
        .split("\n## ")
        .find(|section| section.starts_with("`handoff relay`"))
        .unwrap();
    let keys: Vec<&str> = relay
        .lines()
        .filter_map(|row| row.split(" | ").nth(2))
        .filter_map(|cell| cell.strip_prefix('`'))
        .filter_map(|cell| cell.split('`').next())
        .filter(|key| !key.is_empty() && *key != "Config key")
        .collect();
    assert!(keys.len() > 30, "{keys:?}");
    for key in keys {
        let named = example.lines().any(|line| {
            let line = line.trim_start_matches(['#', ' ']);
            // `key = ...`, or a table's `[kafka]`.
            line.starts_with(&format!("{key} =")) || (key.starts_with('[') && line.starts_with(key))
        });
        assert!(
            named,
            "deploy/relay.example.toml does not name the key {key}"
        );
    }
}
