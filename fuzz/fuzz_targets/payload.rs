//! `cargo fuzz run payload`: see [`handoff_fuzz::payload`] and docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = handoff_fuzz::payload(data);
});
