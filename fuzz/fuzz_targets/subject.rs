//! `cargo fuzz run subject`: see [`handoff_fuzz::subject`] and docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = handoff_fuzz::subject(data);
});
