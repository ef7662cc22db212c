//! The relay's byte bound (`RelayConfig::max_in_flight_bytes`) over the real PostgreSQL (the
//! polling source): a backlog of large events is drained with no more than the bound, plus one
//! event, of events in flight, and in order per aggregate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_core::delivery::{OutboxEvent, PublishError, Receipt, Transport};
use handoff_postgres::{PollingConfig, PollingSource, Schema};
use handoff_relay::{Relay, RelayConfig};
use handoff_test::{eventually, factory, TestDb};
use tokio::sync::watch;

const KB: usize = 1000;
const MB: usize = 1000 * KB;

/// A destination that measures the bytes of the events being published at the same time, and
/// records what it accepted. Each publish yields a few times before it is accepted, so every
/// lane the relay has started is publishing at once: the concurrent bytes are then what the
/// relay holds of the heads of its lanes.
#[derive(Default)]
struct BytesMeter {
    /// Bytes of the events whose publish has started and not ended.
    now: AtomicUsize,
    /// The most `now` ever was.
    peak: AtomicUsize,
    /// Sequences accepted, by aggregate, in the order accepted.
    accepted: Mutex<HashMap<String, Vec<i64>>>,
}

impl BytesMeter {
    fn accepted(&self) -> usize {
        self.accepted.lock().unwrap().values().map(Vec::len).sum()
    }
}

impl Transport for BytesMeter {
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        let bytes = event.size_bytes();
        let now = self.now.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        self.now.fetch_sub(bytes, Ordering::SeqCst);
        let mut accepted = self.accepted.lock().unwrap();
        let lane = accepted.entry(event.aggregate_id.clone()).or_default();
        if !lane.contains(&event.aggregate_sequence) {
            lane.push(event.aggregate_sequence);
        }
        Ok(Receipt::new("measured"))
    }

    async fn wait_until_ready(&self, _at_most: Duration) -> bool {
        true
    }
}

#[tokio::test]
async fn a_relay_holds_no_more_than_its_byte_bound_of_large_events() {
    let db = TestDb::migrated("relay_in_flight_bytes").await;
    let outbox = factory::outbox(handoff_postgres::OrderMode::Aggregate);
    // 200 events of 200 KB: 100 aggregates of 2, a backlog of 40 MB.
    const AGGREGATES: usize = 100;
    for n in 0..2 {
        for a in 0..AGGREGATES {
            db.enqueue_alone(
                &outbox,
                factory::event_of_size(&format!("agg-{a}"), n, 200 * KB),
            )
            .await;
        }
    }
    let source = PollingSource::new(
        db.pool.clone(),
        PollingConfig {
            schema: Schema::named(db.schema()).unwrap(),
            relay_id: "relay-a".into(),
            ..PollingConfig::default()
        },
    )
    .unwrap();
    let meter = Arc::new(BytesMeter::default());
    let config = RelayConfig {
        max_in_flight_bytes: 2 * MB,
        ..RelayConfig::default()
    };
    let relay = Relay::from_shared(Arc::new(source), meter.clone(), config).unwrap();
    let (stop, mut stop_rx) = watch::channel(false);
    let run = tokio::spawn(relay.run(async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    }));

    eventually(
        "every event published",
        Duration::from_secs(60),
        async || {
            let accepted = meter.accepted();
            if accepted == 2 * AGGREGATES {
                Ok(())
            } else {
                Err(accepted)
            }
        },
    )
    .await;
    stop.send(true).unwrap();
    let report = run.await.unwrap();
    assert_eq!(report.published, 2 * AGGREGATES as u64);

    let event = 200 * KB + 64;
    let peak = meter.peak.load(Ordering::SeqCst);
    assert!(
        peak <= 2 * MB + event,
        "{peak} bytes in flight at once, over the bound of {} plus one event",
        2 * MB
    );
    assert!(
        peak >= MB,
        "the bound, not the test, kept the relay small: only {peak} bytes were ever in flight"
    );
    for (aggregate, sequences) in meter.accepted.lock().unwrap().iter() {
        assert_eq!(sequences, &[1, 2], "{aggregate} published out of order");
    }
}
