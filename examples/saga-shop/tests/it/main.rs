//! The integration tests of `saga-shop`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p saga-shop --test it kill::`.

mod common;

mod kill;
mod pooler;
