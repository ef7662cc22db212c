//! `--kafka-option` on the reference consumers: a malformed or reserved option ends the start
//! with a usage error that says why and never echoes the value.

use std::process::Command;

fn inventory(option: &str) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_inventory"))
        .args(["--broker", "kafka", "--kafka-option", option])
        .env("DATABASE_URL", "postgres://127.0.0.1:1/none")
        .output()
        .expect("run inventory");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn a_malformed_or_reserved_kafka_option_is_refused_without_its_value() {
    let (ok, stderr) = inventory("sasl.password:hunter2");
    assert!(!ok);
    assert!(stderr.contains("KEY=VALUE"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");

    let (ok, stderr) = inventory("acks=0");
    assert!(!ok);
    assert!(stderr.contains("acks=all"), "{stderr}");

    let (ok, stderr) = inventory("=hunter2");
    assert!(!ok);
    assert!(!stderr.contains("hunter2"), "{stderr}");
}
