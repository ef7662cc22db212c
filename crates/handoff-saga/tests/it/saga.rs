//! Sagas end to end on the real PostgreSQL and NATS: every path ends in a terminal state with
//! each effect done, or done and undone, exactly once.

use std::time::Duration;

use crate::common::{quick_retry, World};
use handoff_saga::{SagaError, SagaState};
use serde_json::json;
use uuid::Uuid;

/// Each participant's effects for one saga: (done, undone).
async fn effects(world: &World, saga_id: Uuid) -> [(i64, i64); 2] {
    let mut out = [(0, 0); 2];
    for (i, service) in [&world.inventory, &world.payments].into_iter().enumerate() {
        out[i] = (
            service.effects(saga_id, "do").await,
            service.effects(saga_id, "undo").await,
        );
    }
    out
}

/// A saga whose charge is declined and whose stock release fails until repaired.
async fn declined_with_a_broken_release(world: &World) -> Uuid {
    let saga_id = Uuid::now_v7();
    world.inventory.set_broken(saga_id, true).await;
    let mut tx = world.orders.db.pool.begin().await.unwrap();
    world
        .orchestrator
        .start(
            &mut tx,
            "place-order",
            saga_id,
            json!({"payments_refuses": true}),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    saga_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sagas_complete_with_each_step_done_once() {
    let world = World::start("saga_happy", quick_retry()).await;
    let mut sagas = Vec::new();
    for n in 0..20 {
        sagas.push(world.place(json!({"sku": "book", "n": n})).await);
    }
    for &saga_id in &sagas {
        let saga = world.wait_state(saga_id, SagaState::Completed).await;
        assert_eq!(effects(&world, saga_id).await, [(1, 0), (1, 0)]);
        assert_eq!(world.outcome(saga_id).await.as_deref(), Some("completed"));
        // The replies' data was merged into the saga's.
        assert_eq!(
            saga.data["payments_ref"],
            json!(format!("payments-{saga_id}"))
        );
        assert_eq!(
            saga.data["n"],
            json!(sagas.iter().position(|s| *s == saga_id).unwrap())
        );
        let detail = world
            .admin()
            .show(world.pool(), saga_id)
            .await
            .unwrap()
            .unwrap();
        let kinds: Vec<_> = detail.history.iter().map(|h| h.kind.as_str()).collect();
        assert_eq!(kinds, ["started", "step_succeeded", "completed"]);
        // One history row per version.
        assert_eq!(detail.history.last().unwrap().version, detail.saga.version);
    }
    world.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_charge_releases_the_stock_once() {
    let world = World::start("saga_declined", quick_retry()).await;
    let saga_id = world.place(json!({"payments_refuses": true})).await;
    let saga = world.wait_state(saga_id, SagaState::Compensated).await;
    assert_eq!(
        saga.failure.as_deref(),
        Some("charge failed: payments says no")
    );
    // Inventory reserved and released; the refused charge left nothing (its row was rolled
    // back with the refusal).
    assert_eq!(effects(&world, saga_id).await, [(1, 1), (0, 0)]);
    assert_eq!(world.outcome(saga_id).await.as_deref(), Some("compensated"));
    world.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_first_step_has_nothing_to_undo() {
    let world = World::start("saga_first_refused", quick_retry()).await;
    let saga_id = world.place(json!({"inventory_refuses": true})).await;
    world.wait_state(saga_id, SagaState::Compensated).await;
    assert_eq!(effects(&world, saga_id).await, [(0, 0), (0, 0)]);
    assert_eq!(world.outcome(saga_id).await.as_deref(), Some("compensated"));
    world.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_keeps_failing_parks_the_saga_then_an_operator_resumes_it() {
    let world = World::start("saga_stuck_resume", quick_retry()).await;
    let saga_id = declined_with_a_broken_release(&world).await;

    let saga = world.wait_state(saga_id, SagaState::Stuck).await;
    assert_eq!(
        saga.stuck_reason.as_deref(),
        Some("ReleaseStock failed 3 times; last: inventory cannot undo: broken")
    );
    assert_eq!(
        saga.deadline_at, None,
        "a stuck saga has no timer: nothing moves it"
    );
    assert_eq!(effects(&world, saga_id).await, [(1, 0), (0, 0)]);
    assert_eq!(world.outcome(saga_id).await, None, "not ended");
    let stuck = world
        .admin()
        .list(world.pool(), Some(SagaState::Stuck), 10)
        .await
        .unwrap();
    assert_eq!(
        stuck.iter().map(|s| s.saga_id).collect::<Vec<_>>(),
        [saga_id]
    );

    // Resolving needs a reason; resuming a saga that is not stuck is refused.
    assert!(matches!(
        world
            .admin()
            .resolve(world.pool(), saga_id, "ops", " ")
            .await,
        Err(SagaError::NoReason)
    ));
    world.inventory.set_broken(saga_id, false).await;
    world
        .admin()
        .resume(world.pool(), saga_id, "ops", "inventory repaired")
        .await
        .unwrap();
    world.wait_state(saga_id, SagaState::Compensated).await;
    assert_eq!(effects(&world, saga_id).await, [(1, 1), (0, 0)]);
    assert_eq!(world.outcome(saga_id).await.as_deref(), Some("compensated"));
    assert!(matches!(
        world
            .admin()
            .resume(world.pool(), saga_id, "ops", "again")
            .await,
        Err(SagaError::NotStuck {
            state: SagaState::Compensated,
            ..
        })
    ));

    let detail = world
        .admin()
        .show(world.pool(), saga_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(detail.actions.len(), 1);
    let action = &detail.actions[0];
    assert_eq!(
        (
            action.action.as_str(),
            action.actor.as_str(),
            action.reason.as_str()
        ),
        ("resume", "ops", "inventory repaired")
    );
    assert_eq!(
        (action.state_before.as_str(), action.state_after.as_str()),
        ("stuck", "compensating")
    );
    let kinds: Vec<_> = detail.history.iter().map(|h| h.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "started",
            "step_succeeded",
            "step_failed",
            "compensation_failed",
            "retried",
            "compensation_failed",
            "retried",
            "stuck",
            "resumed",
            "retried",
            "compensated",
        ]
    );
    world.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_saga_resolved_by_hand_ends_with_an_audit_record() {
    let world = World::start("saga_stuck_resolve", quick_retry()).await;
    let saga_id = declined_with_a_broken_release(&world).await;
    world.wait_state(saga_id, SagaState::Stuck).await;

    let resolved = world
        .admin()
        .resolve(
            world.pool(),
            saga_id,
            "alice",
            "stock counted and released by hand",
        )
        .await
        .unwrap();
    assert_eq!(resolved.state, SagaState::Resolved);
    assert!(resolved.ended_at.is_some());
    let detail = world
        .admin()
        .show(world.pool(), saga_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(detail.actions.len(), 1);
    assert_eq!(
        detail.actions[0].reason,
        "stock counted and released by hand"
    );
    assert_eq!(detail.actions[0].state_after, "resolved");
    // Resolved is final: nothing resends the release, however long we look.
    let before = detail.saga.version;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = world
        .admin()
        .show(world.pool(), saga_id)
        .await
        .unwrap()
        .unwrap()
        .saga;
    assert_eq!((after.state, after.version), (SagaState::Resolved, before));
    assert_eq!(effects(&world, saga_id).await, [(1, 0), (0, 0)]);
    world.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_charge_times_out_and_is_undone_when_payments_returns() {
    // Payments is down: the charge goes unanswered, is sent again, then undone. Its commands
    // wait in the stream; when payments returns it sees the charges first and the refund
    // last, so whatever it did is undone and the saga ends compensated.
    let mut world = World::idle("saga_timeout", quick_retry()).await;
    world.start_orchestrator().await;
    world.start_participant("inventory").await;
    let saga_id = world.place(json!({})).await;

    // Three sends of the charge, three reply timeouts, then the refund goes out.
    let saga = world.wait_state(saga_id, SagaState::Compensating).await;
    assert_eq!(
        saga.step, 1,
        "the unanswered step itself is compensated first"
    );
    assert_eq!(
        saga.failure.as_deref(),
        Some("no reply to Charge after 3 attempts")
    );
    world.start_participant("payments").await;
    world.wait_state(saga_id, SagaState::Compensated).await;
    assert_eq!(effects(&world, saga_id).await, [(1, 1), (1, 1)]);
    assert_eq!(world.outcome(saga_id).await.as_deref(), Some("compensated"));
    world.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saga_is_started_once_and_its_input_is_checked() {
    let world = World::idle("saga_start", quick_retry()).await;
    let saga_id = world.place(json!({})).await;
    let mut tx = world.orders.db.pool.begin().await.unwrap();
    let again = world
        .orchestrator
        .start(&mut tx, "place-order", saga_id, json!({}))
        .await;
    assert!(matches!(again, Err(SagaError::AlreadyStarted(id)) if id == saga_id));
    let unknown = world
        .orchestrator
        .start(&mut tx, "refund", Uuid::now_v7(), json!({}))
        .await;
    assert!(matches!(unknown, Err(SagaError::UnknownSagaType(_))));
    let not_object = world
        .orchestrator
        .start(&mut tx, "place-order", Uuid::now_v7(), json!([1]))
        .await;
    assert!(matches!(not_object, Err(SagaError::DataNotObject)));
    tx.rollback().await.unwrap();
    // The first start's command is in the outbox, once.
    let commands: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE aggregate_id = $1")
        .bind(saga_id.to_string())
        .fetch_one(&world.orders.db.pool)
        .await
        .unwrap();
    assert_eq!(commands, 1);
    world.stop().await;
}
