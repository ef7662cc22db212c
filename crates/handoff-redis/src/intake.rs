//! [`RedisIntake`]: a consumer's [`Intake`] from a Redis stream through a consumer group.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use handoff_core::contract;
use handoff_core::intake::{Delivery, Intake, IntakeError, Settle};
use redis::aio::MultiplexedConnection;
use redis::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::config::{self, check_name, check_positive, ConfigError, DEFAULT_STREAM};
use crate::entry::{self, Entry};
use crate::error::CallError;
use crate::link::Link;
use crate::ConnectError;

/// Which stream and group a [`RedisIntake`] consumes, and how.
///
/// The `Debug` output shows the URL without its password.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use handoff_redis::IntakeConfig;
///
/// let config = IntakeConfig {
///     group: "inventory".into(),
///     consumer: "inventory-1".into(),
///     claim_idle: Duration::from_secs(60),
///     ..IntakeConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// assert_eq!(config.stream, "handoff:outbox");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct IntakeConfig {
    /// The server, as [`RedisConfig::url`](crate::RedisConfig::url). Default:
    /// `"redis://127.0.0.1:6379"`.
    pub url: String,
    /// The stream the relay appends to. Default: `"handoff:outbox"`.
    pub stream: String,
    /// The consumer group: one group per consuming service; each event is delivered to one
    /// consumer of the group. Created (with the stream, if missing) at connect time. Required.
    pub group: String,
    /// This consumer's name within the group. Keep it stable across restarts (its unsettled
    /// entries are read again first) and distinct between instances. Default: `"handoff"`.
    pub consumer: String,
    /// Entries asked for per read. Default: 64.
    pub batch: usize,
    /// How long one read waits for new entries on the server (`XREADGROUP ... BLOCK`) before
    /// the intake looks at handed-back and abandoned entries again. Default: 1 second.
    pub block: Duration,
    /// How long an entry may stay delivered and unsettled before any consumer of the group
    /// takes it over (`XAUTOCLAIM`): the ack wait. A consumer that died leaves its entries
    /// pending; another one (or itself, restarted) delivers them again after this long. Keep
    /// it above the consumer's keep-alive interval. Default: 30 seconds.
    pub claim_idle: Duration,
    /// Where a group created at connect time starts: `true` for every entry the stream holds,
    /// `false` for entries appended from now on. An existing group keeps its position.
    /// Default: `true`.
    pub from_start: bool,
    /// How long one connection attempt may take. Default: 5 seconds.
    pub connect_timeout: Duration,
    /// How long an acknowledgement, claim or other short command waits for its answer.
    /// Default: 5 seconds.
    pub command_timeout: Duration,
}

impl Default for IntakeConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".to_owned(),
            stream: DEFAULT_STREAM.to_owned(),
            group: String::new(),
            consumer: "handoff".to_owned(),
            batch: 64,
            block: Duration::from_secs(1),
            claim_idle: Duration::from_secs(30),
            from_start: true,
            connect_timeout: Duration::from_secs(5),
            command_timeout: Duration::from_secs(5),
        }
    }
}

// Hand-written so that the URL's password never reaches a log line.
impl std::fmt::Debug for IntakeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IntakeConfig")
            .field("url", &config::redact(&self.url))
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("batch", &self.batch)
            .field("block", &self.block)
            .field("claim_idle", &self.claim_idle)
            .field("from_start", &self.from_start)
            .field("connect_timeout", &self.connect_timeout)
            .field("command_timeout", &self.command_timeout)
            .finish()
    }
}

impl IntakeConfig {
    /// Checks every field but the URL against the rules in its documentation.
    ///
    /// # Errors
    ///
    /// The first [`ConfigError`] found.
    ///
    /// # Examples
    ///
    /// ```
    /// let config = handoff_redis::IntakeConfig::default();
    /// assert!(config.validate().is_err(), "a group is required");
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_name("stream", &self.stream)?;
        check_name("group", &self.group)?;
        check_name("consumer", &self.consumer)?;
        if self.batch == 0 {
            return Err(ConfigError::ZeroCount("batch"));
        }
        if self.block.as_millis() == 0 {
            return Err(ConfigError::ZeroDuration("block"));
        }
        if self.claim_idle.as_millis() == 0 {
            return Err(ConfigError::ZeroDuration("claim_idle"));
        }
        check_positive("connect_timeout", self.connect_timeout)?;
        check_positive("command_timeout", self.command_timeout)
    }
}

/// Deliveries from one Redis stream through a consumer group, read back from handoff's message
/// contract (the fields [`RedisTransport`](crate::RedisTransport) writes).
///
/// - New entries are read with `XREADGROUP ... >`; at start the consumer first reads its own
///   entries still pending from before (a restart under the same name).
/// - `ack` is `XACK`, sent once the consumer's transaction committed; `term` is `XACK` too
///   (the group never delivers the entry again; the entry stays in the stream).
/// - `nak(delay)` hands the entry back after `delay`, by a timer in this process: it stays
///   pending on this consumer until then, and is claimed again (`XCLAIM`) on the next read. If
///   the process dies first, [`claim_idle`](IntakeConfig::claim_idle) later another consumer
///   takes it over.
/// - `in_progress` restarts the entry's idle time (`XCLAIM ... JUSTID`), so a slow handler is
///   not taken over.
/// - Entries pending longer than [`claim_idle`](IntakeConfig::claim_idle) on any consumer of
///   the group (one that died or stalled) are taken over with `XAUTOCLAIM`.
///
/// The delivery count is the group's own (`XPENDING`): 1 for a first delivery, and counted up
/// by every claim. Redis has no delivery limit of its own, so
/// [`set_delivery_backstop`](Intake::set_delivery_backstop) does nothing.
///
/// Order: one consumer in the group receives the entries in stream order. With several, each
/// gets some of each aggregate's entries, and per-aggregate order rests on the consumer's gap
/// policy, as on any broker that spreads one stream over several consumers. Needs Redis 6.2 or
/// later (`XAUTOCLAIM`).
///
/// # Examples
///
/// ```no_run
/// use handoff_core::intake::Intake;
/// use handoff_redis::{IntakeConfig, RedisIntake};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let config = IntakeConfig { group: "audit".into(), ..IntakeConfig::default() };
/// let mut intake = RedisIntake::connect(config).await?;
/// let delivery = intake.next().await?;
/// println!("delivery {} of {:?}", delivery.delivery_count, delivery.event.map(|e| e.event_id));
/// # Ok(())
/// # }
/// ```
pub struct RedisIntake {
    config: IntakeConfig,
    /// The blocking reads' connection: a blocked `XREADGROUP` holds up every command behind it.
    read: Link,
    /// Acknowledgements, claims and pending counts.
    commands: Arc<Link>,
    /// Read, not yet handed out: the entry and its delivery count.
    buffer: VecDeque<(Entry, u64)>,
    /// Where the read of this consumer's own pending entries goes on; `None` once done.
    history: Option<String>,
    /// Where the next `XAUTOCLAIM` starts.
    claim_cursor: String,
    /// When a full `XAUTOCLAIM` pass may run next.
    next_claim: Instant,
    /// Entries handed back by [`Settle::nak`] whose delay is over.
    handed_back: mpsc::UnboundedReceiver<String>,
    hand_back: mpsc::UnboundedSender<String>,
}

impl std::fmt::Debug for RedisIntake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisIntake")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RedisIntake {
    /// Checks the configuration, connects, and creates the group (and the stream) when
    /// missing.
    ///
    /// # Errors
    ///
    /// [`ConnectError`]: an invalid configuration or URL, an unreachable server, refused
    /// credentials, or a key that is not a stream (kind
    /// [`Topology`](crate::ConnectErrorKind::Topology)).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt; the group may have been created.
    pub async fn connect(config: IntakeConfig) -> Result<RedisIntake, ConnectError> {
        config.validate()?;
        let read = Link::new(&config.url, config.connect_timeout)?;
        let commands = Arc::new(Link::new(&config.url, config.connect_timeout)?);
        create_group(&commands, &config).await?;
        let (hand_back, handed_back) = mpsc::unbounded_channel();
        Ok(RedisIntake {
            config,
            read,
            commands,
            buffer: VecDeque::new(),
            history: Some("0".to_owned()),
            claim_cursor: "0-0".to_owned(),
            next_claim: Instant::now(),
            handed_back,
            hand_back,
        })
    }

    /// Fills the buffer from, in turn: entries handed back, this consumer's own pending
    /// entries, entries abandoned by others, new entries (waiting up to `block` for them).
    async fn fill(&mut self) -> Result<(), IntakeError> {
        let mut back = Vec::new();
        while let Ok(id) = self.handed_back.try_recv() {
            back.push(id);
        }
        if !back.is_empty() {
            let entries = self.claim(&back).await?;
            return self.buffer_counted(entries).await;
        }
        if let Some(cursor) = self.history.clone() {
            let entries = self.read_group(&cursor, None).await?;
            self.history = entries.last().map(|entry| entry.id.clone());
            return self.buffer_counted(entries).await;
        }
        if Instant::now() >= self.next_claim {
            let entries = self.auto_claim().await?;
            if !entries.is_empty() {
                return self.buffer_counted(entries).await;
            }
        }
        let entries = self.read_group(">", Some(self.config.block)).await?;
        self.buffer
            .extend(entries.into_iter().map(|entry| (entry, 1)));
        Ok(())
    }

    /// `XREADGROUP` from `cursor` (`>` for new entries, an id for this consumer's pending
    /// ones), blocking up to `block`.
    async fn read_group(
        &self,
        cursor: &str,
        block: Option<Duration>,
    ) -> Result<Vec<Entry>, IntakeError> {
        let config = &self.config;
        let mut command = redis::cmd("XREADGROUP");
        command
            .arg("GROUP")
            .arg(&config.group)
            .arg(&config.consumer)
            .arg("COUNT")
            .arg(config.batch);
        let (link, timeout) = match block {
            Some(block) => {
                command.arg("BLOCK").arg(millis(block));
                (&self.read, block + config.command_timeout)
            }
            None => (&*self.commands, config.command_timeout),
        };
        command.arg("STREAMS").arg(&config.stream).arg(cursor);
        let reply = link
            .call(timeout, |mut connection| async move {
                command.query_async::<Value>(&mut connection).await
            })
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(error) => return self.regroup(error, "while reading the group").await,
        };
        stream_entries(reply).map_err(|e| IntakeError::new("while reading the group", e))
    }

    /// After a failed read: when the group is gone (the stream was deleted, and its groups with
    /// it; the relay's next append creates the stream again) it is created again, from where
    /// `from_start` says, and the read returns nothing; any other failure is returned.
    async fn regroup(&self, error: CallError, what: &str) -> Result<Vec<Entry>, IntakeError> {
        match error {
            CallError::Redis(error) if error.code() == Some("NOGROUP") => {
                tracing::warn!(stream = %self.config.stream, group = %self.config.group,
                    "the consumer group is gone (stream deleted?); creating it again");
                create_group(&self.commands, &self.config)
                    .await
                    .map_err(|e| IntakeError::new("while creating the group again", e))?;
                Ok(Vec::new())
            }
            error => Err(self.error(what, error)),
        }
    }

    /// Takes over entries pending longer than `claim_idle`, a page at a time; after a full
    /// pass the next one waits half of `claim_idle`.
    async fn auto_claim(&mut self) -> Result<Vec<Entry>, IntakeError> {
        let config = &self.config;
        let cursor = self.claim_cursor.clone();
        let reply = self
            .commands
            .call(config.command_timeout, |mut connection| async move {
                redis::cmd("XAUTOCLAIM")
                    .arg(&config.stream)
                    .arg(&config.group)
                    .arg(&config.consumer)
                    .arg(millis(config.claim_idle))
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(config.batch)
                    .query_async::<Value>(&mut connection)
                    .await
            })
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(error) => {
                return self
                    .regroup(error, "while taking over abandoned entries")
                    .await
            }
        };
        let Value::Array(parts) = reply else {
            return Err(IntakeError::message(format!(
                "unexpected XAUTOCLAIM reply: {reply:?}"
            )));
        };
        let mut parts = parts.into_iter();
        let next = parts
            .next()
            .map(entry::text)
            .transpose()
            .map_err(|e| IntakeError::new("while taking over abandoned entries", e))?
            .unwrap_or_else(|| "0-0".to_owned());
        let claimed = parts
            .next()
            .map(entry::entries)
            .transpose()
            .map_err(|e| IntakeError::new("while taking over abandoned entries", e))?
            .unwrap_or_default();
        if next == "0-0" {
            self.next_claim = Instant::now() + self.config.claim_idle / 2;
        }
        self.claim_cursor = next;
        if !claimed.is_empty() {
            tracing::info!(stream = %self.config.stream, group = %self.config.group,
                entries = claimed.len(), "took over entries left pending too long");
        }
        Ok(claimed)
    }

    /// Claims `ids` (handed back by this consumer) again, counting a delivery for each;
    /// entries deleted or acknowledged meanwhile are left out.
    async fn claim(&self, ids: &[String]) -> Result<Vec<Entry>, IntakeError> {
        let config = &self.config;
        let reply: Value = self
            .commands
            .call(config.command_timeout, |mut connection| async move {
                redis::cmd("XCLAIM")
                    .arg(&config.stream)
                    .arg(&config.group)
                    .arg(&config.consumer)
                    .arg(0)
                    .arg(ids)
                    .query_async(&mut connection)
                    .await
            })
            .await
            .map_err(|e| self.error("while claiming handed-back entries", e))?;
        entry::entries(reply).map_err(|e| IntakeError::new("while claiming handed-back entries", e))
    }

    /// Buffers `entries` with the group's delivery count of each (`XPENDING`).
    async fn buffer_counted(&mut self, entries: Vec<Entry>) -> Result<(), IntakeError> {
        if entries.is_empty() {
            return Ok(());
        }
        let config = &self.config;
        let ids: Vec<&str> = entries.iter().map(|entry| entry.id.as_str()).collect();
        let replies: Vec<Value> = self
            .commands
            .call(config.command_timeout, |mut connection| async move {
                let mut pipe = redis::pipe();
                for id in ids {
                    pipe.cmd("XPENDING")
                        .arg(&config.stream)
                        .arg(&config.group)
                        .arg(id)
                        .arg(id)
                        .arg(1);
                }
                pipe.query_async(&mut connection).await
            })
            .await
            .map_err(|e| self.error("while counting deliveries", e))?;
        for (entry, reply) in entries.into_iter().zip(replies) {
            self.buffer.push_back((entry, delivery_count(reply)));
        }
        Ok(())
    }

    fn error(&self, what: &str, error: CallError) -> IntakeError {
        IntakeError::new(
            &format!(
                "{what} {} of stream {}",
                self.config.group, self.config.stream
            ),
            error,
        )
    }

    fn settle(&self, id: String) -> RedisSettle {
        RedisSettle {
            link: self.commands.clone(),
            stream: self.config.stream.clone(),
            group: self.config.group.clone(),
            consumer: self.config.consumer.clone(),
            timeout: self.config.command_timeout,
            id,
            hand_back: self.hand_back.clone(),
        }
    }
}

impl Intake for RedisIntake {
    type Settle = RedisSettle;

    async fn next(&mut self) -> Result<Delivery<RedisSettle>, IntakeError> {
        loop {
            if let Some((entry, delivery_count)) = self.buffer.pop_front() {
                let location = format!("stream {} entry {}", self.config.stream, entry.id);
                let body = entry.payload().unwrap_or_default().to_vec();
                let event = contract::read_event(entry.headers(), &body, &location);
                return Ok(Delivery {
                    event,
                    delivery_count,
                    settle: self.settle(entry.id),
                });
            }
            self.fill().await?;
        }
    }
}

/// Settles one entry of a [`RedisIntake`]: `XACK`, a delayed hand-back, or `XACK` for good.
/// See [`RedisIntake`].
#[derive(Debug)]
pub struct RedisSettle {
    link: Arc<Link>,
    stream: String,
    group: String,
    consumer: String,
    timeout: Duration,
    /// The entry's id.
    id: String,
    hand_back: mpsc::UnboundedSender<String>,
}

impl RedisSettle {
    /// The entry id this delivery settles (`"1733390000000-0"`).
    pub fn entry_id(&self) -> &str {
        &self.id
    }

    async fn acknowledge(&self, what: &str) -> Result<(), IntakeError> {
        let (stream, group, id) = (&self.stream, &self.group, &self.id);
        self.link
            .call(
                self.timeout,
                |mut connection: MultiplexedConnection| async move {
                    redis::cmd("XACK")
                        .arg(stream)
                        .arg(group)
                        .arg(id)
                        .query_async::<i64>(&mut connection)
                        .await
                },
            )
            .await
            .map(drop)
            .map_err(|e| IntakeError::new(what, e))
    }
}

impl Settle for RedisSettle {
    async fn ack(&self) -> Result<(), IntakeError> {
        self.acknowledge("while acknowledging").await
    }

    /// Hands the entry back after `delay` (at the next read for a zero delay). Returns before
    /// the delay ends: a timer task queues it for the intake.
    async fn nak(&self, delay: Duration) -> Result<(), IntakeError> {
        let (hand_back, id) = (self.hand_back.clone(), self.id.clone());
        if delay.is_zero() {
            // Fails only when the intake is gone: the entry stays pending and is taken over.
            let _ = hand_back.send(id);
            return Ok(());
        }
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = hand_back.send(id);
        });
        Ok(())
    }

    async fn term(&self) -> Result<(), IntakeError> {
        self.acknowledge("while dropping an entry for good").await
    }

    async fn in_progress(&self) -> Result<(), IntakeError> {
        let (stream, group, consumer, id) = (&self.stream, &self.group, &self.consumer, &self.id);
        self.link
            .call(self.timeout, |mut connection| async move {
                redis::cmd("XCLAIM")
                    .arg(stream)
                    .arg(group)
                    .arg(consumer)
                    .arg(0)
                    .arg(id)
                    .arg("JUSTID")
                    .query_async::<Value>(&mut connection)
                    .await
            })
            .await
            .map(drop)
            .map_err(|e| IntakeError::new("while extending the ack wait", e))
    }
}

/// `XGROUP CREATE <stream> <group> 0|$ MKSTREAM`; a group that exists already is fine.
async fn create_group(link: &Link, config: &IntakeConfig) -> Result<(), ConnectError> {
    let start = if config.from_start { "0" } else { "$" };
    let result = link
        .call(config.command_timeout, |mut connection| async move {
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&config.stream)
                .arg(&config.group)
                .arg(start)
                .arg("MKSTREAM")
                .query_async::<()>(&mut connection)
                .await
        })
        .await;
    match result {
        Ok(()) => Ok(()),
        Err(CallError::Redis(error)) if error.code() == Some("BUSYGROUP") => Ok(()),
        Err(CallError::Connect(error)) => Err(error),
        Err(CallError::Redis(error)) if error.is_io_error() => Err(ConnectError::Unreachable {
            server: link.server.clone(),
            source: error,
        }),
        Err(CallError::TimedOut(timeout)) => Err(ConnectError::TimedOut {
            server: link.server.clone(),
            timeout,
        }),
        Err(CallError::Redis(error)) => Err(ConnectError::Stream {
            server: link.server.clone(),
            stream: config.stream.clone(),
            reason: format!("group {:?} could not be created: {error}", config.group),
        }),
    }
}

/// The entries of one stream from an `XREADGROUP` reply (`[[stream, entries]]`, or a map in
/// RESP3); none for a nil reply (the block ended with nothing new).
fn stream_entries(reply: Value) -> Result<Vec<Entry>, entry::ReplyError> {
    let streams = match reply {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .into_iter()
            .map(|stream| match stream {
                Value::Array(mut pair) if pair.len() == 2 => Ok(pair.swap_remove(1)),
                other => Err(entry::ReplyError(format!(
                    "expected [stream, entries], got {other:?}"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Value::Map(pairs) => pairs.into_iter().map(|(_, entries)| entries).collect(),
        other => {
            return Err(entry::ReplyError(format!(
                "unexpected XREADGROUP reply: {other:?}"
            )))
        }
    };
    let mut entries = Vec::new();
    for list in streams {
        entries.extend(entry::entries(list)?);
    }
    Ok(entries)
}

/// The delivery count in an `XPENDING <stream> <group> <id> <id> 1` reply
/// (`[[id, consumer, idle, count]]`); 1 when the entry is not pending any more.
fn delivery_count(reply: Value) -> u64 {
    let Value::Array(rows) = reply else {
        return 1;
    };
    match rows.into_iter().next() {
        Some(Value::Array(row)) => match row.get(3) {
            Some(Value::Int(n)) => u64::try_from(*n).unwrap_or(1).max(1),
            _ => 1,
        },
        _ => 1,
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_needs_a_group_and_positive_settings() {
        let good = IntakeConfig {
            group: "g".into(),
            ..IntakeConfig::default()
        };
        assert_eq!(good.validate(), Ok(()));
        assert!(IntakeConfig::default().validate().is_err());
        let no_batch = IntakeConfig {
            batch: 0,
            ..good.clone()
        };
        assert_eq!(no_batch.validate(), Err(ConfigError::ZeroCount("batch")));
        let no_idle = IntakeConfig {
            claim_idle: Duration::ZERO,
            ..good
        };
        assert!(no_idle.validate().is_err());
    }

    #[test]
    fn pending_rows_give_the_delivery_count() {
        let row = Value::Array(vec![Value::Array(vec![
            Value::BulkString(b"1-0".to_vec()),
            Value::BulkString(b"c".to_vec()),
            Value::Int(10),
            Value::Int(3),
        ])]);
        assert_eq!(delivery_count(row), 3);
        assert_eq!(delivery_count(Value::Array(vec![])), 1);
    }

    #[test]
    fn debug_hides_the_password() {
        let config = IntakeConfig {
            url: "redis://app:hunter2@cache:6379".into(),
            ..IntakeConfig::default()
        };
        assert!(!format!("{config:?}").contains("hunter2"));
    }
}
