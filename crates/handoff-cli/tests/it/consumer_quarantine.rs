//! `handoff consumer quarantine list|show|retry|skip` against real PostgreSQL, on rows written
//! the way the consumer writes them (`Inbox::quarantine`): each action changes the row and
//! writes its audit row in one transaction, refusals change nothing, and `handoff status`
//! counts the open rows per consumer and exits 2 while any is open. The consumer's side of a
//! retry (the row applied again through the inbox) runs here through
//! `handoff_consumer::apply_requested_retries`; `handoff-consumer`'s `quarantine_retry` test
//! runs it beside a live consumer over NATS.

use crate::common::{assert_refused, handoff, migrated, stderr, stdout, stdout_json};
use handoff_consumer::{apply_requested_retries, ConsumerConfig, Handler, HandlerError};
use handoff_core::intake::{MalformedEvent, ReceivedEvent};
use handoff_postgres::{Inbox, QuarantineKind, Schema};
use handoff_test::TestDb;
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

pub(crate) fn received(aggregate: &str, sequence: i64) -> ReceivedEvent {
    ReceivedEvent {
        event_id: Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate.into(),
        sequence,
        event_type: "OrderCreated".into(),
        schema_version: 1,
        payload: format!(r#"{{"n":{sequence}}}"#),
        headers: vec![
            ("ce-id".into(), "x".into()),
            ("traceparent".into(), "00-abc-01".into()),
        ],
        replayed: false,
    }
}

/// Quarantines `event` for `consumer` as the consumer loop does; returns its quarantine id.
pub(crate) async fn quarantine(
    db: &TestDb,
    consumer: &str,
    event: &ReceivedEvent,
    kind: QuarantineKind,
) -> i64 {
    let inbox = Inbox::new(Schema::default(), consumer).unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    inbox
        .quarantine(&mut conn, Ok(event), kind, "inventory service said no", 3)
        .await
        .unwrap();
    sqlx::query_scalar("SELECT quarantine_id FROM consumer_quarantine WHERE event_id = $1")
        .bind(event.event_id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn quarantine_malformed(db: &TestDb, consumer: &str) -> i64 {
    let inbox = Inbox::new(Schema::default(), consumer).unwrap();
    let malformed = MalformedEvent {
        reason: "header Handoff-Sequence is missing".into(),
        event_id: None,
        location: "orders.order.o-9".into(),
        headers: vec![("ce-type".into(), "OrderCreated".into())],
        payload: "not json\u{0}".into(),
    };
    let mut conn = db.pool.acquire().await.unwrap();
    inbox
        .quarantine(
            &mut conn,
            Err(&malformed),
            QuarantineKind::Malformed,
            &malformed.reason,
            1,
        )
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT quarantine_id FROM consumer_quarantine WHERE event_id IS NULL AND consumer_name = $1",
    )
    .bind(consumer)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn row_status(db: &TestDb, id: i64) -> (String, Option<String>) {
    sqlx::query_as("SELECT status, resolution FROM consumer_quarantine WHERE quarantine_id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn actions(db: &TestDb, id: i64) -> Vec<(String, String, Option<String>, Value, Value)> {
    sqlx::query_as::<_, (String, String, Option<String>, String, String)>(
        "SELECT action, actor, reason, before::text, after::text FROM consumer_quarantine_actions
         WHERE quarantine_id = $1 ORDER BY action_id",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(a, b, c, d, e)| {
        (
            a,
            b,
            c,
            serde_json::from_str(&d).unwrap(),
            serde_json::from_str(&e).unwrap(),
        )
    })
    .collect()
}

async fn last_sequence(db: &TestDb, consumer: &str, aggregate: &str) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT last_sequence FROM consumer_sequences WHERE consumer_name = $1 AND aggregate_id = $2",
    )
    .bind(consumer)
    .bind(aggregate)
    .fetch_optional(&db.pool)
    .await
    .unwrap()
}

async fn processed(db: &TestDb, consumer: &str, event_id: Uuid) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM processed_events WHERE consumer_name = $1 AND event_id = $2)",
    )
    .bind(consumer)
    .bind(event_id)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn list_and_show_report_each_consumers_rows_as_text_and_json() {
    let (db, _) = migrated("consumer_quarantine_list").await;
    let first = received("o-1", 1);
    let ahead = received("o-2", 3);
    let first_id = quarantine(&db, "inventory", &first, QuarantineKind::HandlerPermanent).await;
    let ahead_id = quarantine(&db, "inventory", &ahead, QuarantineKind::Gap).await;
    let malformed_id = quarantine_malformed(&db, "inventory").await;
    quarantine(
        &db,
        "billing",
        &received("o-1", 1),
        QuarantineKind::DeliveryCap,
    )
    .await;

    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "list",
            "--consumer",
            "inventory",
            "--json",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let rows = stdout_json(&out);
    let rows = rows.as_array().unwrap();
    let ids: Vec<i64> = rows
        .iter()
        .map(|r| r["quarantine_id"].as_i64().unwrap())
        .collect();
    assert_eq!(
        ids,
        [first_id, ahead_id, malformed_id],
        "inventory's rows only, oldest first"
    );
    assert_eq!(rows[0]["event_id"], first.event_id.to_string());
    assert_eq!(rows[0]["aggregate_id"], "o-1");
    assert_eq!(rows[0]["aggregate_sequence"], 1);
    assert_eq!(rows[0]["reason_kind"], "handler_permanent");
    assert_eq!(rows[0]["reason"], "inventory service said no");
    assert_eq!(rows[0]["deliveries"], 3);
    assert_eq!(rows[0]["status"], "quarantined");
    assert_eq!(rows[1]["reason_kind"], "gap");
    assert_eq!(rows[2]["event_id"], Value::Null);
    assert_eq!(rows[2]["reason_kind"], "malformed");

    let out = handoff(
        &db,
        &["consumer", "quarantine", "list", "--consumer", "inventory"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains(&first.event_id.to_string()), "{text}");
    assert!(text.contains("order/o-2 #3"), "{text}");
    assert!(text.contains("gap (at 0)"), "{text}");
    let out = handoff(
        &db,
        &["consumer", "quarantine", "list", "--consumer", "nobody"],
    );
    assert!(stdout(&out).contains("no quarantined deliveries for consumer nobody"));

    // By event id and by quarantine id: the stored message and an empty audit.
    for row in [first.event_id.to_string(), first_id.to_string()] {
        let out = handoff(
            &db,
            &[
                "consumer",
                "quarantine",
                "show",
                "--consumer",
                "inventory",
                &row,
                "--json",
            ],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let detail = stdout_json(&out);
        assert_eq!(detail["quarantine_id"], first_id);
        assert_eq!(detail["payload"], r#"{"n":1}"#);
        assert_eq!(detail["headers"]["traceparent"], "00-abc-01");
        assert_eq!(detail["actions"], Value::Array(Vec::new()));
    }
    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "show",
            "--consumer",
            "inventory",
            &malformed_id.to_string(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("header Handoff-Sequence is missing"),
        "{text}"
    );
    assert!(text.contains("actions      none"), "{text}");

    // Another consumer's row is not this consumer's.
    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "show",
            "--consumer",
            "billing",
            &first_id.to_string(),
        ],
    );
    assert_refused(&out, &format!("no quarantine row {first_id}"));
    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "show",
            "--consumer",
            "inventory",
            "row-7",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
}

#[tokio::test]
async fn retry_marks_the_row_for_the_consumer_with_an_audit_row_and_refuses_what_it_cannot_retry() {
    let (db, _) = migrated("consumer_quarantine_retry").await;
    let event = received("o-1", 1);
    let id = quarantine(&db, "inventory", &event, QuarantineKind::HandlerPermanent).await;
    let malformed_id = quarantine_malformed(&db, "inventory").await;

    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "retry",
            "--consumer",
            "inventory",
            &event.event_id.to_string(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("marked for retry"),
        "{}",
        stdout(&out)
    );
    assert_eq!(row_status(&db, id).await, ("retry_requested".into(), None));
    let audit = actions(&db, id).await;
    assert_eq!(audit.len(), 1);
    let (action, actor, reason, before, after) = &audit[0];
    assert_eq!(
        (action.as_str(), actor.as_str(), reason),
        ("retry", "test-operator", &None)
    );
    assert_eq!(before["status"], "quarantined");
    assert_eq!(after["status"], "retry_requested");
    assert!(after["retry_requested_at"].is_string());
    // Nothing applied yet: that is the consumer's part.
    assert!(!processed(&db, "inventory", event.event_id).await);

    // Refusals: each exits 1, says why, and changes nothing.
    let refusals: [(&str, String, &str); 3] = [
        (
            "inventory",
            id.to_string(),
            "is retry_requested, not quarantined",
        ),
        (
            "inventory",
            malformed_id.to_string(),
            "malformed message the consumer cannot apply",
        ),
        ("inventory", "424242".to_owned(), "no quarantine row 424242"),
    ];
    for (consumer, row, says) in refusals {
        let out = handoff(
            &db,
            &[
                "consumer",
                "quarantine",
                "retry",
                "--consumer",
                consumer,
                &row,
            ],
        );
        assert_eq!(out.status.code(), Some(1), "{row}: {}", stdout(&out));
        assert!(stderr(&out).contains(says), "{row}: {}", stderr(&out));
    }
    assert_eq!(actions(&db, id).await.len(), 1);
    assert!(actions(&db, malformed_id).await.is_empty());
    assert_eq!(row_status(&db, malformed_id).await.0, "quarantined");

    // The consumer's side: the row goes through the inbox and the handler once, and is closed
    // with a `retry_result` audit row; a second round finds nothing.
    let config = ConsumerConfig {
        name: "inventory".into(),
        ..ConsumerConfig::default()
    };
    assert_eq!(
        apply_requested_retries(&db.pool, &config, &Count)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        apply_requested_retries(&db.pool, &config, &Count)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        row_status(&db, id).await,
        ("resolved".into(), Some("applied".into()))
    );
    assert!(processed(&db, "inventory", event.event_id).await);
    assert_eq!(last_sequence(&db, "inventory", "o-1").await, Some(1));
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM retried WHERE event_id = $1")
        .bind(event.event_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(applied, 1);
    let audit = actions(&db, id).await;
    assert_eq!(audit.len(), 2);
    assert_eq!(audit[1].0, "retry_result");
    assert_eq!(audit[1].1, "consumer:inventory");
    assert_eq!(audit[1].2.as_deref(), Some("applied"));
    assert_eq!(audit[1].4["resolution"], "applied");
    assert_eq!(audit[1].4["retries"], 1);

    // Resolved: neither retried nor skipped again.
    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "retry",
            "--consumer",
            "inventory",
            &id.to_string(),
        ],
    );
    assert_refused(&out, "is resolved");
}

/// Records each application in `retried`, in the transaction it is given.
struct Count;

impl Handler for Count {
    async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
        sqlx::query("CREATE TABLE IF NOT EXISTS retried (event_id uuid NOT NULL)")
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO retried (event_id) VALUES ($1)")
            .bind(e.event_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

#[tokio::test]
async fn skip_records_the_event_advances_its_aggregate_when_next_and_refuses_a_hole() {
    let (db, _) = migrated("consumer_quarantine_skip").await;
    let next = received("o-1", 1);
    let ahead = received("o-2", 3);
    let next_id = quarantine(&db, "inventory", &next, QuarantineKind::HandlerPermanent).await;
    let ahead_id = quarantine(&db, "inventory", &ahead, QuarantineKind::Gap).await;
    let malformed_id = quarantine_malformed(&db, "inventory").await;
    let skip = |row: String, extra: &'static [&'static str]| {
        let mut args = vec!["consumer", "quarantine", "skip", "--consumer", "inventory"];
        args.extend_from_slice(extra);
        let db = &db;
        async move {
            let mut args: Vec<String> = args.into_iter().map(str::to_owned).collect();
            args.push(row);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            handoff(db, &args)
        }
    };

    // No reason: a usage error, nothing changed. An empty one: refused by the library.
    let out = skip(next_id.to_string(), &[]).await;
    assert_refused(&out, "--reason");
    let out = skip(next_id.to_string(), &["--reason", "  "]).await;
    assert_refused(&out, "a skip needs a reason");
    assert_eq!(row_status(&db, next_id).await.0, "quarantined");
    assert!(actions(&db, next_id).await.is_empty());

    // Next in line: recorded as processed, the aggregate moves past it, the row is closed.
    let out = skip(
        next_id.to_string(),
        &["--reason", "order cancelled upstream"],
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("its aggregate moved past it"),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        row_status(&db, next_id).await,
        ("resolved".into(), Some("skipped".into()))
    );
    assert!(processed(&db, "inventory", next.event_id).await);
    assert_eq!(last_sequence(&db, "inventory", "o-1").await, Some(1));
    let audit = actions(&db, next_id).await;
    assert_eq!(audit.len(), 1);
    let (action, actor, reason, before, after) = &audit[0];
    assert_eq!((action.as_str(), actor.as_str()), ("skip", "test-operator"));
    assert_eq!(reason.as_deref(), Some("order cancelled upstream"));
    assert_eq!(before["status"], "quarantined");
    assert_eq!(before["last_sequence"], Value::Null);
    assert_eq!(after["status"], "resolved");
    assert_eq!(after["resolution"], "skipped");
    assert_eq!(after["last_sequence"], 1);
    let out = skip(next_id.to_string(), &["--reason", "again"]).await;
    assert_refused(&out, "is resolved");

    // Ahead of its aggregate (o-2 has applied nothing; this is #3): refused, nothing written.
    let out = skip(ahead_id.to_string(), &["--reason", "not wanted"]).await;
    assert_refused(&out, "ahead of its aggregate");
    assert_eq!(row_status(&db, ahead_id).await.0, "quarantined");
    assert!(!processed(&db, "inventory", ahead.event_id).await);
    assert_eq!(last_sequence(&db, "inventory", "o-2").await, None);
    assert!(actions(&db, ahead_id).await.is_empty());
    // Explicitly past the gap: the aggregate moves to 3.
    let out = skip(
        ahead_id.to_string(),
        &["--reason", "1 and 2 were never sent", "--past-gap"],
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(last_sequence(&db, "inventory", "o-2").await, Some(3));
    assert_eq!(
        row_status(&db, ahead_id).await.1.as_deref(),
        Some("skipped")
    );

    // A malformed message: closed, no dedup row, no aggregate to move.
    let out = skip(
        malformed_id.to_string(),
        &["--reason", "garbage from a test publisher"],
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("sequence unchanged"),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        row_status(&db, malformed_id).await.1.as_deref(),
        Some("skipped")
    );

    // `list` shows open rows only; `--all` the resolved ones too.
    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "list",
            "--consumer",
            "inventory",
            "--json",
        ],
    );
    assert_eq!(stdout_json(&out), Value::Array(Vec::new()));
    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "list",
            "--consumer",
            "inventory",
            "--all",
            "--json",
        ],
    );
    assert_eq!(stdout_json(&out).as_array().unwrap().len(), 3);
}

#[tokio::test]
async fn status_counts_open_rows_per_consumer_and_alerts_while_any_is_open() {
    let (db, _) = migrated("consumer_quarantine_status").await;
    let out = handoff(&db, &["status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert_eq!(
        stdout_json(&out)["consumer_quarantine"],
        Value::Array(Vec::new())
    );

    let inventory = received("o-1", 1);
    let inventory_id = quarantine(&db, "inventory", &inventory, QuarantineKind::DeliveryCap).await;
    quarantine(
        &db,
        "inventory",
        &received("o-2", 1),
        QuarantineKind::HandlerPermanent,
    )
    .await;
    let billing = quarantine(&db, "billing", &received("o-1", 1), QuarantineKind::Gap).await;
    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "retry",
            "--consumer",
            "inventory",
            &inventory_id.to_string(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));

    let out = handoff(&db, &["status", "--json"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let report = stdout_json(&out);
    let counts = report["consumer_quarantine"].as_array().unwrap();
    assert_eq!(counts.len(), 2);
    assert_eq!(counts[0]["consumer_name"], "billing");
    assert_eq!(counts[0]["quarantined"], 1);
    assert_eq!(counts[0]["retry_requested"], 0);
    assert_eq!(counts[1]["consumer_name"], "inventory");
    assert_eq!(counts[1]["quarantined"], 1);
    assert_eq!(counts[1]["retry_requested"], 1);
    assert_eq!(report["healthy"], false);
    let alerts: Vec<&str> = report["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(alerts, ["consumer_quarantine_not_empty"; 2]);

    let out = handoff(&db, &["status"]);
    assert_eq!(out.status.code(), Some(2));
    let text = stdout(&out);
    assert!(text.contains("consumer quarantine"), "{text}");
    assert!(text.contains("1 quarantined, 1 retry requested"), "{text}");
    assert!(
        text.contains("ALERT consumer_quarantine_not_empty"),
        "{text}"
    );

    // Closing billing's row removes billing from the report.
    let out = handoff(
        &db,
        &[
            "consumer",
            "quarantine",
            "skip",
            "--consumer",
            "billing",
            &billing.to_string(),
            "--reason",
            "duplicate of an earlier order",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let report = stdout_json(&handoff(&db, &["status", "--json"]));
    let names: Vec<&str> = report["consumer_quarantine"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["consumer_name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["inventory"]);
}
