//! Batch mode ([`BatchConfig`]): several deliveries admitted and applied in one transaction.
//!
//! A child module of `consumer` (declared there with `#[path]`), so it reuses the per-event
//! path's lanes, settlement and fallback unchanged. The lanes stay as they are: a lane whose next
//! event is ready hands it to the batch collector instead of applying it, and waits for the
//! outcome before its next event, so a batch holds at most one event per aggregate and an
//! aggregate's events still apply one at a time, in order. What a batch does not settle (an event
//! out of its aggregate's line, or every event of a batch that failed) comes back to its lane,
//! which applies it alone on the per-event path: gap policy, retries, quarantine and failure
//! bounds are the per-event path's, not a copy.
//!
//! The collector is one task per [`Consumer::run`](crate::Consumer::run): it gathers submitted
//! events until a batch is full or `max_wait` after its first event, waits for one of
//! `max_in_flight` batch slots (gathering meanwhile), and runs the batch in a task of its own.

use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use futures::FutureExt;
use handoff_core::intake::{ReceivedEvent, Settle};
use handoff_core::EventId;
use handoff_postgres::{BatchAdmission, InboxError};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::{log_join, settle_ack, Item, LaneKey, Lanes, Shared};
use crate::failpoints::{self as fp, freeze_if_fired, freeze_if_fired_for};
use crate::{BatchConfig, Handler, HandlerError};

/// Most event ids remembered as having failed a batch; past it the memory starts over.
const MAX_SUSPECTS: usize = 4_096;

/// No handler is running (the blame slot's resting value).
const NO_HANDLER: usize = usize::MAX;

/// The lanes' side of batch mode, for one run of the consumer.
pub(super) struct Batches<S> {
    /// To the collector. `None` once closed: later events are applied alone.
    /// std Mutex: held only to send (which never waits), never across an await.
    sender: Mutex<Option<mpsc::UnboundedSender<Waiting<S>>>>,
    /// Events that failed a batch: their next deliveries are applied alone straight away, so
    /// a poison event does not drag a new batch through a rollback every time it comes back.
    suspects: Arc<Mutex<HashSet<EventId>>>,
}

/// One event handed to the collector, with where its outcome goes.
struct Waiting<S> {
    item: Item<S>,
    reply: oneshot::Sender<Outcome<S>>,
}

/// What became of an event handed to a batch.
enum Outcome<S> {
    /// Committed at this sequence and acknowledged.
    Applied(i64),
    /// Acknowledged as a duplicate, without the handler.
    Duplicate,
    /// Not settled by the batch: apply it alone.
    Alone(Item<S>),
}

/// What a committed batch did with one of its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Applied,
    Duplicate,
    Alone,
}

/// Why a batch rolled back.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("cannot begin a transaction: {0}")]
    Begin(#[source] sqlx::Error),
    #[error(transparent)]
    Admit(InboxError),
    #[error("another transaction admitted one of its events at the same moment")]
    Contended,
    #[error("the handler failed on event {event_id}: {error}")]
    Handler {
        index: usize,
        event_id: EventId,
        #[source]
        error: HandlerError,
    },
    #[error("the handler panicked")]
    Panic,
    #[error("the batch took longer than the apply timeout")]
    Timeout,
    #[error("while rolling back a batch that applied nothing: {0}")]
    Rollback(#[source] sqlx::Error),
    #[error("commit failed (the redeliveries find out whether it happened): {0}")]
    Commit(#[source] sqlx::Error),
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a single insert, check, clear or send: a panic cannot leave
    // the value half-changed.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Batch mode for one run: `None` without it. With it, the collector is spawned into `tasks`,
/// so the run's shutdown waits for (and, past the grace, aborts) it and its batches.
pub(super) fn start<H: Handler, S: Settle>(
    shared: &Arc<Shared<H>>,
    tasks: &mut JoinSet<()>,
) -> Option<Batches<S>> {
    // A handler that needs a transaction per event opts out (`Handler::allows_batches`).
    let config = shared
        .config
        .batch
        .filter(|_| shared.handler.allows_batches())?;
    let (sender, receiver) = mpsc::unbounded_channel();
    let suspects = Arc::new(Mutex::new(HashSet::new()));
    tasks.spawn(collect(shared.clone(), receiver, config, suspects.clone()));
    Some(Batches {
        sender: Mutex::new(Some(sender)),
        suspects,
    })
}

impl<S: Settle> Batches<S> {
    /// Stops taking events: the collector runs what it holds, waits for its batches and ends.
    pub(super) fn close(&self) {
        lock(&self.sender).take();
    }

    /// Hands `item` to the collector and waits for its outcome.
    async fn submit(&self, item: Item<S>) -> Option<Outcome<S>> {
        let (reply, outcome) = oneshot::channel();
        let sent = match lock(&self.sender).as_ref() {
            Some(sender) => sender.send(Waiting { item, reply }).map_err(|e| e.0.item),
            None => Err(item),
        };
        match sent {
            Ok(()) => outcome.await.ok(),
            Err(item) => Some(Outcome::Alone(item)),
        }
    }
}

impl<H: Handler> Shared<H> {
    /// The lane's dispatch point in batch mode: `item` joins a batch, and comes back only when it
    /// is to be applied alone (batch mode off, a suspect, out of line, or its batch failed).
    /// `None`: it was settled (and a parked successor released).
    pub(super) async fn batched<S: Settle>(
        &self,
        lanes: &Lanes<S>,
        key: &LaneKey,
        item: Item<S>,
    ) -> Option<Item<S>> {
        let Some(batches) = &lanes.batches else {
            return Some(item);
        };
        if lock(&batches.suspects).contains(&item.event.event_id) {
            return Some(item);
        }
        let event_id = item.event.event_id;
        match batches.submit(item).await {
            Some(Outcome::Applied(sequence)) => {
                self.release_successor(lanes, key, sequence);
                None
            }
            Some(Outcome::Duplicate) => None,
            Some(Outcome::Alone(item)) => Some(item),
            None => {
                // Its batch task was aborted (shutdown grace over) or panicked outside the
                // guarded part; the delivery went unsettled with it.
                warn!(%event_id, "a batch ended without an outcome; the broker delivers the \
                                  event again after its ack wait");
                None
            }
        }
    }
}

/// The collector: gathers events into batches and runs each in a task of its own.
async fn collect<H: Handler, S: Settle>(
    shared: Arc<Shared<H>>,
    mut receiver: mpsc::UnboundedReceiver<Waiting<S>>,
    config: BatchConfig,
    suspects: Arc<Mutex<HashSet<EventId>>>,
) {
    let slots = Arc::new(Semaphore::new(config.max_in_flight));
    let mut running = JoinSet::new();
    let mut gathered: Vec<Waiting<S>> = Vec::with_capacity(config.max_events);
    let mut open = true;
    while open || !gathered.is_empty() {
        if gathered.is_empty() {
            match receiver.recv().await {
                Some(waiting) => gathered.push(waiting),
                None => break,
            }
        }
        // The batch closes when full or `max_wait` after its first event (biased: whatever
        // is already queued joins before the deadline is looked at).
        let deadline = tokio::time::Instant::now() + config.max_wait;
        while open && gathered.len() < config.max_events {
            tokio::select! {
                biased;
                next = receiver.recv() => match next {
                    Some(waiting) => gathered.push(waiting),
                    None => open = false,
                },
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        // Every slot busy: the batch keeps filling until one frees.
        let slot = loop {
            tokio::select! {
                biased;
                slot = slots.clone().acquire_owned() => break slot,
                next = receiver.recv(), if open && gathered.len() < config.max_events => {
                    match next {
                        Some(waiting) => gathered.push(waiting),
                        None => open = false,
                    }
                }
            }
        };
        let Ok(slot) = slot else {
            break; // never closed
        };
        let batch: Vec<Waiting<S>> = std::mem::take(&mut gathered);
        let shared = shared.clone();
        let suspects = suspects.clone();
        running.spawn(async move {
            shared.run_batch(batch, &suspects).await;
            drop(slot);
        });
        while let Some(done) = running.try_join_next() {
            log_join(done);
        }
    }
    while let Some(done) = running.join_next().await {
        log_join(done);
    }
}

impl<H: Handler> Shared<H> {
    /// Runs one batch to its outcome and tells every event's lane.
    async fn run_batch<S: Settle>(
        &self,
        batch: Vec<Waiting<S>>,
        suspects: &Mutex<HashSet<EventId>>,
    ) {
        let started = Instant::now();
        let (items, replies): (Vec<Item<S>>, Vec<_>) =
            batch.into_iter().map(|w| (w.item, w.reply)).unzip();
        let Ok(permit) = self.permits.acquire().await else {
            return alone(items, replies);
        };
        let running = AtomicUsize::new(NO_HANDLER);
        let work = AssertUnwindSafe(self.try_batch(&items, &running)).catch_unwind();
        let work = keep_alive_all(work, &items, self.config.progress_interval);
        let result = match tokio::time::timeout(self.config.apply_timeout, work).await {
            Ok(Ok(result)) => result,
            Ok(Err(_panic)) => Err(Failure::Panic),
            // Dropping the work dropped its transaction: rolled back with the connection.
            Err(_elapsed) => Err(Failure::Timeout),
        };
        drop(permit);
        let verdicts = match result {
            Ok(verdicts) => verdicts,
            Err(failure) => {
                let blamed = match &failure {
                    Failure::Handler { index, .. } => Some(*index),
                    Failure::Panic | Failure::Timeout => {
                        Some(running.load(Ordering::SeqCst)).filter(|i| *i != NO_HANDLER)
                    }
                    _ => None,
                };
                let blamed = blamed.and_then(|i| items.get(i)).map(|i| i.event.event_id);
                if let Some(event_id) = blamed {
                    let mut suspects = lock(suspects);
                    if suspects.len() >= MAX_SUSPECTS {
                        suspects.clear();
                    }
                    suspects.insert(event_id);
                }
                self.metrics.batch_fallbacks.increment(1);
                warn!(%failure, events = items.len(), blamed = blamed.map(tracing::field::display),
                    "batch rolled back; its events are applied one per transaction");
                return alone(items, replies);
            }
        };
        if verdicts.contains(&Verdict::Applied) {
            freeze_if_fired(fp::AFTER_COMMIT).await;
        }
        let settled = verdicts.iter().filter(|v| **v != Verdict::Alone).count();
        // Every acknowledgement after the one commit (design C4), sent together.
        futures::future::join_all(
            items
                .iter()
                .zip(&verdicts)
                .filter(|(_, v)| **v != Verdict::Alone)
                .map(|(item, _)| settle_ack(item)),
        )
        .await;
        let seconds = started.elapsed().as_secs_f64();
        if settled > 0 {
            self.metrics.batch_events.record(settled as f64);
        }
        debug!(events = items.len(), settled, seconds, "batch committed");
        for ((item, verdict), reply) in items.into_iter().zip(verdicts).zip(replies) {
            let outcome = match verdict {
                Verdict::Applied => {
                    if item.event.skip_reason().is_some() {
                        self.metrics.skipped.increment(1);
                    } else {
                        self.metrics.applied.increment(1);
                    }
                    self.metrics.apply_seconds.record(seconds);
                    Outcome::Applied(item.event.sequence)
                }
                Verdict::Duplicate => {
                    self.metrics.duplicates.increment(1);
                    info!(event_id = %item.event.event_id, deliveries = item.deliveries,
                        "duplicate delivery acknowledged without applying");
                    Outcome::Duplicate
                }
                Verdict::Alone => Outcome::Alone(item),
            };
            // A lane that is gone (its task aborted) needs no answer.
            let _ = reply.send(outcome);
        }
    }

    /// The batch's transaction: one admit statement, the handler per admitted event, one
    /// commit. Any failure rolls all of it back (the transaction is dropped).
    async fn try_batch<S>(
        &self,
        items: &[Item<S>],
        running: &AtomicUsize,
    ) -> Result<Vec<Verdict>, Failure> {
        let mut tx = self.pool.begin().await.map_err(Failure::Begin)?;
        let events: Vec<&ReceivedEvent> = items.iter().map(|i| &i.event).collect();
        let admitted = self
            .inbox
            .admit_batch(&mut tx, &events)
            .await
            .map_err(Failure::Admit)?;
        if admitted.contains(&BatchAdmission::Contended) {
            return Err(Failure::Contended);
        }
        let mut verdicts = Vec::with_capacity(items.len());
        for (index, (item, admission)) in items.iter().zip(admitted).enumerate() {
            verdicts.push(match admission {
                BatchAdmission::Apply => {
                    // A skip marker is admitted (dedup row, sequence) but never handled, as on
                    // the per-event path.
                    if item.event.skip_reason().is_none() {
                        running.store(index, Ordering::SeqCst);
                        // Each handler in its event's trace, as on the per-event path.
                        let span = crate::trace::handler_span(&self.config.name, &item.event);
                        tracing::Instrument::instrument(
                            self.handler.handle(&mut tx, &item.event),
                            span,
                        )
                        .await
                        .map_err(|error| Failure::Handler {
                            index,
                            event_id: item.event.event_id,
                            error,
                        })?;
                    }
                    Verdict::Applied
                }
                BatchAdmission::Duplicate => Verdict::Duplicate,
                // Nothing was written for it: the per-event path admits it again alone.
                BatchAdmission::Alone | BatchAdmission::Contended => Verdict::Alone,
            });
        }
        running.store(NO_HANDLER, Ordering::SeqCst);
        if !verdicts.contains(&Verdict::Applied) {
            // Nothing written; the duplicates were committed long ago.
            tx.rollback().await.map_err(Failure::Rollback)?;
            return Ok(verdicts);
        }
        freeze_if_fired_for(fp::BATCH_BEFORE_COMMIT, &self.config.name).await;
        // The per-event crash windows hold for a batch too (design V1): before the commit, and
        // between the commit and the acknowledgements (below).
        freeze_if_fired(fp::BEFORE_COMMIT).await;
        tx.commit().await.map_err(Failure::Commit)?;
        Ok(verdicts)
    }
}

/// Sends every event of a batch that did not happen back to its lane, to be applied alone.
fn alone<S>(items: Vec<Item<S>>, replies: Vec<oneshot::Sender<Outcome<S>>>) {
    for (item, reply) in items.into_iter().zip(replies) {
        let _ = reply.send(Outcome::Alone(item));
    }
}

/// Runs `work`, restarting the broker's ack wait of every item every `every` until it ends.
async fn keep_alive_all<F: Future, S: Settle>(
    work: F,
    items: &[Item<S>],
    every: std::time::Duration,
) -> F::Output {
    let mut work = std::pin::pin!(work);
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = ticker.tick() => {
                let extended = futures::future::join_all(
                    items.iter().map(|item| item.settle.in_progress()),
                )
                .await;
                if let Some(Err(error)) = extended.into_iter().find(Result::is_err) {
                    debug!(%error, "could not extend the ack wait");
                }
            }
        }
    }
}
