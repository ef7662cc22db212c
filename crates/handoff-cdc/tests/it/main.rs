//! The integration tests of `handoff-cdc`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p handoff-cdc --test it order::`.

mod common;

mod order;
mod poison;
mod reconnect;
mod restart;
mod source_conformance;
mod stream;
mod tls;
mod wal;
