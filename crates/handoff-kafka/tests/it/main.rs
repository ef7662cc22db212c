//! The integration tests of `handoff-kafka`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p handoff-kafka --test it conformance::`.

mod conformance;
mod intake;
mod readback;
mod relay;
mod security;
mod transport;
