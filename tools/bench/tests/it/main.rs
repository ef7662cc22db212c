//! The `handoff-bench` binary as a user runs it: every benchmark the docs name is a command.
//!
//! Also what makes a workspace test run build the binary: the CLI's flag inventory
//! (`crates/handoff-cli/tests/it/flag_names.rs`) reads its `--help`.

use std::process::Command;

/// `handoff-bench --help` lists each benchmark `docs/benchmarks.md` has a section for.
#[test]
fn every_documented_benchmark_is_a_command() {
    let help = Command::new(env!("CARGO_BIN_EXE_handoff-bench"))
        .arg("--help")
        .output()
        .expect("run handoff-bench --help");
    assert!(help.status.success(), "{help:?}");
    let help = String::from_utf8_lossy(&help.stdout);
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/benchmarks.md"
    ))
    .expect("docs/benchmarks.md");
    // The first column of the figures table: [`name`](#anchor).
    let documented: Vec<&str> = page
        .lines()
        .filter_map(|line| line.strip_prefix("| [`"))
        .filter_map(|rest| rest.split('`').next())
        .collect();
    assert!(documented.len() > 10, "{documented:?}");
    for name in documented {
        assert!(
            help.lines()
                .any(|line| line.trim_start().starts_with(&format!("{name} "))),
            "docs/benchmarks.md documents `{name}`, which handoff-bench --help does not list:\n{help}"
        );
    }
}
