//! The integration tests of `consumers`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p consumers --test it health::`.

mod common;

mod cli_names;
mod health;
mod inventory;
mod kafka_options;
mod payments;
mod postgres_tls;
mod provider;
mod redis;
mod schema_evolution;
mod testkit;
