//! What a run is asked to do: its settings, the destination its relays publish to and the
//! source they read.

use handoff_core::destination::DestinationKind;

use super::*;

/// What to run, for how long, with which seed.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// How long load and faults last.
    pub duration: Duration,
    /// Seeds the fault schedule and the load.
    pub seed: u64,
    /// Where the binaries of [`BINARIES`] are.
    pub bin_dir: PathBuf,
    /// Where the children's stderr goes, one file per process (`relay-0.log`, ...); `None`
    /// discards it.
    pub log_dir: Option<PathBuf>,
    /// How long settling may go on without progress after the faults stop: the run waits as
    /// long as the work left (pending outbox rows, consumers' lag) keeps reaching new lows, and
    /// gives up when it has not for this long.
    pub settle_timeout: Duration,
    /// Hold the load while the slowest consumer is more than this many events behind (events
    /// committed minus events it applied); `None` lets the load run unpaced, which on a fast
    /// build measures how far the consumers fall behind rather than whether they are right.
    pub max_lag: Option<u64>,
    /// The length of the intervals of the report's time series.
    pub report_interval: Duration,
    /// Where the relays read committed events from.
    pub relay_source: RelaySource,
    /// Where the relays publish and the consumers read.
    pub destination: Destination,
}

/// Where the run's relays publish and its consumers read (`handoff relay --destination`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Destination {
    /// A private nats-server with JetStream: the relays publish to a stream, each consumer is
    /// a durable pull consumer. The server is a fault target: it keeps its stream on disk.
    #[default]
    Nats,
    /// A private tansu (a Kafka-protocol broker): the relays produce to a topic of 4
    /// partitions keyed by aggregate, each consumer is a consumer group. tansu runs with
    /// memory storage, which a kill wipes, so the broker is not a fault target on this
    /// destination. Nor are the consumers: tansu 0.6's group coordinator keeps a SIGKILLed
    /// member's partitions past its session timeout (seen: a restarted sole member assigned 0
    /// of 4 partitions for minutes), so a consumer kill would test tansu, not handoff. The
    /// consumers still ride out the kills of their database and of the payment provider.
    Kafka,
    /// The machine's RabbitMQ (`AMQP_URL`, by default guest on 127.0.0.1:5672), with an
    /// exchange and queues of the run's own, deleted at the end: each consumer reads a quorum
    /// queue with a single active consumer, and an audit queue bound to every routing key
    /// holds what the checker reads. A shared server, so not a fault target.
    Amqp,
}

impl TryFrom<DestinationKind> for Destination {
    type Error = anyhow::Error;

    /// The library's destination, when the run knows how to set one up and break it.
    fn try_from(kind: DestinationKind) -> anyhow::Result<Destination> {
        match kind {
            DestinationKind::Nats => Ok(Destination::Nats),
            DestinationKind::Kafka => Ok(Destination::Kafka),
            DestinationKind::Amqp => Ok(Destination::Amqp),
            other => anyhow::bail!("the chaos run runs on nats, kafka or amqp, not {other}"),
        }
    }
}

impl Destination {
    /// The kinds of process a run on this destination kills: every kind, except the broker
    /// where a kill would lose what it holds (tansu's memory) or hit a shared server
    /// (RabbitMQ), and the consumers on Kafka (see [`Destination::Kafka`]).
    pub fn fault_targets(self) -> Vec<Kind> {
        Kind::ALL
            .into_iter()
            .filter(|&kind| match self {
                Destination::Nats => true,
                Destination::Amqp => kind != Kind::NatsServer,
                Destination::Kafka => {
                    !matches!(kind, Kind::NatsServer | Kind::Inventory | Kind::Payments)
                }
            })
            .collect()
    }
}

/// Where the run's relays read committed events from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RelaySource {
    /// `handoff relay` polling the outbox: three relays share the work through leases.
    #[default]
    Polling,
    /// `handoff relay --source logical`: one relay streams the slot, the two others stand by
    /// and take over when it is killed. The private PostgreSQL runs with `wal_level=logical`
    /// and the slot is set up with `handoff cdc setup` before the relays start.
    Logical,
    /// `handoff relay --source log`: the relays share the default cursor; one holds its lease
    /// and reads it (and its lane), the two others stand by and take it over when the lease of
    /// a killed reader runs out.
    Log,
}

/// The default `--max-lag`: a backlog the reference consumers clear in well under a minute
/// after the faults stop, and large enough that the load runs free through ordinary kills.
pub const DEFAULT_MAX_LAG: u64 = 5_000;

/// The default `--report-interval`.
pub const DEFAULT_REPORT_INTERVAL: Duration = Duration::from_secs(30);

/// The slot and publication of a run with [`RelaySource::Logical`].
pub(super) const CDC_SLOT: &str = "handoff";
pub(super) const CDC_PUBLICATION: &str = "handoff_outbox";

impl Default for RunConfig {
    /// A minute of faults with seed 1, binaries in the working directory, no logs, up to two
    /// minutes without progress while settling, the load held at [`DEFAULT_MAX_LAG`].
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(60),
            seed: 1,
            bin_dir: PathBuf::from("."),
            log_dir: None,
            settle_timeout: Duration::from_secs(120),
            max_lag: Some(DEFAULT_MAX_LAG),
            report_interval: DEFAULT_REPORT_INTERVAL,
            relay_source: RelaySource::Polling,
            destination: Destination::Nats,
        }
    }
}

impl RunConfig {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// [`RunError::Config`] for a zero duration, settle timeout or report interval.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use handoff_chaos::run::RunConfig;
    ///
    /// assert!(RunConfig::default().validate().is_ok());
    /// let config = RunConfig { duration: Duration::ZERO, ..RunConfig::default() };
    /// assert!(config.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), RunError> {
        if self.duration.is_zero() {
            return Err(RunError::Config("the duration must be above zero".into()));
        }
        if self.settle_timeout.is_zero() {
            return Err(RunError::Config(
                "the settle timeout must be above zero".into(),
            ));
        }
        if self.report_interval.is_zero() {
            return Err(RunError::Config(
                "the report interval must be above zero".into(),
            ));
        }
        Ok(())
    }
}
