//! One name per concept: the reference consumers' help shows each flag and variable under the
//! name the relay uses (`handoff_telemetry::env`), never beside its older spelling, which still
//! works as a hidden alias.

use std::process::Command;

use handoff_telemetry::env::{FALLBACKS, FLAG_ALIASES};

/// The binaries' help, `-h` and `--help`, with an empty environment.
fn helps() -> Vec<(String, String)> {
    let binaries = [
        ("inventory", env!("CARGO_BIN_EXE_inventory")),
        ("payments", env!("CARGO_BIN_EXE_payments")),
        ("payment-provider", env!("CARGO_BIN_EXE_payment-provider")),
    ];
    let mut helps = Vec::new();
    for (name, path) in binaries {
        for flag in ["-h", "--help"] {
            let output = Command::new(path).arg(flag).env_clear().output().unwrap();
            assert!(output.status.success(), "{name} {flag}: {output:?}");
            helps.push((
                format!("{name} {flag}"),
                String::from_utf8(output.stdout).unwrap(),
            ));
        }
    }
    helps
}

/// The words of `text` that can be a flag or a variable.
fn words(text: &str) -> Vec<&str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .filter(|w| !w.is_empty())
        .collect()
}

#[test]
fn the_consumers_show_one_name_per_concept() {
    for (what, help) in helps() {
        let words = words(&help);
        for (name, old) in FLAG_ALIASES.iter().chain(FALLBACKS) {
            assert!(
                !(words.contains(name) && words.contains(old)),
                "{what} shows both {name} and its older spelling {old}:\n{help}"
            );
        }
        if what.starts_with("inventory") || what.starts_with("payments") {
            for name in [
                "--destination",
                "--kafka-brokers",
                "--amqp-url",
                "--consumer-name",
                "HANDOFF_DATABASE_URL",
                "HANDOFF_NATS_URL",
            ] {
                assert!(words.contains(&name), "{what} lacks {name}:\n{help}");
            }
        }
    }
}

#[test]
fn the_older_spellings_still_parse() {
    // A bad --gap-policy fails after the older spellings were accepted: no broker is needed.
    let output = Command::new(env!("CARGO_BIN_EXE_inventory"))
        .args([
            "--broker",
            "kafka",
            "--brokers",
            "k:9092",
            "--gap-policy",
            "nope",
        ])
        .env_clear()
        .env("DATABASE_URL", "postgres://u@127.0.0.1:1/db")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--gap-policy"), "{stderr}");
}
