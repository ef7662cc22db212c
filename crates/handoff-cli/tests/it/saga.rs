//! `handoff saga list|show|resume|resolve` and the sagas in `handoff status`, against the real
//! PostgreSQL: a saga is driven to `stuck` through the orchestrator's own reply path (no
//! broker needed for that), then handled by the command as an operator would.

use std::time::Duration;

use crate::common::{handoff, stdout_json};
use handoff_postgres::Schema;
use handoff_saga::{
    Direction, Orchestrator, OrchestratorConfig, Outcome, Reply, RetryPolicy, SagaAdmin,
    SagaDefinition, SagaState, Step,
};
use handoff_test::TestDb;
use serde_json::{json, Value};
use uuid::Uuid;

/// One attempt per command, so a single failed release parks the saga.
pub(crate) fn orchestrator() -> Orchestrator {
    let once = RetryPolicy {
        attempts: 1,
        reply_timeout: Duration::from_secs(600),
        ..RetryPolicy::default()
    };
    let definition = SagaDefinition::new("place-order")
        .step(
            Step::new("reserve-stock", "inventory", "ReserveStock")
                .compensated_by("ReleaseStock")
                .with_retry(once),
        )
        .step(
            Step::new("charge", "payments", "Charge")
                .compensated_by("Refund")
                .with_retry(once),
        );
    Orchestrator::new(OrchestratorConfig::default(), [definition], ()).unwrap()
}

async fn reply(
    db: &TestDb,
    orchestrator: &Orchestrator,
    saga_id: Uuid,
    step: i32,
    direction: Direction,
    failure: Option<&str>,
) {
    // A reply answers the command last sent; any other is ignored as superseded.
    let sent = SagaAdmin::new(&Schema::default())
        .show(&db.pool, saga_id)
        .await
        .unwrap()
        .unwrap()
        .saga;
    let reply = Reply {
        saga_id,
        step,
        direction,
        attempt: sent.attempt,
        command_id: sent.command_id.unwrap(),
        participant: "test".into(),
        outcome: if failure.is_some() {
            Outcome::Failed
        } else {
            Outcome::Succeeded
        },
        reason: failure.map(str::to_owned),
        data: serde_json::Map::new(),
    };
    let mut tx = db.pool.begin().await.unwrap();
    orchestrator.apply_reply(&mut tx, &reply).await.unwrap();
    tx.commit().await.unwrap();
}

/// A saga whose charge was declined and whose stock release then failed.
pub(crate) async fn stuck_saga(db: &TestDb, orchestrator: &Orchestrator) -> Uuid {
    let saga_id = Uuid::now_v7();
    let mut tx = db.pool.begin().await.unwrap();
    orchestrator
        .start(&mut tx, "place-order", saga_id, json!({"sku": "book"}))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    reply(db, orchestrator, saga_id, 0, Direction::Forward, None).await;
    reply(
        db,
        orchestrator,
        saga_id,
        1,
        Direction::Forward,
        Some("card declined"),
    )
    .await;
    reply(
        db,
        orchestrator,
        saga_id,
        0,
        Direction::Compensate,
        Some("inventory is down"),
    )
    .await;
    saga_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_a_stuck_saga_and_resolves_it_with_an_audit_record() {
    let db = TestDb::migrated("cli_saga_resolve").await;
    let orchestrator = orchestrator();
    let saga_id = stuck_saga(&db, &orchestrator).await;
    let id = saga_id.to_string();

    // status alerts (exit 2) and names the saga and its reason.
    let status = handoff(&db, &["status", "--json"]);
    assert_eq!(
        status.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let report = stdout_json(&status);
    assert_eq!(report["sagas"]["stuck_count"], 1);
    assert_eq!(report["sagas"]["stuck"][0]["saga_id"], id);
    assert!(report["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["name"] == "stuck_sagas"));
    let text = handoff(&db, &["status"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("ALERT stuck_sagas"), "{text}");
    assert!(
        text.contains("ReleaseStock failed 1 times; last: inventory is down"),
        "{text}"
    );

    let list = stdout_json(&handoff(
        &db,
        &["saga", "list", "--state", "stuck", "--json"],
    ));
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["saga_id"], id);
    assert_eq!(list[0]["state"], "stuck");
    assert_eq!(list[0]["failure"], "charge failed: card declined");

    let show = stdout_json(&handoff(&db, &["saga", "show", &id, "--json"]));
    let kinds: Vec<_> = show["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["started", "step_succeeded", "step_failed", "stuck"]);
    let text = handoff(&db, &["saga", "show", &id]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("stuck        ReleaseStock failed"));

    // A reason is required, and nothing is written without one.
    let refused = handoff(&db, &["saga", "resolve", &id]);
    assert_eq!(refused.status.code(), Some(1));
    let refused = handoff(&db, &["saga", "resolve", &id, "--reason", "  "]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("a reason is required"));

    let resolved = handoff(
        &db,
        &[
            "saga",
            "resolve",
            &id,
            "--reason",
            "released by hand",
            "--json",
        ],
    );
    assert!(
        resolved.status.success(),
        "{}",
        String::from_utf8_lossy(&resolved.stderr)
    );
    assert_eq!(stdout_json(&resolved)["state"], "resolved");
    let show = stdout_json(&handoff(&db, &["saga", "show", &id, "--json"]));
    let actions = show["actions"].as_array().unwrap();
    assert_eq!(actions.len(), 1);
    assert_eq!(actions[0]["action"], "resolve");
    assert_eq!(actions[0]["actor"], "test-operator");
    assert_eq!(actions[0]["reason"], "released by hand");
    assert_eq!(actions[0]["state_before"], "stuck");

    // Only a stuck saga can be acted on; status is healthy again.
    let again = handoff(&db, &["saga", "resume", &id]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("is resolved; only a stuck saga"));
    assert_eq!(handoff(&db, &["status"]).status.code(), Some(0));
    let missing = handoff(&db, &["saga", "show", &Uuid::now_v7().to_string()]);
    assert_eq!(missing.status.code(), Some(1));
    let bad_state = handoff(&db, &["saga", "list", "--state", "paused"]);
    assert_eq!(bad_state.status.code(), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_saga_sends_its_compensation_again() {
    let db = TestDb::migrated("cli_saga_resume").await;
    let orchestrator = orchestrator();
    let saga_id = stuck_saga(&db, &orchestrator).await;
    let id = saga_id.to_string();
    let releases = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox WHERE aggregate_id = $1 AND event_type = 'ReleaseStock'",
        )
        .bind(&id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert_eq!(releases().await, 1);

    let resumed = handoff(
        &db,
        &[
            "saga",
            "resume",
            &id,
            "--reason",
            "inventory is back",
            "--json",
        ],
    );
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let saga = stdout_json(&resumed);
    assert_eq!(saga["state"], "compensating");
    assert_eq!(saga["deadline_kind"], "retry");

    // The orchestrator's sweep sends the release again, as attempt 1 of a fresh budget.
    assert_eq!(orchestrator.sweep(&db.pool).await.unwrap(), 1);
    assert_eq!(releases().await, 2);
    let payload: Value = sqlx::query_scalar(
        "SELECT payload FROM outbox WHERE aggregate_id = $1 AND event_type = 'ReleaseStock' \
         ORDER BY aggregate_sequence DESC LIMIT 1",
    )
    .bind(&id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(payload["attempt"], 1);
    assert_eq!(payload["direction"], "compensate");
    reply(&db, &orchestrator, saga_id, 0, Direction::Compensate, None).await;
    let show = stdout_json(&handoff(&db, &["saga", "show", &id, "--json"]));
    assert_eq!(show["state"], SagaState::Compensated.as_str());
    assert_eq!(show["actions"][0]["action"], "resume");
    assert_eq!(show["actions"][0]["state_after"], "compensating");
}
