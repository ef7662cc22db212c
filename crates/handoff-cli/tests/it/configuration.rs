//! `docs/configuration.md` is what `handoff reference` renders from the flags' definitions:
//! a flag, variable, key or default changed in the code and not in the page fails here.
//! `HANDOFF_BLESS=1` rewrites the page instead.

use std::path::Path;
use std::process::Command;

#[test]
fn the_configuration_reference_is_generated_from_the_flags() {
    let output = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .arg("reference")
        .env_clear()
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let generated = String::from_utf8(output.stdout).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md");
    if std::env::var_os("HANDOFF_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let line = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()));
        panic!(
            "docs/configuration.md differs from `handoff reference` from line {}: rerun with \
             HANDOFF_BLESS=1 and commit the page\ncommitted: {:?}\ngenerated: {:?}",
            line + 1,
            committed.lines().nth(line),
            generated.lines().nth(line)
        );
    }
    // What the page must say, whatever the flags' wording.
    for needle in [
        "## `handoff relay`",
        "`--database-url <URL>`",
        "`HANDOFF_DATABASE_URL` (also `DATABASE_URL`)",
        "`--amqp-url <URL>` (alias `--url`)",
        "`amqp_url` (alias `url`)",
        "| `30s` |",
        "## `handoff migrate`",
        "## `handoff quarantine list`",
    ] {
        assert!(generated.contains(needle), "the reference lacks {needle:?}");
    }
}
