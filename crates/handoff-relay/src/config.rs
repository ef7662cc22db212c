//! How a relay runs: batch sizes, in-flight bound, backoff and the attempt cap.

use std::time::Duration;

pub use handoff_core::{Backoff, OrderMode};

/// [`RelayConfig::max_in_flight_bytes`] by default: 32 MiB. A relay's resident set grows up to
/// about three to four times its bound (the events, the broker client's copies of those being
/// published, the rows of a claim being read): 32 MiB kept a relay draining events near a
/// broker's 1 MB limit at about 170 MB (`handoff-bench relay-memory`), 64 MiB at about 260 MB.
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: usize = 32 * 1024 * 1024;

/// Settings of a [`Relay`](crate::Relay). `Default` is what `handoff relay` runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct RelayConfig {
    /// Most events leased in one claim.
    pub batch_size: usize,
    /// Most events leased and not yet finished (acknowledged, failed or released) at once. The
    /// relay claims again only when a whole batch fits under it, so this bounds memory, the
    /// broker's outstanding acknowledgements, and the rows a crash leaves leased.
    pub max_in_flight: usize,
    /// Most bytes of events (payload and headers, [`OutboxEvent::size_bytes`]) the relay holds
    /// at once: claimed and not yet published or given back. Each claim asks the source for no
    /// more than the room left, and the relay claims only when at least a quarter of this is
    /// free. An event larger than the room still goes (alone), so the relay holds at most this
    /// plus one event; memory stays bounded when events are large, where
    /// [`max_in_flight`](Self::max_in_flight) alone would let thousands of them in.
    ///
    /// [`OutboxEvent::size_bytes`]: handoff_core::delivery::OutboxEvent::size_bytes
    pub max_in_flight_bytes: usize,
    /// Longest sleep while idle before polling again, whatever the notifications say (design P7:
    /// about one query per interval while nothing happens).
    pub poll_interval: Duration,
    /// A publish is not started when less than this is left of its lease, so a slow publish
    /// never ends after another relay took the event over. Must exceed the transport's publish
    /// timeout, and stay well below the source's lease (default 30 s): with a lease at or under
    /// it nothing is ever published, which the relay logs once as a warning.
    pub lease_margin: Duration,
    /// Failed attempts after which an event is held for an operator instead of retried (the
    /// poison policy). Attempts are only charged when the failure concerns the event: a
    /// refusal, or an error while the destination accepts other events; an outage, throttling
    /// or an error on every publish pauses the destination instead (docs/relay.md).
    pub max_attempts: i32,
    /// How recent the destination's last accepted publish must be for an ambiguous failure
    /// (timeout, 5xx) to be charged to the event rather than blamed on the destination.
    pub health_window: Duration,
    /// Delay before an event that failed is tried again, by attempt.
    pub retry_backoff: Backoff,
    /// Pause before claiming again after the source or the broker failed, by pauses in a row.
    /// A destination that is down, throttling or failing every publish is paused this long
    /// (or as long as its `Retry-After` asks) before one probe event is sent.
    pub outage_backoff: Backoff,
    /// On shutdown, how long in-flight publishes may take to finish before their events are
    /// released unfinished.
    pub shutdown_grace: Duration,
    /// How claimed events are published. [`OrderMode::Aggregate`] (the default): one lane per
    /// aggregate, lanes in parallel. [`OrderMode::Global`]: the whole claim is one lane in
    /// global sequence order, each event published only after the previous one's
    /// acknowledgement. The source must be set up for the same mode.
    pub order: OrderMode,
    /// Shortest time between the starts of two write-backs of outcomes (marks), while nothing
    /// waits on them. Outcomes that arrive meanwhile go into the next write, so under steady
    /// traffic the source sees one mark per interval instead of one per acknowledged lane;
    /// commit → broker latency does not wait for marks. A claim that finds events waiting
    /// behind this relay's own unmarked ones, or a relay that must see its outcomes written
    /// before it goes on (global order, a suspect published alone, a probe), has the next
    /// write made at once. What it costs: after a crash, up to this much more of acknowledged
    /// events is published again (consumers absorb copies through their inbox). Zero writes
    /// whatever arrived as soon as the previous write ends; at most half of
    /// [`lease_margin`](Self::lease_margin) ([`validate`](Self::validate)).
    pub mark_interval: Duration,
    /// The longest a destination's own `Retry-After` delays an event (and so its aggregate):
    /// the relay waits at least what the destination asked, up to this. A per-event refusal
    /// delays only its aggregate; other aggregates flow meanwhile (docs/relay.md).
    pub max_retry_after: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch_size: 500,
            max_in_flight: 2_000,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            poll_interval: Duration::from_secs(1),
            lease_margin: Duration::from_secs(10),
            max_attempts: 20,
            health_window: Duration::from_secs(30),
            retry_backoff: Backoff {
                initial: Duration::from_millis(500),
                max: Duration::from_secs(300),
            },
            outage_backoff: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(10),
            },
            shutdown_grace: Duration::from_secs(10),
            order: OrderMode::Aggregate,
            mark_interval: Duration::from_millis(25),
            max_retry_after: Duration::from_secs(3600),
        }
    }
}

/// A [`RelayConfig`] that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RelayConfigError {
    /// A zero batch size.
    #[error("batch size must be at least 1")]
    ZeroBatch,
    /// A batch that never fits under the in-flight bound.
    #[error("max in flight ({max_in_flight}) must be at least the batch size ({batch_size})")]
    InFlightBelowBatch {
        /// The configured bound.
        max_in_flight: usize,
        /// The configured batch size.
        batch_size: usize,
    },
    /// A zero byte bound: nothing could ever be claimed.
    #[error("max in-flight bytes must be at least 1")]
    ZeroInFlightBytes,
    /// A poll interval of zero would spin.
    #[error("poll interval must be at least 10ms, got {0:?}")]
    PollTooShort(Duration),
    /// An attempt cap below one.
    #[error("max attempts must be at least 1, got {0}")]
    NoAttempts(i32),
    /// A backoff that starts at zero or ends before it starts.
    #[error("backoff must start above zero and not end before it starts: {0:?}")]
    InvalidBackoff(Backoff),
    /// A mark interval so long that an acknowledged event's lease could run out before its
    /// mark, and the event be claimed and published again, over and over.
    #[error(
        "mark interval ({mark_interval:?}) must be at most half the lease margin ({lease_margin:?})"
    )]
    MarkIntervalTooLong {
        /// The configured interval.
        mark_interval: Duration,
        /// The configured lease margin.
        lease_margin: Duration,
    },
}

impl RelayConfig {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// The first setting that cannot work.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use handoff_relay::RelayConfig;
    ///
    /// assert!(RelayConfig::default().validate().is_ok());
    /// let config = RelayConfig { batch_size: 0, ..RelayConfig::default() };
    /// assert!(config.validate().is_err());
    /// let config = RelayConfig { max_in_flight_bytes: 0, ..RelayConfig::default() };
    /// assert!(config.validate().is_err(), "nothing could be claimed");
    /// let config = RelayConfig {
    ///     mark_interval: Duration::from_secs(30),
    ///     ..RelayConfig::default()
    /// };
    /// assert!(config.validate().is_err(), "marks later than the leases end");
    /// ```
    pub fn validate(&self) -> Result<(), RelayConfigError> {
        if self.batch_size == 0 {
            return Err(RelayConfigError::ZeroBatch);
        }
        if self.max_in_flight < self.batch_size {
            return Err(RelayConfigError::InFlightBelowBatch {
                max_in_flight: self.max_in_flight,
                batch_size: self.batch_size,
            });
        }
        if self.max_in_flight_bytes == 0 {
            return Err(RelayConfigError::ZeroInFlightBytes);
        }
        if self.poll_interval < Duration::from_millis(10) {
            return Err(RelayConfigError::PollTooShort(self.poll_interval));
        }
        if self.max_attempts < 1 {
            return Err(RelayConfigError::NoAttempts(self.max_attempts));
        }
        // An event is acknowledged with about `lease_margin` of its lease left at worst; its
        // mark must land well inside that.
        if self.mark_interval > self.lease_margin / 2 {
            return Err(RelayConfigError::MarkIntervalTooLong {
                mark_interval: self.mark_interval,
                lease_margin: self.lease_margin,
            });
        }
        for backoff in [self.retry_backoff, self.outage_backoff] {
            if backoff.initial.is_zero() || backoff.max < backoff.initial {
                return Err(RelayConfigError::InvalidBackoff(backoff));
            }
        }
        Ok(())
    }
}
