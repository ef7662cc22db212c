//! `handoff replay` as a real process against the real PostgreSQL and nats-server (design O3):
//! a replayed time range reaches a consumer again and its inbox applies nothing twice; bad
//! requests are refused with nothing published; skip markers replay as the relay sent them.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{enqueue_spread, migrated, wait_drained, RelayProcess};
use crate::ops::{db_now, handoff, Broker};
use handoff_consumer::{Consumer, ConsumerConfig, Handler, HandlerError};
use handoff_core::intake::{Delivery, Intake, IntakeError, ReceivedEvent};
use handoff_nats::{IntakeConfig, JetStreamIntake, JetStreamSettle, REPLAY};
use handoff_test::eventually;
use handoff_test::nats::read_stream;
use sqlx::PgConnection;
use uuid::Uuid;

/// Every delivery the consumer got: (event id, `Handoff-Replay` value).
type Deliveries = Arc<Mutex<Vec<(Uuid, Option<String>)>>>;

/// The JetStream intake, recording each delivery before the consumer sees it (the inbox then
/// decides whether it applies).
struct RecordingIntake {
    inner: JetStreamIntake,
    seen: Deliveries,
}

impl Intake for RecordingIntake {
    type Settle = JetStreamSettle;

    async fn next(&mut self) -> Result<Delivery<JetStreamSettle>, IntakeError> {
        let delivery = self.inner.next().await?;
        if let Ok(event) = &delivery.event {
            let replay = event.header(REPLAY).map(str::to_owned);
            assert_eq!(
                event.replayed,
                replay.is_some(),
                "replayed flag follows the header"
            );
            self.seen.lock().unwrap().push((event.event_id, replay));
        }
        Ok(delivery)
    }
}

/// The business effect: one `applied` row per application.
struct Apply;

impl Handler for Apply {
    async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO applied (event_id) VALUES ($1)")
            .bind(e.event_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

async fn ids_between(pool: &sqlx::PgPool, since: &str, until: &str) -> HashSet<Uuid> {
    sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE occurred_at >= $1::timestamptz \
         AND occurred_at <= $2::timestamptz",
    )
    .bind(since)
    .bind(until)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

#[tokio::test]
async fn a_replayed_time_range_reaches_the_consumer_again_and_applies_nothing_twice() {
    let (db, outbox) = migrated("replay_range").await;
    let broker = Broker::new(&db, "replay_range").await;
    sqlx::raw_sql("CREATE TABLE applied (n bigserial PRIMARY KEY, event_id uuid NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();

    // Three batches; the middle one is the range replayed.
    enqueue_spread(&db.pool, &outbox, 0, 6, 3).await;
    let since = db_now(&db.pool).await;
    enqueue_spread(&db.pool, &outbox, 6, 9, 3).await;
    let until = db_now(&db.pool).await;
    enqueue_spread(&db.pool, &outbox, 15, 6, 3).await;
    let range = ids_between(&db.pool, &since, &until).await;
    assert_eq!(range.len(), 9);

    let mut relay = RelayProcess::start(&broker.target, "replay-relay", &[], &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    assert!(relay.terminate().success(), "{}", relay.log());

    let seen: Deliveries = Arc::default();
    let intake = JetStreamIntake::connect(
        &broker.target.nats_url,
        IntakeConfig {
            stream: broker.target.stream.clone(),
            subject_prefix: broker.target.prefix.clone(),
            durable_name: "replay_consumer".into(),
            ..IntakeConfig::default()
        },
    )
    .await
    .unwrap();
    let intake = RecordingIntake {
        inner: intake,
        seen: seen.clone(),
    };
    let config = ConsumerConfig {
        name: "replay_consumer".into(),
        ..ConsumerConfig::default()
    };
    let consumer = Consumer::new(config, db.pool.clone(), Apply).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        consumer
            .run(intake, async {
                let _ = stopped.await;
            })
            .await;
    });
    eventually(
        "the first 21 deliveries",
        Duration::from_secs(30),
        async || seen.lock().unwrap().len() >= 21,
    )
    .await;
    eventually(
        "the 21 events applied",
        Duration::from_secs(30),
        async || db.count("applied").await >= 21,
    )
    .await;

    let run = handoff(
        &broker.target,
        "replay",
        &["--since", &since, "--until", &until, "--json"],
    )
    .await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let summary = run.json();
    assert_eq!(summary["matched"], 9, "{summary}");
    assert_eq!(summary["published"], 9, "{summary}");
    let replay_id = summary["replay_id"].as_str().unwrap().to_owned();
    assert!(Uuid::parse_str(&replay_id).is_ok_and(|id| id.get_version_num() == 7));

    eventually(
        "the 9 replayed deliveries",
        Duration::from_secs(30),
        async || seen.lock().unwrap().len() >= 30,
    )
    .await;
    // Stopping lets the deliveries in hand settle; whatever the inbox did with the copies,
    // the effect must still be one row per event.
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("consumer stopped")
        .unwrap();

    let seen = seen.lock().unwrap().clone();
    let replayed: Vec<_> = seen.iter().filter(|(_, r)| r.is_some()).collect();
    assert_eq!(replayed.len(), 9, "{seen:?}");
    assert_eq!(
        replayed.iter().map(|(id, _)| *id).collect::<HashSet<_>>(),
        range,
        "exactly the range came again"
    );
    assert!(replayed
        .iter()
        .all(|(_, r)| r.as_deref() == Some(replay_id.as_str())));

    let applied: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM applied")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(applied.len(), 21, "one effect per event, replay included");
    assert_eq!(applied.iter().collect::<HashSet<_>>().len(), 21);
    let duplicates = seen.len() - applied.len();
    assert_eq!(duplicates, 9, "the inbox absorbed each replayed copy");

    // In the stream: 21 first publications, then the 9 copies, each aggregate in sequence
    // order, with their own Nats-Msg-Id and ce-id the event id.
    let messages = read_stream(&broker.client, &broker.target.stream).await;
    assert_eq!(messages.len(), 30);
    let mut last: HashMap<String, i64> = HashMap::new();
    for copy in &messages[21..] {
        let id = copy.header("ce-id").unwrap();
        assert_eq!(
            copy.header("Nats-Msg-Id"),
            Some(format!("{id}:replay:{replay_id}").as_str())
        );
        let sequence: i64 = copy.header("Handoff-Sequence").unwrap().parse().unwrap();
        let previous = last.insert(copy.subject.clone(), sequence).unwrap_or(0);
        assert!(sequence > previous, "{} out of order", copy.subject);
        let original = messages[..21]
            .iter()
            .find(|m| m.header("ce-id") == Some(id))
            .unwrap();
        assert_eq!(copy.subject, original.subject);
        assert_eq!(copy.payload, original.payload);
    }
}

#[tokio::test]
async fn replays_without_a_filter_or_with_bad_arguments_are_refused_and_publish_nothing() {
    let (db, outbox) = migrated("replay_refusals").await;
    let broker = Broker::new(&db, "replay_refusals").await;
    broker.ensure_stream().await;
    enqueue_spread(&db.pool, &outbox, 0, 3, 3).await;
    sqlx::query("UPDATE outbox SET published_at = now()")
        .execute(&db.pool)
        .await
        .unwrap();

    let refusals: [(&[&str], &str); 5] = [
        (&[], "no filter given"),
        (&["--json"], "no filter given"),
        (&["--aggregate-id", "agg-1"], "--aggregate-type"),
        (&["--since", "yesterday"], "neither an RFC 3339 timestamp"),
        (&["--all", "--rate", "0"], "--rate"),
    ];
    for (args, why) in refusals {
        let run = handoff(&broker.target, "replay", args).await;
        assert!(
            run.code.is_some_and(|c| c != 0),
            "{args:?} must fail: {run:?}"
        );
        assert!(run.stderr.contains(why), "{args:?}: {why:?} in {run:?}");
        assert_eq!(run.stdout, "", "{args:?}");
    }
    assert!(read_stream(&broker.client, &broker.target.stream)
        .await
        .is_empty());

    // A range that ends before it starts.
    let run = handoff(
        &broker.target,
        "replay",
        &["--since", "1m", "--until", "2h"],
    )
    .await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stderr.contains("after it ends"), "{run:?}");

    // A dry run counts and lists, and publishes nothing.
    let run = handoff(&broker.target, "replay", &["--all", "--dry-run", "--json"]).await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let summary = run.json();
    assert_eq!(
        (&summary["matched"], &summary["published"]),
        (&3.into(), &0.into())
    );
    assert_eq!(summary["events"].as_array().unwrap().len(), 3);
    assert!(read_stream(&broker.client, &broker.target.stream)
        .await
        .is_empty());

    // And --all does replay everything.
    let run = handoff(&broker.target, "replay", &["--all"]).await;
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(run.stdout.contains("3 matched, 3 published"), "{run:?}");
    assert_eq!(
        read_stream(&broker.client, &broker.target.stream)
            .await
            .len(),
        3
    );
}

#[tokio::test]
async fn a_skipped_event_is_replayed_as_the_relay_published_it_and_unpublished_rows_never() {
    let (db, outbox) = migrated("replay_skip").await;
    let broker = Broker::new(&db, "replay_skip").await;
    broker.ensure_stream().await;
    enqueue_spread(&db.pool, &outbox, 0, 3, 1).await;
    // Sequence 2 was skipped by an operator; sequence 3 is still pending.
    sqlx::query(
        "UPDATE outbox SET published_at = now(), \
         skip_reason = CASE aggregate_sequence WHEN 2 THEN 'bad payload' END \
         WHERE aggregate_sequence <= 2",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let run = handoff(
        &broker.target,
        "replay",
        &[
            "--aggregate-type",
            "thing",
            "--aggregate-id",
            "agg-0",
            "--json",
        ],
    )
    .await;
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.json()["published"], 2);
    let messages = read_stream(&broker.client, &broker.target.stream).await;
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0].header("Handoff-Sequence"), Some("1"));
    assert_eq!(messages[0].header("Handoff-Skipped"), None);
    assert_eq!(messages[0].payload, br#"{"n": 0}"#.to_vec());
    assert_eq!(messages[1].header("Handoff-Sequence"), Some("2"));
    assert_eq!(messages[1].header("Handoff-Skipped"), Some("bad payload"));
    assert_eq!(messages[1].payload, b"null".to_vec());
}
