//! The integration tests of `test`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p test --test it nats_server::`.

mod nats_server;
mod pgbouncer;
mod private_postgres;
mod proxy;
mod test_db;
