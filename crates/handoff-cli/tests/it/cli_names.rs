//! One name per concept across the binaries: the `handoff` commands' help shows a flag or a
//! variable under its one name (`handoff_telemetry::env`), never beside its older spelling,
//! which still works as a hidden alias; and `handoff relay -h` fits 100 columns, under headings.
//! The reference consumers hold their own help to the same rule
//! (examples/consumers/tests/it/cli_names.rs).

use std::process::Command;

use handoff_telemetry::env::{FALLBACKS, FLAG_ALIASES};

/// The help `handoff <path> <flag>` prints, with an empty environment (no variable's value
/// shows in it).
fn help(path: &[&str], flag: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(path)
        .arg(flag)
        .env_clear()
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "handoff {path:?} {flag}: {output:?}"
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

/// The words of `text` that can be a flag or a variable.
fn words(text: &str) -> Vec<&str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .filter(|w| !w.is_empty())
        .collect()
}

/// Refuses a help that shows both spellings of one concept.
pub fn assert_one_name_per_concept(what: &str, help: &str) {
    let words = words(help);
    let pairs = FLAG_ALIASES.iter().chain(FALLBACKS);
    for (name, old) in pairs {
        assert!(
            !(words.contains(name) && words.contains(old)),
            "{what} shows both {name} and its older spelling {old}:\n{help}"
        );
    }
}

#[test]
fn every_handoff_command_shows_one_name_per_concept() {
    let mut pending: Vec<Vec<String>> = vec![Vec::new()];
    let mut seen = 0;
    while let Some(path) = pending.pop() {
        let path_str: Vec<&str> = path.iter().map(String::as_str).collect();
        for flag in ["-h", "--help"] {
            let text = help(&path_str, flag);
            assert_one_name_per_concept(&format!("handoff {} {flag}", path.join(" ")), &text);
            if flag == "-h" {
                for sub in subcommands(&text) {
                    let mut next = path.clone();
                    next.push(sub);
                    pending.push(next);
                }
            }
        }
        seen += 1;
    }
    // The root, its commands and their own subcommands (quarantine list, cdc setup, ...).
    assert!(seen > 20, "only {seen} commands found");
    // The consistent names are the ones shown.
    let relay = help(&["relay"], "--help");
    for name in [
        "--destination",
        "--amqp-url",
        "--kafka-brokers",
        "HANDOFF_DATABASE_URL",
        "HANDOFF_NATS_URL",
        "HANDOFF_AMQP_URL",
        "HANDOFF_REDIS_URL",
    ] {
        assert!(
            words(&relay).contains(&name),
            "handoff relay --help lacks {name}"
        );
    }
    let quarantine = help(&["consumer", "quarantine", "list"], "--help");
    assert!(
        words(&quarantine).contains(&"--consumer-name"),
        "{quarantine}"
    );
}

#[test]
fn relay_short_help_fits_100_columns_under_headings() {
    let text = help(&["relay"], "-h");
    for line in text.lines() {
        assert!(
            line.chars().count() <= 100,
            "a line of `handoff relay -h` is {} columns:\n{line}",
            line.chars().count()
        );
    }
    for heading in [
        "Configuration:",
        "Database:",
        "Relay:",
        "Destination:",
        "NATS:",
        "Kafka:",
        "AMQP:",
        "HTTP:",
        "Redis:",
        "Observability:",
    ] {
        assert!(
            text.lines().any(|line| line == heading),
            "`handoff relay -h` has no {heading} heading:\n{text}"
        );
    }
    // The details are in --help.
    assert!(help(&["relay"], "--help").len() > text.len());
}

#[test]
fn older_spellings_still_work() {
    // `--url` and `--brokers` are read as `--amqp-url` and `--kafka-brokers`, and the older
    // variables where the HANDOFF_ ones are not set: --check-config connects to nothing.
    let check = |args: &[&str], env: &[(&str, &str)]| {
        let output = Command::new(env!("CARGO_BIN_EXE_handoff"))
            .args(["relay", "--check-config"])
            .args(args)
            .env_clear()
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let database = ("DATABASE_URL", "postgres://u@127.0.0.1:1/db");
    let (code, stderr) = check(
        &["--destination", "amqp", "--url", "amqp://h:5672/%2f"],
        &[database],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = check(
        &["--destination", "kafka", "--brokers", "k:9092"],
        &[database],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = check(
        &["--destination", "kafka"],
        &[database, ("HANDOFF_BROKERS", "k:9092")],
    );
    assert_eq!(code, Some(0), "{stderr}");
    // No database at all: the message names the one variable.
    let (code, stderr) = check(&[], &[]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("HANDOFF_DATABASE_URL"), "{stderr}");
    // The HANDOFF_ variable wins over the older one.
    let (code, stderr) = check(
        &[],
        &[
            ("DATABASE_URL", "postgres:///db"),
            ("HANDOFF_DATABASE_URL", "postgres://u@127.0.0.1:1/db"),
        ],
    );
    assert_eq!(code, Some(0), "{stderr}");
}

/// `migrate --check` speaks the exit codes of `status` and `reconcile`: 0 current, 2 needs
/// attention (migrations pending), 1 an error.
#[tokio::test]
async fn migrate_check_exits_2_while_migrations_are_pending() {
    let db = handoff_test::TestDb::new("cli_names_migrate_check").await;
    let check = crate::common::handoff(&db, &["migrate", "--check"]);
    assert_eq!(check.status.code(), Some(2), "{check:?}");
    assert!(
        String::from_utf8_lossy(&check.stdout).contains("handoff migrate"),
        "{check:?}"
    );
    let migrate = crate::common::handoff(&db, &["migrate"]);
    assert!(migrate.status.success(), "{migrate:?}");
    let check = crate::common::handoff(&db, &["migrate", "--check"]);
    assert_eq!(check.status.code(), Some(0), "{check:?}");
    let unreachable = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["migrate", "--check"])
        .env_clear()
        .env("HANDOFF_DATABASE_URL", "postgres://u@127.0.0.1:1/db")
        .output()
        .unwrap();
    assert_eq!(unreachable.status.code(), Some(1), "{unreachable:?}");
}
