//! One bound for every failure (issue 24): each hostile message class published straight into
//! the stream ends in `consumer_quarantine` within the configured delivery cap, with its reason
//! kind and the raw message, while other aggregates keep flowing and nothing stays pending on
//! the durable consumer; the durable's `max_deliver` is the backstop above the cap.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{event, Running, Setup, WAIT};
use async_nats::HeaderMap;
use handoff_consumer::{Consumer, ConsumerConfig, Handler, HandlerError};
use handoff_core::contract::{self, header};
use handoff_core::delivery::{OutboxEvent, Transport};
use handoff_core::intake::{broker_backstop, Delivery, Intake, IntakeError, ReceivedEvent};
use handoff_nats::{IntakeConfig, JetStreamIntake};
use handoff_test::eventually;
use handoff_test::inbox;
use handoff_test::nats::shared_url;
use sqlx::PgConnection;

const CAP: u64 = 3;

/// Applies like the reference consumers: refuses a body that is not JSON and a schema version
/// it does not know (permanently); panics on aggregate `panics` and never returns on `hangs`.
struct Hostile;

impl Handler for Hostile {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        match event.aggregate_id.as_str() {
            "panics" => panic!("injected: the handler cannot cope with {}", event.event_id),
            "hangs" => std::future::pending::<()>().await,
            // A write that breaks a deferred constraint: every commit fails.
            "deferred" => {
                sqlx::query("INSERT INTO child (parent_id) VALUES (42)")
                    .execute(&mut *tx)
                    .await?;
            }
            _ => {}
        }
        if serde_json::from_str::<serde_json::Value>(&event.payload).is_err() {
            return Err(HandlerError::permanent("the body is not JSON"));
        }
        if event.schema_version != 1 {
            return Err(HandlerError::permanent(format!(
                "unknown schema version {}",
                event.schema_version
            )));
        }
        inbox::record(tx, event).await
    }
}

/// The relay's headers for `event`, with `change` applied to them.
fn headers_with(event: &OutboxEvent, change: impl FnOnce(&mut Vec<(String, String)>)) -> HeaderMap {
    let mut pairs = contract::headers(event, "hostile").unwrap();
    change(&mut pairs);
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(name.as_str(), value.as_str());
    }
    map
}

fn set(pairs: &mut [(String, String)], name: &str, value: &str) {
    let (_, v) = pairs.iter_mut().find(|(n, _)| n == name).unwrap();
    *v = value.to_owned();
}

type Row = (Option<uuid::Uuid>, String, String, i64, String);

#[tokio::test]
async fn every_hostile_message_is_quarantined_within_the_cap_while_others_flow() {
    let setup = Setup::new("bounded_hostile").await;
    let subject = |id: &str| format!("{}.order.{id}", setup.stream);

    // (ce-id, expected reason kind, a piece of the expected reason)
    let mut expected: Vec<(uuid::Uuid, &str, &str)> = Vec::new();

    let nul = event("ignored", 1);
    let headers = headers_with(&nul, |h| set(h, header::AGGREGATE_ID, "a%00b"));
    setup
        .publish_raw(&subject("a%00b"), headers, nul.payload.clone())
        .await;
    expected.push((
        nul.event_id,
        "malformed",
        "Handoff-Aggregate-Id holds a NUL byte",
    ));

    let not_uuid = event("not-uuid", 1);
    let headers = headers_with(&not_uuid, |h| set(h, header::CE_ID, "order-1"));
    setup
        .publish_raw(&subject("not-uuid"), headers, "{}".into())
        .await;

    let not_json = event("not-json", 1);
    let headers = headers_with(&not_json, |_| {});
    setup
        .publish_raw(&subject("not-json"), headers, "{not json".into())
        .await;
    expected.push((
        not_json.event_id,
        "handler_permanent",
        "the body is not JSON",
    ));

    let overflow = event("overflow", 1);
    let headers = headers_with(&overflow, |h| {
        set(h, header::SEQUENCE, "9223372036854775808")
    });
    setup
        .publish_raw(&subject("overflow"), headers, "{}".into())
        .await;
    expected.push((
        overflow.event_id,
        "malformed",
        "Handoff-Sequence is not a positive",
    ));

    let mut unknown_version = event("unknown-version", 1);
    unknown_version.schema_version = 99;
    setup.publish(&unknown_version).await;
    expected.push((
        unknown_version.event_id,
        "handler_permanent",
        "unknown schema version 99",
    ));

    let panics = event("panics", 1);
    setup.publish(&panics).await;
    expected.push((
        panics.event_id,
        "handler_panic",
        "the handler panicked: injected",
    ));

    let hangs = event("hangs", 1);
    setup.publish(&hangs).await;
    expected.push((
        hangs.event_id,
        "apply_timeout",
        "longer than the apply timeout",
    ));

    // Healthy aggregates, before, between and after the poison, and a second event of one.
    let fine: Vec<OutboxEvent> = (0..6).map(|n| event(&format!("fine-{n}"), 1)).collect();
    for e in &fine {
        setup.publish(e).await;
    }
    let config = ConsumerConfig {
        max_deliveries: CAP,
        apply_timeout: Duration::from_millis(700),
        ..setup.config("hostile")
    };
    let running = setup.start(config, Hostile).await;
    setup
        .wait_count("SELECT count(*) FROM applied", fine.len() as i64)
        .await;
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 7)
        .await;

    // Nothing left with the broker: every message settled (acknowledged or terminated).
    let context = async_nats::jetstream::new(setup.transport.client().clone());
    let stream = context.get_stream(&setup.stream).await.unwrap();
    let durable: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer("hostile").await.unwrap();
    eventually("the durable to hold nothing", WAIT, || {
        let mut durable = durable.clone();
        async move {
            let info = durable.info().await.unwrap();
            info.num_pending == 0 && info.num_ack_pending == 0
        }
    })
    .await;
    let mut durable = durable;
    let info = durable.info().await.unwrap();
    assert_eq!(
        info.config.max_deliver,
        broker_backstop(CAP) as i64,
        "the broker's limit is the backstop above the cap"
    );
    running.stop().await;

    let rows: Vec<Row> = sqlx::query_as(
        "SELECT event_id, reason_kind, reason, deliveries, payload FROM consumer_quarantine \
         ORDER BY quarantine_id",
    )
    .fetch_all(&setup.db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 7, "{rows:#?}");
    for (event_id, kind, fragment) in &expected {
        let row = rows
            .iter()
            .find(|r| r.0 == Some(*event_id))
            .unwrap_or_else(|| panic!("{kind} not quarantined: {rows:#?}"));
        assert_eq!(row.1, *kind, "{row:?}");
        assert!(row.2.contains(fragment), "{row:?}");
        assert!(row.3 as u64 <= CAP, "quarantined within the cap: {row:?}");
    }
    let no_id = rows
        .iter()
        .find(|r| r.0.is_none())
        .expect("the non-UUID ce-id");
    assert_eq!(no_id.1, "malformed");
    assert!(no_id.2.contains("is not a UUID"), "{no_id:?}");
    // The failures that may pass on another delivery were tried up to the cap.
    for kind in ["handler_panic", "apply_timeout"] {
        let row = rows.iter().find(|r| r.1 == kind).unwrap();
        assert_eq!(row.3 as u64, CAP, "{row:?}");
    }
    // The raw message is kept.
    let raw = rows
        .iter()
        .find(|r| r.0 == Some(not_json.event_id))
        .unwrap();
    assert_eq!(raw.4, "{not json");
    let headers: serde_json::Value =
        sqlx::query_scalar("SELECT headers FROM consumer_quarantine WHERE event_id = $1")
            .bind(nul.event_id)
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(headers[header::AGGREGATE_ID], "a%00b");

    let applied = setup.applied().await;
    assert_eq!(applied.len(), fine.len(), "{applied:?}");
    for e in &fine {
        assert!(applied.iter().any(|(id, _, _)| *id == e.event_id), "{e:?}");
    }
}

#[tokio::test]
async fn the_broker_backstop_follows_the_consumer_cap() {
    let setup = Setup::new("bounded_backstop").await;
    setup.transport.publish(&event("o-1", 1)).await.unwrap();
    let config = ConsumerConfig {
        max_deliveries: 25,
        ..setup.config("backstop")
    };
    let running = setup.start(config, Hostile).await;
    setup.wait_count("SELECT count(*) FROM applied", 1).await;
    let context = async_nats::jetstream::new(setup.transport.client().clone());
    let stream = context.get_stream(&setup.stream).await.unwrap();
    let mut durable: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer("backstop").await.unwrap();
    assert_eq!(durable.info().await.unwrap().config.max_deliver, 50);
    running.stop().await;
}

#[tokio::test]
async fn a_commit_that_always_fails_is_quarantined_as_database_at_the_cap() {
    let setup = Setup::new("bounded_database").await;
    sqlx::raw_sql(
        "CREATE TABLE parent (id int PRIMARY KEY); \
         CREATE TABLE child (parent_id int REFERENCES parent DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(&setup.db.pool)
    .await
    .unwrap();
    let poison = event("deferred", 1);
    setup.publish(&poison).await;
    let other = event("other", 1);
    setup.publish(&other).await;
    let config = ConsumerConfig {
        max_deliveries: CAP,
        ..setup.config("database")
    };
    let running = setup.start(config, Hostile).await;
    setup
        .wait_count("SELECT count(*) FROM consumer_quarantine", 1)
        .await;
    setup.wait_count("SELECT count(*) FROM applied", 1).await;
    running.stop().await;
    let (event_id, kind, reason, deliveries): (uuid::Uuid, String, String, i64) =
        sqlx::query_as("SELECT event_id, reason_kind, reason, deliveries FROM consumer_quarantine")
            .fetch_one(&setup.db.pool)
            .await
            .unwrap();
    assert_eq!(event_id, poison.event_id);
    assert_eq!(kind, "database");
    assert!(reason.contains("commit failed"), "{reason}");
    assert_eq!(deliveries as u64, CAP);
    let applied = setup.applied().await;
    assert!(
        applied.iter().any(|(id, _, _)| *id == other.event_id),
        "{applied:?}"
    );
}

/// An intake that counts the deliveries the consumer took from it.
struct Counted<I> {
    inner: I,
    taken: Arc<AtomicUsize>,
}

impl<I: Intake> Intake for Counted<I> {
    type Settle = I::Settle;

    async fn next(&mut self) -> Result<Delivery<I::Settle>, IntakeError> {
        let delivery = self.inner.next().await?;
        self.taken.fetch_add(1, Ordering::SeqCst);
        Ok(delivery)
    }
}

/// Records each event once the test opens its gate; counts the handlers waiting at it.
struct Gated {
    gate: Arc<tokio::sync::RwLock<()>>,
    entered: Arc<AtomicUsize>,
}

impl Handler for Gated {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let _open = self.gate.read().await;
        inbox::record(tx, event).await
    }
}

#[tokio::test]
async fn a_consumer_of_large_events_takes_no_more_than_its_byte_bound() {
    const EVENTS: usize = 60;
    const EVENT_BYTES: usize = 200 * 1024;
    const BOUND: usize = 1 << 20;
    let setup = Setup::new("bounded_bytes").await;
    for n in 0..EVENTS {
        let mut large = event(&format!("doc-{n}"), 1);
        large.payload = format!(r#"{{"pad":"{}"}}"#, "x".repeat(EVENT_BYTES));
        setup.publish(&large).await;
    }
    let gate = Arc::new(tokio::sync::RwLock::new(()));
    let closed = gate.clone().write_owned().await;
    let entered = Arc::new(AtomicUsize::new(0));
    let taken = Arc::new(AtomicUsize::new(0));
    let config = ConsumerConfig {
        max_concurrency: 2,
        max_in_flight_bytes: BOUND,
        // Two handlers at once, one event each: the per-event path (batch mode runs a batch's
        // handlers one after the other, and is bounded by the same bytes).
        batch: None,
        ..setup.config("bounded_bytes")
    };
    let intake = JetStreamIntake::connect(
        &shared_url(),
        IntakeConfig {
            stream: setup.stream.clone(),
            subject_prefix: setup.stream.clone(),
            durable_name: config.name.clone(),
            ..IntakeConfig::default()
        },
    )
    .await
    .unwrap();
    let handler = Gated {
        gate: gate.clone(),
        entered: entered.clone(),
    };
    let consumer = Consumer::new(config, setup.db.pool.clone(), handler).unwrap();
    let running = Running::spawn(
        consumer,
        std::future::ready(Counted {
            inner: intake,
            taken: taken.clone(),
        }),
    );

    // Both permits taken, their handlers waiting at the gate: the rest of what the consumer
    // took waits in the lanes. Unbounded, it would take every message of the stream at once
    // (1000 may be unacknowledged); bounded, the bytes of what it took stop it.
    eventually("two handlers at the gate", WAIT, async || {
        let n = entered.load(Ordering::SeqCst);
        if n >= 2 {
            Ok(())
        } else {
            Err(n)
        }
    })
    .await;
    // The negative needs a window: anything the consumer would take, it takes from a local
    // server within it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let most = BOUND / EVENT_BYTES + 1;
    let held = taken.load(Ordering::SeqCst);
    assert!(
        held <= most,
        "took {held} deliveries of {EVENT_BYTES} bytes under a bound of {BOUND} (at most {most})"
    );

    drop(closed);
    setup
        .wait_count("SELECT count(*) FROM applied", EVENTS as i64)
        .await;
    running.stop().await;
    inbox::assert_applied_once_in_order(&setup.applied().await, EVENTS);
}
