//! A database URL sqlx parses but cannot use (a slash lost in a template) stops every command
//! that takes one with one `error:` line and exit status 1, as other bad configuration does,
//! instead of a panic and its backtrace; and so does a hostile config file or flag value,
//! checked with `handoff relay --check-config`.

use std::process::Command;

/// URLs sqlx reads but would panic on when it writes them back (see
/// `handoff_postgres::DatabaseUrlError`); none needs a server.
const UNUSABLE: [&str; 4] = [
    "postgresql:/@127.0.0.1:5432/db",
    "postgres:///db",
    "postgres://127.0.0.1/db?host=",
    "postgres://u:s3cret@127.0.0.1/db?host=a%20b",
];

#[test]
fn an_unusable_database_url_is_one_error_line_for_every_command() {
    let commands: [&[&str]; 5] = [
        &["relay"],
        &["status"],
        &["migrate"],
        &["migrate", "--check"],
        &["quarantine", "list"],
    ];
    for url in UNUSABLE {
        for command in commands {
            // Through the flag and through the environment: the relay reads both.
            for (flag, env) in [(true, false), (false, true)] {
                let mut handoff = Command::new(env!("CARGO_BIN_EXE_handoff"));
                handoff.args(command).env_remove("DATABASE_URL");
                if flag {
                    handoff.args(["--database-url", url]);
                }
                if env {
                    handoff.env("DATABASE_URL", url);
                }
                // No backtrace either way: set as an operator's shell may have it.
                let output = handoff.env("RUST_BACKTRACE", "1").output().unwrap();
                let stderr = String::from_utf8_lossy(&output.stderr);
                let what = format!("{command:?} with {url:?} (flag {flag})");
                assert_eq!(output.status.code(), Some(1), "{what}: {stderr}");
                assert!(!stderr.contains("panicked"), "{what}: {stderr}");
                let errors: Vec<_> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
                assert_eq!(errors.len(), 1, "{what}: one error line: {stderr}");
                assert!(
                    errors[0].contains("invalid database url")
                        && errors[0].contains("no usable host"),
                    "{what}: {stderr}"
                );
                assert!(!stderr.contains("s3cret"), "{what}: {stderr}");
            }
        }
    }
}

/// A relay config file that `--check-config` accepts: every value below is mutated in turn.
const VALID_CONFIG: &str = r#"database_url = "postgres://u:s3cret@127.0.0.1:1/db"
relay_id = "config-check"
schema = "handoff"
destination = "http"
endpoint = "http://127.0.0.1:1/events"
http_timeout = "5s"
lease = "30s"
publish_timeout = "5s"
poll_interval = "1s"
mark_interval = "5ms"
batch_size = 500
max_in_flight = 2000
max_in_flight_bytes = 33554432
max_attempts = 10
max_retry_after = "1h"
stuck_after = "60s"
query_timeout = "10s"
order = "aggregate"
source = "polling"
"#;

/// Values nobody means, for any key or flag.
const HOSTILE: [&str; 24] = [
    "-1",
    "0",
    "18446744073709551616",
    "1e309",
    "nan",
    r#""0s""#,
    r#""-5s""#,
    r#""99999999999999999999999s""#,
    r#""1ns""#,
    r#""584942417356y""#,
    r#""forever""#,
    r#""""#,
    r#""\u0000""#,
    r#""é\u202e""#,
    "true",
    "[1, 2]",
    "{ a = 1 }",
    "1979-05-27T07:32:00Z",
    r#""postgresql:/@127.0.0.1:5432/db""#,
    r#""http://[::1""#,
    r#""global""#,
    r#""logical""#,
    r#""kafka""#,
    r#""postgres://u:s3cret@127.0.0.1:1/db?sslmode=verify-full&sslrootcert=/nonexistent""#,
];

/// Mutates `base` once, as `rng` picks: a value swapped for a hostile one, a line dropped or
/// doubled, an unknown key, a truncation, or a byte flipped.
fn mutate(base: &str, rng: &mut fastrand::Rng) -> Vec<u8> {
    let mut lines: Vec<String> = base.lines().map(str::to_owned).collect();
    let at = rng.usize(..lines.len());
    match rng.u8(..6) {
        0 | 1 => {
            let key = lines[at].split(" = ").next().unwrap_or_default().to_owned();
            lines[at] = format!("{key} = {}", HOSTILE[rng.usize(..HOSTILE.len())]);
        }
        2 => {
            lines.remove(at);
        }
        3 => {
            let line = lines[at].clone();
            lines.insert(at, line);
        }
        4 => lines.insert(at, "lese = \"30s\"".into()),
        _ => {
            let mut bytes = lines.join("\n").into_bytes();
            let cut = rng.usize(..bytes.len());
            if rng.bool() {
                bytes.truncate(cut);
            } else {
                bytes[cut] = rng.u8(..);
            }
            return bytes;
        }
    }
    (lines.join("\n") + "\n").into_bytes()
}

/// What `handoff relay --check-config` makes of a config file (and `flags`).
fn check_config(file: &[u8], flags: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(&path, file).unwrap();
    Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["relay", "--check-config", "--config"])
        .arg(&path)
        .args(flags)
        .env_remove("DATABASE_URL")
        .env("HANDOFF_HTTP_SECRET", "")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap()
}

/// Accepted (0) or refused with one `error:` line (1; 2 for a flag value the command line's
/// parser refuses, as for any usage error), never a panic; the database password never shown
/// (unless `file` put it elsewhere than the database URL, such as into the relay id).
fn assert_clean(output: &std::process::Output, file: &[u8], what: &str) -> bool {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    let elsewhere = String::from_utf8_lossy(file)
        .lines()
        .any(|l| l.contains("s3cret") && !l.starts_with("database_url"));
    if !elsewhere {
        assert!(
            !stderr.contains("s3cret") && !stdout.contains("s3cret"),
            "{what}: {stderr}"
        );
    }
    match output.status.code() {
        Some(0) => true,
        Some(1 | 2) => {
            let errors = stderr.lines().filter(|l| l.starts_with("error:")).count();
            assert_eq!(errors, 1, "{what}: one error line: {stderr}");
            false
        }
        other => panic!("{what}: exit {other:?}: {stderr}"),
    }
}

/// The config file and the flags are read from whatever an operator (or a broken template)
/// writes: a few hundred seeded mutations of a valid file, and every hostile value on each
/// flag, each either accepted or refused with one error line; none panics or shows the
/// password. The seed is printed, and `HANDOFF_CONFIG_SEED` replays it.
#[test]
fn hostile_config_files_and_flags_are_one_error_line_never_a_panic() {
    let valid = VALID_CONFIG.as_bytes();
    assert!(assert_clean(
        &check_config(valid, &[]),
        valid,
        "the valid file"
    ));
    let seed = std::env::var("HANDOFF_CONFIG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    eprintln!("seed {seed} (HANDOFF_CONFIG_SEED={seed} replays it)");
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut refused = 0;
    for case in 0..300 {
        let file = mutate(VALID_CONFIG, &mut rng);
        let what = format!(
            "case {case} of seed {seed}:\n{}",
            String::from_utf8_lossy(&file)
        );
        if !assert_clean(&check_config(&file, &[]), &file, &what) {
            refused += 1;
        }
    }
    assert!(
        refused > 100,
        "{refused} of 300 mutations refused: the mutations miss"
    );
    for flag in [
        "--lease",
        "--batch-size",
        "--max-in-flight-bytes",
        "--poll-interval",
        "--order",
    ] {
        for value in HOSTILE {
            let value = value.trim_matches('"');
            let what = format!("{flag} {value:?}");
            assert_clean(
                &check_config(valid, &[flag, value]),
                value.as_bytes(),
                &what,
            );
        }
    }
}
