//! [`Consumer`]: deliveries from an [`Intake`] applied through the inbox, one lane per
//! aggregate.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::FutureExt;
use handoff_core::intake::{
    broker_backstop, Delivery, Intake, MalformedEvent, ReceivedEvent, Settle,
};
use handoff_postgres::{Admission, Inbox, QuarantineKind};
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, error, info, warn};

use crate::failpoints::{self as fp, freeze_if_fired};
use crate::in_flight::{self, HeldBytes, InFlightBytes};
use crate::metrics::ConsumerMetrics;
use crate::HandlerErrorKind::Permanent;
use crate::{ConfigError, ConsumerConfig, Gap, GapDecision, GapPolicy, Handler, HandlerError};

// Batch mode lives in its own file; a child module, so it reuses this path's private items.
#[path = "batch.rs"]
mod batch;

/// How long the loop pauses after the intake failed, before it asks again.
const INTAKE_RETRY: Duration = Duration::from_secs(1);

/// Applies delivered events exactly once, in order per aggregate (design C1, C3, C4).
///
/// For each delivery, in one transaction of the consumer's own database: the event id goes into
/// `processed_events` (a conflict means a duplicate, acknowledged without applying), the
/// aggregate's last applied sequence is checked and advanced, and the [`Handler`] applies the
/// effect; the broker is acknowledged only after that transaction commits. A crash anywhere
/// before the commit leaves nothing applied and the message unacknowledged; a crash after it
/// leaves the effect and its dedup row, so the redelivery is a duplicate.
///
/// Events of one aggregate are applied one at a time in delivery order; different aggregates
/// run concurrently, up to [`ConsumerConfig::max_concurrency`]. Several instances (processes)
/// of one consumer may share a durable subscription: the locked sequence row keeps one
/// aggregate's events in order across them.
///
/// Failures: one bound for all of them. A retryable [`HandlerError`], a handler panic, the
/// [apply timeout](ConsumerConfig::apply_timeout) and a database error on the event's own
/// statements (admit, sequence advance, commit) each hand the delivery back after
/// [`retry_backoff`](ConsumerConfig::retry_backoff) and count toward the one
/// [delivery cap](ConsumerConfig::max_deliveries); at the cap the event goes to
/// `consumer_quarantine` with a reason kind (`delivery_cap`, `handler_panic`, `apply_timeout`,
/// `database`) and the raw message, and only then is the broker told to forget it. A permanent
/// error and a malformed message are quarantined at once. The broker's own limit is set above
/// the cap ([`Intake::set_delivery_backstop`]). Gaps follow the [`GapPolicy`]; a stale event is
/// a duplicate under every policy.
///
/// # Examples
///
/// ```no_run
/// use handoff_consumer::{Consumer, ConsumerConfig, Handler, HandlerError};
/// use handoff_core::intake::ReceivedEvent;
/// use handoff_nats::{JetStreamIntake, IntakeConfig};
/// use sqlx::PgConnection;
///
/// struct Reserve;
///
/// impl Handler for Reserve {
///     async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO reservations (order_id) VALUES ($1)")
///             .bind(&e.aggregate_id)
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     }
/// }
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let config = ConsumerConfig { name: "inventory".into(), ..ConsumerConfig::default() };
/// let intake_config = IntakeConfig { durable_name: "inventory".into(), ..IntakeConfig::default() };
/// let intake = JetStreamIntake::connect("nats://127.0.0.1:4222", intake_config).await?;
/// let consumer = Consumer::new(config, pool, Reserve)?;
/// consumer.run(intake, async { let _ = tokio::signal::ctrl_c().await; }).await;
/// # Ok(())
/// # }
/// ```
pub struct Consumer<H> {
    shared: Arc<Shared<H>>,
}

struct Shared<H> {
    config: ConsumerConfig,
    pool: PgPool,
    inbox: Inbox,
    handler: H,
    /// Bounds the events applied at once (each holds a pooled connection).
    permits: Semaphore,
    /// Events held by the buffer gap policy, across lanes.
    buffered: AtomicUsize,
    /// Bytes of the deliveries taken and not yet settled.
    in_flight: Arc<InFlightBytes>,
    metrics: ConsumerMetrics,
    /// Benchmarks only: apply without the inbox, to measure what it costs.
    #[cfg(feature = "bench")]
    bypass_inbox: AtomicBool,
}

/// What one processed delivery leaves for its lane.
enum Step {
    /// Applied at this sequence: a buffered successor may go next.
    Applied(i64),
    /// Ahead of its aggregate under the buffer policy: hold it.
    Park,
    /// Settled (acknowledged, redelivered later, or quarantined).
    Done,
}

/// One delivered event waiting in its lane.
struct Item<S> {
    event: ReceivedEvent,
    deliveries: u64,
    settle: S,
    /// Counted in [`Shared::in_flight`] until the item is dropped.
    _bytes: HeldBytes,
}

/// The events of one aggregate, applied by one task at a time.
struct Lane<S> {
    queue: VecDeque<Item<S>>,
    /// Held by the buffer policy, by sequence, with when each was parked.
    parked: BTreeMap<i64, (Instant, Item<S>)>,
    /// Wakes the lane's task while it waits on parked events.
    wake: Arc<Notify>,
}

type LaneKey = (String, String);

struct Lanes<S> {
    map: Mutex<HashMap<LaneKey, Lane<S>>>,
    closing: AtomicBool,
    /// Batch mode's collector (batch.rs), when [`ConsumerConfig::batch`] is set.
    batches: Option<batch::Batches<S>>,
}

impl<S> Lanes<S> {
    fn lock(&self) -> MutexGuard<'_, HashMap<LaneKey, Lane<S>>> {
        // std Mutex: held only for map operations, never across an await. A panic while holding
        // it leaves the map consistent (every operation is a single insert or remove).
        self.map
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The least time a quarantine write is given, whatever the apply timeout.
const QUARANTINE_WRITE_FLOOR: Duration = Duration::from_secs(10);

/// What a lane's task does next.
enum Next<S> {
    Apply(Item<S>),
    Wait(Arc<Notify>, Instant),
    Exit(Vec<Item<S>>),
}

impl<H: Handler> Consumer<H> {
    /// A consumer that applies events with `handler` on connections from `pool`.
    ///
    /// The pool should hold at least [`max_concurrency`](ConsumerConfig::max_concurrency)
    /// connections, plus one for quarantine writes. The consumer's metrics are registered here:
    /// install the `metrics` recorder (such as the Prometheus exporter) before calling it. The inbox tables must exist: run
    /// `handoff_postgres::Migrator::handoff` on the consumer's database first.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] when `config` does not [validate](ConsumerConfig::validate).
    pub fn new(config: ConsumerConfig, pool: PgPool, handler: H) -> Result<Self, ConfigError> {
        config.validate()?;
        let inbox = Inbox::new(config.schema.clone(), &config.name)?.with_pooling(config.pooling);
        let metrics = ConsumerMetrics::new(&config.name);
        Ok(Self {
            shared: Arc::new(Shared {
                permits: Semaphore::new(config.max_concurrency),
                in_flight: InFlightBytes::new(
                    config.max_in_flight_bytes,
                    metrics.in_flight_bytes.clone(),
                ),
                metrics,
                config,
                pool,
                inbox,
                handler,
                buffered: AtomicUsize::new(0),
                #[cfg(feature = "bench")]
                bypass_inbox: AtomicBool::new(false),
            }),
        })
    }

    /// The same consumer without the inbox: no dedup row, no sequence check, so a redelivery
    /// applies the effect again. For benchmarks that measure the inbox's cost; never for use.
    #[doc(hidden)]
    #[cfg(feature = "bench")]
    pub fn without_inbox_for_benchmarks(self) -> Self {
        self.shared.bypass_inbox.store(true, Ordering::Relaxed);
        self
    }

    /// Takes deliveries from `intake` until `shutdown` completes, then stops taking, hands held
    /// events back to the broker, and gives events being applied
    /// [`shutdown_grace`](ConsumerConfig::shutdown_grace) to finish.
    ///
    /// Never fails: an intake error is logged and retried after a pause, a database error
    /// leaves the delivery to the broker's redelivery.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future aborts events being applied: their transactions roll back and the
    /// broker redelivers them. Prefer completing `shutdown`.
    pub async fn run<I: Intake>(&self, mut intake: I, shutdown: impl Future<Output = ()> + Send) {
        let mut tasks = JoinSet::new();
        let lanes = Arc::new(Lanes {
            map: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
            batches: batch::start(&self.shared, &mut tasks),
        });
        // While it waits for shutdown, the consumer also applies the quarantined events an
        // operator asked to retry (`handoff consumer quarantine retry`), one at a time.
        let shutdown = crate::serve_retries(
            &self.shared.pool,
            &self.shared.config,
            &self.shared.handler,
            shutdown,
        );
        let mut shutdown = std::pin::pin!(shutdown);
        let backstop = broker_backstop(self.shared.config.max_deliveries);
        if let Err(error) = intake.set_delivery_backstop(backstop).await {
            warn!(%error, backstop, "could not set the broker's delivery limit; the consumer's \
                                     delivery cap alone bounds redeliveries");
        }
        info!(consumer = %self.shared.config.name, gap_policy = self.shared.config.gap_policy.as_str(),
            max_deliveries = self.shared.config.max_deliveries, broker_backstop = backstop,
            "consumer running");
        loop {
            // Nothing more is taken while the deliveries held fill the byte bound.
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = self.shared.in_flight.room() => {}
            }
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                next = intake.next() => match next {
                    Ok(delivery) => self.dispatch(delivery, &lanes, &mut tasks),
                    Err(error) => {
                        warn!(%error, "the intake failed; asking again shortly");
                        tokio::select! {
                            () = &mut shutdown => break,
                            () = tokio::time::sleep(INTAKE_RETRY) => {}
                        }
                    }
                },
            }
            while let Some(done) = tasks.try_join_next() {
                log_join(done);
            }
        }
        info!("consumer stopping: handing back held events, finishing those being applied");
        lanes.closing.store(true, Ordering::SeqCst);
        if let Some(batches) = &lanes.batches {
            batches.close();
        }
        for lane in lanes.lock().values() {
            lane.wake.notify_one();
        }
        let drained = tokio::time::timeout(self.shared.config.shutdown_grace, async {
            while let Some(done) = tasks.join_next().await {
                log_join(done);
            }
        })
        .await;
        if drained.is_err() {
            warn!(
                "events still being applied at the end of the shutdown grace were aborted; \
                   the broker redelivers them"
            );
            tasks.abort_all();
        }
    }

    fn dispatch<S: Settle>(
        &self,
        delivery: Delivery<S>,
        lanes: &Arc<Lanes<S>>,
        tasks: &mut JoinSet<()>,
    ) {
        let Delivery {
            event,
            delivery_count,
            settle,
        } = delivery;
        let bytes = match &event {
            Ok(event) => in_flight::event_bytes(event),
            Err(malformed) => in_flight::malformed_bytes(malformed),
        };
        let held = self.shared.in_flight.hold(bytes);
        let event = match event {
            Ok(event) => event,
            Err(malformed) => {
                let shared = self.shared.clone();
                tasks.spawn(async move {
                    let _held = held;
                    shared
                        .quarantine(
                            Err(&malformed),
                            &settle,
                            QuarantineKind::Malformed,
                            &malformed.reason,
                            delivery_count,
                        )
                        .await;
                });
                return;
            }
        };
        let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
        let item = Item {
            event,
            deliveries: delivery_count,
            settle,
            _bytes: held,
        };
        let mut map = lanes.lock();
        if let Some(lane) = map.get_mut(&key) {
            lane.queue.push_back(item);
            lane.wake.notify_one();
            return;
        }
        map.insert(
            key.clone(),
            Lane {
                queue: VecDeque::from([item]),
                parked: BTreeMap::new(),
                wake: Arc::new(Notify::new()),
            },
        );
        drop(map);
        let shared = self.shared.clone();
        let lanes = lanes.clone();
        tasks.spawn(async move { shared.run_lane(&lanes, key).await });
    }
}

fn log_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(error) = done {
        if error.is_panic() {
            error!(%error, "a consumer task panicked");
        }
    }
}

impl<H: Handler> Shared<H> {
    /// Applies a lane's events one by one until it is empty and holds nothing parked.
    async fn run_lane<S: Settle>(self: Arc<Self>, lanes: &Lanes<S>, key: LaneKey) {
        loop {
            match self.next_in_lane(lanes, &key) {
                Next::Apply(item) => {
                    // Batch mode (batch.rs): the event joins a batch and comes back only to be
                    // applied alone, below.
                    let Some(item) = self.batched(lanes, &key, item).await else {
                        continue;
                    };
                    let Ok(_permit) = self.permits.acquire().await else {
                        return;
                    };
                    let event_id = item.event.event_id;
                    let work = AssertUnwindSafe(self.process(&item)).catch_unwind();
                    let step = match tokio::time::timeout(self.config.apply_timeout, work).await {
                        Ok(Ok(step)) => step,
                        // The transaction was dropped with the unwound future (rolled back);
                        // the panic counts toward the delivery cap like any failure, so a
                        // handler that always panics on this event ends in the quarantine.
                        Ok(Err(panic)) => {
                            let reason =
                                format!("the handler panicked: {}", panic_message(&*panic));
                            error!(%event_id, deliveries = item.deliveries, "{reason}");
                            self.failed_attempt(&item, QuarantineKind::HandlerPanic, &reason)
                                .await;
                            Step::Done
                        }
                        // A hanging handler, or a database connection that went silent:
                        // dropping the work drops its transaction (rolled back with the
                        // connection). It counts toward the delivery cap like any failure.
                        Err(_) => {
                            let reason = format!(
                                "applying took longer than the apply timeout ({:?})",
                                self.config.apply_timeout
                            );
                            warn!(%event_id, deliveries = item.deliveries, "{reason}; abandoned");
                            self.metrics.abandoned.increment(1);
                            self.failed_attempt(&item, QuarantineKind::ApplyTimeout, &reason)
                                .await;
                            Step::Done
                        }
                    };
                    match step {
                        Step::Applied(sequence) => self.release_successor(lanes, &key, sequence),
                        Step::Park => self.park(lanes, &key, item).await,
                        Step::Done => {}
                    }
                }
                Next::Wait(wake, deadline) => {
                    tokio::select! {
                        () = wake.notified() => {}
                        () = tokio::time::sleep_until(deadline.into()) => {
                            self.expire_parked(lanes, &key).await;
                        }
                    }
                }
                Next::Exit(handed_back) => {
                    for item in handed_back {
                        settle_nak(&item, Duration::ZERO).await;
                    }
                    return;
                }
            }
        }
    }

    fn next_in_lane<S>(&self, lanes: &Lanes<S>, key: &LaneKey) -> Next<S> {
        let mut map = lanes.lock();
        let Some(lane) = map.get_mut(key) else {
            return Next::Exit(Vec::new());
        };
        if lanes.closing.load(Ordering::SeqCst) {
            let mut items: Vec<Item<S>> = lane.queue.drain(..).collect();
            let parked = std::mem::take(&mut lane.parked);
            self.unbuffer(parked.len());
            items.extend(parked.into_values().map(|(_, item)| item));
            map.remove(key);
            return Next::Exit(items);
        }
        if let Some(item) = lane.queue.pop_front() {
            return Next::Apply(item);
        }
        let max_wait = self.buffer_max_wait();
        match lane.parked.values().map(|(at, _)| *at).min() {
            Some(oldest) => Next::Wait(lane.wake.clone(), oldest + max_wait),
            None => {
                map.remove(key);
                Next::Exit(Vec::new())
            }
        }
    }

    /// After `sequence` was applied, moves a parked event at `sequence + 1` to the lane's front.
    fn release_successor<S>(&self, lanes: &Lanes<S>, key: &LaneKey, sequence: i64) {
        let mut map = lanes.lock();
        if let Some(lane) = map.get_mut(key) {
            if let Some((_, item)) = lane.parked.remove(&(sequence + 1)) {
                self.unbuffer(1);
                debug!(event_id = %item.event.event_id, "the gap filled; applying a held event");
                lane.queue.push_front(item);
            }
        }
    }

    /// Holds `item` until its predecessor is applied, within the buffer's bounds; past them it
    /// goes back to the broker.
    async fn park<S: Settle>(&self, lanes: &Lanes<S>, key: &LaneKey, item: Item<S>) {
        let GapPolicy::Buffer {
            max_per_aggregate,
            max_total,
            max_wait,
        } = self.config.gap_policy
        else {
            return settle_nak(&item, Duration::ZERO).await;
        };
        let refused = {
            let mut map = lanes.lock();
            match map.get_mut(key) {
                Some(lane)
                    if lane.parked.len() < max_per_aggregate
                        && self.buffered.load(Ordering::SeqCst) < max_total =>
                {
                    self.buffered.fetch_add(1, Ordering::SeqCst);
                    self.metrics
                        .buffered
                        .set(self.buffered.load(Ordering::SeqCst) as f64);
                    // A second delivery of a parked sequence replaces the first, which goes
                    // back to the broker.
                    lane.parked
                        .insert(item.event.sequence, (Instant::now(), item))
                        .map(|(_, old)| {
                            self.unbuffer(1);
                            old
                        })
                }
                _ => Some(item),
            }
        };
        if let Some(item) = refused {
            debug!(event_id = %item.event.event_id, "buffer full; the broker delivers it later");
            settle_nak(&item, max_wait).await;
        }
    }

    /// Hands parked events held for `max_wait` back to the broker.
    async fn expire_parked<S: Settle>(&self, lanes: &Lanes<S>, key: &LaneKey) {
        let max_wait = self.buffer_max_wait();
        let expired: Vec<Item<S>> = {
            let mut map = lanes.lock();
            let Some(lane) = map.get_mut(key) else {
                return;
            };
            let now = Instant::now();
            let due: Vec<i64> = lane
                .parked
                .iter()
                .filter(|(_, (at, _))| *at + max_wait <= now)
                .map(|(sequence, _)| *sequence)
                .collect();
            due.iter()
                .filter_map(|sequence| lane.parked.remove(sequence))
                .map(|(_, item)| item)
                .collect()
        };
        self.unbuffer(expired.len());
        for item in expired {
            info!(event_id = %item.event.event_id, sequence = item.event.sequence,
                "the gap did not fill in time; handing the event back to the broker");
            settle_nak(&item, max_wait).await;
        }
    }

    fn unbuffer(&self, n: usize) {
        if n > 0 {
            let left = self.buffered.fetch_sub(n, Ordering::SeqCst) - n;
            self.metrics.buffered.set(left as f64);
        }
    }

    fn buffer_max_wait(&self) -> Duration {
        match self.config.gap_policy {
            GapPolicy::Buffer { max_wait, .. } => max_wait,
            _ => Duration::ZERO,
        }
    }

    /// One delivery, start to settlement (or to [`Step::Park`], which leaves it unsettled).
    async fn process<S: Settle>(&self, item: &Item<S>) -> Step {
        let started = Instant::now();
        let mut tx = match self.pool.begin().await {
            Ok(tx) => tx,
            Err(error) => {
                let reason = format!("cannot begin a transaction: {error}");
                return self
                    .failed_attempt(item, QuarantineKind::Database, &reason)
                    .await;
            }
        };
        #[cfg(feature = "bench")]
        if self.bypass_inbox.load(Ordering::Relaxed) {
            return self.apply(tx, item, false, started).await;
        }
        let admission = match self.inbox.admit(&mut tx, &item.event).await {
            Ok(admission) => admission,
            Err(error) => {
                drop(tx);
                let reason = error.to_string();
                return self
                    .failed_attempt(item, QuarantineKind::Database, &reason)
                    .await;
            }
        };
        match admission {
            Admission::Apply => self.apply(tx, item, false, started).await,
            Admission::Duplicate => {
                drop(tx);
                self.metrics.duplicates.increment(1);
                info!(event_id = %item.event.event_id, deliveries = item.deliveries,
                    "duplicate delivery acknowledged without applying");
                settle_ack(item).await;
                Step::Done
            }
            Admission::Stale { last_sequence } => self.stale(tx, item, last_sequence).await,
            Admission::Gap { last_sequence } => {
                let gap = Gap {
                    last_applied: last_sequence,
                    received: item.event.sequence,
                };
                self.ahead(tx, item, gap, started).await
            }
        }
    }

    /// An event behind its aggregate (its place is already applied: a replay that arrived after
    /// its dedup row was purged). Under every gap policy it is a duplicate: its dedup row is
    /// committed and the broker acknowledged; neither the handler nor the reconcile hook sees it.
    async fn stale<S: Settle>(
        &self,
        tx: sqlx::Transaction<'static, sqlx::Postgres>,
        item: &Item<S>,
        last_sequence: i64,
    ) -> Step {
        self.metrics.stale.increment(1);
        if let Err(error) = tx.commit().await {
            let reason = format!("cannot record a stale event: {error}");
            return self
                .failed_attempt(item, QuarantineKind::Database, &reason)
                .await;
        }
        info!(event_id = %item.event.event_id, aggregate_id = %item.event.aggregate_id,
            sequence = item.event.sequence, last_applied = last_sequence,
            "stale event (its place is already applied) acknowledged as a duplicate");
        self.metrics.skipped.increment(1);
        settle_ack(item).await;
        Step::Done
    }

    /// An event ahead of its aggregate's line, by the gap policy.
    async fn ahead<S: Settle>(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        item: &Item<S>,
        gap: Gap,
        started: Instant,
    ) -> Step {
        let event = &item.event;
        self.metrics.gaps.increment(1);
        let decision = match self.config.gap_policy {
            GapPolicy::Reconcile { .. } => {
                let decided = keep_alive(
                    self.handler.reconcile(&mut tx, event, gap),
                    &item.settle,
                    self.config.progress_interval,
                )
                .await;
                match decided {
                    Ok(decision) => decision,
                    Err(error) => {
                        drop(tx);
                        return self.failed(item, error).await;
                    }
                }
            }
            _ => GapDecision::RetryLater,
        };
        info!(event_id = %event.event_id, aggregate_id = %event.aggregate_id,
            expected = gap.expected(), received = gap.received, policy = self.config.gap_policy.as_str(),
            decision = ?decision, "event ahead of its aggregate's line");
        match decision {
            GapDecision::Apply => self.apply(tx, item, true, started).await,
            GapDecision::Skip => self.skip_ahead(tx, item, gap).await,
            GapDecision::RetryLater => {
                drop(tx);
                if item.deliveries >= self.config.max_deliveries {
                    let reason = format!(
                        "sequence {} still not next after {} deliveries (aggregate waits for {})",
                        gap.received,
                        item.deliveries,
                        gap.expected()
                    );
                    self.quarantine(
                        Ok(&item.event),
                        &item.settle,
                        QuarantineKind::Gap,
                        &reason,
                        item.deliveries,
                    )
                    .await;
                    return Step::Done;
                }
                if matches!(self.config.gap_policy, GapPolicy::Buffer { .. }) {
                    return Step::Park;
                }
                let delay = match self.config.gap_policy {
                    GapPolicy::Reject { retry_after } | GapPolicy::Reconcile { retry_after } => {
                        retry_after
                    }
                    GapPolicy::Buffer { max_wait, .. } => max_wait,
                };
                settle_nak(item, delay).await;
                Step::Done
            }
        }
    }

    /// A reconcile hook skipped an event ahead of its aggregate: the hook vouches that the
    /// consumer's state already covers the aggregate up to and including it (it fetched or
    /// rebuilt it). The aggregate moves to the event's sequence, as it would had the event been
    /// applied, so its successor is next and nothing waits forever; the events skipped over
    /// (`expected ..= received`) are logged and counted, and any of them that still arrives is
    /// stale, acknowledged as a duplicate.
    async fn skip_ahead<S: Settle>(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        item: &Item<S>,
        gap: Gap,
    ) -> Step {
        if let Err(error) = self.inbox.advance_to(&mut tx, &item.event).await {
            drop(tx);
            let reason = error.to_string();
            return self
                .failed_attempt(item, QuarantineKind::Database, &reason)
                .await;
        }
        if let Err(error) = tx.commit().await {
            let reason = format!("cannot record a skipped event: {error}");
            return self
                .failed_attempt(item, QuarantineKind::Database, &reason)
                .await;
        }
        let event = &item.event;
        warn!(event_id = %event.event_id, aggregate_type = %event.aggregate_type,
            aggregate_id = %event.aggregate_id, skipped_from = gap.expected(),
            skipped_to = gap.received,
            "the reconcile hook skipped an event ahead of its aggregate: the aggregate moved \
             past sequences {}..={} without applying them", gap.expected(), gap.received);
        self.metrics.skipped.increment(1);
        self.metrics
            .skipped_ahead
            .increment(u64::try_from(gap.received - gap.last_applied).unwrap_or(0));
        settle_ack(item).await;
        Step::Applied(event.sequence)
    }

    /// Runs the handler in `tx`, commits, then acknowledges.
    async fn apply<S: Settle>(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        item: &Item<S>,
        advance: bool,
        started: Instant,
    ) -> Step {
        let skip_reason = item.event.skip_reason();
        let handled = match skip_reason {
            // A skip marker: an operator skipped this event at the source (`handoff quarantine
            // skip`). The admission already recorded it and, with the sequence advance below,
            // the aggregate moves past it; the handler never sees it.
            Some(reason) => {
                info!(event_id = %item.event.event_id, reason, "skip marker recorded, not applied");
                Ok(())
            }
            None => {
                // In the event's trace (feature `otel`, see crate::trace); no span without it.
                let span = crate::trace::handler_span(&self.config.name, &item.event);
                keep_alive(
                    tracing::Instrument::instrument(
                        self.handler.handle(&mut tx, &item.event),
                        span,
                    ),
                    &item.settle,
                    self.config.progress_interval,
                )
                .await
            }
        };
        if let Err(error) = handled {
            drop(tx);
            return self.failed(item, error).await;
        }
        if advance {
            if let Err(error) = self.inbox.advance_to(&mut tx, &item.event).await {
                drop(tx);
                let reason = error.to_string();
                return self
                    .failed_attempt(item, QuarantineKind::Database, &reason)
                    .await;
            }
        }
        freeze_if_fired(fp::BEFORE_COMMIT).await;
        if let Err(error) = tx.commit().await {
            // Unknown whether the commit happened: the redelivery finds out through the inbox
            // (a duplicate). A commit that keeps failing (a deferred constraint the handler's
            // writes break) is a failure like any other and counts toward the cap.
            let reason = format!("commit failed: {error}");
            return self
                .failed_attempt(item, QuarantineKind::Database, &reason)
                .await;
        }
        freeze_if_fired(fp::AFTER_COMMIT).await;
        settle_ack(item).await;
        if skip_reason.is_some() {
            self.metrics.skipped.increment(1);
        } else {
            self.metrics.applied.increment(1);
        }
        self.metrics
            .apply_seconds
            .record(started.elapsed().as_secs_f64());
        Step::Applied(item.event.sequence)
    }

    /// A handler (or reconcile hook) error: again later, or to the quarantine.
    async fn failed<S: Settle>(&self, item: &Item<S>, error: HandlerError) -> Step {
        self.metrics.handler_error(error.kind());
        if error.kind() == Permanent {
            let reason = error.to_string();
            self.quarantine(
                Ok(&item.event),
                &item.settle,
                QuarantineKind::HandlerPermanent,
                &reason,
                item.deliveries,
            )
            .await;
            return Step::Done;
        }
        self.failed_attempt(item, QuarantineKind::DeliveryCap, &error.to_string())
            .await
    }

    /// One failed attempt at `item`, whatever failed (a retryable handler error, a panic, the
    /// apply timeout, the database): below the delivery cap the broker delivers it again after
    /// the retry backoff; at the cap it goes to the quarantine as `kind`. This is the one bound
    /// every failure counts toward.
    async fn failed_attempt<S: Settle>(
        &self,
        item: &Item<S>,
        kind: QuarantineKind,
        reason: &str,
    ) -> Step {
        if item.deliveries >= self.config.max_deliveries {
            let reason = format!(
                "still failing after {} deliveries: {reason}",
                item.deliveries
            );
            self.quarantine(
                Ok(&item.event),
                &item.settle,
                kind,
                &reason,
                item.deliveries,
            )
            .await;
        } else {
            // After a timeout the abandoned transaction may still be open on the server,
            // holding the aggregate's row lock until the server ends it (the reference
            // consumers set `idle_in_transaction_session_timeout` to the apply timeout): the
            // next delivery waits that long, so it does not time out behind that lock.
            let at_least = match kind {
                QuarantineKind::ApplyTimeout => self.config.apply_timeout,
                _ => Duration::ZERO,
            };
            self.retry_later(item, reason, at_least).await;
        }
        Step::Done
    }

    /// Has the broker deliver `item` again after the retry backoff (and not before
    /// `at_least`).
    async fn retry_later<S: Settle>(&self, item: &Item<S>, error: &str, at_least: Duration) {
        let failures = u32::try_from(item.deliveries).unwrap_or(u32::MAX);
        let delay = self.config.retry_backoff.delay(failures).max(at_least);
        self.metrics.retries.increment(1);
        warn!(event_id = %item.event.event_id, deliveries = item.deliveries,
            cap = self.config.max_deliveries, error, retry_in = ?delay,
            "event not applied; it will be delivered again");
        settle_nak(item, delay).await;
    }

    /// Writes the delivery to the quarantine, then tells the broker to forget it; when the write
    /// fails, the broker delivers it again instead (never a silent drop).
    async fn quarantine<S: Settle>(
        &self,
        event: Result<&ReceivedEvent, &MalformedEvent>,
        settle: &S,
        kind: QuarantineKind,
        reason: &str,
        deliveries: u64,
    ) {
        let write = async {
            let mut conn = self.pool.acquire().await.map_err(|e| e.to_string())?;
            self.inbox
                .quarantine(&mut conn, event, kind, reason, deliveries)
                .await
                .map_err(|e| e.to_string())
        };
        // Bounded, so that a silent database does not hold the lane forever; but not by a
        // short apply timeout, which is about the handler: on a loaded database, opening a
        // connection alone can outlast it, and every failed write costs a delivery of the
        // broker's backstop.
        let bound = self.config.apply_timeout.max(QUARANTINE_WRITE_FLOOR);
        let written: Result<(), String> = match tokio::time::timeout(bound, write).await {
            Ok(written) => written,
            Err(_) => Err(format!("the quarantine write took longer than {bound:?}")),
        };
        let event_id = match event {
            Ok(e) => Some(e.event_id),
            Err(m) => m.event_id,
        };
        match written {
            Ok(()) => {
                self.metrics.quarantined(kind);
                error!(event_id = ?event_id, reason_kind = kind.as_str(), reason,
                    deliveries, "event quarantined");
                if let Err(error) = settle.term().await {
                    warn!(%error, "could not tell the broker to drop a quarantined event; a \
                                   redelivery finds it quarantined");
                }
            }
            Err(error) => {
                warn!(%error, event_id = ?event_id, "cannot write the quarantine; the event \
                                                      will be delivered again");
                let delay = self.config.retry_backoff.max;
                if let Err(error) = settle.nak(delay).await {
                    warn!(%error, "could not hand the event back; the broker redelivers it \
                                   after its ack wait");
                }
            }
        }
    }
}

/// The text of a panic's payload (what `panic!` was given), when it is text.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a payload that is not text")
}

/// Runs `work`, restarting the broker's ack wait every `every` until it ends.
async fn keep_alive<F: Future, S: Settle>(work: F, settle: &S, every: Duration) -> F::Output {
    let mut work = std::pin::pin!(work);
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = ticker.tick() => {
                if let Err(error) = settle.in_progress().await {
                    debug!(%error, "could not extend the ack wait");
                }
            }
        }
    }
}

async fn settle_ack<S: Settle>(item: &Item<S>) {
    if let Err(error) = item.settle.ack().await {
        // The effect is committed; the redelivery that follows is a duplicate to the inbox.
        warn!(%error, event_id = %item.event.event_id, "acknowledgement failed");
    }
}

async fn settle_nak<S: Settle>(item: &Item<S>, delay: Duration) {
    if let Err(error) = item.settle.nak(delay).await {
        warn!(%error, event_id = %item.event.event_id,
            "could not hand the event back; the broker redelivers it after its ack wait");
    }
}
