//! [`RedisTransport`]: the relay's [`Transport`] onto one Redis stream.

use std::sync::Arc;
use std::time::Duration;

use handoff_core::contract::{self, header};
use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind, Receipt, Transport};
use handoff_core::EventId;

use crate::entry::{EVENT_ID_FIELD, PAYLOAD_FIELD};
use crate::link::Link;
use crate::{ConnectError, RedisConfig};

/// Appends an event unless its dedup key is set, then sets the key for the window; atomic, as
/// every Lua script. Replies `{1, id}` for an append, `{0, id-of-the-earlier-append}` for a
/// duplicate.
const APPEND_ONCE: &str = r"
-- KEYS[1]: the stream; KEYS[2]: the event's dedup key.
-- ARGV[1]: the dedup window in milliseconds; ARGV[2..]: the entry's fields and values.
local seen = redis.call('GET', KEYS[2])
if seen then
  return {0, seen}
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('SET', KEYS[2], id, 'PX', ARGV[1])
return {1, id}
";

/// How often [`wait_until_ready`](Transport::wait_until_ready) pings a server that did not
/// answer.
const READY_POLL: Duration = Duration::from_millis(250);

/// The dedup id of a replayed copy of `event_id`: `<event_id>:replay:<marker>`.
///
/// A replayed copy needs a dedup id of its own: the transport appends nothing for an id it saw
/// inside the dedup window, so a replay of an event published a moment ago would be
/// acknowledged and silently dropped. Consumers never key on this id (their inbox keys on
/// `ce-id`, which stays the event id), and the marker keeps two replay runs apart as well. The
/// same shape as `handoff_nats::replay_msg_id`.
///
/// # Examples
///
/// ```
/// assert_eq!(
///     handoff_redis::replay_dedup_id(uuid::Uuid::nil(), "r-1"),
///     "00000000-0000-0000-0000-000000000000:replay:r-1"
/// );
/// ```
pub fn replay_dedup_id(event_id: EventId, marker: &str) -> String {
    format!("{}:replay:{marker}", event_id.hyphenated())
}

/// Appends outbox events to one Redis stream, each exactly once per dedup window.
///
/// Every event is one entry of [`RedisConfig::stream`] with, in this order, the fields
/// `event_id` (the event id), `payload` (the JSON text, byte for byte) and the message contract
/// of every handoff destination by its header names: `ce-specversion`, `ce-id`, `ce-type`,
/// `ce-source`, `ce-time`, `Content-Type`, `Handoff-Aggregate-Type`, `Handoff-Aggregate-Id`,
/// `Handoff-Sequence`, `Handoff-Schema-Version`, `Handoff-Global-Sequence` (global events only)
/// and the writer's own headers (such as `traceparent`). Redis assigns the entry id
/// (`<ms>-<seq>`); the receipt is `redis <stream> <entry id>`.
///
/// Redis has no deduplication of its own, so the append is a Lua script, atomic on the server:
/// it appends only when the key `<stream>:dedup:<event id>` is absent, and then sets that key
/// (holding the entry id) to expire after [`RedisConfig::dedup_window`]. A republish inside the
/// window (after a timeout, a lost connection, or a relay that died between the append and
/// marking the row) appends nothing and returns the first append's receipt, with
/// `(duplicate)` after it. Past the window a republish is a second entry, which consumers drop
/// by event id in their inbox.
///
/// Order: the relay never publishes two events of one aggregate at once, and one stream keeps
/// the order of appends, so an aggregate's events are in the stream in sequence order.
///
/// Errors: an event larger than [`RedisConfig::max_event_bytes`] or a caller header named
/// `event_id` or `payload` fails with [`PublishErrorKind::Rejected`] without being sent; an
/// unreachable server or a dropped connection with [`PublishErrorKind::Unavailable`]; no answer
/// within [`RedisConfig::publish_timeout`] with [`PublishErrorKind::Timeout`] (ambiguous: the
/// script may have run, and the retry under the same id is absorbed by the dedup key); a server
/// out of memory (`OOM`) with [`PublishErrorKind::Throttled`]; other server errors
/// (`WRONGTYPE`, `READONLY`) with [`PublishErrorKind::Transient`]; a refused login or command
/// (`NOAUTH`, `WRONGPASS`, `NOPERM`) with [`PublishErrorKind::Misconfigured`]. A connection that
/// failed or went silent is dropped, and the next call opens a new one.
///
/// Durability is the server's: an acknowledged append is in the primary's memory, and on disk
/// as its persistence settings say (`appendonly yes` with `appendfsync always` for every
/// append). Redis Cluster is not supported (the script touches two keys).
///
/// # Examples
///
/// ```no_run
/// use handoff_core::delivery::Transport;
/// use handoff_redis::{RedisConfig, RedisTransport};
///
/// # use handoff_core::delivery::OutboxEvent;
/// # async fn example(event: OutboxEvent) -> Result<(), Box<dyn std::error::Error>> {
/// let transport = RedisTransport::connect(RedisConfig {
///     url: "redis://127.0.0.1:6379".into(),
///     stream: "orders:outbox".into(),
///     ..RedisConfig::default()
/// })
/// .await?;
/// let receipt = transport.publish(&event).await?;
/// println!("{:?}", receipt.detail()); // Some("redis orders:outbox 1733390000000-0")
/// # Ok(())
/// # }
/// ```
pub struct RedisTransport {
    config: RedisConfig,
    pub(crate) link: Arc<Link>,
    script: redis::Script,
}

impl std::fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTransport")
            .field("server", &self.link.server)
            .field("stream", &self.config.stream)
            .finish_non_exhaustive()
    }
}

impl RedisTransport {
    /// Checks the configuration, connects, and checks that the stream key is a stream or
    /// absent (it is created by the first append).
    ///
    /// # Errors
    ///
    /// [`ConnectError`]: an invalid configuration or URL, an unreachable server, refused
    /// credentials, or a stream key holding another type (kind
    /// [`Topology`](crate::ConnectErrorKind::Topology)).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt; nothing is left behind.
    pub async fn connect(config: RedisConfig) -> Result<RedisTransport, ConnectError> {
        config.validate()?;
        let link = Arc::new(Link::new(&config.url, config.connect_timeout)?);
        check_stream(&link, &config.stream, config.connect_timeout).await?;
        Ok(RedisTransport {
            config,
            link,
            script: redis::Script::new(APPEND_ONCE),
        })
    }

    /// The configuration this transport was connected with.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The key that remembers `dedup_id` for the dedup window: `<stream>:dedup:<dedup_id>`,
    /// where `dedup_id` is the event id, or [`replay_dedup_id`] for a replayed copy.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(transport: &handoff_redis::RedisTransport) {
    /// let key = transport.dedup_key("0192f3a4-7c1e-7d2a-8b3c-4d5e6f708192");
    /// assert_eq!(key, "handoff:outbox:dedup:0192f3a4-7c1e-7d2a-8b3c-4d5e6f708192");
    /// # }
    /// ```
    pub fn dedup_key(&self, dedup_id: &str) -> String {
        format!("{}:dedup:{dedup_id}", self.config.stream)
    }

    /// The fields `event` is appended with (see [`RedisTransport`]), plus
    /// [`Handoff-Replay`](header::REPLAY) set to `replay` for a replayed copy.
    ///
    /// # Errors
    ///
    /// [`PublishErrorKind::Rejected`]: the contract refuses a caller header, a caller header is
    /// named `event_id` or `payload`, or the replay marker holds CR, LF or NUL.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::{OutboxEvent, PublishError};
    /// # fn example(t: &handoff_redis::RedisTransport, e: &OutboxEvent) -> Result<(), PublishError> {
    /// let fields = t.fields(e, None)?;
    /// assert_eq!(fields[0].0, "event_id");
    /// assert_eq!(fields[1].0, "payload");
    /// # Ok(())
    /// # }
    /// ```
    pub fn fields(
        &self,
        event: &OutboxEvent,
        replay: Option<&str>,
    ) -> Result<Vec<(String, String)>, PublishError> {
        let headers = contract::headers(event, &self.config.ce_source)?;
        if let Some((name, _)) = event.headers.iter().find(|(name, _)| {
            name.eq_ignore_ascii_case(EVENT_ID_FIELD) || name.eq_ignore_ascii_case(PAYLOAD_FIELD)
        }) {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!("caller header {name:?} clashes with a field of the redis entry"),
            ));
        }
        let mut fields = Vec::with_capacity(headers.len() + 3);
        fields.push((
            EVENT_ID_FIELD.to_owned(),
            event.event_id.hyphenated().to_string(),
        ));
        fields.push((PAYLOAD_FIELD.to_owned(), event.payload.clone()));
        fields.extend(headers);
        if let Some(marker) = replay {
            if marker.contains(['\r', '\n', '\0']) {
                return Err(PublishError::new(
                    PublishErrorKind::Rejected,
                    format!("replay marker {marker:?} holds CR, LF or NUL"),
                ));
            }
            fields.push((header::REPLAY.to_owned(), marker.to_owned()));
        }
        Ok(fields)
    }

    /// Appends a replayed copy of `event` for `handoff replay` or `handoff reconcile`: the
    /// relay's fields plus [`Handoff-Replay`](header::REPLAY)` = marker`, deduplicated under
    /// [`replay_dedup_id`] rather than the event id, so it gets through the dedup window the
    /// first publish set, and a second send of the same replay run does not.
    ///
    /// # Errors
    ///
    /// As [`publish`](Transport::publish).
    ///
    /// # Cancel safety
    ///
    /// As [`publish`](Transport::publish): the copy may or may not be appended; sending it
    /// again with the same marker appends it at most once.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::{OutboxEvent, PublishError};
    /// # async fn example(t: &handoff_redis::RedisTransport, e: &OutboxEvent) -> Result<(), PublishError> {
    /// t.publish_replay(e, "0193a0c4-replay-run").await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn publish_replay(
        &self,
        event: &OutboxEvent,
        marker: &str,
    ) -> Result<Receipt, PublishError> {
        let fields = self.fields(event, Some(marker))?;
        self.append(event, &replay_dedup_id(event.event_id, marker), fields)
            .await
    }

    async fn append(
        &self,
        event: &OutboxEvent,
        dedup_id: &str,
        fields: Vec<(String, String)>,
    ) -> Result<Receipt, PublishError> {
        let size: usize = fields.iter().map(|(n, v)| n.len() + v.len()).sum();
        if size > self.config.max_event_bytes {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!(
                    "event {} is {size} bytes, over the {} bytes max_event_bytes allows",
                    event.event_id, self.config.max_event_bytes
                ),
            ));
        }
        let stream = self.config.stream.as_str();
        let dedup_key = self.dedup_key(dedup_id);
        let window_ms = u64::try_from(self.config.dedup_window.as_millis()).unwrap_or(u64::MAX);
        let script = &self.script;
        let (appended, id): (i64, String) = self
            .link
            .call(self.config.publish_timeout, |mut connection| async move {
                let mut invocation = script.key(stream);
                invocation.key(&dedup_key).arg(window_ms);
                for (name, value) in &fields {
                    invocation.arg(name).arg(value);
                }
                invocation.invoke_async(&mut connection).await
            })
            .await
            .map_err(|e| {
                e.into_publish_error(&format!(
                    "while appending event {} to stream {stream}",
                    event.event_id
                ))
            })?;
        Ok(if appended == 1 {
            Receipt::new(format!("redis {stream} {id}"))
        } else {
            tracing::debug!(event_id = %event.event_id, stream, entry = %id,
                "appended before inside the dedup window; nothing appended");
            Receipt::new(format!("redis {stream} {id} (duplicate)"))
        })
    }
}

/// Fails unless `stream` is a stream or absent.
pub(crate) async fn check_stream(
    link: &Link,
    stream: &str,
    timeout: Duration,
) -> Result<(), ConnectError> {
    let kind: String = link
        .call(timeout, |mut connection| async move {
            redis::cmd("TYPE")
                .arg(stream)
                .query_async(&mut connection)
                .await
        })
        .await
        .map_err(|error| match error {
            crate::error::CallError::Connect(error) => error,
            crate::error::CallError::Redis(source) if source.is_io_error() => {
                ConnectError::Unreachable {
                    server: link.server.clone(),
                    source,
                }
            }
            crate::error::CallError::Redis(source) if source.code() == Some("NOPERM") => {
                ConnectError::Unauthorized {
                    server: link.server.clone(),
                    source,
                }
            }
            crate::error::CallError::Redis(source) => ConnectError::Stream {
                server: link.server.clone(),
                stream: stream.to_owned(),
                reason: format!("the key's type could not be read: {source}"),
            },
            crate::error::CallError::TimedOut(timeout) => ConnectError::TimedOut {
                server: link.server.clone(),
                timeout,
            },
        })?;
    match kind.as_str() {
        "stream" | "none" => Ok(()),
        other => Err(ConnectError::Stream {
            server: link.server.clone(),
            stream: stream.to_owned(),
            reason: format!("the key holds a {other}, not a stream"),
        }),
    }
}

impl Transport for RedisTransport {
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        let fields = self.fields(event, None)?;
        self.append(event, &event.event_id.hyphenated().to_string(), fields)
            .await
    }

    /// Pings the server (opening a connection when there is none), again every 250 ms, until
    /// it answers or `at_most` has passed.
    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + at_most;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            let ping = self.link.call(left, |mut connection| async move {
                redis::cmd("PING")
                    .query_async::<String>(&mut connection)
                    .await
            });
            if let Ok(Ok(_)) = tokio::time::timeout(left, ping).await {
                return true;
            }
            tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + READY_POLL)).await;
        }
    }
}
