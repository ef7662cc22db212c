//! [`JetStreamIntake`]: a consumer's [`Intake`] from a durable JetStream pull consumer.

use std::time::Duration;

use async_nats::jetstream::consumer::pull::{Config as PullConfig, Stream as PullStream};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use async_nats::jetstream::message::{AckKind, Acker};
use futures::StreamExt;
use handoff_core::contract;
use handoff_core::intake::{Delivery, Intake, IntakeError, MalformedEvent, ReceivedEvent, Settle};

use crate::{ConnectError, ConnectSecurity, JetStreamConfig, JetStreamTransport, StreamError};

/// The header a replay (`handoff replay`, `handoff reconcile --republish`) adds to a
/// republished event; its value is the replay run's id (`reconcile-<id>` for a reconcile).
pub const REPLAY: &str = contract::header::REPLAY;

/// Where and how a [`JetStreamIntake`] subscribes.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_nats::IntakeConfig;
///
/// let config = IntakeConfig {
///     durable_name: "inventory".into(),
///     ack_wait: Duration::from_secs(10),
///     ..IntakeConfig::default()
/// };
/// assert_eq!(config.filter(), "outbox.>");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntakeConfig {
    /// The stream the relay publishes into; created (as the relay would) when missing, so a
    /// consumer may start first. Default `"OUTBOX"`.
    pub stream: String,
    /// The relay's subject prefix. Default `"outbox"`.
    pub subject_prefix: String,
    /// The durable consumer's name: every instance of one consumer shares it (and the messages
    /// it holds). Use the consumer's name.
    pub durable_name: String,
    /// Only these subjects, such as `outbox.order.*`; default `<subject_prefix>.>`.
    pub filter_subject: Option<String>,
    /// How long the server waits for an acknowledgement before it redelivers. Longer than the
    /// slowest handler (outside calls included). Default 30 s.
    pub ack_wait: Duration,
    /// Most messages delivered and not yet acknowledged, across instances: the bound on what a
    /// consumer holds in memory. Default 1000.
    pub max_ack_pending: i64,
    /// Messages asked for per pull request. Default 256.
    pub batch: usize,
    /// Most bytes asked for per pull request: with [`batch`](Self::batch), the bound on what
    /// the client reads ahead of the consumer (the consumer's own bound,
    /// `ConsumerConfig::max_in_flight_bytes`, covers what it took). Raised to the server's
    /// `max_payload` when below it, so that every message fits in one pull; 0 for no byte
    /// bound. Default 8 MiB.
    pub max_batch_bytes: usize,
    /// How often the client pings the server, to find a silent connection; see
    /// [`JetStreamConfig::ping_interval`]. Default 10 s.
    pub ping_interval: Duration,
    /// Credentials and TLS files for the connection; see [`ConnectSecurity`]. Default: none.
    pub security: ConnectSecurity,
}

impl Default for IntakeConfig {
    fn default() -> Self {
        Self {
            stream: "OUTBOX".to_owned(),
            subject_prefix: "outbox".to_owned(),
            durable_name: String::new(),
            filter_subject: None,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
            batch: 256,
            max_batch_bytes: 8 << 20,
            ping_interval: Duration::from_secs(10),
            security: ConnectSecurity::default(),
        }
    }
}

impl IntakeConfig {
    /// The subject filter the durable consumer uses.
    pub fn filter(&self) -> String {
        self.filter_subject
            .clone()
            .unwrap_or_else(|| format!("{}.>", self.subject_prefix))
    }
}

/// Why [`JetStreamIntake::connect`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IntakeConnectError {
    /// The server could not be reached, or refused the credentials or configuration.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The stream could not be found or created.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// The configuration is unusable.
    #[error("invalid intake configuration: {0}")]
    Invalid(&'static str),
    /// The durable consumer could not be created or read.
    #[error("while creating durable consumer {name} on stream {stream}: {message}")]
    Consumer {
        /// The durable name.
        name: String,
        /// The stream.
        stream: String,
        /// The server's or client's error.
        message: String,
    },
}

/// Deliveries from a durable JetStream pull consumer with explicit acknowledgements.
///
/// The durable consumer is created on first use with `AckPolicy::Explicit`, the configured ack
/// wait and max-ack-pending, and delivery from the stream's start. An existing durable consumer
/// gets the configured ack wait and max-ack-pending; one with another subject filter is refused
/// (the server cannot change it).
///
/// Its `max_deliver` is a backstop above the consumer's own delivery cap: a `Consumer` sets it
/// to [`broker_backstop`](handoff_core::intake::broker_backstop)`(max_deliveries)` when it
/// starts ([`Intake::set_delivery_backstop`]). The consumer quarantines a failing message at its
/// cap; the server's limit only stops one whose quarantine write keeps failing. Such a message
/// stays in the stream (replayable) and the server publishes a
/// `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES` advisory. Used without a `Consumer`, the
/// durable has no limit (`-1`) unless one was set before.
///
/// Each message is read back from the relay's contract: `ce-id` (the event id; not
/// `Nats-Msg-Id`, which a second publish may change), `Handoff-Aggregate-Type`,
/// `Handoff-Aggregate-Id` (decoded), `Handoff-Sequence`, `ce-type`, `Handoff-Schema-Version` and
/// [`REPLAY`]. A message without them is handed over as a [`MalformedEvent`].
///
/// # Examples
///
/// ```no_run
/// use handoff_core::intake::Intake;
/// use handoff_nats::{IntakeConfig, JetStreamIntake};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let config = IntakeConfig { durable_name: "audit".into(), ..IntakeConfig::default() };
/// let mut intake = JetStreamIntake::connect("nats://127.0.0.1:4222", config).await?;
/// let delivery = intake.next().await?;
/// println!("delivery {} of {:?}", delivery.delivery_count, delivery.event.map(|e| e.event_id));
/// # Ok(())
/// # }
/// ```
pub struct JetStreamIntake {
    messages: PullStream,
    transport: JetStreamTransport,
    /// The stream, to update the durable's settings.
    stream: async_nats::jetstream::stream::Stream,
    /// The durable's settings, as last written.
    settings: PullConfig,
}

impl JetStreamIntake {
    /// Connects to `url` (as [`JetStreamTransport::connect`]), makes sure the stream exists, and
    /// creates or opens the durable consumer.
    ///
    /// # Errors
    ///
    /// [`IntakeConnectError`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the stream or durable consumer created; a later call uses
    /// them.
    pub async fn connect(url: &str, config: IntakeConfig) -> Result<Self, IntakeConnectError> {
        if config.durable_name.is_empty() {
            return Err(IntakeConnectError::Invalid("durable_name is empty"));
        }
        if config.max_ack_pending < 1 || config.batch == 0 {
            return Err(IntakeConnectError::Invalid(
                "max_ack_pending and batch must be at least 1",
            ));
        }
        let transport = JetStreamTransport::connect(
            url,
            JetStreamConfig {
                stream: config.stream.clone(),
                subject_prefix: config.subject_prefix.clone(),
                ping_interval: config.ping_interval,
                security: config.security.clone(),
                ..JetStreamConfig::default()
            },
        )
        .await?;
        // The server answers a pull that a waiting message does not fit in with an error,
        // again at every pull: that message would stop the consumer for good. So a pull always
        // has room for the largest message the server takes.
        let max_payload = transport.client().server_info().max_payload;
        let max_batch_bytes = match config.max_batch_bytes {
            0 => 0,
            asked if asked < max_payload => {
                tracing::info!(
                    asked,
                    max_payload,
                    "max_batch_bytes raised to the server's \
                    max_payload, so that every message fits in a pull"
                );
                max_payload
            }
            asked => asked,
        };
        transport.ensure_stream().await?;
        let consumer_error = |message: String| IntakeConnectError::Consumer {
            name: config.durable_name.clone(),
            stream: config.stream.clone(),
            message,
        };
        let context = async_nats::jetstream::new(transport.client().clone());
        let stream = context
            .get_stream(&config.stream)
            .await
            .map_err(|e| consumer_error(e.to_string()))?;
        let mut wanted = PullConfig {
            durable_name: Some(config.durable_name.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_ack_pending: config.max_ack_pending,
            max_deliver: -1,
            deliver_policy: DeliverPolicy::All,
            filter_subject: config.filter(),
            ..PullConfig::default()
        };
        let mut consumer = stream
            .get_or_create_consumer::<PullConfig>(&config.durable_name, wanted.clone())
            .await
            .map_err(|e| consumer_error(e.to_string()))?;
        let existing = &consumer.cached_info().config;
        // Kept as it is: set by the consumer that runs on it (`set_delivery_backstop`).
        wanted.max_deliver = existing.max_deliver;
        if existing.filter_subject != wanted.filter_subject {
            // Not editable on the server, and consuming another filter than asked for would
            // silently skip or add events.
            return Err(consumer_error(format!(
                "it exists with filter {:?}, not {:?}; delete it or use another name",
                existing.filter_subject, wanted.filter_subject
            )));
        }
        if existing.ack_wait != wanted.ack_wait
            || existing.max_ack_pending != wanted.max_ack_pending
        {
            // Both are editable: a second create with the same durable name updates them.
            consumer = stream
                .create_consumer(wanted.clone())
                .await
                .map_err(|e| consumer_error(format!("while updating its settings: {e}")))?;
            tracing::info!(durable = %config.durable_name, ack_wait = ?config.ack_wait,
                max_ack_pending = config.max_ack_pending, "updated the durable consumer");
        }
        let mut pulls = consumer.stream().max_messages_per_batch(config.batch);
        if max_batch_bytes != 0 {
            pulls = pulls.max_bytes_per_batch(max_batch_bytes);
        }
        let messages = pulls
            .messages()
            .await
            .map_err(|e| consumer_error(e.to_string()))?;
        Ok(Self {
            messages,
            transport,
            stream,
            settings: wanted,
        })
    }

    /// The durable consumer's `max_deliver` as this intake last set or found it (`-1`: none).
    pub fn max_deliver(&self) -> i64 {
        self.settings.max_deliver
    }

    /// The NATS client, for tools and tests.
    pub fn client(&self) -> &async_nats::Client {
        self.transport.client()
    }
}

impl Intake for JetStreamIntake {
    type Settle = JetStreamSettle;

    async fn next(&mut self) -> Result<Delivery<JetStreamSettle>, IntakeError> {
        let message = match self.messages.next().await {
            Some(Ok(message)) => message,
            Some(Err(error)) => return Err(IntakeError::new("while pulling messages", error)),
            None => return Err(IntakeError::message("the pull subscription ended")),
        };
        let delivery_count = message
            .info()
            .map(|info| u64::try_from(info.delivered).unwrap_or(1))
            .unwrap_or(1);
        let (message, acker) = message.split();
        Ok(Delivery {
            event: read_event(&message),
            delivery_count,
            settle: JetStreamSettle { acker },
        })
    }

    async fn set_delivery_backstop(&mut self, backstop: u64) -> Result<(), IntakeError> {
        let backstop = i64::try_from(backstop).unwrap_or(i64::MAX);
        if self.settings.max_deliver == backstop {
            return Ok(());
        }
        let wanted = PullConfig {
            max_deliver: backstop,
            ..self.settings.clone()
        };
        // A second create with the same durable name updates its editable settings.
        self.stream
            .create_consumer(wanted.clone())
            .await
            .map_err(|e| IntakeError::new("while setting the durable's max_deliver", e))?;
        tracing::info!(durable = ?wanted.durable_name, max_deliver = backstop,
            "the durable consumer's delivery limit is the backstop above the consumer's cap");
        self.settings = wanted;
        Ok(())
    }
}

/// Settles one JetStream delivery (`+ACK`, `-NAK` with a delay, `+TERM`, `+WPI`).
pub struct JetStreamSettle {
    acker: Acker,
}

impl JetStreamSettle {
    async fn send(&self, kind: AckKind, what: &str) -> Result<(), IntakeError> {
        self.acker
            .ack_with(kind)
            .await
            .map_err(|e| IntakeError::message(format!("while {what}: {e}")))
    }
}

impl Settle for JetStreamSettle {
    async fn ack(&self) -> Result<(), IntakeError> {
        self.send(AckKind::Ack, "acknowledging").await
    }

    async fn nak(&self, delay: Duration) -> Result<(), IntakeError> {
        let delay = (!delay.is_zero()).then_some(delay);
        self.send(AckKind::Nak(delay), "handing a message back")
            .await
    }

    async fn term(&self) -> Result<(), IntakeError> {
        self.send(AckKind::Term, "terminating a message").await
    }

    async fn in_progress(&self) -> Result<(), IntakeError> {
        self.send(AckKind::Progress, "extending the ack wait").await
    }
}

/// Reads handoff's message contract back from a message.
fn read_event(message: &async_nats::Message) -> Result<ReceivedEvent, MalformedEvent> {
    let headers: Vec<(String, String)> = message
        .headers
        .iter()
        .flat_map(|map| map.iter())
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |value| (name.to_string(), value.as_str().to_owned()))
        })
        .collect();
    contract::read_event(headers, &message.payload, message.subject.as_str())
}
