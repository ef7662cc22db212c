//! A database URL sqlx parses but cannot use (a slash lost in a template) stops every command
//! that takes one with one `error:` line and exit status 1, as other bad configuration does,
//! instead of a panic and its backtrace.

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
