//! Poison events against the real `handoff relay`, PostgreSQL and nats-server (design P8): a
//! stream whose message size limit refuses some events makes the relay hold them; their
//! aggregates wait while every other aggregate is published; `handoff quarantine retry`,
//! `repair` and `skip` each resume their aggregate in order, and the audit records each.
//! `handoff status` reports the held event and exits 2 while it is held.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use crate::common::{handoff, migrated, stderr, stdout_json, RelayProcess, Target};
use async_nats::jetstream::{self, stream};
use handoff_core::Limits;
use handoff_postgres::{Outbox, OutboxConfig};
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop, StoredMessage,
};
use handoff_test::{eventually, factory, TestDb};
use serde_json::Value;
use uuid::Uuid;

/// The stream's message size limit: the poison events are bigger, the others far smaller.
const STREAM_MAX_MESSAGE: i32 = 4096;

async fn event_id(db: &TestDb, aggregate: &str, sequence: i64) -> Uuid {
    sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE aggregate_id = $1 AND aggregate_sequence = $2",
    )
    .bind(aggregate)
    .bind(sequence)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Unpublished events per aggregate.
async fn unpublished(db: &TestDb) -> HashMap<String, Vec<i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT aggregate_id, aggregate_sequence FROM outbox WHERE published_at IS NULL
         ORDER BY aggregate_id, aggregate_sequence",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut by_aggregate: HashMap<String, Vec<i64>> = HashMap::new();
    for (aggregate, sequence) in rows {
        by_aggregate.entry(aggregate).or_default().push(sequence);
    }
    by_aggregate
}

/// Waits (at most 30 s) until `condition` holds, showing the relay's log on a timeout.
async fn wait_until(what: &str, relay: &RelayProcess, mut condition: impl AsyncFnMut() -> bool) {
    eventually(what, Duration::from_secs(30), async || {
        relay.log_unless(condition().await)
    })
    .await;
}

/// The stream's messages of one aggregate, in stream order.
fn of_aggregate<'a>(messages: &'a [StoredMessage], aggregate: &str) -> Vec<&'a StoredMessage> {
    messages
        .iter()
        .filter(|m| m.header("Handoff-Aggregate-Id") == Some(aggregate))
        .collect()
}

fn sequences(messages: &[&StoredMessage]) -> Vec<i64> {
    messages
        .iter()
        .map(|m| m.header("Handoff-Sequence").unwrap().parse().unwrap())
        .collect()
}

#[tokio::test]
async fn a_poison_event_holds_its_aggregate_only_and_each_operator_action_resumes_it_in_order() {
    let (db, _) = migrated("quarantine_actions").await;
    // The application accepts payloads the stream will refuse: the poison.
    let outbox = Outbox::new(
        OutboxConfig {
            limits: Limits::default(),
            ..OutboxConfig::default()
        },
        factory::catalog(),
    )
    .unwrap();
    let client = prepare_shared_server().await;
    let name = unique_name("quarantine");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &name);
    let js = jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        max_message_size: STREAM_MAX_MESSAGE,
        ..Default::default()
    })
    .await
    .unwrap();

    // Three poisoned aggregates (sequence 2 too big), and 25 healthy ones.
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(8 * 1024));
    let poisoned = ["p-retry", "p-repair", "p-skip"];
    for aggregate in poisoned {
        let mut tx = db.pool.begin().await.unwrap();
        let events = [
            factory::event(aggregate, 1),
            handoff_core::NewEvent::new(
                factory::AGGREGATE_TYPE,
                aggregate,
                factory::EVENT_TYPE,
                1,
                big.clone(),
            ),
            factory::event(aggregate, 3),
            factory::event(aggregate, 4),
        ];
        outbox.enqueue(&mut tx, &events).await.unwrap();
        tx.commit().await.unwrap();
    }
    let healthy: Vec<String> = (0..25).map(|i| format!("h-{i}")).collect();
    for aggregate in &healthy {
        let mut tx = db.pool.begin().await.unwrap();
        let events = [factory::event(aggregate, 1), factory::event(aggregate, 2)];
        outbox.enqueue(&mut tx, &events).await.unwrap();
        tx.commit().await.unwrap();
    }

    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: name.clone(),
        prefix: name.clone(),
    };
    let mut relay = RelayProcess::start(&target, "quarantine-relay", &[], &[]);

    // Every healthy aggregate is published, each poisoned one stops at its sequence 2.
    let held_back: HashMap<String, Vec<i64>> = poisoned
        .iter()
        .map(|a| (a.to_string(), vec![2, 3, 4]))
        .collect();
    wait_until(
        "only the poisoned aggregates' events 2-4 are left",
        &relay,
        || async { unpublished(&db).await == held_back },
    )
    .await;
    // The healthy aggregates can all be out before the relay has claimed (and so refused and
    // held) the last poison event: wait for the hold itself, and that nothing else moved.
    wait_until("each poison event is held", &relay, || async {
        let quarantined: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox
             WHERE available_at = 'infinity' AND quarantined_at IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        quarantined == 3
    })
    .await;
    assert_eq!(unpublished(&db).await, held_back);
    // The relay keeps going: a later event of another aggregate still goes out, while the held
    // aggregates' events 3 and 4 stay put.
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("h-late", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    wait_until("a later healthy event is published", &relay, || async {
        !unpublished(&db).await.contains_key("h-late")
    })
    .await;
    assert_eq!(
        unpublished(&db).await,
        held_back,
        "nothing published past a held event"
    );

    // status: held events and an alert.
    let status = handoff(&db, &["status", "--json"]);
    assert_eq!(
        status.status.code(),
        Some(2),
        "status alerts: {}",
        stderr(&status)
    );
    let report = stdout_json(&status);
    assert_eq!(report["pending"], 9);
    assert_eq!(report["quarantined"], 3);
    assert!(report["oldest_pending_age_seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(report["healthy"], false);

    // list: the three, with the contract fields.
    let list = handoff(&db, &["quarantine", "list", "--json"]);
    assert!(list.status.success(), "{}", stderr(&list));
    let list = stdout_json(&list);
    let listed: HashMap<String, &Value> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["aggregate_id"].as_str().unwrap().to_owned(), e))
        .collect();
    assert_eq!(listed.len(), 3);
    for aggregate in poisoned {
        let entry = listed[aggregate];
        assert_eq!(entry["aggregate_type"], factory::AGGREGATE_TYPE);
        assert_eq!(entry["aggregate_sequence"], 2);
        assert_eq!(entry["held_behind"], 2);
        assert_eq!(
            entry["event_id"].as_str().unwrap(),
            event_id(&db, aggregate, 2).await.to_string()
        );
        assert!(
            !entry["reason"].as_str().unwrap().is_empty(),
            "a reason: {entry}"
        );
    }

    // Refusals change nothing.
    let unknown = Uuid::now_v7().to_string();
    let out = handoff(&db, &["quarantine", "retry", &unknown]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no event"), "{}", stderr(&out));
    let skip_id = event_id(&db, "p-skip", 2).await.to_string();
    let out = handoff(&db, &["quarantine", "skip", &skip_id]);
    assert!(!out.status.success(), "skip without --reason is refused");
    assert!(stderr(&out).contains("--reason"), "{}", stderr(&out));
    let healthy_id = event_id(&db, "h-1", 1).await.to_string();
    let out = handoff(&db, &["quarantine", "retry", &healthy_id]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("published, not quarantined"),
        "{}",
        stderr(&out)
    );
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, r#"{"n": 2"#).unwrap();
    let repair_id = event_id(&db, "p-repair", 2).await.to_string();
    let out = handoff(
        &db,
        &[
            "quarantine",
            "repair",
            &repair_id,
            "--payload-file",
            broken.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("refused"), "{}", stderr(&out));
    assert_eq!(db.count("outbox_quarantine_actions").await, 0);
    assert_eq!(unpublished(&db).await, held_back);

    // repair: a payload the stream takes.
    let fixed = dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"n": 2, "repaired": true}"#).unwrap();
    let out = handoff(
        &db,
        &[
            "quarantine",
            "repair",
            &repair_id,
            "--payload-file",
            fixed.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // skip: a marker in its place.
    let out = handoff(
        &db,
        &[
            "quarantine",
            "skip",
            &skip_id,
            "--reason",
            "blob is corrupt, order re-sent",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    wait_until(
        "the repaired and skipped aggregates drain",
        &relay,
        || async {
            let left = unpublished(&db).await;
            left.len() == 1 && left.get("p-retry") == Some(&vec![2, 3, 4])
        },
    )
    .await;

    // retry, once the cause is fixed: the stream takes bigger messages now.
    js.update_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        max_message_size: 64 * 1024,
        ..Default::default()
    })
    .await
    .unwrap();
    let retry_id = event_id(&db, "p-retry", 2).await.to_string();
    let out = handoff(&db, &["quarantine", "retry", &retry_id]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_until("everything is published", &relay, || async {
        unpublished(&db).await.is_empty()
    })
    .await;
    assert!(relay.terminate().success(), "{}", relay.log());

    // Each aggregate reached the stream in order, and the held ones resumed at sequence 2.
    let messages = read_stream(&client, &name).await;
    for aggregate in poisoned {
        let copies = of_aggregate(&messages, aggregate);
        assert_eq!(
            sequences(&copies),
            [1, 2, 3, 4],
            "{aggregate} in order, once each"
        );
    }
    for aggregate in &healthy {
        assert_eq!(sequences(&of_aggregate(&messages, aggregate)), [1, 2]);
    }
    let repaired = of_aggregate(&messages, "p-repair")[1];
    let body: Value = serde_json::from_slice(&repaired.payload).unwrap();
    assert_eq!(body, serde_json::json!({"n": 2, "repaired": true}));
    let marker = of_aggregate(&messages, "p-skip")[1];
    assert_eq!(marker.payload, b"null");
    assert_eq!(
        marker.header("Handoff-Skipped"),
        Some("blob is corrupt, order re-sent")
    );
    assert_eq!(marker.header("ce-id"), Some(skip_id.as_str()));
    let retried = of_aggregate(&messages, "p-retry")[1];
    let retried: Value = serde_json::from_slice(&retried.payload).unwrap();
    assert!(
        retried == serde_json::from_str::<Value>(&big).unwrap(),
        "the retried event goes out with its original payload"
    );

    // The audit: one row per action, with who, what, before and after.
    let audit: Vec<(Uuid, String, String, Option<String>, Value, Value)> = sqlx::query_as(
        "SELECT event_id, action, actor, reason, before, after FROM outbox_quarantine_actions
         ORDER BY action_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let actions: Vec<(String, String)> = audit
        .iter()
        .map(|(id, action, ..)| (id.to_string(), action.clone()))
        .collect();
    assert_eq!(
        actions,
        [
            (repair_id.clone(), "repair".to_owned()),
            (skip_id.clone(), "skip".to_owned()),
            (retry_id.clone(), "retry".to_owned()),
        ]
    );
    for (_, _, actor, _, before, after) in &audit {
        assert_eq!(actor, "test-operator");
        assert_eq!(before["available_at"], "infinity");
        assert!(before["quarantined_at"].is_string());
        assert!(after["quarantined_at"].is_null());
        assert_eq!(after["attempt_count"], 0);
    }
    assert_eq!(
        audit[0].4["payload"]["blob"].as_str().map(str::len),
        Some(8 * 1024)
    );
    assert_eq!(
        audit[0].5["payload"],
        serde_json::json!({"n": 2, "repaired": true})
    );
    assert_eq!(
        audit[1].3.as_deref(),
        Some("blob is corrupt, order re-sent")
    );

    // show: the event's state and its audit.
    let show = handoff(&db, &["quarantine", "show", &skip_id, "--json"]);
    assert!(show.status.success(), "{}", stderr(&show));
    let shown = stdout_json(&show);
    assert_eq!(shown["state"], "published");
    // The stream's answer is kept with the event: its stream and sequence.
    let receipt = shown["delivery_receipt"].as_str().unwrap_or_default();
    assert!(receipt.starts_with("jetstream "), "receipt {receipt:?}");
    assert_eq!(shown["skip_reason"], "blob is corrupt, order re-sent");
    assert_eq!(shown["actions"][0]["action"], "skip");
    assert_eq!(shown["actions"][0]["actor"], "test-operator");
    let text = handoff(&db, &["quarantine", "show", &skip_id]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("skip by test-operator"));

    // And the outbox is healthy again.
    let status = handoff(&db, &["status", "--json"]);
    assert_eq!(
        status.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&status.stdout)
    );
    let report = stdout_json(&status);
    assert_eq!(report["pending"], 0);
    assert_eq!(report["quarantined"], 0);
}

#[tokio::test]
async fn a_hole_behind_a_held_event_is_not_overtaken_and_a_skip_of_the_missing_sequence_releases_it(
) {
    let (db, outbox) = migrated("quarantine_hole").await;
    let client = prepare_shared_server().await;
    let name = unique_name("quarantine_hole");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &name);
    let js = jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        max_message_size: STREAM_MAX_MESSAGE,
        ..Default::default()
    })
    .await
    .unwrap();

    // a#1 is too big for the stream: the relay holds it. An outside writer then inserts a#3
    // with a plain INSERT; a#2 is never written. b flows beside it.
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(8 * 1024));
    let mut tx = db.pool.begin().await.unwrap();
    let poison =
        handoff_core::NewEvent::new(factory::AGGREGATE_TYPE, "a", factory::EVENT_TYPE, 1, big);
    outbox
        .enqueue_versioned(&mut tx, 1, &[poison])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: name.clone(),
        prefix: name.clone(),
    };
    let mut relay = RelayProcess::start(&target, "hole-relay", &[], &[]);
    wait_until("a#1 is held", &relay, || async {
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox WHERE available_at = 'infinity'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        held == 1
    })
    .await;
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         VALUES ($1, $2, 'a', 3, $3, 1, '{\"n\": 3}')",
    )
    .bind(Uuid::now_v7())
    .bind(factory::AGGREGATE_TYPE)
    .bind(factory::EVENT_TYPE)
    .execute(&db.pool)
    .await
    .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("b", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    wait_until("b#1 is published", &relay, || async {
        !unpublished(&db).await.contains_key("b")
    })
    .await;
    assert_eq!(
        unpublished(&db).await,
        HashMap::from([("a".to_owned(), vec![1, 3])]),
        "a#3 overtook the held a#1"
    );

    // status: the hole, in the JSON and the text, with an alert.
    let status = handoff(&db, &["status", "--json"]);
    assert_eq!(status.status.code(), Some(2), "{}", stderr(&status));
    let report = stdout_json(&status);
    assert_eq!(report["holes"], 1);
    assert!(
        report["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["name"] == "order_holes"),
        "{report}"
    );
    let text = handoff(&db, &["status"]);
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("holes                1"),
        "{}",
        String::from_utf8_lossy(&text.stdout)
    );

    // Skip the missing a#2 by its place (a sequence that is not a hole is refused), then the
    // held a#1.
    let skip_missing = |sequence: &'static str| {
        handoff(
            &db,
            &[
                "quarantine",
                "skip",
                "--aggregate-type",
                factory::AGGREGATE_TYPE,
                "--aggregate-id",
                "a",
                "--sequence",
                sequence,
                "--reason",
                "never written",
            ],
        )
    };
    let out = skip_missing("3");
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not a hole"), "{}", stderr(&out));
    let out = skip_missing("2");
    assert!(out.status.success(), "{}", stderr(&out));
    let report = stdout_json(&handoff(&db, &["status", "--json"]));
    assert_eq!(report["holes"], 0);
    let held_id = event_id(&db, "a", 1).await.to_string();
    let out = handoff(
        &db,
        &["quarantine", "skip", &held_id, "--reason", "too big"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    wait_until("a drains", &relay, || async {
        unpublished(&db).await.is_empty()
    })
    .await;
    assert!(relay.terminate().success(), "{}", relay.log());

    let messages = read_stream(&client, &name).await;
    let a = of_aggregate(&messages, "a");
    assert_eq!(sequences(&a), [1, 2, 3], "a in order, once each");
    assert_eq!(a[0].header("Handoff-Skipped"), Some("too big"));
    assert_eq!(a[1].header("Handoff-Skipped"), Some("never written"));
    assert_eq!(a[1].payload, b"null");
    assert_eq!(a[2].payload, br#"{"n": 3}"#);
}

#[tokio::test]
async fn an_operator_holds_a_pending_event_then_skips_it_and_both_are_audited() {
    use handoff_core::delivery::Source;
    use handoff_postgres::{PollingConfig, PollingSource};

    let (db, outbox) = migrated("quarantine_operator_hold").await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut tx,
            &[
                factory::event("a", 1),
                factory::event("a", 2),
                factory::event("b", 1),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let a1 = event_id(&db, "a", 1).await;
    let id = a1.to_string();
    let hold = |event: &str, reason: &str| {
        handoff(&db, &["quarantine", "hold", event, "--reason", reason])
    };

    // Refused, and nothing written: an unknown event, a reason that is no reason.
    common::assert_refused(&hold(&Uuid::now_v7().to_string(), "stuck"), "in the outbox");
    common::assert_refused(&hold(&id, " "), "needs a reason");
    let audit = || async {
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_quarantine_actions")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        count
    };
    assert_eq!(audit().await, 0);

    let out = hold(&id, "times out at the partner's gateway");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        common::stdout(&out).contains(&format!("held {id}")),
        "{}",
        common::stdout(&out)
    );
    // Held once: a second hold is refused.
    common::assert_refused(&hold(&id, "again"), "is quarantined");

    // It is listed as any held event, a#2 waiting behind it.
    let listed = stdout_json(&handoff(&db, &["quarantine", "list", "--json"]));
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["event_id"], id);
    assert_eq!(listed[0]["hold_reason"], "operator");
    assert_eq!(listed[0]["held_behind"], 1);

    // A relay's claim takes b#1 only: a#1 is held and a#2 waits behind it.
    let relay = PollingSource::new(
        db.pool.clone(),
        PollingConfig {
            relay_id: "hold-relay".into(),
            ..PollingConfig::default()
        },
    )
    .unwrap();
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    let claimed: Vec<_> = claim
        .events
        .iter()
        .map(|e| (e.aggregate_id.as_str(), e.aggregate_sequence))
        .collect();
    assert_eq!(claimed, [("b", 1)]);
    // Leased by a relay right now: refused. Published: refused.
    let b1 = event_id(&db, "b", 1).await.to_string();
    common::assert_refused(&hold(&b1, "stuck"), "is leased");
    let acks: Vec<_> = claim
        .events
        .iter()
        .map(|e| handoff_core::delivery::Published {
            event_id: e.event_id,
            receipt: handoff_core::delivery::Receipt::new("test ack"),
            lease: claim.lease,
        })
        .collect();
    relay.mark_published(&acks).await.unwrap();
    common::assert_refused(&hold(&b1, "stuck"), "is published");
    assert_eq!(audit().await, 1, "only the hold was recorded");

    // Skip works on it as on any held event; the relay then takes it (a skip marker).
    let out = handoff(
        &db,
        &["quarantine", "skip", &id, "--reason", "cancelled by phone"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let listed = stdout_json(&handoff(&db, &["quarantine", "list", "--json"]));
    assert_eq!(listed.as_array().unwrap().len(), 0, "{listed}");
    let claim = relay.claim(100, usize::MAX).await.unwrap();
    assert!(
        claim.events.iter().any(|e| e.event_id == a1),
        "{:?}",
        claim.events
    );

    // The audit: the hold, then the skip, each with the actor and the reason.
    let shown = stdout_json(&handoff(&db, &["quarantine", "show", &id, "--json"]));
    let actions = shown["actions"].as_array().unwrap();
    assert_eq!(actions.len(), 2, "{shown}");
    assert_eq!(actions[0]["action"], "hold");
    assert_eq!(actions[0]["actor"], "test-operator");
    assert_eq!(actions[0]["reason"], "times out at the partner's gateway");
    assert_eq!(actions[0]["before"]["hold_reason"], Value::Null);
    assert_eq!(actions[0]["after"]["hold_reason"], "operator");
    assert_eq!(actions[0]["after"]["available_at"], "infinity");
    assert_eq!(actions[1]["action"], "skip");
    assert_eq!(actions[1]["actor"], "test-operator");
    assert_eq!(actions[1]["reason"], "cancelled by phone");
    assert_eq!(actions[1]["before"]["hold_reason"], "operator");
    assert_eq!(actions[1]["after"]["skip_reason"], "cancelled by phone");
}
