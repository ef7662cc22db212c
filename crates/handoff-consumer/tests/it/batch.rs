//! Batch mode (`ConsumerConfig::batch`): several deliveries per transaction keep every
//! guarantee of the per-event path: each effect once, in order per aggregate, duplicates
//! acknowledged without the handler, gaps by the policy, a poison event quarantined without
//! failing its batch neighbours, and nothing half-applied when the process dies mid-batch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{event, Recorder, Setup, WAIT};
use handoff_consumer::{BatchConfig, ConsumerConfig, GapPolicy, Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_test::eventually;
use handoff_test::inbox::{assert_applied_once_in_order, record};
use sqlx::PgConnection;
use uuid::Uuid;

/// Records each application in `applied` (through `record`) and, beside it, the id of the
/// transaction that applied it, so a test can tell which events shared a transaction. Counts
/// handler calls per event; fails permanently for the aggregate `poison`.
#[derive(Clone, Default)]
struct Tracked {
    calls: Arc<Mutex<HashMap<Uuid, u32>>>,
    /// Every call's event, in call order.
    order: Arc<Mutex<Vec<Uuid>>>,
}

impl Tracked {
    fn order(&self) -> Vec<Uuid> {
        self.order.lock().unwrap().clone()
    }

    fn calls(&self) -> HashMap<Uuid, u32> {
        self.calls.lock().unwrap().clone()
    }

    fn total_calls(&self) -> u32 {
        self.calls.lock().unwrap().values().sum()
    }
}

impl Handler for Tracked {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        record(tx, event).await?;
        sqlx::query("INSERT INTO applied_tx (event_id, tx) VALUES ($1, txid_current())")
            .bind(event.event_id)
            .execute(&mut *tx)
            .await?;
        *self
            .calls
            .lock()
            .unwrap()
            .entry(event.event_id)
            .or_default() += 1;
        self.order.lock().unwrap().push(event.event_id);
        if event.aggregate_id == "poison" {
            // Written above first: a rollback that did not happen would show.
            return Err(HandlerError::permanent("cannot reserve: unknown SKU"));
        }
        Ok(())
    }
}

async fn setup(name: &str) -> Setup {
    let setup = Setup::new(name).await;
    sqlx::raw_sql("CREATE TABLE applied_tx (event_id uuid NOT NULL, tx bigint NOT NULL)")
        .execute(&setup.db.pool)
        .await
        .unwrap();
    setup
}

fn batched(setup: &Setup, name: &str, batch: BatchConfig) -> ConsumerConfig {
    ConsumerConfig {
        batch: Some(batch),
        ..setup.config(name)
    }
}

/// The most effects one transaction committed.
async fn largest_transaction(setup: &Setup) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM applied_tx GROUP BY tx) t",
    )
    .fetch_one(&setup.db.pool)
    .await
    .unwrap()
}

/// Whether the durable consumer `durable` has nothing left to deliver or to be acknowledged.
async fn drained(setup: &Setup, durable: &str) -> bool {
    let context = async_nats::jetstream::new(setup.transport.client().clone());
    let stream = context.get_stream(&setup.stream).await.unwrap();
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(durable).await.unwrap();
    let info = consumer.info().await.unwrap();
    info.num_pending == 0 && info.num_ack_pending == 0
}

async fn quarantined(setup: &Setup) -> Vec<(Uuid, String, String)> {
    sqlx::query_as("SELECT event_id, reason_kind, reason FROM consumer_quarantine")
        .fetch_all(&setup.db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn batch_mode_applies_every_event_once_in_order_and_acks_redelivered_duplicates() {
    let setup = setup("batch_once_in_order").await;
    const AGGREGATES: usize = 30;
    const PER_AGGREGATE: i64 = 5;
    let mut events = Vec::new();
    for sequence in 1..=PER_AGGREGATE {
        for a in 0..AGGREGATES {
            let e = event(&format!("o-{a}"), sequence);
            setup.publish(&e).await;
            events.push(e);
        }
    }
    let handler = Tracked::default();
    let config = batched(
        &setup,
        "batch_order",
        BatchConfig {
            max_events: 16,
            max_wait: Duration::from_millis(20),
            max_in_flight: 2,
        },
    );
    let running = setup.start(config, handler.clone()).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", events.len() as i64)
        .await;

    // Every event again, under new Nats-Msg-Ids the stream does not deduplicate: each copy is
    // a duplicate to the inbox, acknowledged without the handler.
    for e in &events {
        setup.publish_again_with_new_msg_id(e).await;
    }
    eventually("every copy acknowledged", WAIT, || {
        drained(&setup, "batch_order")
    })
    .await;
    running.stop().await;

    let applied = setup.applied().await;
    assert_applied_once_in_order(&applied, events.len());
    let calls = handler.calls();
    assert_eq!(calls.len(), events.len());
    assert!(
        calls.values().all(|n| *n == 1),
        "the handler ran once per event, never for a duplicate: {calls:?}"
    );
    assert!(
        largest_transaction(&setup).await > 1,
        "several events shared a transaction"
    );
    let at_last: i64 =
        sqlx::query_scalar("SELECT count(*) FROM consumer_sequences WHERE last_sequence = $1")
            .bind(PER_AGGREGATE)
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(at_last, AGGREGATES as i64);
    let stream = handoff_test::nats::read_stream(setup.transport.client(), &setup.stream).await;
    assert_eq!(
        stream.len(),
        2 * events.len(),
        "the copies really are in the stream"
    );
}

#[tokio::test]
async fn two_batch_instances_apply_every_event_once_in_order_per_aggregate() {
    let setup = setup("batch_two_instances").await;
    const AGGREGATES: i64 = 40;
    const PER_AGGREGATE: i64 = 8;
    for sequence in 1..=PER_AGGREGATE {
        for a in 0..AGGREGATES {
            setup.publish(&event(&format!("o-{a}"), sequence)).await;
        }
    }
    // Occasional retryable failures roll batches back and shuffle the deliveries between the
    // two instances, whose batches then contend for the same aggregates.
    let calls = Arc::new(AtomicU32::new(0));
    let flaky = |calls: Arc<AtomicU32>| {
        Recorder::failing_with(move |_| {
            if calls.fetch_add(1, Ordering::SeqCst) % 29 == 7 {
                Err(HandlerError::retryable("flaky"))
            } else {
                Ok(())
            }
        })
    };
    let config = batched(
        &setup,
        "batch_shared",
        BatchConfig {
            max_events: 16,
            max_wait: Duration::from_millis(10),
            max_in_flight: 2,
        },
    );
    let a = setup.start(config.clone(), flaky(calls.clone())).await;
    let b = setup.start(config, flaky(calls.clone())).await;
    setup
        .wait_count(
            "SELECT count(*) FROM processed_events",
            AGGREGATES * PER_AGGREGATE,
        )
        .await;
    a.stop().await;
    b.stop().await;

    let applied = setup.applied().await;
    assert_applied_once_in_order(&applied, (AGGREGATES * PER_AGGREGATE) as usize);
    let at_last: i64 =
        sqlx::query_scalar("SELECT count(*) FROM consumer_sequences WHERE last_sequence = $1")
            .bind(PER_AGGREGATE)
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(at_last, AGGREGATES);
}

#[tokio::test]
async fn a_poison_event_is_quarantined_while_its_batch_neighbours_apply_once() {
    let setup = setup("batch_poison").await;
    let poison = event("poison", 1);
    let mut neighbours = Vec::new();
    for n in 0..9 {
        let e = event(&format!("fine-{n}"), 1);
        setup.publish(&e).await;
        neighbours.push(e);
        if n == 4 {
            setup.publish(&poison).await;
        }
    }
    // All ten were published before the consumer starts, and the batch closes only when full
    // (or after 5 s): they form one batch.
    let handler = Tracked::default();
    let config = batched(
        &setup,
        "batch_poison",
        BatchConfig {
            max_events: 10,
            max_wait: Duration::from_secs(5),
            max_in_flight: 1,
        },
    );
    let running = setup.start(config, handler.clone()).await;
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 1)
        .await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 9)
        .await;
    eventually("every delivery settled", WAIT, || {
        drained(&setup, "batch_poison")
    })
    .await;
    running.stop().await;

    let rows = quarantined(&setup).await;
    assert_eq!(
        rows,
        [(
            poison.event_id,
            "handler_permanent".to_owned(),
            "cannot reserve: unknown SKU".to_owned()
        )]
    );
    let applied = setup.applied().await;
    assert_applied_once_in_order(&applied, neighbours.len());
    assert!(applied
        .iter()
        .all(|(_, aggregate, _)| aggregate != "poison"));
    // The batch stops at the poison: the neighbours handled before it ran in the batch that
    // rolled back and again alone, those after it only alone.
    let calls = handler.calls();
    let order = handler.order();
    let poison_at = order.iter().position(|id| *id == poison.event_id).unwrap();
    assert!(
        poison_at > 0,
        "the poison shared its batch with neighbours: {order:?}"
    );
    for e in &neighbours {
        let in_failed_batch = order[..poison_at].contains(&e.event_id);
        assert_eq!(
            calls[&e.event_id],
            1 + u32::from(in_failed_batch),
            "{}",
            e.aggregate_id
        );
    }
    assert_eq!(
        calls[&poison.event_id], 2,
        "the poison failed its batch, then failed alone and was quarantined at once"
    );
    assert_eq!(
        largest_transaction(&setup).await,
        1,
        "after the fallback every event committed in a transaction of its own"
    );
    let processed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_events WHERE event_id = $1")
            .bind(poison.event_id)
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(processed, 0, "the poison's dedup row rolled back with it");
}

#[tokio::test]
async fn events_out_of_their_aggregates_line_follow_the_gap_policy_in_batch_mode() {
    let setup = setup("batch_gaps").await;
    // o-1: 1, 3, 2 in stream order, between events of other aggregates.
    let o1 = [event("o-1", 1), event("o-1", 2), event("o-1", 3)];
    let others: Vec<_> = (0..6).map(|n| event(&format!("x-{n}"), 1)).collect();
    setup.publish(&o1[0]).await;
    setup.publish(&others[0]).await;
    setup.publish(&others[1]).await;
    setup.publish(&o1[2]).await;
    setup.publish(&others[2]).await;
    setup.publish(&others[3]).await;
    setup.publish(&o1[1]).await;
    setup.publish(&others[4]).await;
    setup.publish(&others[5]).await;
    let handler = Tracked::default();
    let config = ConsumerConfig {
        gap_policy: GapPolicy::Reject {
            retry_after: Duration::from_millis(100),
        },
        ..batched(&setup, "batch_gaps", BatchConfig::default())
    };
    let running = setup.start(config, handler.clone()).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 9)
        .await;

    // A new event id at a place already applied (a replay after its dedup row was purged):
    // stale, recorded and skipped as on the per-event path, never applied.
    let stale = event("o-1", 2);
    setup.publish(&stale).await;
    setup
        .wait_count("SELECT count(*) FROM processed_events", 10)
        .await;
    eventually("every delivery settled", WAIT, || {
        drained(&setup, "batch_gaps")
    })
    .await;
    running.stop().await;

    let applied = setup.applied().await;
    assert_applied_once_in_order(&applied, 9);
    let o1_order: Vec<Uuid> = applied
        .iter()
        .filter(|(_, aggregate, _)| aggregate == "o-1")
        .map(|(id, _, _)| *id)
        .collect();
    assert_eq!(
        o1_order,
        o1.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        "o-1 applied 1, 2, 3 although 3 arrived before 2"
    );
    assert!(
        !handler.calls().contains_key(&stale.event_id),
        "the stale event never reached the handler"
    );
    assert!(quarantined(&setup).await.is_empty());
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_batch_commit_leaves_nothing_half_applied() {
    use handoff_consumer::{failpoints, Consumer};
    use handoff_nats::{IntakeConfig, JetStreamIntake};
    use handoff_test::inbox::Running;
    use handoff_test::nats::shared_url;
    use sqlx::postgres::PgPoolOptions;

    let setup = setup("batch_crash").await;
    const AGGREGATES: usize = 8;
    let mut events = Vec::new();
    for sequence in 1..=2 {
        for a in 0..AGGREGATES {
            let e = event(&format!("o-{a}"), sequence);
            setup.publish(&e).await;
            events.push(e);
        }
    }
    // Only for this consumer: other tests of this binary may share the process.
    let name = "batch_crash";
    fail::cfg(failpoints::BATCH_BEFORE_COMMIT, &format!("return({name})")).unwrap();

    // The first instance on a pool of its own, so its connections (and the transaction frozen
    // at the failpoint) go away with it, as with a killed process.
    let application = format!("handoff-batch-crash-{}", std::process::id());
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(setup.db.connect_options().application_name(&application))
        .await
        .unwrap();
    let intake = |ack_wait| {
        let stream = setup.stream.clone();
        async move {
            JetStreamIntake::connect(
                &shared_url(),
                IntakeConfig {
                    stream: stream.clone(),
                    subject_prefix: stream,
                    durable_name: name.into(),
                    ack_wait,
                    ..IntakeConfig::default()
                },
            )
            .await
            .unwrap()
        }
    };
    let config = ConsumerConfig {
        shutdown_grace: Duration::from_millis(100),
        // The first sequence of every aggregate in one batch, closed when full.
        ..batched(
            &setup,
            name,
            BatchConfig {
                max_events: AGGREGATES,
                max_wait: Duration::from_secs(5),
                max_in_flight: 1,
            },
        )
    };
    let handler = Tracked::default();
    let first = Running::spawn(
        Consumer::new(config.clone(), pool.clone(), handler.clone()).unwrap(),
        intake(Duration::from_secs(2)),
    );
    // Every handler of the batch ran; then its transaction waits, open, at the failpoint.
    eventually("the batch's handlers ran", WAIT, || {
        let handler = handler.clone();
        async move { handler.total_calls() as usize == AGGREGATES }
    })
    .await;
    let frozen = "SELECT count(*) FROM pg_stat_activity \
                  WHERE application_name = $1 AND state = 'idle in transaction'";
    eventually(
        "the batch's transaction open at the failpoint",
        WAIT,
        || {
            let pool = setup.db.pool.clone();
            let application = application.clone();
            async move {
                sqlx::query_scalar::<_, i64>(frozen)
                    .bind(application)
                    .fetch_one(&pool)
                    .await
                    .unwrap()
                    == 1
            }
        },
    )
    .await;
    for table in [
        "applied",
        "applied_tx",
        "processed_events",
        "consumer_sequences",
    ] {
        assert_eq!(
            setup.db.count(table).await,
            0,
            "{table}: nothing of the open batch is visible"
        );
    }

    // The crash: the process goes away with its connections.
    first.stop().await;
    pool.close().await;
    for table in ["applied", "processed_events", "consumer_sequences"] {
        assert_eq!(setup.db.count(table).await, 0, "{table}: nothing committed");
    }

    fail::remove(failpoints::BATCH_BEFORE_COMMIT);
    let second_handler = Tracked::default();
    let second = Running::spawn(
        Consumer::new(config, setup.db.pool.clone(), second_handler.clone()).unwrap(),
        intake(Duration::from_secs(2)),
    );
    setup
        .wait_count("SELECT count(*) FROM processed_events", events.len() as i64)
        .await;
    second.stop().await;
    let applied = setup.applied().await;
    assert_applied_once_in_order(&applied, events.len());
    assert!(
        second_handler.calls().values().all(|n| *n == 1),
        "after the crash every event applied once"
    );
}
