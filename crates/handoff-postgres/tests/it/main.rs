//! The integration tests of `handoff-postgres`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p handoff-postgres --test it byte_budget::`.

mod common;

mod byte_budget;
mod cleanup;
mod crash_loop;
mod enqueue;
mod fencing;
mod fuzz_corpus;
mod global_order;
mod inbox_batch;
mod jit;
mod log_source;
mod mark;
mod migrate;
mod order_holes;
mod parking;
mod payload_jsonb;
mod pooler;
mod source;
mod source_conformance;
#[cfg(feature = "tokio-postgres")]
mod tokio_postgres;
