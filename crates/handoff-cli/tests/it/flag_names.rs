//! One flag name per concept across every binary of the workspace: `handoff` and its commands,
//! the reference consumers, the example services, `handoff-chaos`, `handoff-bench` and
//! `handoff-demo`. The test lists every flag and variable each binary's `--help` shows (its
//! clap definitions, subcommands included) and fails on two spellings of one concept: an older
//! spelling still shown, two synonyms of one concept in use, one flag read from different
//! variables in different binaries, a variable not named after its flag, or a setting of a
//! long-running process that no variable can give.
//!
//! The other binaries are read from the directory `handoff` was built into: the workspace's
//! test run (`cargo nextest run --workspace`) builds them all; alone, build them first with
//! `cargo build --workspace --bins --all-features`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use handoff_telemetry::env::{FALLBACKS, FLAG_ALIASES};
use regex::Regex;

/// Every binary of the workspace.
const BINARIES: &[&str] = &[
    "handoff",
    "inventory",
    "payments",
    "payment-provider",
    "order-service",
    "saga-shop",
    "webhook-receiver",
    "handoff-chaos",
    "handoff-bench",
    "handoff-demo",
];

/// Spellings that name one concept: at most one of each group may be in use, anywhere.
const SYNONYMS: &[&[&str]] = &[
    &["--destination", "--broker", "--transport", "--sink"],
    &[
        "--kafka-brokers",
        "--brokers",
        "--bootstrap-servers",
        "--kafka-bootstrap",
    ],
    &["--amqp-url", "--url", "--rabbitmq-url"],
    &[
        "--consumer-name",
        "--consumer",
        "--durable",
        "--durable-name",
    ],
    &[
        "--database-url",
        "--db-url",
        "--postgres-url",
        "--pg-url",
        "--db",
    ],
    &["--nats-url", "--nats", "--nats-server"],
    &["--redis-url", "--redis"],
    &[
        "--metrics-addr",
        "--metrics-address",
        "--metrics-listen",
        "--metrics-port",
    ],
    &[
        "--inbox-batch-wait",
        "--inbox-batch-wait-ms",
        "--batch-wait",
    ],
    &[
        "--inbox-batch-events",
        "--inbox-batch-size",
        "--batch-events",
    ],
    &["--subject-prefix", "--prefix", "--nats-prefix"],
    &["--schema", "--search-path", "--pg-schema"],
    &["--otlp-endpoint", "--otel-endpoint", "--otlp-url"],
    &["--relay-id", "--relay-name"],
];

/// Variables named after the application that reads them rather than after handoff: example
/// services run side by side, each with its own.
const APP_PREFIXES: &[&str] = &["ORDER_SERVICE_", "PAYMENT_PROVIDER_", "SHOP_", "OTEL_"];

/// `HANDOFF_` variables not named `HANDOFF_<FLAG>`, each for a reason: the console's settings
/// carry its name (the relay's `--stuck-after` is another setting), and the consumers'
/// `--concurrency` says whose.
const NAMED_OTHERWISE: &[(&str, &str)] = &[
    ("--concurrency", "HANDOFF_CONSUMER_CONCURRENCY"),
    ("--listen", "HANDOFF_CONSOLE_LISTEN"),
    ("--config", "HANDOFF_CONSOLE_CONFIG"),
    ("--auth-token-file", "HANDOFF_CONSOLE_AUTH_TOKEN_FILE"),
    (
        "--trusted-user-header",
        "HANDOFF_CONSOLE_TRUSTED_USER_HEADER",
    ),
    ("--read-only", "HANDOFF_CONSOLE_READ_ONLY"),
    ("--trusted-proxy", "HANDOFF_CONSOLE_TRUSTED_PROXY"),
    ("--secure-cookies", "HANDOFF_CONSOLE_SECURE_COOKIES"),
    ("--sample-interval", "HANDOFF_CONSOLE_SAMPLE_INTERVAL"),
    ("--stuck-after", "HANDOFF_CONSOLE_STUCK_AFTER"),
    ("--max-payload-bytes", "HANDOFF_CONSOLE_MAX_PAYLOAD_BYTES"),
    ("--max-pending-age", "HANDOFF_CONSOLE_MAX_PENDING_AGE"),
];

/// Flags spelt like an older name of another concept, each for a reason: the console's
/// `--consumer NAME=URL` names a consumer's database to act on (its documented contract), not
/// the consumer name a consumer runs under (`--consumer-name`).
const OTHER_CONCEPTS: &[(&str, &str)] = &[("handoff console", "--consumer")];

/// Long-running processes: every setting that takes a value can come from a variable (a
/// container's configuration), but repeatable ones whose values cannot share one variable
/// (`--kafka-option`, read from the config file's `[kafka]` table instead; the console's
/// `--consumer NAME=URL`, whose URLs may hold any character).
const PROCESSES: &[&str] = &["handoff relay", "handoff console", "inventory", "payments"];
const REPEATABLE: &[&str] = &["--kafka-option", "--consumer"];

#[derive(Debug, Clone)]
struct Flag {
    /// The binary and subcommand path, `handoff quarantine list`.
    command: String,
    name: String,
    takes_value: bool,
    env: Option<String>,
}

fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_handoff"))
        .parent()
        .unwrap()
        .to_owned()
}

fn help(binary: &Path, path: &[String]) -> String {
    let output = Command::new(binary)
        .args(path)
        .arg("--help")
        .env_clear()
        .output()
        .unwrap_or_else(|e| panic!("{} {path:?} --help: {e}", binary.display()));
    assert!(
        output.status.success(),
        "{} {path:?} --help: {output:?}",
        binary.display()
    );
    String::from_utf8(output.stdout).unwrap()
}

/// The subcommands a help lists under `Commands:`, but `help`.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| !line.trim().is_empty())
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// The flags a `--help` shows, each with the variable its `[env: ...]` names.
fn flags(command: &str, help: &str) -> Vec<Flag> {
    // clap indents a flag by 2 (with a short form) or 6 columns, its description by 10.
    let header =
        Regex::new(r"^ {2,6}(?:-\w, )?(--[a-z0-9][a-z0-9-]*)(?:[ =](<[^>]+>|\[[^\]]+\]))?")
            .unwrap();
    let env = Regex::new(r"\[env: ([A-Za-z0-9_]+)").unwrap();
    let mut found: Vec<Flag> = Vec::new();
    for line in help.lines() {
        if let Some(c) = header.captures(line) {
            found.push(Flag {
                command: command.to_owned(),
                name: c[1].to_owned(),
                takes_value: c.get(2).is_some(),
                env: None,
            });
        }
        if let (Some(last), Some(c)) = (found.last_mut(), env.captures(line)) {
            last.env.get_or_insert_with(|| c[1].to_owned());
        }
    }
    found
        .into_iter()
        .filter(|f| f.name != "--help" && f.name != "--version")
        .collect()
}

/// Every flag of every binary, subcommands included.
fn inventory() -> Vec<Flag> {
    let dir = bin_dir();
    let mut all = Vec::new();
    for binary in BINARIES {
        let path = dir.join(binary);
        assert!(
            path.exists(),
            "{} is not built: run `cargo build --workspace --bins --all-features` first (the \
             workspace's test run builds it)",
            path.display()
        );
        let mut pending: Vec<Vec<String>> = vec![Vec::new()];
        while let Some(sub) = pending.pop() {
            let text = help(&path, &sub);
            let command = std::iter::once(binary.to_string())
                .chain(sub.iter().cloned())
                .collect::<Vec<_>>()
                .join(" ");
            all.extend(flags(&command, &text));
            for next in subcommands(&text) {
                let mut deeper = sub.clone();
                deeper.push(next);
                pending.push(deeper);
            }
        }
    }
    all
}

fn upper_snake(flag: &str) -> String {
    flag.trim_start_matches("--")
        .replace('-', "_")
        .to_uppercase()
}

#[test]
fn every_binary_spells_each_concept_one_way() {
    let flags = inventory();
    let commands: BTreeSet<&str> = flags.iter().map(|f| f.command.as_str()).collect();
    assert!(
        commands.len() > 40,
        "only {} commands found",
        commands.len()
    );
    let mut wrong = Vec::new();

    // An older spelling, as a flag or as the variable shown.
    for flag in &flags {
        let other_concept = OTHER_CONCEPTS.contains(&(flag.command.as_str(), flag.name.as_str()));
        for (name, old) in FLAG_ALIASES {
            if flag.name == *old && !other_concept {
                wrong.push(format!("{}: {old} shown (now {name})", flag.command));
            }
        }
        for (name, old) in FALLBACKS {
            if flag.env.as_deref() == Some(*old) {
                wrong.push(format!(
                    "{} {}: reads {old} (now {name}, with {old} as its fallback)",
                    flag.command, flag.name
                ));
            }
        }
    }

    // Two synonyms of one concept in use.
    let names: BTreeSet<&str> = flags
        .iter()
        .filter(|f| !OTHER_CONCEPTS.contains(&(f.command.as_str(), f.name.as_str())))
        .map(|f| f.name.as_str())
        .collect();
    for group in SYNONYMS {
        let used: Vec<&&str> = group.iter().filter(|s| names.contains(**s)).collect();
        if used.len() > 1 {
            wrong.push(format!("one concept, several spellings in use: {used:?}"));
        }
    }

    // One flag, one variable, wherever it is read (app-scoped variables apart).
    let app_scoped = |env: &str| APP_PREFIXES.iter().any(|p| env.starts_with(p));
    let mut by_flag: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let mut by_env: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for flag in &flags {
        if let Some(env) = flag.env.as_deref() {
            let named_otherwise = NAMED_OTHERWISE.contains(&(flag.name.as_str(), env));
            if !app_scoped(env) && !named_otherwise {
                by_flag.entry(&flag.name).or_default().insert(env);
            }
            by_env.entry(env).or_default().insert(&flag.name);
        }
    }
    for (flag, envs) in &by_flag {
        if envs.len() > 1 {
            wrong.push(format!("{flag} reads different variables: {envs:?}"));
        }
    }
    for (env, names) in &by_env {
        if names.len() > 1 {
            wrong.push(format!("{env} is read by different flags: {names:?}"));
        }
    }

    // Variables named after their flag.
    for flag in &flags {
        let Some(env) = flag.env.as_deref() else {
            continue;
        };
        if app_scoped(env) {
            continue;
        }
        let expected = format!("HANDOFF_{}", upper_snake(&flag.name));
        if env != expected && !NAMED_OTHERWISE.contains(&(flag.name.as_str(), env)) {
            wrong.push(format!(
                "{} {}: reads {env}, expected {expected}",
                flag.command, flag.name
            ));
        }
    }

    // Every setting of a long-running process has a variable.
    for flag in &flags {
        if PROCESSES.contains(&flag.command.as_str())
            && flag.takes_value
            && flag.env.is_none()
            && !REPEATABLE.contains(&flag.name.as_str())
        {
            wrong.push(format!("{} {}: no variable", flag.command, flag.name));
        }
    }

    wrong.sort();
    wrong.dedup();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The inventory itself: the help parser finds flags, their values and their variables.
#[test]
fn the_help_parser_reads_flags_values_and_variables() {
    let help = "Options:\n      --database-url <URL>\n          PostgreSQL URL\n          \
                [env: HANDOFF_DATABASE_URL=]\n  -q, --quiet\n          Say less\n";
    let found = flags("x", help);
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(found[0].name, "--database-url");
    assert!(found[0].takes_value);
    assert_eq!(found[0].env.as_deref(), Some("HANDOFF_DATABASE_URL"));
    assert_eq!(found[1].name, "--quiet");
    assert!(!found[1].takes_value);
    assert_eq!(found[1].env, None);
}
