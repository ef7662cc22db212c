//! [`ConsumerConfig`]: how a consumer runs, and the checks it must pass.

use std::time::Duration;

use handoff_core::Backoff;
use handoff_postgres::{validate_consumer_name, InboxError, Pooling, Schema};

/// What a consumer does with an event that is not next in its aggregate's line (design C3).
///
/// An event *ahead* of its aggregate (sequence k+2 while k+1 is not applied) is a gap; the
/// policies differ in how they wait for k+1. An event *behind* it (a new event id at a place
/// already applied: an old event replayed after its dedup row was cleaned up) is stale: under
/// every policy it is recorded and acknowledged as a duplicate, never applied, never given to
/// the reconcile hook. Both are counted (`handoff_consumer_gaps_total`,
/// `handoff_consumer_stale_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapPolicy {
    /// Leave the event with the broker and have it delivered again after `retry_after`; after
    /// the delivery cap it goes to the quarantine with reason `gap`.
    Reject {
        /// How long the broker waits before the next delivery.
        retry_after: Duration,
    },
    /// Hold the event (unacknowledged) in memory until its predecessor is applied, then apply
    /// it at once. Bounded: past `max_per_aggregate` held events of one aggregate, or
    /// `max_total` in all, or after `max_wait`, the event falls back to `Reject` with
    /// `retry_after = max_wait`. `max_wait` must be shorter than the broker's ack wait.
    Buffer {
        /// Most events held for one aggregate.
        max_per_aggregate: usize,
        /// Most events held in all.
        max_total: usize,
        /// Longest an event is held before it is handed back to the broker.
        max_wait: Duration,
    },
    /// Ask [`Handler::reconcile`](crate::Handler::reconcile), which may apply, skip or retry;
    /// a retry is delivered again after `retry_after`.
    Reconcile {
        /// How long the broker waits before the next delivery, on
        /// [`GapDecision::RetryLater`](crate::GapDecision::RetryLater).
        retry_after: Duration,
    },
}

impl GapPolicy {
    /// A short stable name, for logs and flags: `reject`, `buffer`, `reconcile`.
    pub fn as_str(&self) -> &'static str {
        match self {
            GapPolicy::Reject { .. } => "reject",
            GapPolicy::Buffer { .. } => "buffer",
            GapPolicy::Reconcile { .. } => "reconcile",
        }
    }
}

impl Default for GapPolicy {
    fn default() -> Self {
        GapPolicy::Reject {
            retry_after: Duration::from_secs(1),
        }
    }
}

/// Batch mode (the default, [`ConsumerConfig::batch`]): several deliveries admitted and applied
/// in one transaction, to spread a transaction's fixed costs (`BEGIN`, `COMMIT` and its WAL
/// flush, one admit statement) over many events. A handler that needs a transaction per event
/// opts out with [`Handler::allows_batches`](crate::Handler::allows_batches); `batch: None`
/// turns it off for a consumer.
///
/// A batch holds at most one event per aggregate (an aggregate's events still apply one at a
/// time, in order) and closes when it holds [`max_events`](Self::max_events) or
/// [`max_wait`](Self::max_wait) after its first event arrived, whichever comes first. One
/// multi-row statement writes the dedup rows and advances the sequences, the handler runs for
/// each event in the same transaction, and only after the single `COMMIT` is each delivery
/// acknowledged (design C4). Duplicates are acknowledged without the handler; an event that is not
/// next in its aggregate's line leaves the batch and goes through the gap policy alone.
///
/// When anything in a batch fails (a handler error or panic, the apply timeout, a database
/// error, the commit), the whole batch rolls back and each of its events is applied again in a
/// transaction of its own, exactly as without batch mode: one poison event does not fail its
/// neighbours, it only costs them a second try. An event that failed a batch skips batches on
/// its next deliveries.
///
/// Trade-off: a batch holds the row locks of all its events' effects until its commit. Two
/// batches touching the same rows in different orders can deadlock; PostgreSQL then aborts one
/// after `deadlock_timeout` and that batch falls back to one event per transaction. Keep
/// [`max_in_flight`](Self::max_in_flight) low when events of different aggregates update
/// shared rows (counters, stock levels).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_consumer::{BatchConfig, ConsumerConfig};
///
/// let config = ConsumerConfig {
///     name: "inventory".into(),
///     batch: Some(BatchConfig { max_events: 32, ..BatchConfig::default() }),
///     ..ConsumerConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// assert_eq!(BatchConfig::default().max_wait, Duration::from_millis(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Most events in one batch (one transaction). Default 128: on the consumer benchmark 64
    /// reached 0.78 of the no-inbox consumer and 128 reached 1.35 (docs/benchmarks.md).
    pub max_events: usize,
    /// Longest the first event of a batch waits for more before the batch closes. Zero takes
    /// whatever is waiting at that moment. Default 5 ms.
    pub max_wait: Duration,
    /// Batches applied at once, each on its own connection (and each taking one of the
    /// [`max_concurrency`](ConsumerConfig::max_concurrency) permits). Default 2.
    pub max_in_flight: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            max_events: 128,
            max_wait: Duration::from_millis(5),
            max_in_flight: 2,
        }
    }
}

/// How a [`Consumer`](crate::Consumer) runs. `Default` gives everything but the name.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_consumer::{ConsumerConfig, GapPolicy};
///
/// let config = ConsumerConfig {
///     name: "inventory".into(),
///     gap_policy: GapPolicy::Buffer {
///         max_per_aggregate: 16,
///         max_total: 1000,
///         max_wait: Duration::from_secs(5),
///     },
///     ..ConsumerConfig::default()
/// };
/// assert!(config.validate().is_ok());
///
/// // Dedup rows must outlive the replay horizon (design C5).
/// let short = ConsumerConfig {
///     dedup_retention: Duration::from_secs(3600),
///     replay_horizon: Duration::from_secs(86_400),
///     ..config
/// };
/// assert!(short.validate().is_err());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerConfig {
    /// The consumer's name: its key in `processed_events` and the other inbox tables, and its
    /// durable subscription's name. Every instance of one consumer uses the same name.
    pub name: String,
    /// Where the inbox tables live.
    pub schema: Schema,
    /// Most events applied at once (each on its own connection), across aggregates. Default 16.
    pub max_concurrency: usize,
    /// Most bytes (payloads, headers and ids) of deliveries taken from the intake and not yet
    /// settled: queued in their aggregates' lanes, held by the gap policy, in a batch or being
    /// applied. At the bound the consumer takes nothing more from the intake until some are
    /// settled; one delivery is always let in below it, so an event larger than the bound
    /// still flows, alone. Default 32 MiB.
    ///
    /// The intake's own read-ahead comes on top, bounded by its settings: JetStream's
    /// `max_batch_bytes`, Kafka's `queued.max.messages.kbytes`, Redis's read count, AMQP's
    /// prefetch (RabbitMQ has no byte-sized prefetch: prefetch × the largest message).
    pub max_in_flight_bytes: usize,
    /// Deliveries after which an event that still fails goes to the quarantine: a retryable
    /// handler error, a handler panic, the apply timeout, a database error on the event's own
    /// statements, or a gap still open. Every failure counts toward this one cap. The broker's
    /// own limit, where it has one, is set above it
    /// ([`broker_backstop`](handoff_core::intake::broker_backstop)). Default 10.
    pub max_deliveries: u64,
    /// Delay before the next delivery after a retryable handler error, by delivery count.
    /// Default 500 ms doubling to 30 s.
    pub retry_backoff: Backoff,
    /// What to do with an event that is not next in its aggregate's line.
    pub gap_policy: GapPolicy,
    /// How long dedup rows are kept. Must be at least [`replay_horizon`](Self::replay_horizon):
    /// an event replayed after its dedup row is gone is caught only by the sequence check.
    /// Default 7 days.
    pub dedup_retention: Duration,
    /// How far back the outbox can replay events (its retention of published rows, or the
    /// broker's retention, whichever is longer). Default 7 days.
    pub replay_horizon: Duration,
    /// While a handler runs, the broker's ack wait is restarted this often (`in_progress`), so
    /// a slow handler (an outside call with retries) is not redelivered while it still runs.
    /// Keep it below the broker's ack wait. Default 10 s.
    pub progress_interval: Duration,
    /// At shutdown, how long events being applied may take to finish. Default 10 s.
    pub shutdown_grace: Duration,
    /// Longest one delivery may take from `BEGIN` to its settlement, handler included. Past
    /// it the work is abandoned: the transaction's connection is dropped (so it rolls back)
    /// and the delivery is handed back, delivered again after the retry backoff but no sooner
    /// than this timeout (a commit that did land makes that a duplicate the inbox absorbs). It
    /// counts toward [`max_deliveries`](Self::max_deliveries): a handler that hangs on one
    /// event ends in the quarantine with reason `apply_timeout`.
    ///
    /// This is what frees a consumer whose database connection went silent (a partition, a
    /// failover): such a connection never fails by itself, and the in-progress signals would
    /// otherwise keep the event, and its aggregate's lane, waiting forever. Build the pool with
    /// [`bounded_release`](handoff_postgres::bounded_release) as well, so the abandoned connection is closed
    /// instead of held by the pool's release check. Longer than the slowest handler, outside
    /// calls included. Default 60 s. Writing an event to the quarantine is bounded by this
    /// timeout too, but never by less than 10 s.
    pub apply_timeout: Duration,
    /// Batch mode: several deliveries per transaction (see [`BatchConfig`]). Default
    /// `Some(BatchConfig::default())`, used when the handler
    /// [allows it](crate::Handler::allows_batches); `None` applies every delivery in a
    /// transaction of its own. In batch mode the apply timeout bounds a whole batch.
    pub batch: Option<BatchConfig>,
    /// [`Pooling::Transaction`] when the pool goes through a transaction pooler (PgBouncer
    /// `pool_mode = transaction`): the inbox's statements then go unnamed, and those outside
    /// the event's transaction (the dedup purge, the record of outside calls) each in a
    /// transaction of their own. The handler's own statements must follow suit
    /// (`.persistent(false)`; docs/poolers.md). Default: [`Pooling::Session`].
    pub pooling: Pooling,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            schema: Schema::default(),
            max_concurrency: 16,
            max_in_flight_bytes: 32 << 20,
            max_deliveries: 10,
            retry_backoff: Backoff {
                initial: Duration::from_millis(500),
                max: Duration::from_secs(30),
            },
            gap_policy: GapPolicy::default(),
            dedup_retention: Duration::from_secs(7 * 86_400),
            replay_horizon: Duration::from_secs(7 * 86_400),
            progress_interval: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(10),
            apply_timeout: Duration::from_secs(60),
            // On `handoff-bench consumer` the batch inbox applied several times the messages/s
            // of the per-event inbox (docs/benchmarks.md): the fast path is the default.
            batch: Some(BatchConfig::default()),
            pooling: Pooling::Session,
        }
    }
}

/// Why a [`ConsumerConfig`] is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The name breaks the consumer name rules.
    #[error(transparent)]
    Name(#[from] InboxError),
    /// Dedup rows would be deleted while their events can still be replayed (design C5).
    #[error(
        "dedup retention {} is shorter than the replay horizon {}: a replayed event could be \
         applied twice",
        humanize(*dedup_retention),
        humanize(*replay_horizon)
    )]
    RetentionShorterThanReplay {
        /// The configured dedup retention.
        dedup_retention: Duration,
        /// The configured replay horizon.
        replay_horizon: Duration,
    },
    /// `max_concurrency` is 0.
    #[error("max concurrency must be at least 1")]
    NoConcurrency,
    /// `max_in_flight_bytes` is 0.
    #[error("max in-flight bytes must be at least 1")]
    NoInFlightBytes,
    /// `max_deliveries` is 0.
    #[error("max deliveries must be at least 1")]
    NoDeliveries,
    /// `progress_interval` is 0.
    #[error("progress interval must be above zero")]
    NoProgressInterval,
    /// `apply_timeout` is 0.
    #[error("apply timeout must be above zero")]
    NoApplyTimeout,
    /// A backoff starts at zero or ends below its start.
    #[error("invalid retry backoff {0:?}: it must start above zero and end at or above its start")]
    InvalidBackoff(Backoff),
    /// The buffer policy cannot hold anything or never hands events back.
    #[error("invalid buffer policy: {0}")]
    InvalidBuffer(&'static str),
    /// The batch mode's bounds hold no event or run no batch.
    #[error("invalid batch mode: {0}")]
    InvalidBatch(&'static str),
}

impl ConsumerConfig {
    /// Checks the configuration.
    ///
    /// # Errors
    ///
    /// [`ConfigError`]: an invalid name, a dedup retention shorter than the replay horizon,
    /// zero concurrency, in-flight bytes, deliveries or progress interval, a broken backoff,
    /// buffer or batch bound.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_consumer_name(&self.name)?;
        if self.dedup_retention < self.replay_horizon {
            return Err(ConfigError::RetentionShorterThanReplay {
                dedup_retention: self.dedup_retention,
                replay_horizon: self.replay_horizon,
            });
        }
        if self.max_concurrency == 0 {
            return Err(ConfigError::NoConcurrency);
        }
        if self.max_in_flight_bytes == 0 {
            return Err(ConfigError::NoInFlightBytes);
        }
        if self.max_deliveries == 0 {
            return Err(ConfigError::NoDeliveries);
        }
        if self.apply_timeout.is_zero() {
            return Err(ConfigError::NoApplyTimeout);
        }
        if self.progress_interval.is_zero() {
            return Err(ConfigError::NoProgressInterval);
        }
        let backoff = self.retry_backoff;
        if backoff.initial.is_zero() || backoff.max < backoff.initial {
            return Err(ConfigError::InvalidBackoff(backoff));
        }
        if let GapPolicy::Buffer {
            max_per_aggregate,
            max_total,
            max_wait,
        } = self.gap_policy
        {
            if max_per_aggregate == 0 || max_total == 0 {
                return Err(ConfigError::InvalidBuffer("it holds no event"));
            }
            if max_wait.is_zero() {
                return Err(ConfigError::InvalidBuffer("max_wait is zero"));
            }
        }
        if let Some(batch) = self.batch {
            if batch.max_events == 0 {
                return Err(ConfigError::InvalidBatch("max_events is zero"));
            }
            if batch.max_in_flight == 0 {
                return Err(ConfigError::InvalidBatch("max_in_flight is zero"));
            }
        }
        Ok(())
    }
}

/// Whole days, hours, minutes or seconds, whichever is largest and exact enough.
fn humanize(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        s if s >= 86_400 && s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s >= 3_600 && s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s >= 60 && s % 60 == 0 => format!("{}m", s / 60),
        _ => format!("{:?}", d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named() -> ConsumerConfig {
        ConsumerConfig {
            name: "c".into(),
            ..ConsumerConfig::default()
        }
    }

    #[test]
    fn dedup_retention_shorter_than_replay_horizon_is_refused() {
        let config = ConsumerConfig {
            dedup_retention: Duration::from_secs(86_400),
            replay_horizon: Duration::from_secs(2 * 86_400),
            ..named()
        };
        let error = config.validate().unwrap_err();
        assert!(matches!(
            error,
            ConfigError::RetentionShorterThanReplay { .. }
        ));
        assert_eq!(
            error.to_string(),
            "dedup retention 1d is shorter than the replay horizon 2d: a replayed event could \
             be applied twice"
        );
        let equal = ConsumerConfig {
            dedup_retention: Duration::from_secs(2 * 86_400),
            ..config
        };
        assert!(equal.validate().is_ok());
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(ConsumerConfig::default().validate().is_err(), "no name");
        let bad = [
            ConsumerConfig {
                max_concurrency: 0,
                ..named()
            },
            ConsumerConfig {
                max_deliveries: 0,
                ..named()
            },
            ConsumerConfig {
                retry_backoff: Backoff {
                    initial: Duration::ZERO,
                    max: Duration::from_secs(1),
                },
                ..named()
            },
            ConsumerConfig {
                gap_policy: GapPolicy::Buffer {
                    max_per_aggregate: 0,
                    max_total: 10,
                    max_wait: Duration::from_secs(1),
                },
                ..named()
            },
            ConsumerConfig {
                name: "a.b".into(),
                ..named()
            },
            ConsumerConfig {
                apply_timeout: Duration::ZERO,
                ..named()
            },
            ConsumerConfig {
                batch: Some(BatchConfig {
                    max_events: 0,
                    ..BatchConfig::default()
                }),
                ..named()
            },
            ConsumerConfig {
                batch: Some(BatchConfig {
                    max_in_flight: 0,
                    ..BatchConfig::default()
                }),
                ..named()
            },
        ];
        for config in bad {
            assert!(config.validate().is_err(), "{config:?}");
        }
    }
}
