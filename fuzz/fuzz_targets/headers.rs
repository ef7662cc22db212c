//! `cargo fuzz run headers`: see [`handoff_fuzz::headers`] and docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = handoff_fuzz::headers(data);
});
