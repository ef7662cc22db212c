//! How far the run's system has got, read while it runs: the events committed and still
//! pending in the outbox, and each consumer's applied events and lag. The [`Monitor`] reads
//! them every [`SAMPLE`], holds the load while the slowest consumer is too far behind, and
//! keeps the run's time series; the settle phase waits on its readings while they improve.

use super::*;

/// How often the monitor reads the system.
pub(crate) const SAMPLE: Duration = Duration::from_secs(2);

/// The consumers whose lag is measured, in report order.
const CONSUMERS: [Kind; 2] = [Kind::Inventory, Kind::Payments];

/// Where a consumer stands on JetStream (destination nats only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Position {
    /// The stream sequence at or below which it has acknowledged everything.
    pub(crate) ack_floor: u64,
    /// Deliveries made to it so far (JetStream's consumer sequence): first ones and
    /// redeliveries alike.
    pub(crate) deliveries: u64,
}

/// One reading of the system.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Reading {
    /// Order events committed: the sum of the orders' versions (each command that changed an
    /// order committed its event at that version in the same transaction, so this is the
    /// outbox's order events without scanning the outbox).
    pub(crate) events: u64,
    /// Outbox rows not yet published (through the outbox's partial index of pending rows).
    pub(crate) pending: u64,
    /// Per consumer of [`CONSUMERS`], events applied: the sum of its last applied sequences,
    /// which advance by one per applied event in the effect's transaction.
    pub(crate) applied: [u64; 2],
    /// Per consumer, its position on JetStream, when it could be read.
    pub(crate) positions: [Option<Position>; 2],
}

impl Reading {
    /// Events committed that `consumer` (an index into [`CONSUMERS`]) has not applied yet.
    pub(crate) fn lag(&self, consumer: usize) -> u64 {
        self.events.saturating_sub(self.applied[consumer])
    }

    /// The slowest consumer's lag.
    pub(crate) fn max_lag(&self) -> u64 {
        (0..CONSUMERS.len()).map(|c| self.lag(c)).max().unwrap_or(0)
    }

    /// Work left before the system is settled: pending outbox rows and every consumer's lag.
    pub(crate) fn remaining(&self) -> u64 {
        self.pending + (0..CONSUMERS.len()).map(|c| self.lag(c)).sum::<u64>()
    }

    fn published(&self) -> u64 {
        self.events.saturating_sub(self.pending)
    }

    /// The consumers' ack floors summed, when every one was read: it moves on while a
    /// consumer works through redeliveries of events it has applied already, which its lag
    /// does not show.
    pub(crate) fn floors(&self) -> Option<u64> {
        self.positions.iter().map(|p| p.map(|p| p.ack_floor)).sum()
    }
}

/// Reads [`Reading`]s over pools of one connection each, opened lazily: the servers are
/// killed and come back, and a reading that fails is simply missing.
pub(crate) struct Gauge {
    orders: PgPool,
    consumers: [PgPool; 2],
    /// The NATS server's URL, and the connection once made (destination nats).
    nats: Option<(String, Option<async_nats::jetstream::Context>)>,
}

impl Gauge {
    pub(crate) fn new(urls: &Urls) -> Result<Self, RunError> {
        let pool = |url: &str| {
            PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(2))
                .connect_lazy(url)
        };
        let nats = match &urls.broker {
            BrokerUrls::Nats(url) => Some((url.clone(), None)),
            _ => None,
        };
        Ok(Self {
            orders: pool(&urls.orders)?,
            consumers: [pool(&urls.inventory)?, pool(&urls.payments)?],
            nats,
        })
    }

    /// The consumers' positions on JetStream; `None` each when the server does not answer
    /// within a second (it is being killed), or on another destination.
    async fn positions(&mut self) -> [Option<Position>; 2] {
        let mut positions = [None; 2];
        let Some((url, context)) = self.nats.as_mut() else {
            return positions;
        };
        if context.is_none() {
            // Once connected the client reconnects by itself; until then, try at each reading.
            let connect = async_nats::connect(url.as_str());
            if let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(1), connect).await {
                *context = Some(async_nats::jetstream::new(client));
            }
        }
        let Some(context) = context.as_ref() else {
            return positions;
        };
        for (slot, kind) in positions.iter_mut().zip(CONSUMERS) {
            let info = async {
                let stream = context.get_stream_no_info(STREAM).await.ok()?;
                stream.consumer_info(kind.name()).await.ok()
            };
            if let Ok(Some(info)) = tokio::time::timeout(Duration::from_secs(1), info).await {
                *slot = Some(Position {
                    ack_floor: info.ack_floor.stream_sequence,
                    deliveries: info.delivered.consumer_sequence,
                });
            }
        }
        positions
    }

    pub(crate) async fn read(&mut self) -> Result<Reading, sqlx::Error> {
        let (events, pending): (i64, i64) = sqlx::query_as(&format!(
            "SELECT (SELECT coalesce(sum(version), 0)::bigint FROM orders),
                    (SELECT count(*) FROM outbox o WHERE {})",
            crate::UNPUBLISHED_SQL
        ))
        .fetch_one(&self.orders)
        .await?;
        let mut applied = [0; 2];
        for (slot, (kind, pool)) in applied
            .iter_mut()
            .zip(CONSUMERS.iter().zip(&self.consumers))
        {
            let sum: i64 = sqlx::query_scalar(
                "SELECT coalesce(sum(last_sequence), 0)::bigint FROM consumer_sequences
                 WHERE consumer_name = $1 AND aggregate_type = $2",
            )
            .bind(kind.name())
            .bind(crate::ORDER)
            .fetch_one(pool)
            .await?;
            *slot = sum.max(0) as u64;
        }
        Ok(Reading {
            events: events.max(0) as u64,
            pending: pending.max(0) as u64,
            applied,
            positions: self.positions().await,
        })
    }

    async fn close(self) {
        self.orders.close().await;
        for pool in self.consumers {
            pool.close().await;
        }
    }
}

/// A reading and when it was taken.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) at: Instant,
    pub(crate) reading: Reading,
}

/// One consumer over one interval of the time series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerRate {
    /// Events it applied per second.
    pub applied_per_second: f64,
    /// Events committed that it had not applied, at the end of the interval.
    pub lag: u64,
    /// JetStream deliveries to it per second, first ones and redeliveries alike (destination
    /// nats; `null` when its position could not be read at both ends of the interval).
    /// Well above `applied_per_second`, it is working through redeliveries.
    pub deliveries_per_second: Option<f64>,
    /// Its JetStream ack floor (a stream sequence) at the end of the interval.
    pub ack_floor: Option<u64>,
    /// How far its ack floor moved back within the interval, summed over the readings: the
    /// broker lost acknowledgements (a nats-server killed before it had stored them) and
    /// delivers again everything above the older floor, which the inbox absorbs.
    pub ack_floor_rewound: u64,
}

/// One interval of the run's time series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Interval {
    /// Start, in seconds from the start of the load.
    pub from_seconds: f64,
    /// End, in seconds from the start of the load.
    pub to_seconds: f64,
    /// `load` (faults and load) or `settle` (after them).
    pub phase: &'static str,
    /// Commands the order service accepted, per second.
    pub commands_per_second: f64,
    /// Order events committed to the outbox, per second.
    pub events_per_second: f64,
    /// Outbox events published, per second.
    pub published_per_second: f64,
    /// Outbox rows not yet published at the end of the interval.
    pub pending: u64,
    /// Per consumer, what it applied and how far behind it was.
    pub consumers: BTreeMap<String, ConsumerRate>,
    /// How long the load's clients were held in the interval (the slowest consumer's lag was
    /// over `--max-lag`), in seconds.
    pub held_seconds: f64,
}

/// What the monitor leaves when it stops.
#[derive(Debug, Default)]
pub(crate) struct Record {
    pub(crate) series: Vec<Interval>,
    pub(crate) held: Duration,
    pub(crate) last: Option<Reading>,
}

/// Reads the system every [`SAMPLE`] until stopped: publishes each reading, holds the load's
/// clients while the slowest consumer's lag is over `max_lag` (and releases them once it is
/// down to three quarters of it: a margin, so that the clients do not flap at the bound), and
/// cuts the readings into intervals of at least `interval`.
pub(crate) struct Monitor {
    pub(crate) gauge: Gauge,
    pub(crate) load: Load,
    pub(crate) started: Instant,
    pub(crate) interval: Duration,
    pub(crate) max_lag: Option<u64>,
    /// Set once the load has ended: the intervals after it are the settle phase.
    pub(crate) settling: Arc<AtomicBool>,
    pub(crate) hold: watch::Sender<bool>,
    pub(crate) samples: watch::Sender<Option<Sample>>,
}

impl Monitor {
    pub(crate) async fn run(mut self, mut stop: watch::Receiver<bool>) -> Record {
        let mut record = Record::default();
        // The start of the current interval: its time, reading, commands and held time.
        let mut mark: Option<(Sample, u64, Duration)> = None;
        let mut held_since: Option<Instant> = None;
        // Per consumer, its last ack floor read, and how far it moved back in this interval.
        let mut floors: [Option<u64>; 2] = [None; 2];
        let mut rewound = [0u64; 2];
        let mut ticks = tokio::time::interval(SAMPLE);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Told to stop (or its sender gone): one last reading closes the last interval.
        let mut stopping = false;
        loop {
            if !stopping {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = stop.changed() => stopping = true,
                }
            }
            let reading = match self.gauge.read().await {
                Ok(reading) => reading,
                // A server is down: no reading this time; the hold stays as it was.
                Err(error) => {
                    tracing::debug!(%error, "no reading");
                    if stopping {
                        break;
                    }
                    continue;
                }
            };
            let now = Instant::now();
            let sample = Sample { at: now, reading };
            for (c, position) in reading.positions.iter().enumerate() {
                if let Some(position) = position {
                    if let Some(before) = floors[c] {
                        rewound[c] += before.saturating_sub(position.ack_floor);
                    }
                    floors[c] = Some(position.ack_floor);
                }
            }
            record.last = Some(reading);
            self.samples.send_replace(Some(sample));
            let lag = reading.max_lag();
            let holding = *self.hold.borrow();
            let hold = hold_next(holding, lag, self.max_lag);
            if hold != holding {
                tracing::info!(lag, hold, "load {}", if hold { "held" } else { "released" });
                self.hold.send_replace(hold);
            }
            let held = |record: &Record, held_since: Option<Instant>| {
                record.held + held_since.map_or(Duration::ZERO, |since| now - since)
            };
            match (hold, held_since) {
                (true, None) => held_since = Some(now),
                (false, Some(since)) => {
                    record.held += now - since;
                    held_since = None;
                }
                _ => {}
            }
            let commands = self.load.commands.load(Ordering::Relaxed);
            match mark {
                None => mark = Some((sample, commands, held(&record, held_since))),
                Some((from, from_commands, from_held))
                    if now - from.at >= self.interval
                        || (stopping && now - from.at >= Duration::from_secs(1)) =>
                {
                    let total_held = held(&record, held_since);
                    record.series.push(self.interval_between(
                        &from,
                        &sample,
                        commands - from_commands,
                        total_held - from_held,
                        std::mem::take(&mut rewound),
                    ));
                    mark = Some((sample, commands, total_held));
                }
                Some(_) => {}
            }
            if stopping {
                break;
            }
        }
        if let Some(since) = held_since {
            record.held += Instant::now() - since;
        }
        self.hold.send_replace(false);
        self.gauge.close().await;
        record
    }

    fn interval_between(
        &self,
        from: &Sample,
        to: &Sample,
        commands: u64,
        held: Duration,
        rewound: [u64; 2],
    ) -> Interval {
        let seconds = (to.at - from.at).as_secs_f64().max(f64::EPSILON);
        let rate = |a: u64, b: u64| b.saturating_sub(a) as f64 / seconds;
        let consumers = CONSUMERS
            .iter()
            .enumerate()
            .map(|(c, kind)| {
                (
                    kind.name().to_owned(),
                    ConsumerRate {
                        applied_per_second: rate(from.reading.applied[c], to.reading.applied[c]),
                        lag: to.reading.lag(c),
                        deliveries_per_second: from.reading.positions[c]
                            .zip(to.reading.positions[c])
                            .map(|(a, b)| rate(a.deliveries, b.deliveries)),
                        ack_floor: to.reading.positions[c].map(|p| p.ack_floor),
                        ack_floor_rewound: rewound[c],
                    },
                )
            })
            .collect();
        Interval {
            from_seconds: from
                .at
                .saturating_duration_since(self.started)
                .as_secs_f64(),
            to_seconds: to.at.saturating_duration_since(self.started).as_secs_f64(),
            phase: if self.settling.load(Ordering::Relaxed) {
                "settle"
            } else {
                "load"
            },
            commands_per_second: commands as f64 / seconds,
            events_per_second: rate(from.reading.events, to.reading.events),
            published_per_second: rate(from.reading.published(), to.reading.published()),
            pending: to.reading.pending,
            consumers,
            held_seconds: held.as_secs_f64(),
        }
    }
}

/// Whether the load is to be held after a reading of `lag` (the slowest consumer's), when it
/// was `holding` before: held above `max_lag`, released at three quarters of it.
fn hold_next(holding: bool, lag: u64, max_lag: Option<u64>) -> bool {
    match max_lag {
        Some(bound) if !holding => lag > bound,
        Some(bound) => lag > bound / 4 * 3,
        None => false,
    }
}

/// Waits until the system is settled (as [`settled`] says) for as long as it keeps catching
/// up: `false` once neither the work left (pending outbox rows and the consumers' lags, from
/// the monitor's `samples`) has reached a new low nor the consumers' ack floors a new high for
/// `stall`. A system that keeps moving
/// is never cut off, one that stopped moving is given up on after `stall`.
pub(crate) async fn settle_while_progressing(
    urls: &Urls,
    mut samples: watch::Receiver<Option<Sample>>,
    stall: Duration,
) -> bool {
    let mut best = u64::MAX;
    let mut best_floors = 0;
    let mut progress_at = Instant::now();
    loop {
        if let Ok(true) = settled(urls).await {
            return true;
        }
        if let Some(sample) = *samples.borrow_and_update() {
            if sample.reading.remaining() < best {
                best = sample.reading.remaining();
                progress_at = sample.at;
            }
            // A consumer working through redeliveries (its broker lost acknowledgements) moves
            // its ack floor on without applying anything new: progress too.
            if let Some(floors) = sample.reading.floors() {
                if floors > best_floors {
                    best_floors = floors;
                    progress_at = sample.at;
                }
            }
        }
        if progress_at.elapsed() >= stall {
            tracing::warn!(
                remaining = best,
                "no progress for {stall:?}: giving up settling"
            );
            return false;
        }
        // The next reading, or a second, whichever comes first: settled() confirms with
        // exact counts, which is worth doing about once a second, not more.
        let next = tokio::time::timeout(Duration::from_secs(1), samples.changed()).await;
        if matches!(next, Ok(Err(_))) {
            // The monitor is gone: no more readings to wait for, only the clock.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_is_held_above_the_bound_and_released_at_three_quarters() {
        let bound = Some(1_000);
        assert!(!hold_next(false, 1_000, bound));
        assert!(hold_next(false, 1_001, bound));
        // Held, it stays held until the lag is down to 750.
        assert!(hold_next(true, 900, bound));
        assert!(hold_next(true, 751, bound));
        assert!(!hold_next(true, 750, bound));
        // Unbounded: never held.
        assert!(!hold_next(false, u64::MAX, None));
        assert!(!hold_next(true, u64::MAX, None));
    }

    #[test]
    fn lag_is_per_consumer_and_the_work_left_counts_the_outbox_too() {
        let reading = Reading {
            events: 100,
            pending: 7,
            applied: [100, 60],
            positions: [None; 2],
        };
        assert_eq!((reading.lag(0), reading.lag(1)), (0, 40));
        assert_eq!(reading.max_lag(), 40);
        assert_eq!(reading.remaining(), 47);
        assert_eq!(reading.published(), 93);
    }
}
