//! The relay loop: claim, publish in ordered lanes, record outcomes, shut down cleanly.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::stream::{FuturesUnordered, StreamExt};
use handoff_core::delivery::{
    Claim, Failure, Lease, OutboxEvent, PublishError, Published, Released, Settled, Source,
    SourceError, SourceErrorKind, Transport,
};
use handoff_core::EventId;
use tokio::sync::{mpsc, watch, Notify, Semaphore};
// tokio's clock, which is the system's in production and can be paused in simulation
// (tools/sim): leases and pauses then follow simulated time, not the host's.
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::failpoints::{self as fp, freeze_if_fired};
pub use crate::health::{DestinationPause, RelayStatus};
use crate::health::{Health, Pause, PauseReason, Verdict};
use crate::metrics as m;
use crate::{OrderMode, RelayConfig, RelayConfigError};

/// Moves committed events from a [`Source`] to a [`Transport`] at least once, in order per
/// aggregate (design P1-P6).
///
/// - Claims are leased batches; while one batch is being published the next is claimed, up to
///   [`RelayConfig::max_in_flight`] events and [`RelayConfig::max_in_flight_bytes`] bytes.
/// - Each claim is split into one lane per aggregate. Lanes run concurrently; inside a lane an
///   event is published only after its predecessor's acknowledgement. The source never leases an
///   event whose predecessor is unpublished and outside the claim, so no relay, this one or
///   another, can overtake a lane.
/// - Acknowledgements, failures and releases are written back in batches by one task, apart
///   from publishing, so a database round trip never stalls the broker pipeline.
/// - With [`RelayConfig::order`] set to [`OrderMode::Global`], each claim is one lane in global
///   sequence order instead: strictly one publish at a time. The source hands out the global
///   lane's front to one relay at a time, so the lane is never overtaken either.
/// - A destination that is down, throttling (`Retry-After`, `connection.blocked`) or failing
///   every publish pauses claiming (no tight loop, no database load, no attempt charged) with
///   backoff; one probe event then tells whether it accepts again. Attempts are charged only
///   for failures that concern the event (docs/relay.md, "Failures (P3): whose fault is it?").
///
/// # Examples
///
/// ```no_run
/// use handoff_relay::{Relay, RelayConfig};
/// # use handoff_core::delivery::{Source, Transport};
///
/// # async fn example(source: impl Source, transport: impl Transport) -> Result<(), Box<dyn std::error::Error>> {
/// let relay = Relay::new(source, transport, RelayConfig::default())?;
/// let report = relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await;
/// println!("published {}", report.published);
/// # Ok(())
/// # }
/// ```
pub struct Relay<S, T> {
    source: Arc<S>,
    transport: Arc<T>,
    config: RelayConfig,
    health: Arc<Health>,
}

/// What a relay did before it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// Events the broker acknowledged.
    pub published: u64,
    /// Publishes that failed and were scheduled for a retry.
    pub retried: u64,
    /// Events held for an operator (attempt cap reached, or refused by the broker for good).
    pub held: u64,
    /// Leased events given back unpublished.
    pub released: u64,
    /// The kind of the source failure that ended the run, when one did: a source error that
    /// retrying cannot cure ([`SourceErrorKind::is_retryable`] false). `None` when the run
    /// ended on its shutdown signal. [`Relay::try_run`] returns the error itself.
    pub source_failure: Option<SourceErrorKind>,
}

/// The relay stopped on its own: its source failed in a way retrying cannot cure (a missing
/// table or column, a refused permission or login). Leased events were released where the
/// source still took writes, else their leases expire; nothing is lost.
#[derive(Debug, thiserror::Error)]
#[error(
    "the relay stopped: the source failed for good ({kind}) during {op}: {source}",
    kind = .source.kind()
)]
#[non_exhaustive]
pub struct RelayError {
    /// The source call that failed: `claim`, `mark_published`, `record_failures`, `release`.
    pub op: &'static str,
    /// What the source said.
    #[source]
    pub source: SourceError,
    /// What the relay did before it stopped.
    pub report: RelayReport,
}

/// The kind of a [`RelayError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RelayErrorKind {
    /// The source failed with an error of this kind, which is not retryable.
    Source(SourceErrorKind),
}

impl RelayError {
    /// What ended the run.
    pub fn kind(&self) -> RelayErrorKind {
        RelayErrorKind::Source(self.source.kind())
    }
}

/// An event's fate, written back to the source by the bookkeeper; each carries the lease the
/// event was claimed under, which fences its write.
enum Outcome {
    Published(Published),
    Failed(Failure),
    Released(Released),
}

/// State the claim loop, the lanes and the bookkeeper share. std mutex: never held across an
/// `.await`.
struct Shared {
    /// Leased events whose outcome is not decided yet, with the lease each was claimed under;
    /// released on shutdown.
    in_flight: Mutex<HashMap<EventId, Option<Lease>>>,
    /// The destination's health, apart from each event's: who is charged for a failure, and
    /// whether publishing is paused.
    health: Arc<Health>,
    /// Woken after every batch of outcomes is written: predecessors got marked, so events the
    /// last claim had to leave behind may be claimable now.
    progress: Notify,
    /// Asks the bookkeeper to write what it holds now instead of at the end of its
    /// [`mark_interval`](RelayConfig::mark_interval): something waits on its next write.
    hurry: Notify,
    /// Bytes of the events claimed and not yet published or given back
    /// ([`OutboxEvent::size_bytes`]), against [`RelayConfig::max_in_flight_bytes`]: the claim
    /// loop waits on it for room.
    bytes: watch::Sender<usize>,
    /// Claimed events whose outcome is not written back yet (the bookkeeper lags the lanes).
    /// Until it is 0, a claim may still find events blocked behind this relay's own unwritten
    /// outcomes; in global order mode the lane's front is this relay's own lease.
    unsettled: AtomicUsize,
    published: AtomicU64,
    retried: AtomicU64,
    held: AtomicU64,
    released: AtomicU64,
    /// The first source error retrying cannot cure, and the call it came from: it ends the run.
    fatal: Mutex<Option<(&'static str, SourceError)>>,
    /// Woken once [`fatal`](Self::fatal) is set.
    fatal_set: Notify,
}

impl Shared {
    /// Takes `bytes` of claimed events into the in-flight bytes.
    fn hold_bytes(&self, bytes: usize) {
        self.bytes
            .send_modify(|held| *held = held.saturating_add(bytes));
        metrics::gauge!(m::IN_FLIGHT_BYTES).set(*self.bytes.borrow() as f64);
    }

    /// Gives back `bytes` of events that were published, failed or given back: the lane no
    /// longer holds them.
    fn return_bytes(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        self.bytes
            .send_modify(|held| *held = held.saturating_sub(bytes));
        metrics::gauge!(m::IN_FLIGHT_BYTES).set(*self.bytes.borrow() as f64);
    }

    /// Records a source error retrying cannot cure and asks the run to end; the first one wins.
    fn fail(&self, op: &'static str, error: SourceError) {
        error!(
            error = %error,
            kind = error.kind().as_str(),
            op,
            "the source failed in a way retrying cannot cure: stopping the relay"
        );
        let mut fatal = self.fatal.lock().unwrap_or_else(|e| e.into_inner());
        if fatal.is_none() {
            *fatal = Some((op, error));
            self.fatal_set.notify_one();
        }
    }

    /// Forgets an event whose outcome is decided, if it is still in flight under `lease`: a
    /// lane that outlived its lease must not forget the event a later claim leased again.
    fn finish(&self, event_id: &EventId, lease: Option<Lease>) {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if in_flight.get(event_id) == Some(&lease) {
            in_flight.remove(event_id);
        }
    }
}

/// How a lane ended.
struct LaneEnd {
    /// The event that failed, why, and whose fault it was; the lane stopped there.
    failed: Option<(OutboxEvent, PublishError, Verdict)>,
    /// Events after the failure, or left because the lease ran short, in sequence order.
    unstarted: Vec<EventId>,
    /// The lease the lane's events were claimed under.
    lease: Option<Lease>,
}

impl<S: Source, T: Transport> Relay<S, T> {
    /// A relay over `source` and `transport`.
    ///
    /// # Errors
    ///
    /// The configuration does not validate.
    pub fn new(source: S, transport: T, config: RelayConfig) -> Result<Self, RelayConfigError> {
        Self::from_shared(Arc::new(source), Arc::new(transport), config)
    }

    /// A relay over a source and transport the caller keeps handles to (for status queries or
    /// tests).
    ///
    /// # Errors
    ///
    /// The configuration does not validate.
    pub fn from_shared(
        source: Arc<S>,
        transport: Arc<T>,
        config: RelayConfig,
    ) -> Result<Self, RelayConfigError> {
        config.validate()?;
        m::describe();
        let health = Arc::new(Health::new(config.health_window, config.outage_backoff));
        Ok(Relay {
            source,
            transport,
            config,
            health,
        })
    }

    /// A handle that tells, while the relay runs, whether it paused its destination and why:
    /// for a readiness probe or a status page. Take it before [`run`](Self::run).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_relay::{Relay, RelayConfig};
    /// # use handoff_core::delivery::{Source, Transport};
    ///
    /// # async fn example(source: impl Source, transport: impl Transport) -> Result<(), Box<dyn std::error::Error>> {
    /// let relay = Relay::new(source, transport, RelayConfig::default())?;
    /// let status = relay.status();
    /// tokio::spawn(async move {
    ///     if let Some(pause) = status.destination_pause() {
    ///         eprintln!("destination paused ({}): {}", pause.reason, pause.cause);
    ///     }
    /// });
    /// relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn status(&self) -> RelayStatus {
        RelayStatus {
            health: self.health.clone(),
        }
    }

    /// Runs until `shutdown` completes, then stops claiming, lets in-flight publishes finish
    /// (for at most [`RelayConfig::shutdown_grace`]), writes their outcomes, releases what is
    /// left and returns.
    ///
    /// Errors of the transport and retryable errors of the source never end the run: they are
    /// logged, counted and retried with backoff. A source error that retrying cannot cure
    /// ([`SourceErrorKind::is_retryable`] false: a missing table, a refused permission) ends
    /// it as a shutdown would, and [`RelayReport::source_failure`] says so;
    /// [`try_run`](Self::try_run) returns that error instead.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons leased events to their lease expiry; they are published
    /// again then (at least once). Prefer completing `shutdown`.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> RelayReport {
        match self.try_run(shutdown).await {
            Ok(report) => report,
            Err(error) => error.report,
        }
    }

    /// As [`run`](Self::run), but a source failure that retrying cannot cure is returned as an
    /// error, so the caller can exit with it.
    ///
    /// # Errors
    ///
    /// [`RelayError`]: the source failed with a kind that is not retryable; the relay stopped
    /// claiming, let in-flight publishes finish and released what it could.
    ///
    /// # Cancel safety
    ///
    /// As [`run`](Self::run).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_relay::{Relay, RelayConfig};
    /// # use handoff_core::delivery::{Source, Transport};
    ///
    /// # async fn example(source: impl Source, transport: impl Transport) -> Result<(), Box<dyn std::error::Error>> {
    /// let relay = Relay::new(source, transport, RelayConfig::default())?;
    /// match relay.try_run(async { tokio::signal::ctrl_c().await.ok(); }).await {
    ///     Ok(report) => println!("published {}", report.published),
    ///     Err(error) => eprintln!("{error}"), // e.g. the outbox table is missing
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<RelayReport, RelayError> {
        let shared = Arc::new(Shared {
            in_flight: Mutex::new(HashMap::new()),
            health: self.health.clone(),
            progress: Notify::new(),
            hurry: Notify::new(),
            published: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            held: AtomicU64::new(0),
            released: AtomicU64::new(0),
            unsettled: AtomicUsize::new(0),
            bytes: watch::Sender::new(0),
            fatal: Mutex::new(None),
            fatal_set: Notify::new(),
        });
        // Up until a publish says otherwise, so the gauge exists from the start rather than from
        // the first outage (a dashboard panel and `absent()` need the series).
        metrics::gauge!(m::BROKER_UP).set(1.0);
        metrics::gauge!(m::IN_FLIGHT_BYTES).set(0.0);
        show_pause(None);
        let (stop_tx, stop_rx) = watch::channel(false);
        let (outcome_tx, outcome_rx) = mpsc::unbounded_channel();
        let (claim_tx, mut claim_rx) = mpsc::channel::<Claim>(1);
        let capacity = Arc::new(Semaphore::new(self.config.max_in_flight));

        let bookkeeper = tokio::spawn(bookkeep(
            self.source.clone(),
            outcome_rx,
            shared.clone(),
            self.config.clone(),
            stop_rx.clone(),
        ));
        let claimer = tokio::spawn(claim_loop(
            self.source.clone(),
            self.transport.clone(),
            capacity.clone(),
            claim_tx,
            shared.clone(),
            self.config.clone(),
            stop_rx,
        ));

        let mut lanes = FuturesUnordered::new();
        let mut stopping: Option<tokio::time::Instant> = None;
        let mut claims_open = true;
        let shutdown = std::pin::pin!(shutdown);
        let mut shutdown = futures::FutureExt::fuse(shutdown);
        loop {
            if !claims_open && lanes.is_empty() {
                break;
            }
            let grace_end = stopping.unwrap_or_else(tokio::time::Instant::now);
            tokio::select! {
                biased;
                () = &mut shutdown, if stopping.is_none() => {
                    info!(in_flight = lanes.len(), "shutting down: no new claims");
                    let _ = stop_tx.send(true);
                    stopping = Some(tokio::time::Instant::now() + self.config.shutdown_grace);
                }
                () = shared.fatal_set.notified(), if stopping.is_none() => {
                    info!(in_flight = lanes.len(), "stopping on a source failure: no new claims");
                    let _ = stop_tx.send(true);
                    stopping = Some(tokio::time::Instant::now() + self.config.shutdown_grace);
                }
                claim = claim_rx.recv(), if claims_open => match claim {
                    Some(claim) => {
                        for lane in lanes_of(claim.events, self.config.order) {
                            lanes.push(run_lane(
                                lane,
                                self.transport.clone(),
                                claim.lease,
                                claim.lease_deadline.map(Instant::from_std),
                                self.config.lease_margin,
                                outcome_tx.clone(),
                                shared.clone(),
                            ));
                        }
                    }
                    None => claims_open = false,
                },
                Some((end, size)) = lanes.next() => {
                    capacity.add_permits(size);
                    self.settle(end, &outcome_tx, &shared);
                    metrics::gauge!(m::IN_FLIGHT).set(in_flight(&shared) as f64);
                }
                () = tokio::time::sleep_until(grace_end), if stopping.is_some() => {
                    warn!(lanes = lanes.len(), "shutdown grace over: releasing unfinished events");
                    break;
                }
            }
        }
        drop(lanes);
        let _ = claimer.await;

        // Whatever is still leased was not acknowledged (or its publish was cut short and may
        // or may not have reached the broker: a later republish is deduplicated).
        let leftovers: Vec<(EventId, Option<Lease>)> = shared
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .collect();
        for (event_id, lease) in leftovers {
            let _ = outcome_tx.send(Outcome::Released(Released { event_id, lease }));
        }
        drop(outcome_tx);
        let _ = bookkeeper.await;
        let fatal = shared
            .fatal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let report = RelayReport {
            published: shared.published.load(Ordering::Relaxed),
            retried: shared.retried.load(Ordering::Relaxed),
            held: shared.held.load(Ordering::Relaxed),
            released: shared.released.load(Ordering::Relaxed),
            source_failure: fatal.as_ref().map(|(_, error)| error.kind()),
        };
        info!(?report, "relay stopped");
        match fatal {
            None => Ok(report),
            Some((op, source)) => Err(RelayError { op, source, report }),
        }
    }

    /// Turns a lane's end into outcomes: the failure with its retry decision, and releases for
    /// the events behind it.
    fn settle(&self, end: LaneEnd, outcomes: &mpsc::UnboundedSender<Outcome>, shared: &Shared) {
        if let Some((event, error, verdict)) = end.failed {
            let kind = error.kind();
            metrics::counter!(m::PUBLISH_FAILURES, "kind" => kind.as_str()).increment(1);
            let failure = Failure {
                lease: end.lease,
                ..self.decide(&event, &error, verdict)
            };
            if failure.retry_after.is_none() {
                shared.held.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::HELD).increment(1);
                error!(
                    event_id = %event.event_id,
                    aggregate_type = %event.aggregate_type,
                    aggregate_id = %event.aggregate_id,
                    sequence = event.aggregate_sequence,
                    attempts = event.attempt_count + i32::from(failure.counts_as_attempt),
                    error = %error,
                    "event held for an operator: it will not be retried, and the later events \
                     of its aggregate wait behind it"
                );
                if let Some(global) = event.global_sequence {
                    error!(
                        event_id = %event.event_id,
                        global_sequence = global,
                        "the global lane is blocked: no global event is published until this \
                         one is retried or skipped (`handoff quarantine`)"
                    );
                }
            } else {
                shared.retried.fetch_add(1, Ordering::Relaxed);
                debug!(event_id = %event.event_id, error = %error, "publish failed; will retry");
            }
            shared.finish(&event.event_id, end.lease);
            let _ = outcomes.send(Outcome::Failed(failure));
        }
        for event_id in end.unstarted {
            shared.finish(&event_id, end.lease);
            let _ = outcomes.send(Outcome::Released(Released {
                event_id,
                lease: end.lease,
            }));
        }
    }

    /// The retry decision for one failed publish (design P3, P8), given the health verdict:
    /// whether the failure concerns the event or the destination, and how long the
    /// destination's pause still lasts.
    ///
    /// A charged failure waits its backoff; an uncharged one waits out the pause and a little
    /// more, so the probe that ends the pause is another event where there is one (a probe of
    /// the event that just failed would tell nothing new). Either way a `Retry-After` the
    /// destination named delays the event, and so its aggregate, at least that long, up to
    /// [`RelayConfig::max_retry_after`].
    fn decide(&self, event: &OutboxEvent, error: &PublishError, verdict: Verdict) -> Failure {
        let kind = error.kind();
        let charged = verdict.charged;
        let attempts = event.attempt_count.saturating_add(i32::from(charged));
        let hold_reason = if !kind.is_retryable() {
            Some("rejected")
        } else if attempts >= self.config.max_attempts {
            Some("attempts")
        } else {
            None
        };
        let retry_after = if hold_reason.is_some() {
            None
        } else if charged {
            Some(self.config.retry_backoff.delay(attempts.max(1) as u32))
        } else if kind.is_destination_wide() {
            // Down, throttling or refusing the setup, whatever the event: its pause paces the
            // retry, and the probe may as well be this event.
            Some(self.config.outage_backoff.delay(1))
        } else {
            // Ambiguous, and judged the destination's for now: retried only after the probe,
            // so that the probe is another event and tells whose fault it was.
            Some(verdict.pause_left + self.config.outage_backoff.delay(1))
        }
        .map(|delay| {
            let asked = error
                .retry_after()
                .map(|asked| asked.min(self.config.max_retry_after));
            asked.map_or(delay, |asked| asked.max(delay))
        });
        Failure {
            event_id: event.event_id,
            error: error.to_string(),
            retry_after,
            counts_as_attempt: charged,
            hold_reason,
            // The claim's, set by `settle`.
            lease: None,
        }
    }
}

/// `handoff_destination_paused{reason}`: 1 for the reason of the pause in force, 0 for the
/// others, so every series exists from the start.
fn show_pause(reason: Option<PauseReason>) {
    for each in PauseReason::ALL {
        let paused = if Some(each) == reason { 1.0 } else { 0.0 };
        metrics::gauge!(m::DESTINATION_PAUSED, "reason" => each.as_str()).set(paused);
    }
}

fn unsettled(shared: &Shared) -> usize {
    shared.unsettled.load(Ordering::Relaxed)
}

/// Waits until every outcome this relay has is written back (nothing of it in flight or
/// unsettled), or shutdown begins; the claim loop then checks `stop` itself.
async fn settled(shared: &Shared, stop: &mut watch::Receiver<bool>) {
    while unsettled(shared) > 0 {
        shared.hurry.notify_one();
        tokio::select! {
                biased;
            _ = stop.changed() => return,
            () = shared.progress.notified() => {}
        }
    }
}

fn in_flight(shared: &Shared) -> usize {
    shared
        .in_flight
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .len()
}

/// Splits a claim into one lane per aggregate, each in sequence order; in global order mode the
/// claim is one lane in global sequence order.
fn lanes_of(mut events: Vec<OutboxEvent>, order: OrderMode) -> Vec<Vec<OutboxEvent>> {
    if order == OrderMode::Global {
        if events.is_empty() {
            return Vec::new();
        }
        events.sort_by_key(|e| e.global_sequence);
        return vec![events];
    }
    // Lanes in the order their aggregates first appear in the claim (not a hash map's order,
    // which differs from run to run): a seeded simulation (tools/sim) replays exactly.
    let mut index: HashMap<(String, String), usize> = HashMap::new();
    let mut lanes: Vec<Vec<OutboxEvent>> = Vec::new();
    for event in events {
        let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
        let at = *index.entry(key).or_insert_with(|| {
            lanes.push(Vec::new());
            lanes.len() - 1
        });
        lanes[at].push(event);
    }
    lanes
        .into_iter()
        .map(|mut lane| {
            lane.sort_by_key(|e| e.aggregate_sequence);
            lane
        })
        .collect()
}

/// Publishes one aggregate's events, each only after the previous one's acknowledgement.
/// Returns how it ended and how many events it held (for the in-flight bound).
async fn run_lane<T: Transport>(
    lane: Vec<OutboxEvent>,
    transport: Arc<T>,
    lease: Option<Lease>,
    lease_deadline: Option<Instant>,
    lease_margin: Duration,
    outcomes: mpsc::UnboundedSender<Outcome>,
    shared: Arc<Shared>,
) -> (LaneEnd, usize) {
    let size = lane.len();
    // What the lane holds of the in-flight bytes; given back as events leave it.
    let mut held: usize = lane.iter().map(OutboxEvent::size_bytes).sum();
    let mut events = lane.into_iter();
    while let Some(event) = events.next() {
        // Past this point another relay may own the event: leave it to that relay rather than
        // publish it late (a late publish outside the broker's dedup window is a duplicate).
        // A paused destination gets nothing more from any lane until a probe gets through: the
        // rest goes back, uncharged, and waits for the pause to end.
        if lease_deadline.is_some_and(|deadline| Instant::now() + lease_margin >= deadline)
            || shared.health.is_paused()
        {
            let mut unstarted = vec![event.event_id];
            unstarted.extend(events.map(|e| e.event_id));
            shared.return_bytes(held);
            return (
                LaneEnd {
                    failed: None,
                    unstarted,
                    lease,
                },
                size,
            );
        }
        freeze_if_fired(fp::BEFORE_PUBLISH).await;
        fp::abort_if_named(&event.event_id);
        let started = Instant::now();
        // In the event's trace (feature `otel`, see crate::trace); a no-op span without it.
        let publish = tracing::Instrument::instrument(
            transport.publish(&event),
            crate::trace::publish_span(&event),
        );
        match publish.await {
            Ok(receipt) => {
                if let Some(pause) = shared.health.succeeded(event.event_id, Instant::now()) {
                    info!(
                        reason = pause.reason.as_str(),
                        paused_rounds = pause.rounds,
                        "destination accepts events again: claiming"
                    );
                    show_pause(None);
                    metrics::gauge!(m::BROKER_UP).set(1.0);
                }
                freeze_if_fired(fp::AFTER_ACK).await;
                metrics::histogram!(m::ACK_SECONDS).record(started.elapsed().as_secs_f64());
                if let Ok(age) = SystemTime::now().duration_since(event.occurred_at) {
                    metrics::histogram!(m::COMMIT_TO_ACK_SECONDS).record(age.as_secs_f64());
                }
                metrics::counter!(m::PUBLISHED).increment(1);
                shared.published.fetch_add(1, Ordering::Relaxed);
                shared.finish(&event.event_id, lease);
                let _ = outcomes.send(Outcome::Published(Published {
                    event_id: event.event_id,
                    receipt,
                    lease,
                }));
                let weight = event.size_bytes();
                drop(event);
                held = held.saturating_sub(weight);
                shared.return_bytes(weight);
            }
            Err(error) => {
                let verdict = shared.health.failed(
                    event.event_id,
                    error.kind(),
                    error.retry_after(),
                    &error.to_string(),
                    Instant::now(),
                );
                let unstarted = events.map(|e| e.event_id).collect();
                // The failed event is kept for its outcome only until `settle`, right after.
                shared.return_bytes(held);
                return (
                    LaneEnd {
                        failed: Some((event, error, verdict)),
                        unstarted,
                        lease,
                    },
                    size,
                );
            }
        }
    }
    (
        LaneEnd {
            failed: None,
            unstarted: Vec::new(),
            lease,
        },
        size,
    )
}

/// Claims batches while there is room in flight, pausing while the broker is down and sleeping
/// on the source's wake-up while there is nothing to claim.
async fn claim_loop<S: Source, T: Transport>(
    source: Arc<S>,
    transport: Arc<T>,
    capacity: Arc<Semaphore>,
    claims: mpsc::Sender<Claim>,
    shared: Arc<Shared>,
    config: RelayConfig,
    stop: watch::Receiver<bool>,
) {
    let bytes_held = shared.bytes.subscribe();
    let claimer = Claimer {
        source,
        transport,
        capacity,
        claims,
        shared,
        config,
        stop,
        source_failures: 0,
        probing: false,
        announced: 0,
        unready: 0,
        lease_warned: false,
        bytes_held,
        event_bytes: None,
    };
    claimer.run().await;
}

/// What the claim loop does after a step: go on with what the step gave, start the next round
/// from the top, or stop (shutdown, or a failure retrying cannot cure).
enum Flow<T = ()> {
    /// Go on with the step's result.
    Go(T),
    /// Start the next round.
    Again,
    /// End the loop.
    Stop,
}

/// The claim loop with what it keeps from one round to the next.
struct Claimer<S, T> {
    source: Arc<S>,
    transport: Arc<T>,
    /// Permits for events in flight ([`RelayConfig::max_in_flight`]).
    capacity: Arc<Semaphore>,
    /// Where claims go to be split into lanes.
    claims: mpsc::Sender<Claim>,
    shared: Arc<Shared>,
    config: RelayConfig,
    stop: watch::Receiver<bool>,
    /// Claims that failed in a row, for the retry's backoff.
    source_failures: u32,
    /// After a pause, one event goes out alone; only its success reopens full claims.
    probing: bool,
    /// The pause last logged and counted (by its serial), so each is said once.
    announced: u64,
    /// Rounds the transport said it was still unreachable, for the wait's backoff.
    unready: u32,
    /// Said once: a lease shorter than the margin is a configuration error, not a passing state.
    lease_warned: bool,
    /// The in-flight bytes ([`Shared::bytes`]), watched for room.
    bytes_held: watch::Receiver<usize>,
    /// Bytes of an event of the recent claims, on average: large events are asked for in
    /// claims of about what the byte room holds, since a claim reads the size of every event
    /// it could lease before it cuts to the budget.
    event_bytes: Option<usize>,
}

/// What one claim said, for the steps of its round that follow it.
struct Round {
    /// How many events the claim asked for.
    batch: usize,
    /// How many it leased.
    claimed: usize,
    /// The byte budget cut events the batch had room for: a backlog is left.
    bytes_full: bool,
    /// One suspect event, leased alone: nothing else may be in flight while it is published.
    isolated: bool,
    /// Events wait behind this relay's own in flight.
    waiting_on_in_flight: bool,
}

impl<S: Source, T: Transport> Claimer<S, T> {
    /// Rounds until shutdown: wait out a pause, reserve room, claim, hand the claim to the
    /// lanes, then wait for work when the claim left nothing to claim.
    async fn run(mut self) {
        loop {
            if *self.stop.borrow() {
                break;
            }
            match self.wait_out_pause().await {
                Flow::Go(()) => {}
                Flow::Again => continue,
                Flow::Stop => break,
            }
            if self.config.order == OrderMode::Global && unsettled(&self.shared) > 0 {
                // The lane's front is this relay's own lease until the outcomes are written: a
                // claim now could only come back empty. Wait for the bookkeeper instead.
                self.shared.hurry.notify_one();
                tokio::select! {
                biased;
                    _ = self.stop.changed() => break,
                    () = self.shared.progress.notified() => continue,
                }
            }
            let batch = match self.reserve().await {
                Flow::Go(batch) => batch,
                Flow::Again => continue,
                Flow::Stop => break,
            };
            let claim = match self.claim(batch).await {
                Flow::Go(claim) => claim,
                Flow::Again => continue,
                Flow::Stop => break,
            };
            let round = self.take_in(&claim, batch).await;
            if round.waiting_on_in_flight {
                // Events wait behind this relay's own, whose marks the bookkeeper may be holding
                // back to write them together: they are claimable once those are written.
                self.shared.hurry.notify_one();
            }
            if round.isolated {
                // A suspect of killing its relays: nothing else may be in flight when it is
                // published, so a crash charges its takeover to it alone.
                settled(&self.shared, &mut self.stop).await;
            }
            if round.claimed > 0 && !self.hand_over(claim).await {
                break;
            }
            if round.isolated {
                // ... and nothing else is claimed until its outcome is written.
                settled(&self.shared, &mut self.stop).await;
            }
            if self.probing && round.claimed > 0 {
                self.await_probe().await;
                continue;
            }
            if round.claimed < round.batch && !round.bytes_full {
                if let Flow::Stop = self.wait_for_work(&round).await {
                    break;
                }
            }
        }
    }

    /// Waits out the destination's pause, if one is in force (announcing it once), then opens
    /// a probe: one event goes out alone. `Again` while the transport still cannot reach the
    /// broker.
    async fn wait_out_pause(&mut self) -> Flow {
        let Some(pause) = self.shared.health.pause() else {
            return Flow::Go(());
        };
        if pause.serial != self.announced {
            self.announced = pause.serial;
            announce_pause(&pause);
        }
        tokio::select! {
                biased;
            _ = self.stop.changed() => return Flow::Stop,
            () = tokio::time::sleep_until(pause.until) => {}
        }
        if matches!(
            pause.reason,
            PauseReason::Unavailable | PauseReason::Throttled
        ) {
            // The transport knows when it can reach the broker again (or, for RabbitMQ,
            // when the broker lifts its connection.blocked): no probe event is spent
            // before then.
            let wait = self
                .config
                .outage_backoff
                .delay(pause.rounds.saturating_add(self.unready));
            tokio::select! {
                biased;
                _ = self.stop.changed() => return Flow::Stop,
                ready = self.transport.wait_until_ready(wait) => if !ready {
                    self.unready = self.unready.saturating_add(1);
                    return Flow::Again;
                },
            }
        }
        self.unready = 0;
        self.shared.health.resume();
        self.probing = true;
        Flow::Go(())
    }

    /// Waits for room in flight, by bytes and then by events, and takes the permits of the
    /// next claim: how many events it asks for.
    async fn reserve(&mut self) -> Flow<usize> {
        let batch = if self.probing {
            1
        } else {
            self.config.batch_size
        };
        // A claim waits for a quarter of the byte bound to be free (a probe for any room), so
        // that large events still go in claims of several, not one claim per event returned.
        let bytes_wanted = if self.probing {
            1
        } else {
            (self.config.max_in_flight_bytes / 4).max(1)
        };
        let max_bytes = self.config.max_in_flight_bytes;
        let room = |held: usize| max_bytes.saturating_sub(held);
        let bytes_held = &mut self.bytes_held;
        if room(*bytes_held.borrow()) < bytes_wanted {
            debug!(
                in_flight_bytes = *bytes_held.borrow(),
                "in-flight byte bound reached: waiting for room"
            );
            tokio::select! {
                biased;
                _ = self.stop.changed() => return Flow::Stop,
                freed = async {
                    bytes_held.wait_for(|held| room(*held) >= bytes_wanted).await.map(|_| ())
                } => if freed.is_err() {
                    return Flow::Stop;
                },
            }
        }
        let batch = match self.event_bytes {
            Some(each) if each > 0 => {
                let fits = room(*bytes_held.borrow()) / each;
                batch.min(fits.saturating_add(fits / 4).saturating_add(1))
            }
            _ => batch,
        };
        if self.capacity.available_permits() < batch {
            debug!(
                in_flight = in_flight(&self.shared),
                "in-flight bound reached: waiting for room"
            );
        }
        let permits = tokio::select! {
                biased;
            _ = self.stop.changed() => return Flow::Stop,
            permits = self.capacity.clone().acquire_many_owned(batch as u32) => match permits {
                Ok(permits) => permits,
                Err(_closed) => return Flow::Stop,
            },
        };
        permits.forget();
        Flow::Go(batch)
    }

    /// Claims up to `batch` events within the byte room; on a failure gives the permits back
    /// and retries with backoff (`Again`), or ends the run if retrying cannot cure it.
    async fn claim(&mut self, batch: usize) -> Flow<Claim> {
        // Only lanes change it meanwhile, and they only give bytes back: the room can only grow
        // between this read and the claim.
        let max_bytes = self
            .config
            .max_in_flight_bytes
            .saturating_sub(*self.shared.bytes.borrow());
        let started = Instant::now();
        let result = self.source.claim(batch, max_bytes).await;
        metrics::histogram!(m::CLAIM_SECONDS).record(started.elapsed().as_secs_f64());
        match result {
            Ok(claim) => {
                self.source_failures = 0;
                Flow::Go(claim)
            }
            Err(error) => {
                self.capacity.add_permits(batch);
                metrics::counter!(m::SOURCE_ERRORS, "op" => "claim").increment(1);
                if !error.kind().is_retryable() {
                    self.shared.fail("claim", error);
                    return Flow::Stop;
                }
                self.source_failures += 1;
                let delay = self.config.outage_backoff.delay(self.source_failures);
                warn!(error = %error, retry_in = ?delay, "claim failed");
                tokio::select! {
                biased;
                    _ = self.stop.changed() => Flow::Stop,
                    () = tokio::time::sleep(delay) => Flow::Again,
                }
            }
        }
    }

    /// Takes a claim's events into the in-flight bytes, gives back the permits it did not use,
    /// counts it, and reads what it says for the rest of the round.
    async fn take_in(&mut self, claim: &Claim, batch: usize) -> Round {
        let claimed = claim.events.len();
        // Held from here: the lanes give the bytes back as events leave them.
        let claimed_bytes: usize = claim.events.iter().map(OutboxEvent::size_bytes).sum();
        self.shared.hold_bytes(claimed_bytes);
        if let Some(each) = claimed_bytes.checked_div(claimed) {
            self.event_bytes = Some(self.event_bytes.map_or(each, |before| {
                before.saturating_mul(3).saturating_add(each) / 4
            }));
        }
        let bytes_full = claim.bytes_full;
        if claimed > 0 {
            freeze_if_fired(fp::CLAIM).await;
        }
        self.capacity.add_permits(batch - claimed);
        debug!(claimed, bytes_full, "claimed");
        metrics::counter!(m::CLAIMS).increment(1);
        metrics::counter!(m::CLAIMED).increment(claimed as u64);
        if claim.taken_over > 0 {
            info!(
                taken_over = claim.taken_over,
                "took over events whose lease ran out"
            );
            metrics::counter!(m::TAKEN_OVER).increment(claim.taken_over as u64);
        }
        if claimed > 0 && !self.lease_warned {
            self.warn_if_lease_short(claim);
        }
        if self.probing && claimed == 0 {
            // Nothing to probe with: the next claim is a full one, and its failures, if any,
            // pause again. The pause is still reported (gauge, /readyz) until an event gets
            // through: the events it held back wait for their retry time, unproven.
            self.probing = false;
        }
        Round {
            batch,
            claimed,
            bytes_full,
            isolated: claim.isolate && claimed > 0,
            waiting_on_in_flight: claim.waiting_on_in_flight,
        }
    }

    /// Warns (once) when a fresh claim's lease is already within the lease margin.
    fn warn_if_lease_short(&mut self, claim: &Claim) {
        if let Some(deadline) = claim.lease_deadline {
            let left = Instant::from_std(deadline).saturating_duration_since(Instant::now());
            if left <= self.config.lease_margin {
                // Every lane would give its events back unpublished, claim after claim.
                self.lease_warned = true;
                warn!(
                    lease_left = ?left,
                    lease_margin = ?self.config.lease_margin,
                    "a fresh claim's lease is already within lease_margin: nothing can be \
                     published; make the source's lease longer than lease_margin"
                );
            }
        }
    }

    /// Puts a claim's events in flight and sends it to the lanes; false once the run no longer
    /// takes claims.
    async fn hand_over(&mut self, claim: Claim) -> bool {
        self.shared
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(claim.events.iter().map(|e| (e.event_id, claim.lease)));
        self.shared
            .unsettled
            .fetch_add(claim.events.len(), Ordering::Relaxed);
        metrics::gauge!(m::IN_FLIGHT).set(in_flight(&self.shared) as f64);
        self.claims.send(claim).await.is_ok()
    }

    /// Waits for the probe's outcome: a success ended the pause (the lane logged it), a failure
    /// started the next one.
    async fn await_probe(&mut self) {
        settled(&self.shared, &mut self.stop).await;
        self.probing = false;
        if !self.shared.health.is_paused() {
            info!("probe event accepted: destination resumed, claiming");
            show_pause(None);
            metrics::gauge!(m::BROKER_UP).set(1.0);
        }
    }

    /// After a claim that left no backlog, or whose backlog waits behind events in flight:
    /// sleeps until a writer commits, our own outcomes unblock something (only when the claim
    /// saw events waiting on them: at steady load a claim after every mark would cost a query
    /// each for nothing), or the poll interval ends. (A claim the byte bound cut leaves a
    /// backlog: the next waits for bytes back in [`Claimer::reserve`], not for a writer.)
    async fn wait_for_work(&mut self, round: &Round) -> Flow {
        let unblocks =
            round.waiting_on_in_flight && (round.claimed > 0 || unsettled(&self.shared) > 0);
        tokio::select! {
                biased;
            _ = self.stop.changed() => return Flow::Stop,
            () = self.shared.progress.notified(), if unblocks => {}
            woke = self.source.wait_for_work(self.config.poll_interval) => {
                if let Err(error) = woke {
                    warn!(error = %error, "wake-up channel failed: polling");
                    tokio::select! {
                biased;
                        _ = self.stop.changed() => return Flow::Stop,
                        () = tokio::time::sleep(self.config.poll_interval) => {}
                    }
                }
            }
        }
        Flow::Go(())
    }
}

/// Logs and counts a new pause of the destination (once per pause: by its serial).
fn announce_pause(pause: &Pause) {
    if pause.rounds == 1 && pause.reason == PauseReason::Misconfigured {
        error!(
            reason = pause.reason.as_str(),
            cause = %pause.cause,
            "the destination refuses the relay's credentials or address: \
             destination paused, no claims and no attempts charged; it resumes by \
             itself once a probe event gets through"
        );
    } else if pause.rounds == 1 && pause.reason == PauseReason::Throttled {
        warn!(
            reason = pause.reason.as_str(),
            cause = %pause.cause,
            "destination throttling: destination paused, no claims and no attempts \
             charged until a probe event gets through"
        );
    } else if pause.rounds == 1 && pause.reason == PauseReason::Failing {
        warn!(
            reason = pause.reason.as_str(),
            cause = %pause.cause,
            "broker unreachable: different events failed one after another; \
             destination paused, no claims and no attempts charged until a probe \
             event gets through"
        );
    } else if pause.rounds == 1 {
        warn!(
            reason = pause.reason.as_str(),
            "broker unreachable: destination paused, no claims and no attempts \
             charged until a probe event gets through"
        );
    } else {
        debug!(
            reason = pause.reason.as_str(),
            paused_rounds = pause.rounds,
            "probe failed: destination paused again"
        );
    }
    metrics::counter!(m::DESTINATION_PAUSES, "reason" => pause.reason.as_str()).increment(1);
    show_pause(Some(pause.reason));
    // A throttling or misconfigured destination answers; one that is down or
    // fails everything does not.
    if matches!(
        pause.reason,
        PauseReason::Unavailable | PauseReason::Failing
    ) {
        metrics::gauge!(m::BROKER_UP).set(0.0);
    }
}

/// Writes outcomes back to the source in batches: whatever arrived while the previous write
/// ran, or within [`RelayConfig::mark_interval`] of its start, goes in the next one.
///
/// Why wait: a mark costs the database mostly per statement (a commit, a snapshot, the call's
/// setup), not per event. A relay keeping up with busy writers hears an acknowledgement every
/// few milliseconds, and writing each lane's as it came made more marks than claims, each
/// taken from the writers' share of the machine. Nothing downstream waits for a mark unless
/// an event waits behind a marked one; who sees that ([`Shared::hurry`]) cuts the wait short.
async fn bookkeep<S: Source>(
    source: Arc<S>,
    mut outcomes: mpsc::UnboundedReceiver<Outcome>,
    shared: Arc<Shared>,
    config: RelayConfig,
    mut stop: watch::Receiver<bool>,
) {
    let mut buffer = Vec::with_capacity(4096);
    let mut last_write: Option<tokio::time::Instant> = None;
    while outcomes.recv_many(&mut buffer, 4096).await > 0 {
        if let Some(due) = last_write.map(|at| at + config.mark_interval) {
            if due > tokio::time::Instant::now() && !*stop.borrow() {
                tokio::select! {
                biased;
                    () = tokio::time::sleep_until(due) => {}
                    () = shared.hurry.notified() => {}
                    _ = stop.changed() => {}
                }
            }
            while buffer.len() < 4096 {
                match outcomes.try_recv() {
                    Ok(outcome) => buffer.push(outcome),
                    Err(_) => break,
                }
            }
        }
        last_write = Some(tokio::time::Instant::now());
        let written = buffer.len();
        let mut published = Vec::new();
        let mut failures = Vec::new();
        let mut released = Vec::new();
        for outcome in buffer.drain(..) {
            match outcome {
                Outcome::Published(acked) => published.push(acked),
                Outcome::Failed(failure) => failures.push(failure),
                Outcome::Released(given_back) => released.push(given_back),
            }
        }
        if !published.is_empty() {
            persist("mark_published", &config, &stop, &shared, || {
                source.mark_published(&published)
            })
            .await;
        }
        if !failures.is_empty() {
            let settled = persist("record_failures", &config, &stop, &shared, || {
                source.record_failures(&failures)
            })
            .await;
            count_stale("record_failures", settled);
        }
        if !released.is_empty() {
            shared
                .released
                .fetch_add(released.len() as u64, Ordering::Relaxed);
            let settled = persist("release", &config, &stop, &shared, || {
                source.release(&released)
            })
            .await;
            count_stale("release", settled);
        }
        shared
            .unsettled
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(written))
            })
            .ok();
        shared.progress.notify_one();
    }
}

/// Counts the outcomes a write left alone because their event is no longer held under their
/// lease (a claim took it again since, or it was settled already): the relay's bookkeeping
/// lagged past a lease.
fn count_stale(op: &'static str, settled: Option<Settled>) {
    let Some(Settled { stale }) = settled else {
        return;
    };
    if stale > 0 {
        warn!(
            stale,
            op,
            "outcomes written after their lease ran out changed nothing: their events were \
             claimed again or settled since (the relay's writes lag its leases)"
        );
        metrics::counter!(m::STALE_WRITES, "op" => op).increment(stale as u64);
    }
}

/// Retries one write with backoff: for as long as it takes while running (an unwritten mark
/// only costs a duplicate publish later, but a bounded number of them is better), a few times
/// once shutdown began. A write that retrying cannot cure is not retried: it ends the run
/// ([`Shared::fail`]) and the leases expire instead. What the write returned, if it landed.
async fn persist<F, Fut, T>(
    op: &'static str,
    config: &RelayConfig,
    stop: &watch::Receiver<bool>,
    shared: &Shared,
    write: F,
) -> Option<T>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, SourceError>>,
{
    for attempt in 1u32.. {
        match write().await {
            Ok(written) => return Some(written),
            Err(error) => {
                metrics::counter!(m::SOURCE_ERRORS, "op" => op).increment(1);
                if !error.kind().is_retryable() {
                    shared.fail(op, error);
                    return None;
                }
                if *stop.borrow() && attempt >= 3 {
                    error!(error = %error, op, "giving up at shutdown; the leases expire instead");
                    return None;
                }
                let delay = config.outage_backoff.delay(attempt);
                warn!(error = %error, op, retry_in = ?delay, "write-back failed");
                tokio::time::sleep(delay).await;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(aggregate: &str, sequence: i64) -> OutboxEvent {
        OutboxEvent {
            event_id: uuid::Uuid::now_v7(),
            aggregate_type: "thing".into(),
            aggregate_id: aggregate.into(),
            aggregate_sequence: sequence,
            global_sequence: None,
            event_type: "ThingHappened".into(),
            schema_version: 1,
            payload: "{}".into(),
            headers: Vec::new(),
            occurred_at: SystemTime::now(),
            attempt_count: 0,
        }
    }

    #[test]
    fn lanes_hold_one_aggregate_each_in_sequence_order() {
        let claim = vec![
            event("a", 3),
            event("b", 1),
            event("a", 1),
            event("a", 2),
            event("b", 2),
        ];
        let mut lanes = lanes_of(claim, OrderMode::Aggregate);
        lanes.sort_by(|x, y| x[0].aggregate_id.cmp(&y[0].aggregate_id));
        let shape: Vec<Vec<(String, i64)>> = lanes
            .iter()
            .map(|lane| {
                lane.iter()
                    .map(|e| (e.aggregate_id.clone(), e.aggregate_sequence))
                    .collect()
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                vec![("a".into(), 1), ("a".into(), 2), ("a".into(), 3)],
                vec![("b".into(), 1), ("b".into(), 2)],
            ]
        );
    }

    #[test]
    fn a_global_claim_is_one_lane_in_global_order() {
        let mut claim = Vec::new();
        for (aggregate, sequence, global) in [("a", 2, 4), ("b", 1, 1), ("a", 1, 2), ("b", 2, 3)] {
            let mut e = event(aggregate, sequence);
            e.global_sequence = Some(global);
            claim.push(e);
        }
        let lanes = lanes_of(claim, OrderMode::Global);
        assert_eq!(lanes.len(), 1);
        let order: Vec<Option<i64>> = lanes[0].iter().map(|e| e.global_sequence).collect();
        assert_eq!(order, [Some(1), Some(2), Some(3), Some(4)]);
        assert!(lanes_of(Vec::new(), OrderMode::Global).is_empty());
    }
}
