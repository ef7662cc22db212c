//! How often a relay writes its acknowledgements back (`RelayConfig::mark_interval`), over the
//! real PostgreSQL (the polling source) and nats-server: at most one mark per interval under
//! steady traffic, but at once when an event waits behind an unmarked one, and at once on
//! shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::OwnStream;
use handoff_postgres::{OrderMode, PollingConfig, PollingSource};
use handoff_relay::{Relay, RelayConfig, RelayReport};
use handoff_test::counting::CountingSource;
use handoff_test::{eventually, factory, TestDb};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A relay running over `db` and a fresh stream, counting its calls to the source.
struct Running {
    source: Arc<CountingSource<PollingSource>>,
    stream: OwnStream,
    stop: watch::Sender<bool>,
    run: JoinHandle<RelayReport>,
}

impl Running {
    async fn start(db: &TestDb, name: &str, mark_interval: Duration, order: OrderMode) -> Running {
        let stream = OwnStream::new(name).await;
        let transport = stream.transport().await;
        // A lease and a margin long enough for any interval the tests use (the relay refuses
        // an interval over half the margin).
        let polling = PollingConfig {
            order,
            lease: Duration::from_secs(600),
            ..PollingConfig::default()
        };
        let source = Arc::new(CountingSource::new(
            PollingSource::new(db.pool.clone(), polling).unwrap(),
        ));
        let config = RelayConfig {
            mark_interval,
            lease_margin: Duration::from_secs(120),
            order,
            ..RelayConfig::default()
        };
        let relay = Relay::from_shared(source.clone(), Arc::new(transport), config).unwrap();
        let (stop, mut stop_rx) = watch::channel(false);
        let run = tokio::spawn(relay.run(async move {
            let _ = stop_rx.wait_for(|stop| *stop).await;
        }));
        Running {
            source,
            stream,
            stop,
            run,
        }
    }

    /// Waits until the stream holds `n` messages.
    async fn on_broker(&self, n: usize) {
        eventually(
            &format!("{n} messages on the broker"),
            Duration::from_secs(20),
            async || {
                let stored = self.stream.messages().await.len();
                if stored >= n {
                    Ok(())
                } else {
                    Err(stored)
                }
            },
        )
        .await;
    }

    /// Stops the relay, which must end well before `bound`.
    async fn stop_within(self, bound: Duration) -> RelayReport {
        self.stop.send(true).unwrap();
        tokio::time::timeout(bound, self.run)
            .await
            .expect("the relay stops without waiting out its mark interval")
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_steady_traffic_a_relay_marks_at_most_once_per_interval() {
    const EVENTS: u64 = 300;
    const INTERVAL: Duration = Duration::from_millis(200);
    let db = TestDb::migrated("relay_marks_steady").await;
    let outbox = factory::outbox(OrderMode::Aggregate);
    let started = Instant::now();
    let relay = Running::start(&db, "marks_steady", INTERVAL, OrderMode::Aggregate).await;

    // One event per transaction, each of its own aggregate, every few milliseconds: the relay
    // keeps up, so each claim carries a few events and each lane acknowledges on its own.
    let mut pace = tokio::time::interval(Duration::from_millis(4));
    for n in 0..EVENTS {
        pace.tick().await;
        db.enqueue_alone(&outbox, factory::event(&format!("steady-{n}"), n))
            .await;
    }
    relay.on_broker(EVENTS as usize).await;
    let source = relay.source.clone();
    let report = relay.stop_within(Duration::from_secs(10)).await;
    let elapsed = started.elapsed();

    assert_eq!(report.published, EVENTS);
    assert_eq!(db.pending_rows().await, 0, "every event marked");
    assert_eq!(source.marked(), EVENTS, "each event marked once");
    // Each mark begins at least an interval after the previous one; the one at shutdown may
    // come early.
    let bound = (elapsed.as_millis() / INTERVAL.as_millis()) as u64 + 2;
    assert!(
        source.marks() <= bound,
        "{} marks in {elapsed:?} (at most {bound}), for {} claims",
        source.marks(),
        source.claims()
    );
    assert!(
        source.claims() > 2 * source.marks(),
        "the relay claimed {} times: more often than it marked ({})",
        source.claims(),
        source.marks()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_behind_an_unmarked_one_does_not_wait_out_the_mark_interval() {
    one_after_another("relay_marks_hurry", OrderMode::Aggregate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_relay_does_not_wait_out_the_mark_interval_between_claims() {
    // The global lane's front is the relay's own lease until its outcomes are written.
    one_after_another("relay_marks_hurry_global", OrderMode::Global).await;
}

/// Events of one aggregate (and, in global order, of one lane), each written once the previous
/// one is on the broker: its predecessor is then acknowledged but, with a mark interval longer
/// than one wait for the broker may take, unmarked, and only the relay's own mark makes it
/// claimable.
async fn one_after_another(name: &str, order: OrderMode) {
    const EVENTS: usize = 6;
    // Longer than one wait for the broker may take: an event that waited for it would time
    // out there.
    const INTERVAL: Duration = Duration::from_secs(40);
    let db = TestDb::migrated(name).await;
    let outbox = factory::outbox(order);
    let relay = Running::start(&db, name, INTERVAL, order).await;

    let started = Instant::now();
    for n in 1..=EVENTS {
        db.enqueue_alone(&outbox, factory::event("hot", n as u64))
            .await;
        relay.on_broker(n).await;
    }
    let took = started.elapsed();
    let sequences: Vec<String> = relay
        .stream
        .messages()
        .await
        .iter()
        .map(|m| m.header("Handoff-Sequence").unwrap().to_owned())
        .collect();
    let source = relay.source.clone();
    let report = relay.stop_within(Duration::from_secs(10)).await;

    assert!(took < INTERVAL, "{EVENTS} events took {took:?}");
    assert_eq!(sequences, ["1", "2", "3", "4", "5", "6"]);
    assert_eq!(report.published, EVENTS as u64);
    // The marks that made each successor claimable, then the last one's at shutdown.
    assert_eq!(source.marks(), EVENTS as u64, "one mark per event");
    assert_eq!(
        db.pending_rows().await,
        0,
        "the last one marked at shutdown"
    );
}
