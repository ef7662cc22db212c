//! The integration tests of `handoff-cli`, one module per concern, in one test binary: each test
//! binary links every dependency it uses, so one per file cost the workspace most of its
//! test build's disk and link time. Run one module with a filter, e.g.
//! `cargo nextest run -p handoff-cli --test it cdc::`.

mod common;
mod ops;

mod cdc;
mod cleanup;
mod cli_names;
mod compatibility;
mod configuration;
mod console;
mod consumer_quarantine;
mod database_url;
mod deploy;
mod deploy_kubernetes;
mod destination_amqp;
mod destination_http;
mod destination_kafka;
mod destination_redis;
mod failure_policy;
mod flag_names;
mod global_order;
mod health;
mod log_source;
mod nats_cluster;
mod nats_security;
mod pooler;
mod postgres_tls;
mod quarantine;
mod reconcile;
mod reconcile_kafka;
mod relay;
mod relay_outage;
mod relay_postgres_restart;
mod replay;
mod roles;
mod saga;
mod secrets_from_files;
mod user_docs;
