//! The saga failure policy (issue 25) on the real PostgreSQL and NATS: a deadline transition
//! that keeps failing for one saga parks that saga as stuck while the others' deadlines keep
//! firing; a deadline with nothing to do is not due forever; a reply to a superseded send
//! changes nothing.

use std::time::Duration;

use crate::common::{place_order, quick_retry, World};
use handoff_postgres::Schema;
use handoff_saga::{
    Direction, Orchestrator, OrchestratorConfig, Outcome, Reply, RetryPolicy, SagaAdmin,
    SagaDefinition, SagaRecord, SagaState, Step,
};
use handoff_test::{eventually, TestDb};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

/// The kinds of the saga's history, oldest first.
async fn kinds(world: &World, saga_id: Uuid) -> Vec<String> {
    history(world.pool(), saga_id)
        .await
        .into_iter()
        .map(|(kind, _)| kind)
        .collect()
}

/// The saga's history as (kind, detail), oldest first.
async fn history(pool: &PgPool, saga_id: Uuid) -> Vec<(String, Option<String>)> {
    SagaAdmin::new(&Schema::default())
        .show(pool, saga_id)
        .await
        .unwrap()
        .unwrap()
        .history
        .into_iter()
        .map(|h| (h.kind, h.detail))
        .collect()
}

/// When the saga's last transition of kind `kind` committed.
async fn when(pool: &PgPool, saga_id: Uuid, kind: &str) -> chrono::DateTime<chrono::Utc> {
    SagaAdmin::new(&Schema::default())
        .show(pool, saga_id)
        .await
        .unwrap()
        .unwrap()
        .history
        .into_iter()
        .rev()
        .find(|h| h.kind == kind)
        .unwrap_or_else(|| panic!("saga {saga_id} has no {kind} transition"))
        .at
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_transition_that_keeps_failing_parks_its_saga_while_the_others_fire() {
    let world = World::start("saga_failing_transition", quick_retry()).await;
    // Three notify sagas time out on their own deadlines (nobody answers the mailer) and end
    // compensated through the hook. The hook fails for the first two, started first, so theirs
    // are the earliest deadlines of every sweep.
    let resolved = world.start_saga("notify", json!({})).await;
    let resumed = world.start_saga("notify", json!({})).await;
    for saga_id in [resolved, resumed] {
        world.set_poisoned(saga_id, true).await;
    }
    let healthy = world.start_saga("notify", json!({})).await;

    // The first failure of the poisoned: from here on they are failing and backing off.
    let failing = world
        .wait_saga(resolved, "failing", |s| s.transition_failures >= 1)
        .await;
    assert_eq!(failing.state, SagaState::Running, "still in flight");
    let error = failing.last_transition_error.as_deref().unwrap();
    assert!(error.contains("is poisoned"), "{error}");
    // A retry (backoff) deadline that falls due now fires too: the release fails on its first
    // attempt only and is sent again.
    let retried = world
        .place(json!({"payments_refuses": true, "inventory_undo_fails_attempt": 1}))
        .await;

    // The healthy sagas end while the poisoned ones are still failing.
    world.wait_state(healthy, SagaState::Compensated).await;
    world.wait_state(retried, SagaState::Compensated).await;
    assert_eq!(world.outcome(healthy).await.as_deref(), Some("compensated"));
    assert_eq!(
        kinds(&world, retried).await,
        [
            "started",
            "step_succeeded",
            "step_failed",
            "compensation_failed",
            "retried",
            "compensated"
        ]
    );

    // Past the bound (4 tries), each poisoned saga is stuck with the error, and the stuck hook
    // ran for it.
    for saga_id in [resolved, resumed] {
        let saga = world.wait_state(saga_id, SagaState::Stuck).await;
        let reason = saga.stuck_reason.as_deref().unwrap();
        assert!(
            reason.starts_with(
                "the transition due at its reply deadline failed 4 times in a row; last: \
                 saga hook failed: saga"
            ) && reason.ends_with("is poisoned"),
            "{reason}"
        );
        assert_eq!(saga.transition_failures, 4);
        assert_eq!(
            (
                saga.resume_state.as_deref(),
                saga.resume_deadline_kind.as_deref()
            ),
            (Some("running"), Some("reply"))
        );
        assert_eq!((saga.deadline_at, saga.attempt), (None, 3));
        assert_eq!(world.stuck_hooks(saga_id).await, 1);
        assert_eq!(world.outcome(saga_id).await, None);
        assert_eq!(
            kinds(&world, saga_id).await,
            ["started", "timed_out", "timed_out", "stuck"]
        );
    }
    let healthy_ended = when(world.pool(), healthy, "compensated").await;
    assert!(
        healthy_ended < when(world.pool(), resolved, "stuck").await,
        "the healthy saga's deadline fired while the poisoned one was still failing"
    );

    // The operator actions work on them: resolve closes one by hand...
    let saga = world
        .admin()
        .resolve(world.pool(), resolved, "ops", "mail sent by hand")
        .await
        .unwrap();
    assert_eq!(saga.state, SagaState::Resolved);
    assert_eq!(saga.resume_state, None);
    // ...and, the hook repaired, resume tries the same transition again, which now commits.
    world.set_poisoned(resumed, false).await;
    let saga = world
        .admin()
        .resume(world.pool(), resumed, "ops", "hook fixed")
        .await
        .unwrap();
    assert_eq!(
        (saga.state, saga.attempt, saga.transition_failures),
        (SagaState::Running, 3, 0)
    );
    assert_eq!(saga.deadline_kind.as_deref(), Some("reply"));
    let saga = world.wait_state(resumed, SagaState::Compensated).await;
    assert_eq!(
        saga.failure.as_deref(),
        Some("no reply to SendMail after 3 attempts")
    );
    assert_eq!(world.outcome(resumed).await.as_deref(), Some("compensated"));
    assert_eq!(
        kinds(&world, resumed).await,
        [
            "started",
            "timed_out",
            "timed_out",
            "stuck",
            "resumed",
            "compensated"
        ]
    );
    world.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_failure_of_a_superseded_release_changes_nothing() {
    // Replies are slower than the reply timeout: the release is sent three times before any
    // answer arrives. Attempt 1 fails, attempts 2 and 3 succeed. The failure of attempt 1,
    // arriving while attempt 3 (the last) is out, must not park the saga.
    let retry = RetryPolicy {
        reply_timeout: Duration::from_secs(5),
        ..quick_retry()
    };
    let mut world = World::idle("saga_late_failure", retry).await;
    world.start_orchestrator().await;
    world.start_participant("inventory").await;
    let saga_id = world
        .place(json!({"payments_refuses": true, "inventory_undo_fails_attempt": 1}))
        .await;
    // The stock is reserved (its reply consumed); the charge waits for payments.
    world
        .wait_saga(saga_id, "charging", |s| {
            s.state == SagaState::Running && s.step == 1
        })
        .await;
    world.inventory.stop_relay().await;
    world.start_participant("payments").await;

    // Each release attempt is answered at once, but the answers stay in inventory's outbox.
    let replies = format!("inventory:{saga_id}");
    world
        .wait_until("three release answers held", || async {
            world.inventory.unpublished(&replies).await == 3
        })
        .await;
    let saga = world
        .admin()
        .show(world.pool(), saga_id)
        .await
        .unwrap()
        .unwrap()
        .saga;
    assert_eq!(
        (saga.state, saga.step, saga.attempt),
        (SagaState::Compensating, 0, 3),
        "the last release attempt is out"
    );
    world.inventory.start_relay().await;

    let saga = world.wait_state(saga_id, SagaState::Compensated).await;
    assert_eq!(world.outcome(saga_id).await.as_deref(), Some("compensated"));
    assert_eq!(saga.stuck_reason, None);
    assert_eq!(world.stuck_hooks(saga_id).await, 0);
    let history = history(world.pool(), saga_id).await;
    let kinds: Vec<_> = history.iter().map(|(k, _)| k.as_str()).collect();
    // Attempt 1's failure was ignored; attempt 2's success (a superseded send, arriving while
    // attempt 3 was out) ended it; attempt 3's success found it ended.
    assert_eq!(
        kinds,
        [
            "started",
            "step_succeeded",
            "step_failed",
            "timed_out",
            "timed_out",
            "compensated"
        ]
    );
    assert_eq!(
        history.last().unwrap().1.as_deref(),
        Some(
            "reserve-stock (a late success of attempt 2, the saga being compensating at \
             attempt 3)"
        )
    );
    // Every answer was consumed (none is waiting to be redelivered).
    world
        .wait_until("every answer published", || async {
            world.inventory.unpublished(&replies).await == 0
        })
        .await;
    let effects = (
        world.inventory.effects(saga_id, "do").await,
        world.inventory.effects(saga_id, "undo").await,
    );
    assert_eq!(effects, (1, 1), "released once");
    world.stop().await;
}

/// The saga's row.
async fn saga(pool: &PgPool, saga_id: Uuid) -> SagaRecord {
    SagaAdmin::new(&Schema::default())
        .show(pool, saga_id)
        .await
        .unwrap()
        .unwrap()
        .saga
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_with_nothing_to_do_is_not_due_forever() {
    // The saga is at step 1; an orchestrator whose definition has one step only (as during a
    // rolling deploy) cannot act on its deadline. The deadline moves instead of staying due
    // (and first in every sweep), and past the bound the saga is parked as stuck.
    let db = TestDb::migrated("saga_ignored_deadline").await;
    let short = RetryPolicy {
        reply_timeout: Duration::from_millis(200),
        ..quick_retry()
    };
    let long = Orchestrator::new(OrchestratorConfig::default(), [place_order(short)], ()).unwrap();
    let config = OrchestratorConfig {
        transition_backoff: handoff_core::Backoff {
            initial: Duration::from_secs(2),
            max: Duration::from_secs(2),
        },
        transition_attempts: 2,
        ..OrchestratorConfig::default()
    };
    let one_step = SagaDefinition::new("place-order").step(
        Step::new("reserve-stock", "inventory", "ReserveStock").compensated_by("ReleaseStock"),
    );
    let short_sighted = Orchestrator::new(config, [one_step], ()).unwrap();

    let saga_id = Uuid::now_v7();
    let mut tx = db.pool.begin().await.unwrap();
    long.start(&mut tx, "place-order", saga_id, json!({}))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let started = saga(&db.pool, saga_id).await;
    let reply = Reply {
        saga_id,
        step: 0,
        direction: Direction::Forward,
        attempt: 1,
        command_id: started.command_id.unwrap(),
        participant: "inventory".into(),
        outcome: Outcome::Succeeded,
        reason: None,
        data: serde_json::Map::new(),
    };
    let mut tx = db.pool.begin().await.unwrap();
    long.apply_reply(&mut tx, &reply).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(saga(&db.pool, saga_id).await.step, 1);

    // Due in 200 ms: the first sweep after that fails it and moves the deadline 1 to 2 s on.
    let first = eventually("the deadline fired", Duration::from_secs(30), async || {
        short_sighted.sweep(&db.pool).await.unwrap();
        let saga = saga(&db.pool, saga_id).await;
        (saga.transition_failures > 0).then_some(saga)
    })
    .await;
    assert_eq!(first.state, SagaState::Running);
    assert_eq!(first.transition_failures, 1);
    assert_eq!(
        first.last_transition_error.as_deref(),
        Some(
            "no transition for the deadline at step 1: the saga is at a step its definition \
             does not have"
        )
    );
    assert!(
        first.deadline_at.unwrap() > chrono::Utc::now(),
        "moved forward"
    );
    // Not due any more: the next sweeps leave it alone until the new deadline.
    assert_eq!(short_sighted.sweep(&db.pool).await.unwrap(), 0);
    assert_eq!(saga(&db.pool, saga_id).await.transition_failures, 1);

    // The second failure reaches the bound: stuck, no deadline.
    let parked = eventually("the saga parked", Duration::from_secs(30), async || {
        short_sighted.sweep(&db.pool).await.unwrap();
        let saga = saga(&db.pool, saga_id).await;
        (saga.state != SagaState::Running).then_some(saga)
    })
    .await;
    assert_eq!(parked.state, SagaState::Stuck);
    assert_eq!((parked.deadline_at, parked.deadline_kind), (None, None));
    assert_eq!(
        parked.stuck_reason.as_deref(),
        Some(
            "the transition due at its reply deadline failed 2 times in a row; last: no \
             transition for the deadline at step 1: the saga is at a step its definition does \
             not have"
        )
    );
    let kinds: Vec<_> = history(&db.pool, saga_id)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(kinds, ["started", "step_succeeded", "stuck"]);
    let resolved = SagaAdmin::new(&Schema::default())
        .resolve(&db.pool, saga_id, "ops", "charged by hand")
        .await
        .unwrap();
    assert_eq!(resolved.state, SagaState::Resolved);
}
