//! Whose fault is a failed publish, on a RabbitMQ node of the test's own (so that its alarm and
//! limits never reach the shared broker): a memory alarm (`connection.blocked`) pauses the
//! destination without charging any event, and a message the broker refuses by closing the
//! channel is held while every other aggregate flows.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{config_at, unique_name, Broker, Message};
use handoff_amqp::AmqpTransport;
use handoff_core::delivery::PublishErrorKind;
use handoff_core::NewEvent;
use handoff_postgres::{Outbox, OutboxConfig, PollingConfig, PollingSource};
use handoff_relay::{Backoff, Relay, RelayConfig, RelayReport};
use handoff_test::factory;
use handoff_test::faults::{FaultStats, Faulty};
use handoff_test::rabbitmq::RabbitMqNode;
use handoff_test::{eventually, TestDb};
use tokio::sync::watch;
use tokio::task::{block_in_place, JoinHandle};
use uuid::Uuid;

/// The relay's attempt cap in these tests: an outage charged to its events would hold them
/// after three tries.
const MAX_ATTEMPTS: i32 = 3;

struct Setup {
    db: TestDb,
    outbox: Outbox,
    exchange: String,
    /// Dropped before the node it reads from.
    broker: Broker,
    node: RabbitMqNode,
}

impl Setup {
    /// A migrated schema, a private node (`prepare` runs on it before the exchange is declared), and an
    /// exchange with a queue of the same name bound with `#`.
    async fn new(name: &str, prepare: impl FnOnce(&RabbitMqNode) + Send) -> Self {
        let db = TestDb::migrated(name).await;
        let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
        let node = block_in_place(|| {
            let node = RabbitMqNode::start().expect("a private rabbitmq node starts");
            prepare(&node);
            node
        });
        let exchange = unique_name(name);
        let mut broker = Broker::at(&node.url()).await;
        drop(
            AmqpTransport::connect(config_at(&node.url(), &exchange))
                .await
                .unwrap(),
        );
        broker.queue(&exchange, &exchange, "#").await;
        Self {
            db,
            outbox,
            exchange,
            broker,
            node,
        }
    }

    /// Commits `events` in one transaction; returns their ids.
    async fn commit(&self, events: Vec<NewEvent>) -> Vec<Uuid> {
        let mut tx = self.db.pool.begin().await.unwrap();
        let ids = self
            .outbox
            .enqueue(&mut tx, &events)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event_id)
            .collect();
        tx.commit().await.unwrap();
        ids
    }

    /// `per_aggregate` events for each of `aggregates`, round by round.
    async fn commit_each(&self, aggregates: &[String], per_aggregate: u64) -> Vec<Uuid> {
        let mut ids = Vec::new();
        for n in 0..per_aggregate {
            let events = aggregates.iter().map(|a| factory::event(a, n)).collect();
            ids.extend(self.commit(events).await);
        }
        ids
    }

    /// Starts a relay on the node; the counters say what each publish came to.
    async fn start(&self, publish_timeout: Duration) -> (RunningRelay, Arc<FaultStats>) {
        let inner = AmqpTransport::connect(handoff_amqp::AmqpConfig {
            publish_timeout,
            ..config_at(&self.node.url(), &self.exchange)
        })
        .await
        .unwrap();
        let transport = Arc::new(Faulty::new(inner));
        let stats = transport.stats();
        let source = PollingSource::new(
            self.db.pool.clone(),
            PollingConfig {
                relay_id: format!("{}-relay", self.exchange),
                ..PollingConfig::default()
            },
        )
        .unwrap();
        let quick = Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
        };
        let relay = Relay::from_shared(
            Arc::new(source),
            transport.clone(),
            RelayConfig {
                batch_size: 100,
                max_in_flight: 500,
                max_attempts: MAX_ATTEMPTS,
                retry_backoff: quick,
                outage_backoff: quick,
                poll_interval: Duration::from_millis(100),
                ..RelayConfig::default()
            },
        )
        .unwrap();
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(relay.run(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        (RunningRelay { stop, task }, stats)
    }

    async fn count(&self, query: &str) -> i64 {
        handoff_test::inbox::count(&self.db.pool, query).await
    }

    /// Waits until `query` returns at least `n`, or panics after 40 s.
    async fn wait_count(&self, query: &str, n: i64) {
        handoff_test::inbox::wait_count(&self.db.pool, query, n).await;
    }
}

struct RunningRelay {
    stop: watch::Sender<bool>,
    task: JoinHandle<RelayReport>,
}

impl RunningRelay {
    async fn stop(self) -> RelayReport {
        self.stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the relay stopped within 30 s")
            .expect("the relay task did not panic")
    }
}

/// Checks the queue's messages against `expected`: every id at least once, nothing else, and
/// per aggregate (first copies only) sequences 1, 2, 3 ... Returns the duplicates.
fn check_delivery(messages: &[Message], expected: &[Uuid]) -> usize {
    let expected: HashSet<Uuid> = expected.iter().copied().collect();
    let mut seen = HashSet::new();
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut duplicates = 0;
    for message in messages {
        let id = message.event_id();
        assert!(expected.contains(&id), "{id} was not expected");
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let aggregate = message.aggregate_id();
        let want = next.entry(aggregate.clone()).or_insert(1);
        assert_eq!(
            message.sequence(),
            *want,
            "aggregate {aggregate} out of order"
        );
        *want += 1;
    }
    assert_eq!(seen.len(), expected.len(), "every expected event delivered");
    duplicates
}

const PUBLISHED: &str = "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL";
const HELD: &str = "SELECT count(*) FROM outbox WHERE available_at = 'infinity'";
const CHARGED: &str = "SELECT count(*) FROM outbox WHERE attempt_count > 0";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_connection_pauses_the_destination_and_charges_no_event() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("handoff_relay=info,handoff_amqp=info")
        .try_init();
    let setup = Setup::new("amqp_blocked", |_| {}).await;
    let aggregates: Vec<String> = (0..8).map(|a| format!("agg-{a}")).collect();
    let mut committed = setup.commit_each(&aggregates, 2).await;
    // A confirm that does not come within a second is given up on, so a blocked publish comes
    // back to the relay many times over while the alarm lasts.
    let (relay, watched) = setup.start(Duration::from_secs(1)).await;
    setup.wait_count(PUBLISHED, 16).await;

    // The memory alarm: the node blocks the relay's connection at its next publish, and reads
    // nothing more from it until the alarm clears.
    block_in_place(|| {
        setup
            .node
            .set_vm_memory_high_watermark(RabbitMqNode::BLOCKING_WATERMARK)
    })
    .unwrap();
    committed.extend(setup.commit(vec![factory::event("agg-0", 2)]).await);
    eventually(
        "the blocked publish to come back throttled",
        Duration::from_secs(40),
        async || watched.failed(PublishErrorKind::Throttled) >= 1,
    )
    .await;
    let accepted_when_blocked = watched.acknowledged();
    // More writes during the alarm, on every aggregate.
    for n in 3..6 {
        let events = aggregates.iter().map(|a| factory::event(a, n)).collect();
        committed.extend(setup.commit(events).await);
    }
    committed.extend(
        setup
            .commit(vec![factory::event("agg-1", 6), factory::event("agg-2", 6)])
            .await,
    );
    // The alarm (the fault window of this test) outlasts the attempt cap several times over:
    // charged, each blocked publish would time out after 1 s and back off at most 200 ms, so
    // three attempts would hold the event within 4 s.
    tokio::time::sleep(Duration::from_secs(3 * MAX_ATTEMPTS as u64)).await;
    // Paused, the relay waits for the transport to see the block lifted instead of sending
    // probe after probe into a connection the broker does not read.
    assert!(
        watched.failed(PublishErrorKind::Throttled) <= aggregates.len() as u64 + 2,
        "{} publishes tried against the blocked connection",
        watched.failed(PublishErrorKind::Throttled)
    );
    assert_eq!(
        watched.acknowledged(),
        accepted_when_blocked,
        "nothing is confirmed while the connection is blocked"
    );
    assert_eq!(setup.count(PUBLISHED).await, 16, "publishing stalled");
    assert_eq!(setup.count(CHARGED).await, 0, "no attempt charged");
    assert_eq!(setup.count(HELD).await, 0, "nothing held");
    let said: i64 = setup
        .count(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL \
             AND last_error LIKE '%blocked the connection%'",
        )
        .await;
    assert!(said >= 1, "the outbox says why it waits");

    block_in_place(|| {
        setup
            .node
            .set_vm_memory_high_watermark(RabbitMqNode::DEFAULT_WATERMARK)
    })
    .unwrap();
    setup.wait_count(PUBLISHED, committed.len() as i64).await;
    let report = relay.stop().await;
    assert_eq!(report.held, 0);
    assert_eq!(setup.count(CHARGED).await, 0, "no attempt charged");
    assert_eq!(setup.count(HELD).await, 0, "nothing held");

    let messages = setup.broker.drain(&setup.exchange).await;
    // The publish stalled by the block was confirmed once the alarm cleared, and its retry
    // waited for that confirm instead of sending a copy: every event exactly once.
    assert_eq!(check_delivery(&messages, &committed), 0, "no copies");
    assert_eq!(messages.len(), committed.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_brokers_size_limit_is_held_while_others_flow() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("handoff_relay=info,handoff_amqp=info")
        .try_init();
    // Before any channel opens: each channel reads the limit when it opens.
    let setup = Setup::new("amqp_oversize", |node| {
        node.set_max_message_size(4096).unwrap();
    })
    .await;
    let good: Vec<String> = (0..6).map(|a| format!("good-{a}")).collect();
    let big = |n: u64| {
        let filler = if n == 1 {
            "x".repeat(6000)
        } else {
            String::new()
        };
        NewEvent::new(
            factory::AGGREGATE_TYPE,
            "big",
            factory::EVENT_TYPE,
            1,
            format!(r#"{{"n":{n},"filler":"{filler}"}}"#),
        )
    };
    let mut delivered = Vec::new();
    let mut big_ids = Vec::new();
    for n in 0..3 {
        let mut events: Vec<NewEvent> = good.iter().map(|a| factory::event(a, n)).collect();
        events.push(big(n));
        let ids = setup.commit(events).await;
        delivered.extend(&ids[..good.len()]);
        big_ids.push(ids[good.len()]);
    }
    delivered.push(big_ids[0]);

    let (relay, watched) = setup.start(Duration::from_secs(5)).await;
    setup.wait_count(HELD, 1).await;
    setup.wait_count(PUBLISHED, delivered.len() as i64).await;
    let report = relay.stop().await;
    assert_eq!(report.held, 1);
    assert_eq!(watched.failed(PublishErrorKind::Rejected), 1);

    let (event_id, attempts, reason, error): (Uuid, i32, String, String) = sqlx::query_as(
        "SELECT event_id, attempt_count, hold_reason, last_error FROM outbox \
         WHERE available_at = 'infinity'",
    )
    .fetch_one(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!(event_id, big_ids[1], "the event over the limit is held");
    assert_eq!(attempts, 1, "its attempt is charged");
    assert_eq!(reason, "rejected");
    assert!(error.contains("4096"), "{error}");
    assert!(error.contains("max_message_size"), "{error}");
    // No other event was charged for the channel the broker closed under it.
    assert_eq!(setup.count(CHARGED).await, 1);
    // Its aggregate's later event waits behind it, neither published nor held itself.
    let waiting: (bool, bool, i32) = sqlx::query_as(
        "SELECT published_at IS NULL, available_at = 'infinity', attempt_count FROM outbox \
         WHERE event_id = $1",
    )
    .bind(big_ids[2])
    .fetch_one(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!(
        waiting,
        (true, false, 0),
        "unpublished, not held, not charged"
    );

    let messages = setup.broker.drain(&setup.exchange).await;
    check_delivery(&messages, &delivered);
}
