//! The committed corpus of the `database_url` fuzz target (`fuzz/corpus/database_url/`) through
//! the target's own function (`fuzz/src/database_url.rs`), in the normal test suite: no URL
//! panics, every refusal is typed, and a seed whose file name starts with an expectation gets
//! it (see docs/fuzzing.md): `ok.` accepted, `unusable.` refused as a URL sqlx parses but
//! cannot use (`DatabaseUrlError`), `refused.` refused otherwise. No server is needed.

use std::fs;
use std::path::PathBuf;

#[allow(dead_code)]
#[path = "../../../../fuzz/src/database_url.rs"]
mod harness;

use harness::UrlOutcome;

#[test]
fn every_database_url_seed_parses_as_its_name_says_without_panicking() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/database_url");
    let mut seeds: Vec<(String, Vec<u8>)> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            (name, fs::read(entry.path()).unwrap())
        })
        .collect();
    seeds.sort();
    let mut checked = 0;
    for (name, data) in &seeds {
        let got = match harness::database_url(data) {
            UrlOutcome::Accepted => "ok",
            UrlOutcome::Unusable => "unusable",
            UrlOutcome::Refused => "refused",
        };
        if let Some((expected, _)) = name.split_once('.') {
            if ["ok", "unusable", "refused"].contains(&expected) {
                assert_eq!(got, expected, "{name}: {}", String::from_utf8_lossy(data));
                checked += 1;
            }
        }
    }
    assert!(
        checked >= 20,
        "only {checked} database url seeds name an expectation"
    );
}
