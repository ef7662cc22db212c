//! The integration tests of `chaos`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p chaos --test it backlog::`.

mod common;

mod backlog;
mod check;
mod drills;
mod network;
mod run;
mod write_windows;
