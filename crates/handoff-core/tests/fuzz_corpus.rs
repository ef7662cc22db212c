//! The committed fuzz corpus (`fuzz/corpus/<target>/`) through the fuzz targets' own functions
//! (`fuzz/src/lib.rs`), in the normal test suite: no input panics, each result is typed, and a
//! seed whose file name starts with an expectation gets it (see docs/fuzzing.md):
//!
//! - `payload`: `ok.` accepted, `<ValidationErrorKind>.` refused with that kind;
//! - `headers`: `ok.` read as an event, `malformed.` quarantined as malformed, `any.` either;
//! - `subject`: `ok.` decodes to an id validation accepts, `<ValidationErrorKind>.` decodes to
//!   an id refused with that kind, `invalid.` does not decode.
//!
//! Files without one of these prefixes (inputs a fuzz run found and someone committed) are
//! only checked not to panic and to keep the targets' invariants.

use std::fs;
use std::path::PathBuf;

#[allow(dead_code)]
#[path = "../../../fuzz/src/lib.rs"]
mod harness;

use harness::TokenOutcome;

/// Every file of `fuzz/corpus/<target>/`, as (file name, bytes), sorted by name.
fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<(String, Vec<u8>)> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            (name, fs::read(entry.path()).unwrap())
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "the {target} corpus has {} files",
        files.len()
    );
    files
}

/// The expectation a seed's name starts with (`ok` in `ok.object`), if any.
fn expectation(name: &str) -> Option<&str> {
    name.split_once('.').map(|(prefix, _)| prefix)
}

#[test]
fn every_payload_seed_validates_as_its_name_says_without_panicking() {
    let mut checked = 0;
    for (name, data) in corpus("payload") {
        let kind = harness::payload(&data);
        let got = kind.map_or_else(|| "ok".to_owned(), |k| format!("{k:?}"));
        if let Some(expected) = expectation(&name) {
            assert_eq!(got, expected, "{name}");
            checked += 1;
        }
    }
    assert!(
        checked >= 30,
        "only {checked} payload seeds name an expectation"
    );
}

#[test]
fn every_header_seed_reads_as_its_name_says_without_panicking() {
    let mut checked = 0;
    for (name, data) in corpus("headers") {
        let read = harness::headers(&data);
        match expectation(&name) {
            Some("ok") => {
                read.unwrap_or_else(|m| panic!("{name}: {}", m.reason));
            }
            Some("malformed") => {
                let malformed = read.expect_err(&name);
                assert_eq!(malformed.location, harness::LOCATION, "{name}");
            }
            _ => continue,
        }
        checked += 1;
    }
    assert!(
        checked >= 20,
        "only {checked} header seeds name an expectation"
    );
}

#[test]
fn the_known_hostile_headers_are_refused_with_a_reason() {
    let seed = |name: &str| {
        corpus("headers")
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("seed {name} is missing"))
            .1
    };
    for (name, says) in [
        ("malformed.sequence-beyond-i64", "Handoff-Sequence"),
        ("malformed.huge-sequence", "Handoff-Sequence"),
        ("malformed.ce-id-not-uuid", "not a UUID"),
        (
            "malformed.aggregate-id-invalid-utf8",
            "Handoff-Aggregate-Id",
        ),
        ("malformed.body-invalid-utf8", "UTF-8"),
    ] {
        let malformed = harness::headers(&seed(name)).expect_err(name);
        assert!(
            malformed.reason.contains(says),
            "{name}: {}",
            malformed.reason
        );
    }
}

#[test]
fn every_subject_seed_decodes_as_its_name_says_without_panicking() {
    let mut checked = 0;
    for (name, data) in corpus("subject") {
        let got = match harness::subject(&data) {
            TokenOutcome::Decoded(_, None) => "ok".to_owned(),
            TokenOutcome::Decoded(_, Some(kind)) => format!("{kind:?}"),
            TokenOutcome::Invalid => "invalid".to_owned(),
        };
        if let Some(expected) = expectation(&name) {
            assert_eq!(got, expected, "{name}");
            checked += 1;
        }
    }
    assert!(
        checked >= 15,
        "only {checked} subject seeds name an expectation"
    );
}
