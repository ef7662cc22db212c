//! The integration tests of `handoff-relay`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p handoff-relay --test it broker_errors::`.

mod common;

mod broker_errors;
mod fencing;
mod in_flight_bytes;
mod marks;
mod source_errors;
