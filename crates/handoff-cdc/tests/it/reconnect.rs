//! In-process reconnects (issue 25): the walsender of the CDC relay is terminated again and
//! again (`pg_terminate_backend`) while writers commit events over shared aggregates. After each
//! reconnect the server sends again every transaction after the last confirmed position; an
//! event of it that was already published, or is in flight, must not be handed out again.
//!
//! The destination is the real JetStream (tansu, the Kafka broker of the tests, is not always
//! installed); a decorator around the real transport checks, per aggregate, that no publish
//! starts while another of the aggregate is in progress, and that no event is published again
//! once it, or a newer event of its aggregate, was acknowledged. JetStream's duplicate window
//! would hide such a copy in the stream, so the decorator is what sees it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{eventually, Fixture, Ledger, Seeded};
use handoff_cdc::RowMode;
use handoff_core::delivery::{OutboxEvent, PublishError, Receipt, Transport};
use handoff_core::NewEvent;
use handoff_test::factory;

const WRITERS: u64 = 4;
const AGGREGATES: u64 = 12;
/// Walsender terminations per run.
const TERMINATIONS: usize = 8;
/// A writer stops after this many transactions even if the terminations are not done: a
/// bound for a relay that never comes back, far above what the terminations take. (At 2,000 a
/// quiet machine's writers finished before the relay's reconnect backoff had let eight
/// terminations happen, and the last waits for traffic that never came.)
const MAX_TRANSACTIONS_PER_WRITER: u64 = 20_000;

/// What the decorator saw.
#[derive(Default)]
struct Seen {
    /// Aggregates with a publish in progress.
    in_progress: HashSet<String>,
    /// Per aggregate, the highest sequence the broker acknowledged.
    acked_max: HashMap<String, i64>,
    acked: u64,
    /// Each breach of the rules, described.
    violations: Vec<String>,
}

/// The real transport, checking one in-flight event per aggregate and no copy after an ack.
struct InFlightChecker<T> {
    inner: T,
    seen: Arc<Mutex<Seen>>,
}

/// Ends a publish in the record even when the relay drops its future.
struct Publishing<'a> {
    seen: &'a Mutex<Seen>,
    aggregate: String,
}

impl Drop for Publishing<'_> {
    fn drop(&mut self) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.in_progress.remove(&self.aggregate);
    }
}

impl<T: Transport> Transport for InFlightChecker<T> {
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        let aggregate = event.aggregate_id.clone();
        let sequence = event.aggregate_sequence;
        {
            let mut seen = self.seen.lock().unwrap();
            if !seen.in_progress.insert(aggregate.clone()) {
                seen.violations.push(format!(
                    "{aggregate}/{sequence} published while another event of {aggregate} was \
                     in flight"
                ));
            }
            if let Some(acked) = seen.acked_max.get(&aggregate).copied() {
                if sequence <= acked {
                    seen.violations.push(format!(
                        "{aggregate}/{sequence} published again after {aggregate}/{acked} was \
                         acknowledged"
                    ));
                }
            }
        }
        let _publishing = Publishing {
            seen: &self.seen,
            aggregate: aggregate.clone(),
        };
        let receipt = self.inner.publish(event).await?;
        let mut seen = self.seen.lock().unwrap();
        let max = seen.acked_max.entry(aggregate).or_insert(sequence);
        *max = (*max).max(sequence);
        seen.acked += 1;
        Ok(receipt)
    }

    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        self.inner.wait_until_ready(at_most).await
    }
}

/// Writers committing small transactions over shared aggregates until `stop` is set.
fn start_writers(fx: &Fixture, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<Ledger>> {
    (0..WRITERS)
        .map(|writer| {
            let pool = fx.db.pool.clone();
            let outbox = fx.outbox.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut rng = Seeded::new(25_000 + writer);
                let mut ledger = Ledger::default();
                for _ in 0..MAX_TRANSACTIONS_PER_WRITER {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    // One or two distinct aggregates, one or two events each.
                    let first = rng.below(AGGREGATES);
                    let mut aggregates = vec![first];
                    if rng.below(2) == 0 {
                        aggregates.push((first + 1 + rng.below(AGGREGATES - 1)) % AGGREGATES);
                    }
                    let events: Vec<NewEvent> = aggregates
                        .iter()
                        .flat_map(|a| {
                            let count = 1 + rng.below(2);
                            (0..count).map(move |k| factory::event(&format!("agg{a}"), k))
                        })
                        .collect();
                    let mut tx = pool.begin().await.unwrap();
                    let enqueued = outbox.enqueue(&mut tx, &events).await.unwrap();
                    tx.commit().await.unwrap();
                    ledger.record(&events, &enqueued);
                }
                ledger
            })
        })
        .collect()
}

async fn walsender(fx: &Fixture) -> Option<i32> {
    fx.slot().await.active_pid
}

async fn terminate(fx: &Fixture, pid: i32) -> bool {
    sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&fx.db.pool)
        .await
        .unwrap()
}

async fn walsender_terminated_repeatedly_never_has_two_events_of_an_aggregate_in_flight(
    name: &str,
    rows: RowMode,
) {
    let fx = Fixture::start(name, rows, &[]).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    // The default confirm interval: the more the server sends again after a reconnect, the
    // more copies the source must recognise.
    let config = handoff_cdc::LogicalConfig {
        confirm_interval: Duration::from_secs(1),
        ..fx.logical_config()
    };
    let relay = fx
        .relay_with(config, |inner| InFlightChecker {
            inner,
            seen: seen.clone(),
        })
        .await;
    let stop = Arc::new(AtomicBool::new(false));
    let writers = start_writers(&fx, stop.clone());

    let mut terminated = 0;
    let mut last_pid = None;
    while terminated < TERMINATIONS {
        // Streaming again (a new walsender) and publishing since the last termination.
        let acked_before = seen.lock().unwrap().acked;
        eventually(
            "the relay streams again and publishes",
            Duration::from_secs(30),
            || async {
                let pid = walsender(&fx).await;
                pid.is_some() && pid != last_pid && seen.lock().unwrap().acked >= acked_before + 50
            },
        )
        .await;
        let Some(pid) = walsender(&fx).await else {
            continue;
        };
        if terminate(&fx, pid).await {
            terminated += 1;
            last_pid = Some(pid);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut ledger = Ledger::default();
    for writer in writers {
        ledger.merge(writer.await.unwrap());
    }
    let wal_after = fx.current_wal_lsn().await;
    assert!(
        ledger.len() > 500,
        "a real workload: {} events",
        ledger.len()
    );

    eventually(
        "every committed event in the stream",
        Duration::from_secs(60),
        || async { fx.delivered().await.ids.len() >= ledger.len() },
    )
    .await;
    fx.delivered().await.assert_exactly(&ledger);
    eventually(
        "the slot confirmed past the last commit",
        Duration::from_secs(15),
        || async { fx.slot().await.confirmed_flush_lsn >= wal_after },
    )
    .await;
    {
        let seen = seen.lock().unwrap();
        assert!(
            seen.violations.is_empty(),
            "{} violations across {terminated} reconnects, first: {:#?}",
            seen.violations.len(),
            &seen.violations[..seen.violations.len().min(10)]
        );
        assert_eq!(
            seen.acked as usize,
            ledger.len(),
            "each event acknowledged exactly once"
        );
    }
    let report = relay.stop().await;
    assert_eq!(report.held, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_deleted_rows_reconnects_never_put_two_events_of_an_aggregate_in_flight() {
    walsender_terminated_repeatedly_never_has_two_events_of_an_aggregate_in_flight(
        "cdc_reconnect_delete",
        RowMode::Delete,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_kept_rows_reconnects_never_put_two_events_of_an_aggregate_in_flight() {
    walsender_terminated_repeatedly_never_has_two_events_of_an_aggregate_in_flight(
        "cdc_reconnect_keep",
        RowMode::Keep,
    )
    .await;
}
