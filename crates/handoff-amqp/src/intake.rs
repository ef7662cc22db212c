//! [`AmqpIntake`]: a consumer's [`Intake`] from one RabbitMQ queue.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use handoff_core::contract;
use handoff_core::intake::{Delivery, Intake, IntakeError, Settle};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Acker, Channel, Connection};

use crate::transport::{connect, connect_error, ensure_exchange};
use crate::url::{self, BrokerUrl};
use crate::{ConfigError, ConnectError};

/// The header quorum queues set on a redelivered message: how many times it was delivered
/// before and not acknowledged.
pub const X_DELIVERY_COUNT: &str = "x-delivery-count";

/// At most this many redelivered messages are counted by the intake itself (for queues without
/// [`X_DELIVERY_COUNT`]); past it the counts start over, which only delays a delivery cap.
const MAX_COUNTED: usize = 100_000;

/// Which queue an [`AmqpIntake`] consumes, and how.
///
/// The `Debug` output shows the URL without its password.
///
/// # Examples
///
/// ```
/// use handoff_amqp::IntakeConfig;
///
/// let config = IntakeConfig { queue: "inventory".into(), prefetch: 64, ..IntakeConfig::default() };
/// assert_eq!(config.connection_name, "handoff consumer");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct IntakeConfig {
    /// The broker, as [`AmqpConfig::url`](crate::AmqpConfig::url). Default:
    /// `"amqp://127.0.0.1:5672/%2f"`.
    pub url: String,
    /// The queue to consume. It must exist: see [`AmqpIntake::declare_queue`].
    pub queue: String,
    /// Most messages delivered and not yet settled on this consumer (`basic.qos`): the bound
    /// on what it holds in memory. A message handed back with a delay
    /// ([`Settle::nak`]) counts until the delay ends. 1 to 65535. Default 256.
    pub prefetch: u16,
    /// The connection's name in `rabbitmqctl list_connections`. Default `"handoff consumer"`.
    pub connection_name: String,
    /// How long one connection attempt may take. Default 5 seconds.
    pub connect_timeout: Duration,
    /// The AMQP heartbeat asked for when the URL sets none, as
    /// [`AmqpConfig::heartbeat`](crate::AmqpConfig::heartbeat). Default 10 seconds.
    pub heartbeat: Duration,
    /// A CA certificate file (PEM) trusted for an `amqps://` URL, as
    /// [`AmqpConfig::tls_ca`](crate::AmqpConfig::tls_ca). Default: none.
    pub tls_ca: Option<PathBuf>,
}

impl Default for IntakeConfig {
    fn default() -> Self {
        Self {
            url: "amqp://127.0.0.1:5672/%2f".to_owned(),
            queue: String::new(),
            prefetch: 256,
            connection_name: "handoff consumer".to_owned(),
            connect_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_secs(10),
            tls_ca: None,
        }
    }
}

// Hand-written so that the URL's password never reaches a log line.
impl std::fmt::Debug for IntakeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IntakeConfig")
            .field("url", &url::redact(&self.url))
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("connection_name", &self.connection_name)
            .field("connect_timeout", &self.connect_timeout)
            .field("heartbeat", &self.heartbeat)
            .field("tls_ca", &self.tls_ca)
            .finish()
    }
}

/// A durable queue bound to the relay's exchange, for [`AmqpIntake::declare_queue`].
///
/// # Examples
///
/// ```
/// use handoff_amqp::QueueDeclaration;
///
/// // Every order event, on a quorum queue with one active consumer at a time.
/// let queue = QueueDeclaration {
///     exchange: "outbox".into(),
///     binding_key: "order.*".into(),
///     quorum: true,
///     single_active_consumer: true,
/// };
/// # let _ = queue;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDeclaration {
    /// The relay's exchange; declared as a durable topic exchange when missing (as the relay
    /// does), so consumers may start first.
    pub exchange: String,
    /// The binding key: `#` for every event, `order.*` for every event of aggregate type
    /// `order`. Default `"#"`.
    pub binding_key: String,
    /// A quorum queue (`x-queue-type: quorum`): replicated, and it counts deliveries
    /// ([`X_DELIVERY_COUNT`]), which the consumer's delivery cap reads. Default `false` (a
    /// classic queue).
    pub quorum: bool,
    /// `x-single-active-consumer`: of all consumers of the queue, one receives at a time and
    /// the others stand by, which keeps per-aggregate order with several instances running.
    /// Default `false`.
    pub single_active_consumer: bool,
}

impl Default for QueueDeclaration {
    fn default() -> Self {
        Self {
            exchange: "outbox".to_owned(),
            binding_key: "#".to_owned(),
            quorum: false,
            single_active_consumer: false,
        }
    }
}

/// Deliveries from one RabbitMQ queue with manual acknowledgements, read back from handoff's
/// message contract.
///
/// Each message is read with [`handoff_core::contract::read_event`]: `ce-id` (the event id),
/// `Handoff-Aggregate-Type`, `Handoff-Aggregate-Id` (decoded), `Handoff-Sequence`, `ce-type`,
/// `Handoff-Schema-Version`. A message without them is handed over as a
/// [`MalformedEvent`](handoff_core::intake::MalformedEvent).
///
/// Settling maps onto AMQP as follows:
///
/// - `ack` is `basic.ack`;
/// - `nak(delay)` is `basic.nack` with `requeue`, sent after `delay` by a timer in this
///   process. RabbitMQ has no delayed redelivery of its own: until the timer fires the message
///   stays unacknowledged on this consumer (counting against the prefetch), and if the
///   process dies first the broker requeues it at once;
/// - `term` is `basic.reject` without `requeue`: the message is dropped, or dead-lettered if
///   the queue has a dead-letter exchange;
/// - `in_progress` does nothing: RabbitMQ has no per-message ack wait to restart (only the
///   broker's `consumer_timeout`, 30 minutes by default, after which it closes the channel).
///
/// The delivery count is `x-delivery-count + 1` on quorum queues. Classic queues only flag a
/// redelivery, so there the count is the higher of 2 (when flagged) and the number of times
/// this intake has itself seen the event since it last settled it for good; the count starts
/// over when the process restarts.
///
/// The broker-side backstop above the consumer's delivery cap is a quorum queue's delivery
/// limit (`x-delivery-limit` or a `delivery-limit` policy, best with a dead-letter exchange),
/// which this intake does not set: queue arguments cannot change after declaration. Keep it at
/// or above [`broker_backstop`](handoff_core::intake::broker_backstop)`(max_deliveries)`; a
/// lower limit drops messages before the consumer can quarantine them (docs/consumers.md).
///
/// When the connection or channel closes, [`next`](Intake::next) fails once and the next call
/// reconnects; the broker requeues whatever was unacknowledged, and the inbox absorbs the
/// redeliveries.
///
/// # Examples
///
/// ```no_run
/// use handoff_amqp::{AmqpIntake, IntakeConfig, QueueDeclaration};
/// use handoff_core::intake::Intake;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let config = IntakeConfig { queue: "audit".into(), ..IntakeConfig::default() };
/// AmqpIntake::declare_queue(&config, &QueueDeclaration::default()).await?;
/// let mut intake = AmqpIntake::connect(config).await?;
/// let delivery = intake.next().await?;
/// println!("delivery {} of {:?}", delivery.delivery_count, delivery.event.map(|e| e.event_id));
/// # Ok(())
/// # }
/// ```
pub struct AmqpIntake {
    config: IntakeConfig,
    url: BrokerUrl,
    open: Option<Open>,
    /// Deliveries seen per event id, for queues that do not count them.
    seen: Arc<Mutex<HashMap<String, u64>>>,
}

/// One open connection, its channel and the queue's consumer.
struct Open {
    // Kept so the connection lives as long as the consumer.
    _connection: Connection,
    _channel: Channel,
    consumer: lapin::Consumer,
}

impl AmqpIntake {
    /// Connects to the broker and starts consuming [`IntakeConfig::queue`] with manual
    /// acknowledgements and the configured prefetch.
    ///
    /// # Errors
    ///
    /// [`ConnectError`]: a bad URL or configuration, an unreachable broker, refused
    /// credentials, or a queue that does not exist (kind
    /// [`Topology`](crate::ConnectErrorKind::Topology)).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt; nothing is left behind.
    pub async fn connect(config: IntakeConfig) -> Result<Self, ConnectError> {
        let url = parse_url(&config)?;
        let mut intake = Self {
            config,
            url,
            open: None,
            seen: Arc::new(Mutex::new(HashMap::new())),
        };
        intake.open = Some(intake.open().await?);
        Ok(intake)
    }

    /// Declares [`IntakeConfig::queue`] as a durable queue (with the arguments `declaration`
    /// asks for) bound to `declaration.exchange` with `declaration.binding_key`, declaring the
    /// exchange first when it is missing. Declaring an existing queue with the same arguments
    /// changes nothing; with other arguments the broker refuses (`PRECONDITION_FAILED`).
    ///
    /// # Errors
    ///
    /// [`ConnectError`]: as [`connect`](Self::connect), and kind
    /// [`Topology`](crate::ConnectErrorKind::Topology) when the broker refuses the queue, the
    /// binding or the exchange.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the exchange, queue or binding declared; a later call
    /// finds them.
    pub async fn declare_queue(
        config: &IntakeConfig,
        declaration: &QueueDeclaration,
    ) -> Result<(), ConnectError> {
        let url = parse_url(config)?;
        let queue = config.queue.as_str();
        let queue_error = |reason: String| ConnectError::Queue {
            server: url.shown.clone(),
            queue: queue.to_owned(),
            reason,
        };
        let attempt = async {
            let connection = connect(&url, &config.connection_name).await?;
            ensure_exchange(&connection, &url, &declaration.exchange, true).await?;
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| connect_error(e, &url))?;
            let mut arguments = FieldTable::default();
            if declaration.quorum {
                arguments.insert(
                    "x-queue-type".into(),
                    AMQPValue::LongString("quorum".into()),
                );
            }
            if declaration.single_active_consumer {
                arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
            }
            let durable = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            channel
                .queue_declare(queue.into(), durable, arguments)
                .await
                .map_err(|e| queue_error(format!("could not be declared: {e}")))?;
            channel
                .queue_bind(
                    queue.into(),
                    declaration.exchange.as_str().into(),
                    declaration.binding_key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    queue_error(format!(
                        "could not be bound to {:?} with {:?}: {e}",
                        declaration.exchange, declaration.binding_key
                    ))
                })?;
            let _ = connection.close(200, "OK".into()).await;
            Ok(())
        };
        tokio::time::timeout(config.connect_timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(ConnectError::TimedOut {
                    server: url.shown.clone(),
                    timeout: config.connect_timeout,
                })
            })
    }

    async fn open(&self) -> Result<Open, ConnectError> {
        let url = &self.url;
        let queue = self.config.queue.as_str();
        let attempt = async {
            let connection = connect(url, &self.config.connection_name).await?;
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| connect_error(e, url))?;
            channel
                .basic_qos(self.config.prefetch, BasicQosOptions::default())
                .await
                .map_err(|e| connect_error(e, url))?;
            let consumer = channel
                .basic_consume(
                    queue.into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    if e.is_amqp_error() {
                        ConnectError::Queue {
                            server: url.shown.clone(),
                            queue: queue.to_owned(),
                            reason: format!("cannot be consumed: {e}"),
                        }
                    } else {
                        connect_error(e, url)
                    }
                })?;
            Ok(Open {
                _connection: connection,
                _channel: channel,
                consumer,
            })
        };
        tokio::time::timeout(self.config.connect_timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(ConnectError::TimedOut {
                    server: url.shown.clone(),
                    timeout: self.config.connect_timeout,
                })
            })
    }
}

fn parse_url(config: &IntakeConfig) -> Result<BrokerUrl, ConnectError> {
    let invalid = |reason| {
        ConnectError::InvalidConfig(ConfigError::InvalidQueue {
            name: config.queue.clone(),
            reason,
        })
    };
    if config.queue.is_empty() || config.queue.len() > 255 {
        return Err(invalid("a queue name is 1 to 255 bytes"));
    }
    if config.queue.chars().any(char::is_control) {
        return Err(invalid("a queue name cannot hold control characters"));
    }
    if config.prefetch == 0 {
        return Err(invalid(
            "prefetch must be at least 1 (0 would mean unbounded)",
        ));
    }
    let heartbeat = u16::try_from(config.heartbeat.as_secs().max(1)).unwrap_or(u16::MAX);
    url::with_tls_ca(
        url::parse(&config.url, heartbeat)?,
        config.tls_ca.as_deref(),
    )
}

impl Intake for AmqpIntake {
    type Settle = AmqpSettle;

    async fn next(&mut self) -> Result<Delivery<AmqpSettle>, IntakeError> {
        if self.open.is_none() {
            let open = self
                .open()
                .await
                .map_err(|e| IntakeError::new("while reconnecting", e))?;
            tracing::info!(queue = %self.config.queue, server = %self.url.shown,
                "consuming again");
            self.open = Some(open);
        }
        let Some(open) = self.open.as_mut() else {
            return Err(IntakeError::message("no open consumer"));
        };
        let delivery = match open.consumer.next().await {
            Some(Ok(delivery)) => delivery,
            Some(Err(error)) => {
                self.open = None;
                return Err(IntakeError::new("while consuming", error));
            }
            None => {
                self.open = None;
                return Err(IntakeError::message(format!(
                    "the consumer of queue {:?} ended (connection closed, queue deleted or \
                     consumer cancelled); reconnecting",
                    self.config.queue
                )));
            }
        };
        let headers = headers_of(delivery.properties.headers().as_ref());
        let location = format!(
            "queue {} (exchange {}, routing key {})",
            self.config.queue, delivery.exchange, delivery.routing_key
        );
        let event = contract::read_event(headers, &delivery.data, &location);
        let key = match &event {
            Ok(event) => Some(event.event_id.to_string()),
            Err(malformed) => malformed.event_id.map(|id| id.to_string()),
        };
        let counted = key.as_ref().map_or(1, |key| {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if seen.len() >= MAX_COUNTED && !seen.contains_key(key) {
                seen.clear();
            }
            let n = seen.entry(key.clone()).or_default();
            *n += 1;
            *n
        });
        let from_broker = match delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(X_DELIVERY_COUNT))
        {
            Some(value) => as_u64(value).map_or(1, |n| n.saturating_add(1)),
            None => 1 + u64::from(delivery.redelivered),
        };
        Ok(Delivery {
            event,
            delivery_count: from_broker.max(counted),
            settle: AmqpSettle {
                acker: delivery.acker,
                key,
                seen: self.seen.clone(),
            },
        })
    }
}

/// Settles one AMQP delivery: `basic.ack`, a delayed `basic.nack` with requeue, or
/// `basic.reject` without requeue. See [`AmqpIntake`].
pub struct AmqpSettle {
    acker: Acker,
    /// The event id the intake counts deliveries under.
    key: Option<String>,
    seen: Arc<Mutex<HashMap<String, u64>>>,
}

impl AmqpSettle {
    /// The event is settled for good: stop counting its deliveries.
    fn forget(&self) {
        if let Some(key) = &self.key {
            self.seen
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(key);
        }
    }
}

impl Settle for AmqpSettle {
    async fn ack(&self) -> Result<(), IntakeError> {
        self.forget();
        self.acker
            .ack(BasicAckOptions::default())
            .await
            .map(drop)
            .map_err(|e| IntakeError::new("while acknowledging", e))
    }

    /// Requeues the message after `delay` (at once for a zero delay). Returns before the delay
    /// ends: a timer task sends the `basic.nack`.
    async fn nak(&self, delay: Duration) -> Result<(), IntakeError> {
        let requeue = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        if delay.is_zero() {
            return self
                .acker
                .nack(requeue)
                .await
                .map(drop)
                .map_err(|e| IntakeError::new("while handing a message back", e));
        }
        let acker = self.acker.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            // A failure means the channel closed, which requeues the message anyway.
            if let Err(error) = acker.nack(requeue).await {
                tracing::debug!(%error, "delayed nack not sent; the broker requeues on close");
            }
        });
        Ok(())
    }

    async fn term(&self) -> Result<(), IntakeError> {
        self.forget();
        self.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .map(drop)
            .map_err(|e| IntakeError::new("while rejecting a message", e))
    }

    /// Nothing to do: RabbitMQ has no per-message ack wait to restart.
    async fn in_progress(&self) -> Result<(), IntakeError> {
        Ok(())
    }
}

/// A message's header table as text pairs: strings as they are, numbers in decimal, anything
/// else in its debug form (handoff's own headers are all strings). For readers of a queue
/// outside the intake (checkers, demos) that want the headers the intake would see.
pub fn headers_of(table: Option<&FieldTable>) -> Vec<(String, String)> {
    let Some(table) = table else {
        return Vec::new();
    };
    table
        .inner()
        .iter()
        .map(|(name, value)| {
            let text = match value {
                AMQPValue::LongString(s) => s.to_string(),
                AMQPValue::ShortString(s) => s.to_string(),
                AMQPValue::Boolean(b) => b.to_string(),
                other => match as_u64(other) {
                    Some(n) => n.to_string(),
                    None => format!("{other:?}"),
                },
            };
            (name.to_string(), text)
        })
        .collect()
}

fn as_u64(value: &AMQPValue) -> Option<u64> {
    match *value {
        AMQPValue::ShortShortUInt(n) => Some(n.into()),
        AMQPValue::ShortUInt(n) => Some(n.into()),
        AMQPValue::LongUInt(n) => Some(n.into()),
        AMQPValue::ShortShortInt(n) => u64::try_from(n).ok(),
        AMQPValue::ShortInt(n) => u64::try_from(n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(n).ok(),
        AMQPValue::LongLongInt(n) => u64::try_from(n).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_password() {
        let config = IntakeConfig {
            url: "amqp://inventory:hunter2@rabbit:5672/%2f".into(),
            ..IntakeConfig::default()
        };
        for shown in [format!("{config:?}"), format!("{config:#?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(
                shown.contains("amqp://inventory:***@rabbit:5672/%2f"),
                "{shown}"
            );
        }
    }

    #[test]
    fn header_values_are_read_as_text() {
        let mut table = FieldTable::default();
        table.insert("ce-id".into(), AMQPValue::LongString("abc".into()));
        table.insert(X_DELIVERY_COUNT.into(), AMQPValue::LongLongInt(3));
        let headers = headers_of(Some(&table));
        assert!(headers.contains(&("ce-id".to_owned(), "abc".to_owned())));
        assert!(headers.contains(&(X_DELIVERY_COUNT.to_owned(), "3".to_owned())));
        assert_eq!(as_u64(&AMQPValue::LongInt(-1)), None);
    }

    #[test]
    fn bad_queue_settings_are_refused_before_connecting() {
        let no_queue = IntakeConfig::default();
        assert!(parse_url(&no_queue).is_err());
        let no_prefetch = IntakeConfig {
            queue: "q".into(),
            prefetch: 0,
            ..IntakeConfig::default()
        };
        assert!(parse_url(&no_prefetch).is_err());
    }
}
