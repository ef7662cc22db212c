//! Crash loops against the real PostgreSQL: a takeover counts towards `--max-takeovers` only
//! when the relay that held the lease is gone (its session stopped heartbeating, or the relay
//! restarted), and a successful mark clears the count (migration 0020).

use crate::common;

use crate::common::previous_release;

use std::time::Duration;

use handoff_core::delivery::{Claim, Published, Source};
use handoff_postgres::{
    Migrator, OrderMode, Outbox, OutboxConfig, PollingConfig, PollingSource, Schema,
};
use handoff_test::{eventually, factory, TestDb};

/// The bound the tests hold events after: two counted takeovers, a suspect from the second.
const MAX_TAKEOVERS: i32 = 2;

/// A source of relay `relay_id` with a one-second lease: its heartbeat renews its session every
/// 250 ms, each beat vouching for 750 ms.
fn source(db: &TestDb, relay_id: &str) -> PollingSource {
    source_in(db, relay_id, OrderMode::Aggregate)
}

/// As [`source`], publishing the lanes of `order`.
fn source_in(db: &TestDb, relay_id: &str, order: OrderMode) -> PollingSource {
    let config = PollingConfig {
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: relay_id.into(),
        lease: Duration::from_secs(1),
        max_takeovers: MAX_TAKEOVERS,
        order,
        ..PollingConfig::default()
    };
    PollingSource::new(db.pool.clone(), config).unwrap()
}

/// A claim by `relay` that leases something or holds something, waited for: the previous
/// lease runs out within its second.
async fn claim_once_expired(relay: &PollingSource) -> Claim {
    eventually(
        "a claim after the lease ran out",
        Duration::from_secs(10),
        async || {
            let claim = relay.claim(100, usize::MAX).await.unwrap();
            if claim.events.is_empty() && claim.held == 0 {
                Err("nothing claimable yet")
            } else {
                Ok(claim)
            }
        },
    )
    .await
}

/// `(takeover_count, hold_reason)` of every event of aggregate `x`, in sequence order.
async fn counts(db: &TestDb) -> Vec<(i32, Option<String>)> {
    sqlx::query_as(
        "SELECT takeover_count, hold_reason FROM outbox WHERE aggregate_id = 'x'
         ORDER BY aggregate_sequence",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

async fn enqueue_x(db: &TestDb, outbox: &Outbox, events: u64) {
    for n in 0..events {
        db.enqueue_alone(outbox, factory::event("x", n)).await;
    }
}

/// A relay that lives on but does not settle its leases in time (frozen for less than its
/// session's bound, marks held up, a claim whose answer it never got) is no crash: every round
/// of leases that run out and are taken over by the other relay is a takeover, and none counts.
#[tokio::test]
async fn leases_of_a_relay_that_still_heartbeats_are_taken_over_without_counting() {
    let (db, outbox) = common::migrated("crash_loop_live_relay").await;
    enqueue_x(&db, &outbox, 3).await;
    let (a, b) = (source(&db, "relay-a"), source(&db, "relay-b"));
    let first = a.claim(100, usize::MAX).await.unwrap();
    assert_eq!(first.events.len(), 3);

    // Two rounds more than the bound: a, then b, then a ... each leaving its lease to run out.
    let mut takeovers = 0;
    for round in 0..(MAX_TAKEOVERS + 2) {
        let relay = if round % 2 == 0 { &b } else { &a };
        let claim = claim_once_expired(relay).await;
        assert_eq!(claim.held, 0, "round {round}: nothing held");
        assert!(!claim.isolate, "round {round}: no suspect");
        assert_eq!(
            claim.events.len(),
            3,
            "round {round}: the whole run, together"
        );
        assert_eq!(claim.taken_over, 3, "round {round}: each a takeover");
        takeovers += claim.taken_over;
        assert_eq!(
            counts(&db).await,
            vec![(0, None), (0, None), (0, None)],
            "round {round}: no takeover counted"
        );
    }
    assert_eq!(takeovers, 3 * (MAX_TAKEOVERS as usize + 2));
}

/// A relay that is gone (here: dropped, so its session stops heartbeating) leaves leases whose
/// takeover counts; the event is a suspect from the second, and past the bound it is held as a
/// crash loop, with the event behind it waiting.
#[tokio::test]
async fn leases_of_a_relay_that_is_gone_count_until_the_event_is_held_as_a_crash_loop() {
    let (db, outbox) = common::migrated("crash_loop_gone_relay").await;
    enqueue_x(&db, &outbox, 2).await;
    let first = source(&db, "relay-0");
    assert_eq!(first.claim(100, usize::MAX).await.unwrap().events.len(), 2);
    drop(first);

    for round in 1..=MAX_TAKEOVERS {
        let relay = source(&db, &format!("relay-{round}"));
        let claim = claim_once_expired(&relay).await;
        let counted = counts(&db).await;
        assert_eq!(counted[0], (round, None), "round {round}: counted");
        if round >= 2 {
            assert!(claim.isolate, "round {round}: a suspect, leased alone");
            assert_eq!(claim.events.len(), 1, "round {round}: alone");
        } else {
            assert!(!claim.isolate, "round {round}: one crash is anyone's fate");
            assert_eq!(claim.events.len(), 2, "round {round}");
        }
        drop(relay);
    }

    let last = source(&db, "relay-last");
    let claim = claim_once_expired(&last).await;
    assert_eq!(claim.held, 1, "held instead of leased");
    assert!(claim.events.is_empty(), "nothing behind it leased");
    // The takeover that holds it is counted too: one past the bound.
    assert_eq!(
        counts(&db).await[0],
        (MAX_TAKEOVERS + 1, Some("crash_loop".to_owned()))
    );
    let error: String = sqlx::query_scalar(
        "SELECT last_error FROM outbox WHERE aggregate_id = 'x' AND aggregate_sequence = 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(error.starts_with("crash_loop:"), "{error}");
}

/// A relay restarted under the same relay id is a new session: the leases of the one before
/// count even while its last heartbeat still vouches for it (the old process is gone, whatever
/// its last beat said).
#[tokio::test]
async fn leases_of_an_earlier_session_of_a_restarted_relay_count() {
    let (db, outbox) = common::migrated("crash_loop_restarted_relay").await;
    enqueue_x(&db, &outbox, 1).await;
    // Kept alive (heartbeating) on purpose: only the restart makes its session gone.
    let before = source(&db, "relay-r");
    assert_eq!(before.claim(100, usize::MAX).await.unwrap().events.len(), 1);
    let after = source(&db, "relay-r");
    let claim = claim_once_expired(&after).await;
    assert_eq!(claim.taken_over, 1);
    assert_eq!(counts(&db).await, vec![(1, None)]);
    drop(before);
}

/// A successful publish clears the count: through the source's mark, and through
/// `handoff_mark_published` as other callers run it.
#[tokio::test]
async fn a_successful_mark_clears_the_takeover_count() {
    let (db, outbox) = common::migrated("crash_loop_mark_clears").await;
    enqueue_x(&db, &outbox, 2).await;
    let first = source(&db, "relay-0");
    assert_eq!(first.claim(100, usize::MAX).await.unwrap().events.len(), 2);
    drop(first);
    let relay = source(&db, "relay-1");
    let claim = claim_once_expired(&relay).await;
    assert_eq!(counts(&db).await, vec![(1, None), (1, None)]);

    let ids: Vec<uuid::Uuid> = claim.events.iter().map(|e| e.event_id).collect();
    relay
        .mark_published(&[Published::id(ids[0])])
        .await
        .unwrap();
    sqlx::query("SELECT handoff_mark_published($1, $2)")
        .bind(&ids[1..])
        .bind(vec![None::<String>])
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(counts(&db).await, vec![(0, None), (0, None)]);
}

/// A database of the previous release, with events leased by its relays (no session), upgrades
/// in place: a lease without a session that runs out counts as before, and the relays of this
/// release then count only what their gone sessions leave.
#[tokio::test]
async fn leases_written_before_the_upgrade_count_as_before() {
    let db = TestDb::new("crash_loop_upgrade").await;
    let mut conn = db.pool.acquire().await.unwrap();
    previous_release::migrated_through(&mut conn, 19).await;
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    enqueue_x(&db, &outbox, 2).await;
    // The previous release's relay leased both, and its lease ran out.
    sqlx::query(
        "UPDATE outbox SET claimed_by = 'old-relay', claim_until = now() - interval '1 second',
                available_at = now() - interval '1 second'",
    )
    .execute(&mut *conn)
    .await
    .unwrap();

    Migrator::handoff(Schema::default())
        .run(&mut conn)
        .await
        .unwrap();
    let sessions: Vec<Option<uuid::Uuid>> =
        sqlx::query_scalar("SELECT claimed_session FROM outbox")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    assert_eq!(sessions, vec![None, None], "no session on existing rows");

    let (a, b) = (source(&db, "relay-a"), source(&db, "relay-b"));
    let claim = a.claim(100, usize::MAX).await.unwrap();
    assert_eq!((claim.events.len(), claim.taken_over), (2, 2));
    assert_eq!(counts(&db).await, vec![(1, None), (1, None)], "counted");

    // relay-a lives on: its lease running out counts nothing more.
    let claim = claim_once_expired(&b).await;
    assert_eq!(claim.taken_over, 2);
    assert_eq!(counts(&db).await, vec![(1, None), (1, None)], "not counted");
    drop(a);
}

/// The global lane's claim counts as the per-aggregate one does: a takeover from a relay that
/// still heartbeats counts nothing, one from a relay that is gone counts.
#[tokio::test]
async fn the_global_lane_counts_only_the_takeovers_of_relays_that_are_gone() {
    let db = TestDb::migrated("crash_loop_global").await;
    let global = factory::outbox(OrderMode::Global);
    let mut tx = db.pool.begin().await.unwrap();
    global
        .enqueue(&mut tx, &[factory::event("x", 0), factory::event("x", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let (a, b) = (
        source_in(&db, "relay-a", OrderMode::Global),
        source_in(&db, "relay-b", OrderMode::Global),
    );
    assert_eq!(a.claim(100, usize::MAX).await.unwrap().events.len(), 2);
    let claim = claim_once_expired(&b).await;
    assert_eq!((claim.events.len(), claim.taken_over), (2, 2));
    assert_eq!(
        counts(&db).await,
        vec![(0, None), (0, None)],
        "relay-a lives"
    );

    drop(b);
    let c = source_in(&db, "relay-c", OrderMode::Global);
    let claim = claim_once_expired(&c).await;
    assert_eq!(claim.taken_over, 2);
    assert_eq!(
        counts(&db).await,
        vec![(1, None), (1, None)],
        "relay-b is gone"
    );
    drop(a);
}
