//! The integration tests of `handoff-consumer`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p handoff-consumer --test it batch::`.

mod common;

mod batch;
mod bounded;
mod external;
mod gaps;
mod inbox;
mod quarantine;
mod quarantine_retry;
mod skip_marker;
#[cfg(feature = "otel")]
mod trace;
