//! `handoff-bench`: benchmarks of handoff, each against a baseline measured in the same run.
//!
//! - `handoff-bench write-path` ([`write_path`]) measures orders/s through the order service's
//!   own write with the outbox, against the identical write without it.
//! - `handoff-bench relay` ([`relay`]) drains one preloaded backlog through the relay and
//!   through its bounds (the claim/mark SQL alone, JetStream alone, a naive one-at-a-time loop),
//!   checks order and completeness in the stream, and measures commit-to-ack latency under a
//!   live writer.
//! - `handoff-bench consumer` ([`consumer`]) measures msgs/s of a consumer applying events
//!   through the inbox, against the same consumer and handler without it.
//! - `handoff-bench cleanup` ([`cleanup`]) measures the relay's commit-to-ack latency with and
//!   without a cleanup of a million published rows running beside it.
//! - `handoff-bench cdc` ([`cdc`]) measures the CDC source (rows kept, rows deleted) against the
//!   polling relay on one private `wal_level=logical` PostgreSQL: drain rate, commit-to-ack
//!   latency, and the order write's orders/s with each setup in place.
//! - `handoff-bench kafka` ([`kafka`]) drains a committed backlog through the relay into Kafka
//!   (a private tansu), against the same events produced by the Kafka transport alone.
//! - `handoff-bench http` ([`http`]) measures the relay draining committed rows into the
//!   reference `webhook-receiver` against POSTing the same events to it directly.
//! - `handoff-bench amqp` ([`amqp`]) measures the relay draining a committed backlog into
//!   RabbitMQ against the raw bound of publishing the same events with confirms alone.
//! - `handoff-bench global-order` ([`global_order`]) measures strict global order against
//!   per-aggregate order: the order write's orders/s at several client counts, and one relay's
//!   drain of the same backlog.
//! - `handoff-bench saga` ([`saga`]) measures sagas/s of two-step orchestrated sagas end to end
//!   (3 relays, 3 consumers, the deadline sweep) against a plain 4-hop event ping-pong over the
//!   same topology.
//! - `handoff-bench console` ([`console`]) measures the operator console's pages and API, `handoff
//!   status` and `handoff cleanup --dry-run` on a 10-million-row outbox built in place, and a
//!   relay's drain with a watched console beside it against without.
//! - `handoff-bench blocked-backlog`, `held-xmin`, `writers` and `drain-bound` ([`hot_path`])
//!   measure the relay's hot path under a held aggregate's long tail, a held xmin horizon,
//!   writers beside it, and against its drain bounds and the peer (oxide-outbox), each against a
//!   baseline of the same run.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod amqp;
mod cdc;
mod cleanup;
mod console;
mod consumer;
mod global_order;
mod harness;
mod hot_path;
mod http;
mod kafka;
mod machine;
mod relay;
mod relay_memory;
mod saga;
mod write_path;

#[derive(Parser)]
#[command(
    name = "handoff-bench",
    about = "handoff benchmarks, each with its same-run baseline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Orders/s of the order write with the outbox vs without it.
    WritePath(write_path::WritePathArgs),
    /// Relay drain rate against its bounds, order checks, commit-to-ack latency.
    Relay(relay::RelayArgs),
    /// Consumer msgs/s with the inbox vs the same handler without it.
    Consumer(consumer::ConsumerArgs),
    /// Relay commit-to-ack latency with vs without a cleanup running beside it.
    Cleanup(cleanup::CleanupArgs),
    /// The CDC source (rows kept / deleted) against the polling relay: drain, latency, write.
    Cdc(cdc::CdcArgs),
    /// The relay's drain into Kafka against the Kafka producer alone.
    Kafka(kafka::KafkaArgs),
    /// The relay draining into an HTTP endpoint vs POSTing to it directly.
    Http(http::HttpArgs),
    /// RabbitMQ: the relay's drain against publishing with confirms alone.
    Amqp(amqp::AmqpArgs),
    /// Strict global order vs per-aggregate order: write path and relay drain.
    GlobalOrder(global_order::GlobalOrderArgs),
    /// Sagas/s end to end vs a plain 4-hop event ping-pong over the same topology.
    Saga(saga::SagaArgs),
    /// Healthy drain and claim p99 beside a run of events behind a held head vs nothing blocked.
    BlockedBacklog(hot_path::blocked::BlockedArgs),
    /// Commit → broker p99, backlog and dead tuples under a held XID vs a clean phase.
    HeldXmin(hot_path::xmin::XminArgs),
    /// Order writes/s with a relay running vs none; commit → broker p99 at fixed rates.
    Writers(hot_path::writers::WritersArgs),
    /// One relay's drain vs the claim+mark SQL bound, the JetStream async bound and the peer,
    /// oxide-outbox at its best tuning.
    DrainBound(hot_path::bound::BoundArgs),
    /// A relay's resident-set growth draining near-1 MB events with its byte bound vs none.
    RelayMemory(relay_memory::RelayMemoryArgs),
    /// Console pages and API p99, status and cleanup --dry-run on a 10 M-row outbox; relay
    /// drain with a watched console vs without.
    Console(console::ConsoleArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // The relay logs through tracing; RUST_LOG=warn shows its warnings during a run.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // HANDOFF_ variables, with the older names (DATABASE_URL, NATS_URL, ...) read when unset.
    let matches = handoff_telemetry::env::with_fallbacks(Cli::command()).get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    let result = match cli.command {
        Command::WritePath(args) => write_path::write_path(args).await,
        Command::Relay(args) => relay::relay(args).await,
        Command::Consumer(args) => consumer::consumer(args).await,
        Command::Cleanup(args) => cleanup::cleanup(args).await,
        Command::Cdc(args) => cdc::cdc(args).await,
        Command::Kafka(args) => kafka::kafka(args).await,
        Command::Http(args) => http::http(args).await,
        Command::Amqp(args) => amqp::amqp(args).await,
        Command::GlobalOrder(args) => global_order::global_order(args).await,
        Command::Saga(args) => saga::saga(args).await,
        Command::BlockedBacklog(args) => hot_path::blocked::blocked_backlog(args).await,
        Command::HeldXmin(args) => hot_path::xmin::held_xmin(args).await,
        Command::Writers(args) => hot_path::writers::writers(args).await,
        Command::DrainBound(args) => hot_path::bound::drain_bound(args).await,
        Command::RelayMemory(args) => relay_memory::relay_memory(args).await,
        Command::Console(args) => console::console(args).await,
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Cli;

    #[test]
    fn every_subcommands_arguments_are_consistent() {
        // Flattened shared arguments (harness::ScratchArgs, ReportArgs) must not clash with a
        // benchmark's own.
        Cli::command().debug_assert();
    }

    #[test]
    fn hot_path_benches_take_their_smoke_flags() {
        for args in [
            &["blocked-backlog", "--blocked", "100000", "--rounds", "2"][..],
            &[
                "held-xmin",
                "--rate",
                "800",
                "--clean",
                "20s",
                "--held",
                "30s",
            ][..],
            &[
                "writers",
                "--clients",
                "8,16",
                "--seconds",
                "4",
                "--rates",
                "500,1000",
            ][..],
            &["drain-bound", "--events", "20000", "--aggregates", "2000"][..],
        ] {
            let parsed =
                Cli::try_parse_from(std::iter::once("handoff-bench").chain(args.iter().copied()));
            assert!(parsed.is_ok(), "{args:?}: {:?}", parsed.err());
        }
        // A duration that humantime cannot read is refused, not defaulted.
        assert!(Cli::try_parse_from(["handoff-bench", "held-xmin", "--held", "soon"]).is_err());
    }
}
