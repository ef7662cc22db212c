//! A poison event through the CDC source (design P8, P9): the broker refuses one event of
//! aggregate `a` for good. It is parked in the table as quarantined, `a`'s later events wait
//! behind it while every other aggregate flows, and the slot's position moves on past it;
//! after `handoff quarantine retry` (and the cause gone) `a` resumes in order. With rows kept
//! and with rows deleted by the trigger.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{eventually, Fixture, Ledger};
use handoff_cdc::RowMode;
use handoff_core::delivery::PublishErrorKind;
use handoff_core::{EventId, NewEvent};
use handoff_postgres::Quarantine;
use handoff_test::factory;
use handoff_test::faults::{Fault, Faulty, Poison};

/// Commits `events` (aggregate id, count) in one transaction and records them; the event at
/// index `poisoned`, if any, is made poison before the commit, so the relay never sees it
/// healthy. Returns the ids.
async fn commit(
    fx: &Fixture,
    ledger: &mut Ledger,
    events: &[(&str, u64)],
    poisoned: Option<(&Poison, usize)>,
) -> Vec<EventId> {
    let events: Vec<NewEvent> = events
        .iter()
        .flat_map(|(aggregate, count)| (0..*count).map(|n| factory::event(aggregate, n)))
        .collect();
    let mut tx = fx.db.pool.begin().await.unwrap();
    let enqueued = fx.outbox.enqueue(&mut tx, &events).await.unwrap();
    if let Some((poison, at)) = poisoned {
        poison.lock().unwrap().insert(enqueued[at].event_id);
    }
    tx.commit().await.unwrap();
    ledger.record(&events, &enqueued);
    enqueued.iter().map(|e| e.event_id).collect()
}

/// The row of a held event: available_at, quarantined_at set, last_error, published_at set.
type HeldRow = (bool, bool, Option<String>, bool);

async fn row_state(fx: &Fixture, id: EventId) -> Option<HeldRow> {
    sqlx::query_as(
        "SELECT available_at = 'infinity', quarantined_at IS NOT NULL, last_error,
                published_at IS NOT NULL
         FROM outbox WHERE event_id = $1",
    )
    .bind(id)
    .fetch_optional(&fx.db.pool)
    .await
    .unwrap()
}

async fn poison_is_parked_others_flow_and_retry_resumes_in_order(name: &str, rows: RowMode) {
    let fx = Fixture::start(name, rows, &[]).await;
    let poison: Poison = Arc::default();
    let relay = fx
        .relay_over(|inner| {
            Faulty::new(inner).for_ids(poison.clone(), Fault::Fail(PublishErrorKind::Rejected))
        })
        .await;

    let mut ledger = Ledger::default();
    let a1 = commit(&fx, &mut ledger, &[("a", 1), ("b", 1)], None).await[0];
    let tx2 = commit(&fx, &mut ledger, &[("a", 1), ("c", 1)], Some((&poison, 0))).await;
    let a2 = tx2[0];
    let poison_commit = fx.current_wal_lsn().await;
    let a3 = commit(&fx, &mut ledger, &[("a", 1), ("b", 1)], None).await[0];
    let a4 = commit(&fx, &mut ledger, &[("a", 1), ("d", 2)], None).await[0];
    for round in 0..10u64 {
        let other = format!("e{}", round % 4);
        commit(&fx, &mut ledger, &[("b", 1), (other.as_str(), 2)], None).await;
    }
    let wal_after = fx.current_wal_lsn().await;
    let waiting = [a2, a3, a4];
    let flowing: HashSet<String> = ledger
        .ids()
        .into_iter()
        .filter(|id| !waiting.iter().any(|w| w.to_string() == *id))
        .collect();

    // Every other aggregate, and `a` before the poison, is published.
    eventually(
        "every event but a's from the poison on published",
        Duration::from_secs(15),
        || async { fx.delivered().await.ids.is_superset(&flowing) },
    )
    .await;
    // The position moves past the poison's transaction and every later one: parked events
    // settle once durable in the table.
    eventually(
        "the slot confirmed past the poison's commit and everything after",
        Duration::from_secs(10),
        || async { fx.slot().await.confirmed_flush_lsn >= wal_after },
    )
    .await;
    assert!(wal_after > poison_commit);
    // The held row: quarantined for an operator, with the broker's reason.
    let (infinite, quarantined, last_error, published) = row_state(&fx, a2)
        .await
        .expect("the held event is in the table");
    assert!(infinite, "available_at = 'infinity'");
    assert!(quarantined, "quarantined_at set");
    assert!(
        last_error.as_deref().is_some_and(|e| e.contains("refused")),
        "last_error says why: {last_error:?}"
    );
    assert!(!published);
    for id in [a3, a4] {
        let (infinite, quarantined, _, published) = row_state(&fx, id)
            .await
            .expect("a waiting event is in the table");
        assert!(
            !infinite && !quarantined && !published,
            "{id} waits, not held"
        );
    }
    // a's later events stay back: watched over several sweep intervals (200 ms), as a
    // sweep is what would wrongly publish them.
    let watch_until = tokio::time::Instant::now() + Duration::from_secs(1);
    while tokio::time::Instant::now() < watch_until {
        let delivered = fx.delivered().await;
        for id in &waiting {
            assert!(
                !delivered.contains(id),
                "{id} published behind a held event"
            );
        }
        assert!(delivered.contains(&a1));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut conn = fx.db.pool.acquire().await.unwrap();
    if rows == RowMode::Delete {
        // The writers' rows are gone; only the held event and those waiting behind it were
        // written back, each marked by a last_error.
        let kept: Vec<(EventId, Option<String>)> =
            sqlx::query_as("SELECT event_id, last_error FROM outbox ORDER BY aggregate_sequence")
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        assert_eq!(
            kept.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            waiting.to_vec(),
            "only a's held and waiting events are in the table"
        );
        assert!(kept.iter().all(|(_, error)| error.is_some()));
    } else {
        let left: Vec<(String, i64, Option<String>)> = sqlx::query_as(
            "SELECT aggregate_id, aggregate_sequence, last_error FROM outbox
             WHERE published_at IS NULL ORDER BY aggregate_id, aggregate_sequence",
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        assert_eq!(left.len(), 3, "every other row marked published: {left:?}");
    }

    // The operator removes the cause and retries: a resumes, in order.
    poison.lock().unwrap().clear();
    Quarantine::new(&fx.schema())
        .retry(&mut conn, a2, "cdc-test")
        .await
        .unwrap();
    eventually(
        "a's held and waiting events published",
        Duration::from_secs(15),
        || async {
            let delivered = fx.delivered().await;
            waiting.iter().all(|id| delivered.contains(id))
        },
    )
    .await;
    // And a later event of `a` follows them.
    commit(&fx, &mut ledger, &[("a", 1)], None).await;
    eventually("every event published", Duration::from_secs(15), || async {
        fx.delivered().await.ids.len() >= ledger.len()
    })
    .await;
    fx.delivered().await.assert_exactly(&ledger);
    eventually(
        "no row left unpublished",
        Duration::from_secs(10),
        || async { fx.unpublished().await == 0 },
    )
    .await;
    if rows == RowMode::Delete {
        // What stays is written-back rows only, all marked published now: a2..a4, and a5 if it
        // streamed in before the sweep freed `a`.
        let kept: Vec<(EventId, bool, bool)> = sqlx::query_as(
            "SELECT event_id, last_error IS NOT NULL, published_at IS NOT NULL FROM outbox",
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        let ids: HashSet<EventId> = kept.iter().map(|(id, _, _)| *id).collect();
        assert!(ids.is_superset(&waiting.into_iter().collect()));
        assert!(ids.len() <= 4, "no row but a's: {kept:?}");
        assert!(kept
            .iter()
            .all(|(_, written_back, published)| *written_back && *published));
    } else {
        assert_eq!(
            fx.db.count("outbox").await,
            ledger.len() as i64,
            "kept rows: one per event"
        );
    }
    let actions: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_quarantine_actions")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(actions, 1, "the retry is audited");
    drop(conn);
    let report = relay.stop().await;
    assert_eq!(report.held, 1, "exactly one event was held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_kept_rows_a_poison_event_is_quarantined_its_aggregate_waits_and_retry_resumes_it() {
    poison_is_parked_others_flow_and_retry_resumes_in_order("cdc_poison_keep", RowMode::Keep).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_deleted_rows_a_poison_event_is_written_back_quarantined_and_retry_resumes_it() {
    poison_is_parked_others_flow_and_retry_resumes_in_order("cdc_poison_delete", RowMode::Delete)
        .await;
}
