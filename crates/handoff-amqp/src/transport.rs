//! [`AmqpTransport`]: the relay's [`Transport`] onto one RabbitMQ exchange.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use handoff_core::contract;
use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind, Receipt, Transport};
use handoff_core::subject::encode_token;
use handoff_core::EventId;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind,
    ExchangeKind,
};

use crate::url::{self, BrokerUrl};
use crate::{AmqpConfig, ConnectError};

/// AMQP's persistent delivery mode: a durable queue writes the message to disk before the
/// broker confirms it.
const PERSISTENT: u8 = 2;

/// How often [`wait_until_ready`](Transport::wait_until_ready) looks whether the broker has
/// unblocked the connection.
const BLOCKED_POLL: Duration = Duration::from_millis(50);

/// How long a publish stalled by `connection.blocked` is kept for a retry of its event to
/// adopt (see [`AmqpTransport`]); an event retried later than this is published again.
const STALLED_KEEP: Duration = Duration::from_secs(3600);

/// A publish's outcome, still to come: sending the frames, then the broker's confirm.
type ConfirmFuture = Pin<Box<dyn Future<Output = Result<Confirmation, lapin::Error>> + Send>>;

/// Publishes outbox events to one RabbitMQ exchange and waits for each publisher confirm.
///
/// Each event is published to [`AmqpConfig::exchange`] with routing key
/// `<aggregate_type>.<encode_token(aggregate_id)>` (see [`routing_key`](Self::routing_key)),
/// `mandatory` set, and these properties: `message_id` = the event id, `content_type` =
/// `application/json`, `delivery_mode` = 2 (persistent), and as `headers` the message contract
/// of every handoff destination (`ce-*`, `Content-Type`, `Handoff-*` and the writer's own
/// headers, all as long strings). The body is the payload's JSON text, byte for byte.
///
/// The channel is in confirm mode, and a publish succeeds only on the broker's `basic.ack`
/// for it: by then every queue the message was routed to holds it (on disk, for durable
/// queues). A message no queue is bound for comes back (`basic.return`) and fails with
/// [`PublishErrorKind::Rejected`], which quarantines it; a `basic.nack` fails with
/// [`PublishErrorKind::Transient`].
///
/// RabbitMQ has no deduplication of its own: a republish (after a timeout, a lost connection,
/// or a relay that died between the confirm and marking the row) is a second message, which
/// consumers drop by event id in their inbox.
///
/// RabbitMQ blocks a publishing connection while a memory or disk alarm is raised
/// (`connection.blocked`): it reads nothing more from it, so no publish can be confirmed until
/// the alarm clears. That concerns every event, not one: while the broker says the connection
/// is blocked a publish fails at once with [`PublishErrorKind::Throttled`] (nothing is sent), and
/// so does one whose confirm did not come in time because the connection got blocked meanwhile;
/// the relay pauses the destination and charges no attempt.
/// [`wait_until_ready`](Transport::wait_until_ready) is ready only once the connection is open
/// and not blocked. A publish stalled that way is already in the broker's socket buffer (or in
/// the client's): it is routed when the alarm clears. So the transport keeps it, and when the
/// same event is published again on the same connection it waits for that publish's confirm
/// instead of sending a second copy.
///
/// A message the broker refuses by closing the channel (`PRECONDITION_FAILED`, such as a body
/// over its `max_message_size`) fails with [`PublishErrorKind::Rejected`], which holds it; the
/// other publishes in flight on that channel fail with [`PublishErrorKind::Unavailable`] and
/// are retried on a new channel.
///
/// lapin does not reconnect by itself (its auto-recovery is not used: it would replay
/// publishes whose confirm was lost). When the connection or channel closes, publishes fail
/// with [`PublishErrorKind::Unavailable`] and [`wait_until_ready`](Transport::wait_until_ready)
/// opens a new connection and channel (and declares the exchange again if configured).
///
/// # Examples
///
/// ```no_run
/// use handoff_amqp::{AmqpConfig, AmqpTransport};
/// use handoff_core::delivery::Transport;
///
/// # use handoff_core::delivery::OutboxEvent;
/// # async fn example(event: OutboxEvent) -> Result<(), Box<dyn std::error::Error>> {
/// let transport = AmqpTransport::connect(AmqpConfig {
///     url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
///     exchange: "orders".into(),
///     ..AmqpConfig::default()
/// })
/// .await?;
/// transport.publish(&event).await?;
/// # Ok(())
/// # }
/// ```
pub struct AmqpTransport {
    config: AmqpConfig,
    url: BrokerUrl,
    /// The connection and confirm-mode channel publishes go through; `None` after a failed
    /// reconnect. std Mutex: never held across `.await`.
    link: Mutex<Option<Link>>,
    /// One reconnect at a time: concurrent `wait_until_ready` calls wait for the first.
    reconnecting: tokio::sync::Mutex<()>,
    /// Publishes whose confirm did not come in time because the broker blocked the connection,
    /// by event: the message is on its way and is confirmed once the alarm clears, so a retry
    /// of the event on the same link waits for it rather than publishing a copy. std Mutex:
    /// never held across `.await`.
    stalled: Mutex<HashMap<EventId, Stalled>>,
}

/// A publish stalled by `connection.blocked`, kept for a retry of its event.
struct Stalled {
    /// The [`Link::serial`] it was published on: on another link it is no use.
    link: u64,
    /// When it was kept.
    since: Instant,
    confirm: ConfirmFuture,
}

impl std::fmt::Debug for AmqpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpTransport")
            .field("server", &self.url.shown)
            .field("exchange", &self.config.exchange)
            .finish_non_exhaustive()
    }
}

/// One open connection and its publishing channel.
#[derive(Clone)]
struct Link {
    /// Tells links apart: a new one for every channel opened.
    serial: u64,
    connection: Arc<Connection>,
    channel: Channel,
}

impl Link {
    fn is_open(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    /// Whether the broker has blocked the connection (`connection.blocked`, a memory or disk
    /// alarm) and not unblocked it yet.
    fn is_blocked(&self) -> bool {
        self.connection.status().blocked()
    }
}

impl AmqpTransport {
    /// Validates `config`, connects to the broker, makes sure the exchange exists (declaring
    /// it as a durable `topic` exchange when it is missing and
    /// [`declare_exchange`](AmqpConfig::declare_exchange) is on) and opens a channel in
    /// confirm mode.
    ///
    /// The first connection is tried once, within
    /// [`connect_timeout`](AmqpConfig::connect_timeout), so a caller that waits for the broker
    /// retries with its own backoff and can say what it waits for.
    ///
    /// # Errors
    ///
    /// [`ConnectError`], whose [`kind`](ConnectError::kind) tells an invalid configuration or
    /// URL (permanent) from an unreachable broker (retry), refused credentials or vhost, and an
    /// exchange that is missing or cannot be declared. No message holds the URL's password.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt; a half-open connection is closed. A declared
    /// exchange stays.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_amqp::{AmqpConfig, AmqpTransport, ConnectErrorKind};
    ///
    /// # async fn example() {
    /// match AmqpTransport::connect(AmqpConfig::default()).await {
    ///     Ok(_transport) => {}
    ///     Err(e) if e.kind() == ConnectErrorKind::Unreachable => { /* retry later */ }
    ///     Err(e) => panic!("{e}"),
    /// }
    /// # }
    /// ```
    pub async fn connect(config: AmqpConfig) -> Result<Self, ConnectError> {
        config.validate()?;
        let heartbeat = u16::try_from(config.heartbeat.as_secs()).unwrap_or(u16::MAX);
        let url = url::with_tls_ca(
            url::parse(&config.url, heartbeat)?,
            config.tls_ca.as_deref(),
        )?;
        let link = open_link(&url, &config, None).await?;
        Ok(Self {
            config,
            url,
            link: Mutex::new(Some(link)),
            reconnecting: tokio::sync::Mutex::new(()),
            stalled: Mutex::new(HashMap::new()),
        })
    }

    /// The routing key `event` is published with:
    /// `<aggregate_type>.<encode_token(aggregate_id)>`, or `global` for an event of the global
    /// lane (global order mode; bind one queue with `global` to read it in order).
    ///
    /// The aggregate id is percent-encoded by [`encode_token`], so any id is exactly one word
    /// (no `.`) and decodes back; consumers bind with `<aggregate_type>.*` or `#`.
    ///
    /// # Errors
    ///
    /// [`PublishErrorKind::Rejected`] when the aggregate type is not one word (empty, or
    /// holding `.`, `*`, `#`, whitespace or a non-ASCII character) or the key is longer than
    /// AMQP's 255 bytes.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::SystemTime;
    /// # use handoff_core::delivery::OutboxEvent;
    /// # let event = OutboxEvent {
    /// #     event_id: uuid::Uuid::nil(), aggregate_type: "order".into(),
    /// #     aggregate_id: "eu.42".into(), aggregate_sequence: 1, global_sequence: None,
    /// #     event_type: "OrderPlaced".into(),
    /// #     schema_version: 1, payload: "{}".into(), headers: vec![],
    /// #     occurred_at: SystemTime::UNIX_EPOCH, attempt_count: 0,
    /// # };
    /// assert_eq!(handoff_amqp::AmqpTransport::routing_key(&event).unwrap(), "order.eu%2E42");
    /// ```
    pub fn routing_key(event: &OutboxEvent) -> Result<String, PublishError> {
        if event.global_sequence.is_some() {
            return Ok("global".to_owned());
        }
        let kind = &event.aggregate_type;
        let one_word = !kind.is_empty()
            && kind
                .bytes()
                .all(|b| b.is_ascii_graphic() && !matches!(b, b'.' | b'*' | b'#'));
        if !one_word {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!(
                    "aggregate type {kind:?} is not one routing-key word (printable ASCII \
                     without '.', '*' or '#')"
                ),
            ));
        }
        let key = format!("{kind}.{}", encode_token(&event.aggregate_id));
        if key.len() > 255 {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!(
                    "routing key for aggregate {:?} is {} bytes; AMQP allows 255",
                    event.aggregate_id,
                    key.len()
                ),
            ));
        }
        Ok(key)
    }

    /// The `headers` table `event` is published with: the message contract
    /// ([`handoff_core::contract::headers`]) as long strings.
    ///
    /// # Errors
    ///
    /// [`PublishErrorKind::Rejected`] when the contract refuses a caller header, a header name
    /// is longer than 255 bytes, or a caller header name appears twice (a table holds one
    /// value per name).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::{OutboxEvent, PublishError};
    /// # fn example(transport: &handoff_amqp::AmqpTransport, event: &OutboxEvent)
    /// # -> Result<(), PublishError> {
    /// let headers = transport.headers(event)?;
    /// assert!(headers.contains_key("ce-id"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn headers(&self, event: &OutboxEvent) -> Result<FieldTable, PublishError> {
        field_table(contract::headers(event, &self.config.ce_source)?)
    }

    /// The configuration the transport was connected with.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(transport: &handoff_amqp::AmqpTransport) {
    /// println!("publishing to exchange {}", transport.config().exchange);
    /// # }
    /// ```
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// The broker as `scheme://host:port/vhost`, without credentials, for messages.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(transport: &handoff_amqp::AmqpTransport) {
    /// assert_eq!(transport.server(), "amqp://127.0.0.1:5672/%2f");
    /// # }
    /// ```
    pub fn server(&self) -> &str {
        &self.url.shown
    }

    /// Closes the current connection from the client side, as a broker restart or a network
    /// cut would end it: publishes fail with [`PublishErrorKind::Unavailable`] until
    /// [`wait_until_ready`](Transport::wait_until_ready) reconnects. For drills and tests.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn example(transport: &handoff_amqp::AmqpTransport) {
    /// use handoff_core::delivery::Transport;
    ///
    /// transport.disconnect().await;
    /// assert!(transport.wait_until_ready(std::time::Duration::from_secs(5)).await);
    /// # }
    /// ```
    pub async fn disconnect(&self) {
        let link = self.current();
        if let Some(link) = link {
            let _ = link.connection.close(320, "closed by handoff".into()).await;
        }
    }

    fn current(&self) -> Option<Link> {
        self.link.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn stalled_publishes(&self) -> std::sync::MutexGuard<'_, HashMap<EventId, Stalled>> {
        self.stalled.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the stalled publish of `event_id`, if one was kept on `link`.
    fn take_stalled(&self, event_id: EventId, link: &Link) -> Option<ConfirmFuture> {
        let stalled = self.stalled_publishes().remove(&event_id)?;
        (stalled.link == link.serial).then_some(stalled.confirm)
    }

    /// Keeps a publish stalled by `connection.blocked` for a retry of `event_id`, and drops
    /// the ones kept too long or on another link.
    fn keep_stalled(&self, event_id: EventId, link: &Link, confirm: ConfirmFuture) {
        let now = Instant::now();
        let mut stalled = self.stalled_publishes();
        stalled.retain(|_, kept| {
            kept.link == link.serial && now.saturating_duration_since(kept.since) < STALLED_KEEP
        });
        stalled.insert(
            event_id,
            Stalled {
                link: link.serial,
                since: now,
                confirm,
            },
        );
    }

    /// The open link, reopening the connection or channel when either closed.
    async fn ensure_link(&self) -> Result<Link, ConnectError> {
        let _one_at_a_time = self.reconnecting.lock().await;
        let current = self.current();
        if let Some(link) = current.as_ref().filter(|link| link.is_open()) {
            return Ok(link.clone());
        }
        // A channel closed by the broker (a missing exchange, a refused message) leaves the
        // connection open: only the channel is reopened then.
        let connection = current
            .map(|link| link.connection)
            .filter(|connection| connection.status().connected());
        match open_link(&self.url, &self.config, connection).await {
            Ok(link) => {
                tracing::info!(server = %self.url.shown, exchange = %self.config.exchange,
                    "amqp channel open again");
                *self.link.lock().unwrap_or_else(|e| e.into_inner()) = Some(link.clone());
                // Publishes stalled on the old link are lost with it, or were routed: either
                // way their events are published again.
                self.stalled_publishes().clear();
                Ok(link)
            }
            Err(error) => {
                tracing::warn!(%error, "amqp reconnect failed");
                Err(error)
            }
        }
    }
}

impl Transport for AmqpTransport {
    /// Publishes `event` (mandatory, persistent) and waits at most
    /// [`AmqpConfig::publish_timeout`] for the broker's confirm.
    ///
    /// The receipt is `amqp <exchange> <routing key>`.
    ///
    /// While the connection or channel is closed this fails at once with
    /// [`PublishErrorKind::Unavailable`]; the relay then waits in
    /// [`wait_until_ready`](Transport::wait_until_ready), which reconnects. While the broker
    /// blocks the connection (`connection.blocked`) it fails at once with
    /// [`PublishErrorKind::Throttled`], and a publish of the same event that the block stalled
    /// is waited for rather than sent again.
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        let routing_key = Self::routing_key(event)?;
        let headers = self.headers(event)?;
        let message_id = event.event_id.hyphenated().to_string();
        let properties = BasicProperties::default()
            .with_message_id(message_id.into())
            .with_content_type("application/json".into())
            .with_delivery_mode(PERSISTENT)
            .with_headers(headers);
        let Some(link) = self.current().filter(Link::is_open) else {
            return Err(PublishError::new(
                PublishErrorKind::Unavailable,
                format!(
                    "not connected to the amqp broker {} (reconnecting)",
                    self.url.shown
                ),
            ));
        };
        let exchange = self.config.exchange.as_str();
        let blocked = || {
            PublishError::new(
                PublishErrorKind::Throttled,
                format!(
                    "the broker blocked the connection: memory or disk alarm on {} \
                     (connection.blocked); publishing waits until it clears",
                    self.url.shown
                ),
            )
        };
        // A publish of this event that the block stalled is still on its way: its confirm,
        // not a second copy.
        let mut confirm = match self.take_stalled(event.event_id, &link) {
            Some(confirm) if link.is_blocked() => {
                self.keep_stalled(event.event_id, &link, confirm);
                return Err(blocked());
            }
            Some(confirm) => confirm,
            // Nothing is sent to a blocked connection: the broker would not read it before
            // the alarm clears.
            None if link.is_blocked() => return Err(blocked()),
            None => {
                let options = BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                };
                let channel = link.channel.clone();
                let exchange = ShortString::from(exchange);
                let key = ShortString::from(routing_key.as_str());
                let body = event.payload.clone().into_bytes();
                Box::pin(async move {
                    channel
                        .basic_publish(exchange, key, options, &body, properties)
                        .await?
                        .await
                })
            }
        };
        let timeout = self.config.publish_timeout;
        match tokio::time::timeout(timeout, &mut confirm).await {
            Ok(Ok(Confirmation::Ack(None))) => {
                Ok(Receipt::new(format!("amqp {exchange} {routing_key}")))
            }
            Ok(Ok(Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)))) => {
                Err(PublishError::new(
                    PublishErrorKind::Rejected,
                    format!(
                        "unroutable: exchange {exchange:?} has no queue bound for routing key \
                         {routing_key:?} (the broker returned it: {} {}); bind a queue for it \
                         and retry the event",
                        returned.reply_code, returned.reply_text
                    ),
                ))
            }
            Ok(Ok(Confirmation::Nack(None))) => Err(PublishError::new(
                PublishErrorKind::Transient,
                format!(
                    "the broker nacked the message to {exchange:?} with routing key \
                     {routing_key:?} (a queue refused it, such as overflow=reject-publish, or \
                     an internal error)"
                ),
            )),
            Ok(Ok(Confirmation::NotRequested)) => Err(PublishError::new(
                PublishErrorKind::Transient,
                "the channel is not in confirm mode; reopening it",
            )),
            Ok(Err(error)) => Err(publish_error(
                &error,
                link.is_open(),
                exchange,
                &routing_key,
                event.payload.len(),
            )),
            Err(_elapsed) if link.is_blocked() => {
                // The broker stopped reading the connection: the message is routed when the
                // alarm clears, so a retry waits for this publish instead of sending a copy.
                self.keep_stalled(event.event_id, &link, confirm);
                Err(PublishError::new(
                    PublishErrorKind::Throttled,
                    format!(
                        "no confirm for {exchange:?} / {routing_key:?} within {timeout:?}: the \
                         broker blocked the connection (memory or disk alarm on {}, \
                         connection.blocked); the message is confirmed when it clears",
                        self.url.shown
                    ),
                ))
            }
            Err(_elapsed) => {
                let kind = if link.is_open() {
                    PublishErrorKind::Timeout
                } else {
                    PublishErrorKind::Unavailable
                };
                Err(PublishError::new(
                    kind,
                    format!("no confirm for {exchange:?} / {routing_key:?} within {timeout:?}"),
                ))
            }
        }
    }

    /// Returns `true` once a connection and a confirm-mode channel are open, reconnecting if
    /// needed, and the broker does not block the connection (`connection.blocked`, a memory or
    /// disk alarm), within `at_most`.
    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        let ready = async {
            loop {
                match self.ensure_link().await {
                    Ok(link) if !link.is_blocked() => return true,
                    // lapin clears the flag on `connection.unblocked`; nothing to send meanwhile.
                    Ok(_blocked) => tokio::time::sleep(BLOCKED_POLL).await,
                    Err(_) => return false,
                }
            }
        };
        tokio::time::timeout(at_most, ready).await.unwrap_or(false)
    }
}

/// Opens a connection (or reuses `connection` when it is still open), checks or declares the
/// exchange, and opens a channel in confirm mode; all within the connect timeout.
async fn open_link(
    url: &BrokerUrl,
    config: &AmqpConfig,
    connection: Option<Arc<Connection>>,
) -> Result<Link, ConnectError> {
    let attempt = async {
        let connection = match connection {
            Some(connection) => connection,
            None => Arc::new(connect(url, &config.connection_name).await?),
        };
        ensure_exchange(&connection, url, &config.exchange, config.declare_exchange).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|source| connect_error(source, url))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|source| connect_error(source, url))?;
        static LINKS: AtomicU64 = AtomicU64::new(0);
        Ok(Link {
            serial: LINKS.fetch_add(1, Ordering::Relaxed),
            connection,
            channel,
        })
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

/// Opens one connection named `name` (shown by `rabbitmqctl list_connections` and the
/// management UI). lapin always announces the `connection.blocked` capability, so the broker
/// tells it when it blocks the connection for an alarm (`Connection::status().blocked()`).
pub(crate) async fn connect(url: &BrokerUrl, name: &str) -> Result<Connection, ConnectError> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    lapin::DefaultConnectionBuilder::new()
        .map_err(|source| connect_error(source, url))?
        .with_uri(url.uri.clone())
        .with_properties(properties)
        .with_tls_config(url.tls.clone())
        .connect()
        .await
        .map_err(|source| connect_error(source, url))
}

/// Makes sure the exchange exists. With `declare`, a durable topic declare (a no-op for an
/// exchange that exists with those settings); when the broker refuses it because the exchange
/// exists with other settings (`PRECONDITION_FAILED`), a passive declare confirms it exists and
/// it is used as it is. Without `declare`, only the passive declare. Each on a throwaway
/// channel, since a refusal closes the channel it was asked on.
pub(crate) async fn ensure_exchange(
    connection: &Connection,
    url: &BrokerUrl,
    name: &str,
    declare: bool,
) -> Result<(), ConnectError> {
    let exchange_error = |reason: String| ConnectError::Exchange {
        server: url.shown.clone(),
        exchange: name.to_owned(),
        reason,
    };
    if declare {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        match declare_on_own_channel(connection, url, name, durable).await? {
            Ok(()) => return Ok(()),
            Err(error) if soft_error(&error) == Some(AMQPSoftError::PRECONDITIONFAILED) => {}
            Err(error) => {
                return Err(exchange_error(format!("could not be declared: {error}")));
            }
        }
    }
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    match declare_on_own_channel(connection, url, name, passive).await? {
        Ok(()) if declare => {
            tracing::info!(exchange = %name, server = %url.shown,
                "the exchange exists with other settings than durable topic; using it as it is");
            Ok(())
        }
        Ok(()) => Ok(()),
        Err(error) if soft_error(&error) == Some(AMQPSoftError::NOTFOUND) => Err(exchange_error(
            "does not exist, and declaring it is off; declare it or allow handoff to".to_owned(),
        )),
        Err(error) => Err(exchange_error(error.to_string())),
    }
}

/// One `exchange.declare` on a channel of its own: the outer error is the connection's, the
/// inner one the broker's answer to the declare.
async fn declare_on_own_channel(
    connection: &Connection,
    url: &BrokerUrl,
    name: &str,
    options: ExchangeDeclareOptions,
) -> Result<Result<(), lapin::Error>, ConnectError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| connect_error(source, url))?;
    match channel
        .exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            options,
            FieldTable::default(),
        )
        .await
    {
        Ok(()) => {
            let _ = channel.close(200, "OK".into()).await;
            Ok(Ok(()))
        }
        Err(error) if error.is_amqp_error() => Ok(Err(error)),
        Err(source) => Err(connect_error(source, url)),
    }
}

/// The channel-level AMQP error code of `error`, if it is one.
pub(crate) fn soft_error(error: &lapin::Error) -> Option<AMQPSoftError> {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(soft) => Some(soft.clone()),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}

/// Sorts a connection-time error: refused credentials or vhost, or an unreachable broker.
pub(crate) fn connect_error(source: lapin::Error, url: &BrokerUrl) -> ConnectError {
    let server = url.shown.clone();
    let refused = match source.kind() {
        ErrorKind::ProtocolError(amqp) => matches!(
            amqp.kind(),
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
        ),
        _ => false,
    };
    // rustls reports a refused certificate as InvalidData; nothing else on a TLS socket does
    // before the AMQP handshake.
    let tls = url.uri.scheme == lapin::uri::AMQPScheme::AMQPS
        && matches!(source.kind(), ErrorKind::IOError(e) if e.kind() == std::io::ErrorKind::InvalidData);
    if refused {
        ConnectError::Unauthorized { server, source }
    } else if tls {
        let mut innermost: &dyn std::error::Error = &source;
        while let Some(next) = innermost.source() {
            innermost = next;
        }
        ConnectError::Tls {
            server,
            reason: innermost.to_string(),
        }
    } else {
        ConnectError::Unreachable { server, source }
    }
}

/// The contract headers as an AMQP table of long strings.
pub(crate) fn field_table(headers: Vec<(String, String)>) -> Result<FieldTable, PublishError> {
    let mut table = FieldTable::default();
    for (name, value) in headers {
        let key = ShortString::try_new(name.as_str()).map_err(|_| {
            PublishError::new(
                PublishErrorKind::Rejected,
                format!("header name {name:?} is longer than AMQP's 255 bytes"),
            )
        })?;
        if table.contains_key(&name) {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!(
                    "header {name:?} is given twice; an AMQP header table holds one value per \
                     name"
                ),
            ));
        }
        table.insert(key, AMQPValue::LongString(LongString::from(value)));
    }
    Ok(table)
}

/// A failed publish (before any confirm): a message the broker refused by closing the channel
/// is the event's; otherwise a closed connection or channel is the broker being away, and
/// anything else the broker said may pass. `body_len` is the event's body, in bytes.
fn publish_error(
    error: &lapin::Error,
    link_open: bool,
    exchange: &str,
    routing_key: &str,
    body_len: usize,
) -> PublishError {
    if let Some(max) = refused_over_size(error) {
        // The broker closed the channel over one message, and every publish in flight on it
        // fails with its words: only the one over the limit is that message.
        if u64::try_from(body_len).map_or(true, |len| len > max) {
            return PublishError::new(
                PublishErrorKind::Rejected,
                format!(
                    "the broker refuses messages over {max} bytes (max_message_size) and this \
                     one is {body_len} bytes: publish to {exchange:?} with routing key \
                     {routing_key:?} failed: {error}"
                ),
            );
        }
    }
    let kind = match error.kind() {
        _ if !link_open => PublishErrorKind::Unavailable,
        ErrorKind::IOError(_)
        | ErrorKind::InvalidChannelState(..)
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::MissingHeartbeatError => PublishErrorKind::Unavailable,
        // The exchange is gone (deleted by an operator): not the event's fault. The channel
        // is closed by it, and reopening it declares the exchange again when allowed.
        ErrorKind::ProtocolError(_) if soft_error(error) == Some(AMQPSoftError::NOTFOUND) => {
            PublishErrorKind::Unavailable
        }
        // The relay's user may not write to the exchange (a permission revoked): no event
        // gets through until an operator fixes the setup.
        ErrorKind::ProtocolError(_) if soft_error(error) == Some(AMQPSoftError::ACCESSREFUSED) => {
            PublishErrorKind::Misconfigured
        }
        _ => PublishErrorKind::Transient,
    };
    PublishError::new(
        kind,
        format!("publish to {exchange:?} with routing key {routing_key:?} failed: {error}"),
    )
}

/// The size limit named when the broker closed the channel over a message too large
/// (`PRECONDITION_FAILED`), if that is what `error` is.
fn refused_over_size(error: &lapin::Error) -> Option<u64> {
    if soft_error(error) != Some(AMQPSoftError::PRECONDITIONFAILED) {
        return None;
    }
    let ErrorKind::ProtocolError(amqp) = error.kind() else {
        return None;
    };
    max_message_size_in(amqp.get_message().as_str())
}

/// The limit in RabbitMQ's refusal of a message over its size limit: `message size 5000 is
/// larger than configured max size 4096` (after `PRECONDITION_FAILED - ` as the broker sends
/// it), or `... is larger than max size 536870912` for its absolute limit.
fn max_message_size_in(text: &str) -> Option<u64> {
    let larger = text.find("is larger than ")?;
    let rest = &text[larger..];
    const MARKER: &str = "max size ";
    let digits = &rest[rest.find(MARKER)? + MARKER.len()..];
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    digits[..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;

    fn event(aggregate_type: &str, aggregate_id: &str) -> OutboxEvent {
        OutboxEvent {
            event_id: "0192f3a4-7c1e-7d2a-8b3c-4d5e6f708192".parse().unwrap(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            aggregate_sequence: 7,
            global_sequence: None,
            event_type: "OrderPlaced".into(),
            schema_version: 3,
            payload: r#"{"total":10}"#.into(),
            headers: vec![("traceparent".into(), "00-abc-def-01".into())],
            occurred_at: SystemTime::UNIX_EPOCH + Duration::new(1_796_238_994, 123_456_789),
            attempt_count: 0,
        }
    }

    #[test]
    fn a_global_event_goes_out_under_the_key_global_with_its_number() {
        let mut global = event("order", "o-1");
        global.global_sequence = Some(42);
        assert_eq!(AmqpTransport::routing_key(&global).unwrap(), "global");
        let headers = contract::headers(&global, "handoff").unwrap();
        assert!(headers.contains(&("Handoff-Global-Sequence".to_owned(), "42".to_owned())));
        let per_aggregate = contract::headers(&event("order", "o-1"), "handoff").unwrap();
        assert!(per_aggregate
            .iter()
            .all(|(name, _)| name != "Handoff-Global-Sequence"));
    }

    #[test]
    fn routing_keys_are_two_words() {
        let key = AmqpTransport::routing_key(&event("order", "eu.west 42")).unwrap();
        assert_eq!(key, "order.eu%2Ewest%2042");
        for bad in ["", "a.b", "a*", "a#", "a b", "é"] {
            let error = AmqpTransport::routing_key(&event(bad, "x")).unwrap_err();
            assert_eq!(error.kind(), PublishErrorKind::Rejected, "{bad:?}");
        }
        let long = AmqpTransport::routing_key(&event("order", &"ü".repeat(50))).unwrap_err();
        assert_eq!(long.kind(), PublishErrorKind::Rejected);
    }

    #[test]
    fn headers_become_a_table_of_long_strings() {
        let table = field_table(contract::headers(&event("order", "o.1"), "svc").unwrap()).unwrap();
        let get = |name: &str| match table.inner().get(name) {
            Some(AMQPValue::LongString(value)) => Some(value.to_string()),
            _ => None,
        };
        assert_eq!(
            get("ce-id").as_deref(),
            Some("0192f3a4-7c1e-7d2a-8b3c-4d5e6f708192")
        );
        assert_eq!(get("ce-source").as_deref(), Some("svc"));
        assert_eq!(get("Handoff-Aggregate-Id").as_deref(), Some("o%2E1"));
        assert_eq!(get("Handoff-Sequence").as_deref(), Some("7"));
        assert_eq!(get("traceparent").as_deref(), Some("00-abc-def-01"));
        assert_eq!(get("Nats-Msg-Id"), None);
    }

    #[test]
    fn unsendable_headers_are_rejected_not_panicking() {
        let long_name = vec![("x".repeat(256), "v".to_owned())];
        assert_eq!(
            field_table(long_name).unwrap_err().kind(),
            PublishErrorKind::Rejected
        );
        let twice = vec![
            ("a".to_owned(), "1".to_owned()),
            ("a".to_owned(), "2".to_owned()),
        ];
        assert_eq!(
            field_table(twice).unwrap_err().kind(),
            PublishErrorKind::Rejected
        );
    }

    fn refusal(soft: AMQPSoftError, text: &str) -> lapin::Error {
        lapin::Error::from(ErrorKind::ProtocolError(lapin::protocol::AMQPError::new(
            AMQPErrorKind::Soft(soft),
            text.into(),
        )))
    }

    const TOO_LARGE: &str =
        "PRECONDITION_FAILED - message size 5000 is larger than configured max size 4096";

    #[test]
    fn the_size_limit_is_read_from_the_brokers_refusal() {
        assert_eq!(max_message_size_in(TOO_LARGE), Some(4096));
        assert_eq!(
            max_message_size_in("message size 9 is larger than configured max size 8"),
            Some(8)
        );
        assert_eq!(
            max_message_size_in("message size 600000000 is larger than max size 536870912"),
            Some(536_870_912)
        );
        for other in [
            "PRECONDITION_FAILED - inequivalent arg 'durable'",
            "message size 5 is larger than configured max size ",
            "message size 5 is larger than configured max size x12",
            "max size 12",
            "",
        ] {
            assert_eq!(max_message_size_in(other), None, "{other:?}");
        }
    }

    #[test]
    fn a_channel_closed_over_one_message_is_charged_to_that_message_only() {
        let error = refusal(AMQPSoftError::PRECONDITIONFAILED, TOO_LARGE);
        assert_eq!(refused_over_size(&error), Some(4096));
        // The message over the limit: refused for good, whatever became of the channel.
        let own = publish_error(&error, false, "x", "thing.a", 5000);
        assert_eq!(own.kind(), PublishErrorKind::Rejected);
        assert!(own.to_string().contains("4096"), "{own}");
        assert!(own.to_string().contains("5000 bytes"), "{own}");
        // The others in flight on that channel failed because it closed under them.
        for len in [0, 12, 4096] {
            let other = publish_error(&error, false, "x", "thing.b", len);
            assert_eq!(other.kind(), PublishErrorKind::Unavailable, "{len}");
        }
        assert_eq!(
            publish_error(&error, true, "x", "thing.b", 10).kind(),
            PublishErrorKind::Transient
        );
    }

    #[test]
    fn other_refusals_keep_their_classification() {
        let inequivalent = refusal(
            AMQPSoftError::PRECONDITIONFAILED,
            "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x'",
        );
        assert_eq!(refused_over_size(&inequivalent), None);
        assert_eq!(
            publish_error(&inequivalent, false, "x", "k", 1 << 20).kind(),
            PublishErrorKind::Unavailable
        );
        assert_eq!(
            publish_error(&inequivalent, true, "x", "k", 1 << 20).kind(),
            PublishErrorKind::Transient
        );
        // A size text under another code is not a size refusal.
        let not_found = refusal(AMQPSoftError::NOTFOUND, TOO_LARGE);
        assert_eq!(refused_over_size(&not_found), None);
        assert_eq!(
            publish_error(&not_found, true, "x", "k", 5000).kind(),
            PublishErrorKind::Unavailable
        );
        let closed = lapin::Error::from(ErrorKind::InvalidChannelState(
            lapin::ChannelState::Closed,
            "basic.publish",
        ));
        assert_eq!(
            publish_error(&closed, true, "x", "k", 5000).kind(),
            PublishErrorKind::Unavailable
        );
    }
}
