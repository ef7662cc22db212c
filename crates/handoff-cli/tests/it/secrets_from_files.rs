//! Secrets from files: `DATABASE_URL_FILE` names a file holding the database URL (the
//! container-secrets convention); with `DATABASE_URL` also set, or an unreadable file, the
//! command stops with one line that names the variable and the file, never the content.

use std::process::{Command, Output};

use handoff_test::TestDb;

/// `handoff status --json` with exactly the environment given (no `DATABASE_URL` inherited).
fn status(env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_handoff"));
    command
        .args(["status", "--json"])
        .env_remove("DATABASE_URL")
        .env_remove("DATABASE_URL_FILE")
        .env("RUST_LOG", "warn");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("run handoff")
}

fn text(output: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[tokio::test]
async fn status_reads_the_database_url_from_database_url_file() {
    let db = TestDb::migrated("secrets_file_status").await;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("database_url");
    // As `echo "$URL" > file` writes it: with a trailing newline.
    std::fs::write(&secret, format!("{}\n", db.url())).unwrap();
    let secret_path = secret.to_str().unwrap();

    let ok = status(&[("DATABASE_URL_FILE", secret_path)]);
    assert_eq!(ok.status.code(), Some(0), "{}", text(&ok));
    let report: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert_eq!(report["pending"], 0, "{report}");

    // Both set: which one is meant is a guess, so neither is used.
    let both = status(&[
        ("DATABASE_URL_FILE", secret_path),
        ("DATABASE_URL", &db.url()),
    ]);
    assert_eq!(both.status.code(), Some(1), "{}", text(&both));
    assert_eq!(
        String::from_utf8_lossy(&both.stderr).trim_end(),
        "error: both DATABASE_URL and DATABASE_URL_FILE are set; set only one of them"
    );

    // An unreadable file is named; a secret's content never appears.
    let missing = dir.path().join("missing");
    let unreadable = status(&[("DATABASE_URL_FILE", missing.to_str().unwrap())]);
    assert_eq!(unreadable.status.code(), Some(1), "{}", text(&unreadable));
    let stderr = String::from_utf8_lossy(&unreadable.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "error: cannot read DATABASE_URL_FILE ({}): ",
            missing.display()
        )),
        "{stderr}"
    );
}
