//! `cargo fuzz run database_url`: see `fuzz/src/database_url.rs` and docs/fuzzing.md.
#![no_main]

#[path = "../src/database_url.rs"]
mod database_url;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = database_url::database_url(data);
});
