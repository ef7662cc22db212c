//! The relay in process (PostgreSQL polling source, `handoff_relay::Relay`) onto the AMQP
//! transport and the real RabbitMQ: every committed event reaches the queue in order per
//! aggregate, an unroutable event is quarantined while the other aggregates flow, and the relay
//! survives the broker closing its connection mid-run.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{close_connections_named, config, unique_name, Broker, Message};
use handoff_amqp::AmqpTransport;
use handoff_postgres::{Migrator, Outbox, OutboxConfig, PollingConfig, PollingSource, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig, RelayReport};
use handoff_test::{factory, TestDb};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use uuid::Uuid;

struct Setup {
    db: TestDb,
    outbox: Outbox,
    broker: Broker,
    exchange: String,
}

impl Setup {
    /// A migrated schema, and an exchange with a queue of the same name bound with `bindings`.
    async fn new(name: &str, bindings: &[&str]) -> Self {
        let db = TestDb::new(name).await;
        Migrator::handoff(Schema::default())
            .run(&mut db.pool.acquire().await.unwrap())
            .await
            .unwrap();
        let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
        let exchange = unique_name(name);
        let mut broker = Broker::new().await;
        broker.owns_exchange(&exchange);
        // The relay declares the exchange; declare it first here so the queue can be bound.
        drop(AmqpTransport::connect(config(&exchange)).await.unwrap());
        for binding in bindings {
            broker.queue(&exchange, &exchange, binding).await;
        }
        Self {
            db,
            outbox,
            broker,
            exchange,
        }
    }

    /// Commits `per_aggregate` events for each of `aggregates`, one transaction per round.
    /// Returns the ids in commit order.
    async fn commit(&self, aggregates: &[String], rounds: u64, per_round: u64) -> Vec<Uuid> {
        let mut ids = Vec::new();
        for round in 0..rounds {
            let mut tx = self.db.pool.begin().await.unwrap();
            for aggregate in aggregates {
                let events: Vec<_> = (0..per_round)
                    .map(|k| factory::event(aggregate, round * per_round + k))
                    .collect();
                ids.extend(
                    self.outbox
                        .enqueue(&mut tx, &events)
                        .await
                        .unwrap()
                        .into_iter()
                        .map(|e| e.event_id),
                );
            }
            tx.commit().await.unwrap();
        }
        ids
    }

    async fn start(&self) -> RunningRelay {
        let transport = AmqpTransport::connect(config(&self.exchange))
            .await
            .unwrap();
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
            Arc::new(transport),
            RelayConfig {
                batch_size: 100,
                max_in_flight: 500,
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
        RunningRelay { stop, task }
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

/// Checks the queue's messages against the committed ids: every id at least once, nothing
/// else, and per aggregate (first copies only) sequences 1, 2, 3 ... Returns the duplicates.
fn check_delivery(messages: &[Message], committed: &[Uuid], per_aggregate: i64) -> usize {
    let committed: HashSet<Uuid> = committed.iter().copied().collect();
    let mut seen = HashSet::new();
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut duplicates = 0;
    for message in messages {
        let id = message.event_id();
        assert!(committed.contains(&id), "{id} was never committed");
        assert_eq!(
            message
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string()),
            Some(id.to_string())
        );
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let aggregate = message.aggregate_id();
        let expected = next.entry(aggregate.clone()).or_insert(1);
        assert_eq!(
            message.sequence(),
            *expected,
            "aggregate {aggregate} out of order"
        );
        *expected += 1;
    }
    assert_eq!(
        seen.len(),
        committed.len(),
        "every committed event delivered"
    );
    assert!(next.values().all(|n| *n == per_aggregate + 1), "{next:?}");
    duplicates
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_delivers_every_committed_event_in_order_per_aggregate() {
    let setup = Setup::new("amqp_relay_order", &["#"]).await;
    let aggregates: Vec<String> = (0..30).map(|a| format!("agg.{a}")).collect();
    let mut committed = setup.commit(&aggregates, 5, 2).await;
    // A rolled-back transaction leaves nothing to publish.
    let mut tx = setup.db.pool.begin().await.unwrap();
    let rolled_back = setup
        .outbox
        .enqueue(&mut tx, &[factory::event("agg.0", 999)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let relay = setup.start().await;
    // More commits while the relay runs.
    committed.extend(setup.commit(&aggregates, 5, 2).await);
    let messages = setup.broker.read(&setup.exchange, committed.len()).await;
    let report = relay.stop().await;
    assert_eq!(report.published as usize, committed.len());

    assert_eq!(check_delivery(&messages, &committed, 20), 0);
    assert!(messages
        .iter()
        .all(|m| m.event_id() != rolled_back[0].event_id));
    assert_eq!(setup.db.pending_rows().await, 0);
    // The receipt names the exchange and routing key.
    let receipt: String = sqlx::query_scalar(
        "SELECT delivery_receipt FROM outbox WHERE aggregate_id = 'agg.7' \
         AND aggregate_sequence = 1",
    )
    .fetch_one(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!(receipt, format!("amqp {} thing.agg%2E7", setup.exchange));
    // Routing keys carry the aggregate, encoded as one word.
    assert!(messages.iter().any(|m| m.routing_key == "thing.agg%2E7"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_event_is_quarantined_while_other_aggregates_flow() {
    // Only the aggregates `good-*` have a queue bound for their routing keys.
    let good: Vec<String> = (0..5).map(|a| format!("good-{a}")).collect();
    let bindings: Vec<String> = good.iter().map(|a| format!("thing.{a}")).collect();
    let bindings: Vec<&str> = bindings.iter().map(String::as_str).collect();
    let setup = Setup::new("amqp_relay_unroutable", &bindings).await;
    let mut all = good.clone();
    all.push("lost".to_owned());
    let committed = setup.commit(&all, 3, 1).await;

    let relay = setup.start().await;
    setup
        .wait_count(
            "SELECT count(*) FROM outbox WHERE quarantined_at IS NOT NULL",
            1,
        )
        .await;
    setup
        .wait_count(
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
            15,
        )
        .await;
    relay.stop().await;

    let (sequence, error): (i64, String) = sqlx::query_as(
        "SELECT aggregate_sequence, last_error FROM outbox WHERE quarantined_at IS NOT NULL",
    )
    .fetch_one(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!(sequence, 1, "the first event of the unroutable aggregate");
    assert!(error.contains("unroutable"), "{error}");
    // Its later events wait behind it, unpublished and not quarantined themselves.
    let waiting = setup
        .count(
            "SELECT count(*) FROM outbox WHERE aggregate_id = 'lost' AND published_at IS NULL \
             AND quarantined_at IS NULL",
        )
        .await;
    assert_eq!(waiting, 2);

    let good_ids: Vec<Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE aggregate_id <> 'lost' ORDER BY event_id",
    )
    .fetch_all(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!(good_ids.len() + 3, committed.len());
    let messages = setup.broker.read(&setup.exchange, good_ids.len()).await;
    check_delivery(&messages, &good_ids, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_survives_the_broker_closing_its_connection() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("handoff_relay=info,handoff_amqp=info")
        .try_init();
    let setup = Setup::new("amqp_relay_reconnect", &["#"]).await;
    let aggregates: Vec<String> = (0..20).map(|a| format!("agg-{a}")).collect();
    let relay = setup.start().await;
    let name = setup.exchange.clone();
    let mut committed = Vec::new();
    for round in 0..4 {
        committed.extend(setup.commit(&aggregates, 5, 1).await);
        // The broker ends the relay's connection while it publishes (a restart, a failover).
        setup
            .wait_count(
                "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
                (round * 100 + 20) as i64,
            )
            .await;
        assert_eq!(close_connections_named(&name), 1, "round {round}");
    }
    setup
        .wait_count(
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
            committed.len() as i64,
        )
        .await;
    let report = relay.stop().await;
    let messages = setup.broker.drain(&setup.exchange).await;
    let duplicates = check_delivery(&messages, &committed, 20);
    assert_eq!(messages.len(), committed.len() + duplicates);
    assert!(
        report.retried > 0,
        "the closes failed some publishes: {report:?}"
    );
}
