//! The flags both reference consumers take ([`CommonArgs`]), what they describe (the
//! consumer's and the JetStream intake's configuration), and [`parse_args`].

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use handoff_consumer::{BatchConfig, ConsumerConfig, GapPolicy};
use handoff_nats::IntakeConfig;
use handoff_postgres::Schema;

use super::{RunError, AGGREGATE_TYPE};

/// Longest time a held event waits under `--gap-policy buffer`; shorter when the ack wait is.
const MAX_BUFFER_WAIT: Duration = Duration::from_secs(5);

/// The flags both reference consumers take. Each also comes from the environment variable
/// named in its help.
#[derive(clap::Args, Debug, Clone)]
pub struct CommonArgs {
    /// PostgreSQL URL of the consumer's own database; its tables are created at start. The
    /// password, if any, is never logged.
    #[arg(
        long,
        env = "HANDOFF_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL",
        help_heading = "Database"
    )]
    pub database_url: String,
    /// `--destination` and each destination's flags.
    #[command(flatten)]
    pub from: super::BrokerArgs,
    /// The consumer's name: its key in the inbox tables and its JetStream durable name; every
    /// instance of one consumer uses the same. The default is the binary's name.
    #[arg(long, env = "HANDOFF_CONSUMER_NAME", help_heading = "Consumer")]
    pub consumer_name: String,
    /// How long JetStream waits for an acknowledgement before it redelivers (e.g. 30s); longer
    /// than the slowest event takes to apply.
    #[arg(long, env = "HANDOFF_ACK_WAIT", default_value = "30s",
        value_parser = humantime::parse_duration, value_name = "DURATION",
        help_heading = "Consumer")]
    pub ack_wait: Duration,
    /// Deliveries after which an event that still fails goes to the consumer quarantine.
    #[arg(
        long,
        env = "HANDOFF_MAX_DELIVERIES",
        default_value_t = 10,
        value_name = "N",
        help_heading = "Consumer"
    )]
    pub max_deliveries: u64,
    /// Most events applied at once, across orders (each holds a database connection).
    #[arg(
        long,
        env = "HANDOFF_CONSUMER_CONCURRENCY",
        default_value_t = 16,
        value_name = "N",
        help_heading = "Consumer"
    )]
    pub concurrency: usize,
    /// Most bytes of deliveries (payload and headers) held at once: taken from the broker and
    /// not yet settled. At the bound nothing more is taken until some are settled (an event
    /// larger than the bound still goes, alone). In bytes, e.g. 16777216 [default: 33554432,
    /// 32 MiB]. The NATS intake also reads ahead no more than 8 MiB per pull.
    #[arg(
        long,
        env = "HANDOFF_MAX_IN_FLIGHT_BYTES",
        value_name = "BYTES",
        help_heading = "Consumer"
    )]
    pub max_in_flight_bytes: Option<usize>,
    /// What to do with an event that arrives before its predecessor: `reject` hands it back
    /// to the broker for a later delivery, `buffer` holds it until the gap fills (bounded).
    #[arg(long, env = "HANDOFF_GAP_POLICY", value_enum, default_value_t = GapPolicyArg::Reject,
        help_heading = "Consumer")]
    pub gap_policy: GapPolicyArg,
    /// How long dedup rows are kept (e.g. 7d); at least the replay horizon.
    #[arg(long, env = "HANDOFF_DEDUP_RETENTION", default_value = "7d",
        value_parser = humantime::parse_duration, value_name = "DURATION",
        help_heading = "Consumer")]
    pub dedup_retention: Duration,
    /// How far back events can be replayed to this consumer (e.g. 7d): the longer of the
    /// outbox's and the stream's retention.
    #[arg(long, env = "HANDOFF_REPLAY_HORIZON", default_value = "7d",
        value_parser = humantime::parse_duration, value_name = "DURATION",
        help_heading = "Consumer")]
    pub replay_horizon: Duration,
    /// Serve Prometheus metrics at http://ADDR/metrics, and the /healthz (alive) and /readyz
    /// (database, schema and broker ready) probes [default: off].
    #[arg(
        long,
        env = "HANDOFF_METRICS_ADDR",
        value_name = "ADDR",
        help_heading = "Observability"
    )]
    pub metrics_addr: Option<SocketAddr>,
    /// Longest one event may take to apply, handler included (e.g. 60s); past it the work is
    /// abandoned (rolled back) and the event delivered again. Frees the consumer from a
    /// database connection that went silent. Also the consumer's sessions'
    /// `idle_in_transaction_session_timeout`, so the server ends a transaction left behind on
    /// such a connection and releases its locks.
    #[arg(long, env = "HANDOFF_APPLY_TIMEOUT", default_value = "60s",
        value_parser = humantime::parse_duration, value_name = "DURATION",
        help_heading = "Consumer")]
    pub apply_timeout: Duration,
    /// Most events applied in one transaction (the inbox's batch mode); 1 applies each event in
    /// a transaction of its own.
    ///
    /// A batch holds at most one event per order, so an order's events still apply one at a
    /// time, in sequence; anything that fails in a batch is applied again alone. A handler that
    /// needs a transaction per event ignores it: payments does (it calls the provider).
    #[arg(long, env = "HANDOFF_INBOX_BATCH_EVENTS", default_value_t = BatchConfig::default().max_events,
        value_name = "N", help_heading = "Consumer")]
    pub inbox_batch_events: usize,
    /// Longest the first event of a batch waits for more before the batch is applied (e.g.
    /// 5ms); 0 takes what is waiting at that moment.
    #[arg(long, env = "HANDOFF_INBOX_BATCH_WAIT", default_value = "5ms",
        value_parser = humantime::parse_duration, value_name = "DURATION",
        help_heading = "Consumer")]
    pub inbox_batch_wait: Duration,
    /// Schema of the consumer's tables (inbox and its own) [default: the connection's
    /// search_path].
    #[arg(long, env = "HANDOFF_SCHEMA", help_heading = "Database")]
    pub schema: Option<String>,
    /// `--otlp-endpoint`: where trace spans go (nowhere without it).
    #[command(flatten)]
    pub otlp: handoff_telemetry::OtlpArgs,
}

/// The `--gap-policy` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapPolicyArg {
    /// Hand the early event back to the broker, delivered again after 1 s.
    Reject,
    /// Hold the early event in memory until its predecessor is applied (bounded).
    Buffer,
}

impl CommonArgs {
    /// The consumer configuration these flags describe; [`run`](super::run) validates it.
    ///
    /// # Errors
    ///
    /// [`RunError::Schema`] for a `--schema` that is not a plain identifier.
    pub fn consumer_config(&self) -> Result<ConsumerConfig, RunError> {
        let gap_policy = match self.gap_policy {
            GapPolicyArg::Reject => GapPolicy::default(),
            GapPolicyArg::Buffer => GapPolicy::Buffer {
                max_per_aggregate: 64,
                // Held events are unacknowledged, so the intake's max-ack-pending (1000) bounds
                // them anyway; this keeps the same bound explicit.
                max_total: 1_000,
                // The library requires the hold to end before the broker's ack wait does.
                max_wait: MAX_BUFFER_WAIT.min(self.ack_wait / 2),
            },
        };
        Ok(ConsumerConfig {
            name: self.consumer_name.clone(),
            schema: self.schema()?,
            max_concurrency: self.concurrency,
            max_deliveries: self.max_deliveries,
            gap_policy,
            dedup_retention: self.dedup_retention,
            replay_horizon: self.replay_horizon,
            // Three times per ack wait: a slow handler is never redelivered while it runs.
            progress_interval: (self.ack_wait / 3).max(std::time::Duration::from_millis(10)),
            apply_timeout: self.apply_timeout,
            max_in_flight_bytes: self
                .max_in_flight_bytes
                .unwrap_or(ConsumerConfig::default().max_in_flight_bytes),
            batch: (self.inbox_batch_events > 1).then_some(BatchConfig {
                max_events: self.inbox_batch_events,
                max_wait: self.inbox_batch_wait,
                ..BatchConfig::default()
            }),
            ..ConsumerConfig::default()
        })
    }

    /// The schema named by `--schema`, or the connection's default.
    ///
    /// # Errors
    ///
    /// [`RunError::Schema`] for a name that is not a plain identifier.
    pub fn schema(&self) -> Result<Schema, RunError> {
        match &self.schema {
            Some(name) => Ok(Schema::named(name.as_str())?),
            None => Ok(Schema::default()),
        }
    }

    /// The RabbitMQ queue to consume with `--destination amqp`: `--queue`, else the consumer name.
    pub fn amqp_queue(&self) -> &str {
        self.from.queue.as_deref().unwrap_or(&self.consumer_name)
    }

    /// The JetStream subscription these flags describe: a durable pull consumer named after
    /// the consumer, filtered to the order events.
    pub fn intake_config(&self) -> IntakeConfig {
        IntakeConfig {
            stream: self.from.stream.clone(),
            subject_prefix: self.from.subject_prefix.clone(),
            durable_name: self.consumer_name.clone(),
            filter_subject: Some(format!("{}.{AGGREGATE_TYPE}.*", self.from.subject_prefix)),
            ack_wait: self.ack_wait,
            ping_interval: self.from.nats_ping_interval,
            security: self.from.nats_security.security(),
            ..IntakeConfig::default()
        }
    }
}

/// Parses the command line of a reference consumer whose `--consumer-name` defaults to
/// `default_consumer_name`.
///
/// # Errors
///
/// The exit code to leave with: success after `--help` or `--version` (printed), failure after
/// a bad command line, which is reported as one `error: ...` line like every other failure.
pub fn parse_args<A: Parser>(default_consumer_name: &'static str) -> Result<A, ExitCode> {
    let command = handoff_telemetry::env::with_fallbacks(A::command())
        .mut_arg("consumer_name", |arg| {
            arg.default_value(default_consumer_name).required(false)
        });
    let parsed = command
        .try_get_matches()
        .and_then(|mut matches| A::from_arg_matches_mut(&mut matches));
    match parsed {
        Ok(args) => Ok(args),
        Err(error) if !error.use_stderr() => {
            let _ = error.print();
            Err(ExitCode::SUCCESS)
        }
        Err(error) => {
            eprintln!("error: {}", one_line(&error));
            Err(ExitCode::FAILURE)
        }
    }
}

/// A clap error on one line: its message without the usage and help hints clap adds.
fn one_line(error: &clap::Error) -> String {
    let rendered = error.render().to_string();
    let message = rendered
        .lines()
        .map(str::trim)
        .take_while(|line| !line.starts_with("Usage:") && !line.starts_with("For more information"))
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    message
        .strip_prefix("error: ")
        .unwrap_or(&message)
        .to_owned()
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::common::RunError;

    #[derive(Parser, Debug)]
    struct Args {
        #[command(flatten)]
        common: CommonArgs,
    }

    fn parse(args: &[&str]) -> Result<CommonArgs, clap::Error> {
        let command = Args::command().mut_arg("consumer_name", |arg| {
            arg.default_value("c").required(false)
        });
        let mut matches = command.try_get_matches_from(
            std::iter::once("c")
                .chain(["--database-url", "postgres://u:p@h/db"])
                .chain(args.iter().copied()),
        )?;
        Ok(Args::from_arg_matches_mut(&mut matches)?.common)
    }

    #[test]
    fn defaults_describe_the_documented_consumer() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.consumer_name, "c");
        assert_eq!(args.ack_wait, Duration::from_secs(30));
        assert_eq!(args.dedup_retention, Duration::from_secs(7 * 86_400));
        let config = args.consumer_config().unwrap();
        assert!(config.validate().is_ok());
        assert_eq!(config.gap_policy, GapPolicy::default());
        // The inbox's batch mode is the default, as the library's.
        assert_eq!(config.batch, Some(BatchConfig::default()));
        let intake = args.intake_config();
        assert_eq!(intake.filter(), "outbox.order.*");
        assert_eq!(intake.durable_name, "c");
    }

    #[test]
    fn the_inbox_batch_flags_reach_the_consumer() {
        let config = parse(&["--inbox-batch-events", "32", "--inbox-batch-wait", "20ms"])
            .unwrap()
            .consumer_config()
            .unwrap();
        let batch = config.batch.unwrap();
        assert_eq!(batch.max_events, 32);
        assert_eq!(batch.max_wait, Duration::from_millis(20));
        assert!(config.validate().is_ok());
        // One event per batch is no batch: a transaction per event.
        let single = parse(&["--inbox-batch-events", "1"]).unwrap();
        assert_eq!(single.consumer_config().unwrap().batch, None);
    }

    #[test]
    fn the_amqp_queue_is_the_consumer_name_unless_given() {
        assert_eq!(parse(&[]).unwrap().amqp_queue(), "c");
        let args = parse(&["--queue", "demo_1_c"]).unwrap();
        assert_eq!(args.amqp_queue(), "demo_1_c");
        assert_eq!(args.consumer_name, "c");
    }

    #[test]
    fn buffer_policy_waits_less_than_the_ack_wait() {
        let args = parse(&["--gap-policy", "buffer", "--ack-wait", "2s"]).unwrap();
        let GapPolicy::Buffer { max_wait, .. } = args.consumer_config().unwrap().gap_policy else {
            panic!("not a buffer policy");
        };
        assert_eq!(max_wait, Duration::from_secs(1));
    }

    #[test]
    fn retention_shorter_than_the_horizon_is_refused() {
        let args = parse(&["--dedup-retention", "1d", "--replay-horizon", "7d"]).unwrap();
        let error = args.consumer_config().unwrap().validate().unwrap_err();
        let message = RunError::from(error).to_string();
        assert!(message.contains("dedup retention 1d"), "{message}");
    }

    // NATS credentials and TLS (issue 23).
    #[test]
    fn nats_files_reach_the_intake() {
        let args = parse(&[
            "--nats-nkey",
            "/run/secrets/inventory.nk",
            "--nats-tls-ca",
            "/etc/nats/ca.pem",
        ])
        .unwrap();
        let security = args.intake_config().security;
        assert_eq!(
            security.nkey.as_deref(),
            Some(std::path::Path::new("/run/secrets/inventory.nk"))
        );
        assert_eq!(
            security.tls_ca.as_deref(),
            Some(std::path::Path::new("/etc/nats/ca.pem"))
        );
        assert_eq!(security.creds, None);
        assert!(parse(&[]).unwrap().intake_config().security.is_empty());
    }
}
