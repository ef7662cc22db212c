//! The polling claim's byte budget against the real PostgreSQL: a claim leases no more than its
//! budget of payload and header bytes, keeps every aggregate's run unbroken from its head, and
//! still leases an event larger than the budget, alone.

use crate::common;

use std::collections::HashMap;

use handoff_core::delivery::{Claim, OutboxEvent, Published, Receipt, Source};
use handoff_postgres::{OrderMode, PollingConfig, PollingSource, Schema};
use handoff_test::{factory, TestDb};

const KB: usize = 1000;

fn source(db: &TestDb, order: OrderMode) -> PollingSource {
    let config = PollingConfig {
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: "relay-a".into(),
        order,
        ..PollingConfig::default()
    };
    PollingSource::new(db.pool.clone(), config).unwrap()
}

/// Enqueues `per_aggregate` events of about `bytes` bytes for each of `aggregates` aggregates,
/// each in its own transaction, round-robin (an aggregate's events spread over the backlog).
async fn enqueue(
    db: &TestDb,
    order: OrderMode,
    aggregates: usize,
    per_aggregate: u64,
    bytes: usize,
) {
    let outbox = factory::outbox(order);
    for n in 0..per_aggregate {
        for a in 0..aggregates {
            db.enqueue_alone(
                &outbox,
                factory::event_of_size(&format!("agg-{a}"), n, bytes),
            )
            .await;
        }
    }
}

fn weight(events: &[OutboxEvent]) -> usize {
    events.iter().map(OutboxEvent::size_bytes).sum()
}

async fn mark_all(source: &PollingSource, claim: &Claim) {
    let published: Vec<Published> = claim
        .events
        .iter()
        .map(|e| Published {
            event_id: e.event_id,
            receipt: Receipt::new("test ack"),
            lease: claim.lease,
        })
        .collect();
    source.mark_published(&published).await.unwrap();
}

/// Each aggregate's sequences in the claim, in claim order.
fn runs(events: &[OutboxEvent]) -> HashMap<String, Vec<i64>> {
    let mut runs: HashMap<String, Vec<i64>> = HashMap::new();
    for e in events {
        runs.entry(e.aggregate_id.clone())
            .or_default()
            .push(e.aggregate_sequence);
    }
    runs
}

/// Claims with `max_bytes` until nothing is left, marking each claim published, and checks each
/// claim: within the budget (or one event alone), every aggregate's run unbroken from the
/// next sequence it owes. Returns the number of events of each claim, and whether the budget
/// cut it.
async fn drain(source: &PollingSource, max_bytes: usize, total: usize) -> Vec<(usize, bool)> {
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut sizes = Vec::new();
    let mut claimed = 0;
    while claimed < total {
        let claim = source.claim(500, max_bytes).await.unwrap();
        assert!(
            !claim.events.is_empty(),
            "the budget blocked progress after {claimed} of {total} events"
        );
        assert!(
            claim.events.len() == 1 || weight(&claim.events) <= max_bytes,
            "{} events of {} bytes over a budget of {max_bytes}",
            claim.events.len(),
            weight(&claim.events)
        );
        for (aggregate, sequences) in runs(&claim.events) {
            let from = next.get(&aggregate).copied().unwrap_or(1);
            let expected: Vec<i64> = (from..from + sequences.len() as i64).collect();
            assert_eq!(
                sequences, expected,
                "{aggregate}: not an unbroken run in order from its head"
            );
            next.insert(aggregate, from + sequences.len() as i64);
        }
        claimed += claim.events.len();
        sizes.push((claim.events.len(), claim.bytes_full));
        mark_all(source, &claim).await;
    }
    sizes
}

#[tokio::test]
async fn a_claim_stops_at_its_byte_budget_with_unbroken_runs() {
    let (db, _outbox) = common::migrated("bytes_budget").await;
    // 100 events of 100 KB: 10 aggregates of 10.
    enqueue(&db, OrderMode::Aggregate, 10, 10, 100 * KB).await;
    let relay = source(&db, OrderMode::Aggregate);

    let claims = drain(&relay, 1_000 * KB, 100).await;
    let (n, bytes_full) = claims[0];
    assert!(
        (8..=10).contains(&n),
        "a budget of 1 MB over events of 100 KB leases about 10, leased {n}"
    );
    assert!(bytes_full, "the budget, not the batch, cut the claim");
    // What the budget left was claimable at once, each run going on from where it stopped.
    let last = claims.len() - 1;
    for (i, &(n, bytes_full)) in claims.iter().enumerate() {
        assert!(
            i == last || (8..=10).contains(&n) && bytes_full,
            "claims of about 10 events until the last: {claims:?}"
        );
    }

    // Without a budget the same backlog goes in one claim.
    let (db, _outbox) = common::migrated("bytes_no_budget").await;
    enqueue(&db, OrderMode::Aggregate, 10, 10, 100 * KB).await;
    let claim = source(&db, OrderMode::Aggregate)
        .claim(500, usize::MAX)
        .await
        .unwrap();
    assert_eq!(claim.events.len(), 100);
    assert!(!claim.bytes_full);
}

#[tokio::test]
async fn an_event_larger_than_the_budget_is_claimed_alone_and_never_blocks_progress() {
    let (db, _outbox) = common::migrated("bytes_alone").await;
    enqueue(&db, OrderMode::Aggregate, 3, 4, 100 * KB).await;
    let relay = source(&db, OrderMode::Aggregate);
    let sizes = drain(&relay, 10 * KB, 12).await;
    assert!(
        sizes.iter().all(|&(n, _)| n == 1) && sizes.len() == 12,
        "one event per claim, every one of them: {sizes:?}"
    );
    // A budget of one byte still moves.
    let (db, _outbox) = common::migrated("bytes_one_byte").await;
    enqueue(&db, OrderMode::Aggregate, 2, 3, KB).await;
    let sizes = drain(&source(&db, OrderMode::Aggregate), 1, 6).await;
    assert!(
        sizes.iter().all(|&(n, _)| n == 1) && sizes.len() == 6,
        "{sizes:?}"
    );
}

#[tokio::test]
async fn a_global_claim_stops_at_its_byte_budget_in_global_order() {
    let (db, _outbox) = common::migrated("bytes_global").await;
    enqueue(&db, OrderMode::Global, 4, 10, 100 * KB).await;
    let relay = source(&db, OrderMode::Global);
    let mut next_global = 1;
    let mut sizes = Vec::new();
    while next_global <= 40 {
        let claim = relay.claim(500, 1_000 * KB).await.unwrap();
        assert!(
            !claim.events.is_empty(),
            "the budget blocked the global lane"
        );
        assert!(claim.events.len() == 1 || weight(&claim.events) <= 1_000 * KB);
        let mut globals: Vec<i64> = claim
            .events
            .iter()
            .map(|e| e.global_sequence.unwrap())
            .collect();
        globals.sort();
        let expected: Vec<i64> = (next_global..next_global + globals.len() as i64).collect();
        assert_eq!(globals, expected, "the global lane's unbroken front");
        next_global += globals.len() as i64;
        sizes.push(claim.events.len());
        mark_all(&relay, &claim).await;
    }
    assert!(
        (8..=10).contains(&sizes[0]),
        "a budget of 1 MB over events of 100 KB leases about 10: {sizes:?}"
    );
}
