//! The source conformance suite: the outbox side's counterpart of the transport
//! [`conformance`](crate::conformance) and [`intake_conformance`](crate::intake_conformance)
//! suites. Every relay [`Source`] (the polling source, the log source, the logical source) runs
//! the same cases against the real PostgreSQL, so per-aggregate order, late and rolled-back
//! transactions, retries, holds, release, a second instance, takeover, holes and the global lane
//! are held to one contract.
//!
//! A source's crate implements [`SourceDriver`] in its `tests/it/source_conformance.rs` — how to
//! make a fresh migrated schema for a case and open a source on it under a relay id — and
//! invokes [`source_conformance_suite!`](crate::source_conformance_suite) inside a module, naming
//! the cases it runs and, for each case that does not apply to it, why:
//!
//! ```ignore
//! mod log {
//!     struct Log { db: TestDb }
//!     impl SourceDriver for Log { /* start, db, open */ }
//!     handoff_test::source_conformance_suite!(Log;
//!         run: [order_per_aggregate_across_batches, /* ... */],
//!         skip: [a_global_lane_comes_out_in_global_order =
//!             "the log source publishes aggregate order only"]);
//! }
//! ```
//!
//! A skipped case is written as an `#[ignore]`d test whose reason says why, so it shows as
//! skipped, not as passed; the macro also writes `every_case_is_run_or_skipped`, which fails when
//! a case of [`CASES`] is neither run nor skipped (a case added to the suite later).
//!
//! | case | invariant |
//! |---|---|
//! | [`order_per_aggregate_across_batches`] | many aggregates, claims smaller than the backlog: each aggregate's events come out 1, 2, 3 … across claims, each once when every claim is acknowledged |
//! | [`late_commit_is_not_missed_and_rollback_never_comes_out`] | a transaction begun before others and committed after them is published; a rolled-back one never |
//! | [`a_retry_comes_back_after_its_delay_and_holds_only_its_aggregate`] | a failure counted as an attempt with a retry delay: the event comes back after the delay and not before, its aggregate's later events never overtake it, other aggregates flow meanwhile |
//! | [`a_held_aggregate_waits_for_an_operator_retry`] | a failure held as `rejected`: nothing more of its aggregate comes out until [`Quarantine::retry`], then all of it in order |
//! | [`released_events_come_out_again`] | events given back at shutdown come out again, nothing lost, nothing twice once acknowledged |
//! | [`a_second_instance_never_duplicates_or_reorders`] | two sources (two relay ids) claiming and acknowledging side by side: no event twice, no reorder (a source whose second instance stands by passes too) |
//! | [`a_dead_instance_is_taken_over_after_its_lease`] | a source dropped with events in flight: after its lease another instance publishes what it left, in order, and not before the lease ran out (with what it acknowledged since its last write, where the source paces its progress: [`SourceDriver::PACES_PROGRESS`]) |
//! | [`a_hole_holds_its_aggregate_until_skipped`] | an event whose predecessor was never written is not published until an operator skips the hole ([`Quarantine::skip_missing`]); then the skip marker and the event, in order |
//! | [`a_global_lane_comes_out_in_global_order`] | events written in [`OrderMode::Global`] come out in their global sequence, each once |
//!
//! Each case makes its own schema ([`SourceDriver::start`]), so the cases run in parallel. Run
//! one source's suite with e.g. `cargo nextest run -p handoff-postgres --test it
//! source_conformance::log::`.
//!
//! What every case checks on every claim, whatever it is about (the [`Ledger`]): an event is
//! never handed out again once acknowledged, never handed out while another claim holds it, and
//! never before its aggregate's previous sequence was acknowledged unless that one is earlier
//! in the same claim (design P5). The one exception is a dead instance's last acknowledgements
//! where the source paces its progress ([`SourceDriver::PACES_PROGRESS`]): the takeover case
//! forgets them, so they may come out once more, in order.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use handoff_core::delivery::{Claim, Failure, OutboxEvent, Published, Receipt, Released, Source};
use handoff_core::{EventId, NewEvent, OrderMode};
use handoff_postgres::{Outbox, OutboxConfig, Quarantine, Schema};
use std::time::Instant;

use crate::{eventually, factory, TestDb};

/// Every case of the suite, by its function's name: what
/// [`source_conformance_suite!`](crate::source_conformance_suite) checks its lists against.
pub const CASES: &[&str] = &[
    "order_per_aggregate_across_batches",
    "late_commit_is_not_missed_and_rollback_never_comes_out",
    "a_retry_comes_back_after_its_delay_and_holds_only_its_aggregate",
    "a_held_aggregate_waits_for_an_operator_retry",
    "released_events_come_out_again",
    "a_second_instance_never_duplicates_or_reorders",
    "a_dead_instance_is_taken_over_after_its_lease",
    "a_hole_holds_its_aggregate_until_skipped",
    "a_global_lane_comes_out_in_global_order",
];

/// How long a case waits for events that must come out.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// How long a case keeps claiming to see that something does not come out: longer than any
/// source's own schedule for a parked aggregate (the log source looks at its lane every
/// 250 ms).
pub const QUIET: Duration = Duration::from_millis(1_200);

/// The lease the cases that take over open their sources with.
pub const SHORT_LEASE: Duration = Duration::from_secs(2);

/// The lease of every other source the cases open: longer than any case.
pub const LONG_LEASE: Duration = Duration::from_secs(120);

/// The retry delay of [`a_retry_comes_back_after_its_delay_and_holds_only_its_aggregate`].
pub const RETRY_DELAY: Duration = Duration::from_secs(3);

/// What the suite needs from a source's crate: implemented once per source, in the crate's
/// `tests/it/source_conformance.rs`. See the [module documentation](self).
pub trait SourceDriver: Sized {
    /// The source under test.
    type Source: Source;

    /// A short name for failure messages: `polling`, `log`, `logical`.
    const NAME: &'static str;

    /// A fresh schema with handoff's migrations (and whatever the source needs besides) for
    /// the case named `case` (one of [`CASES`]); nothing written in the outbox yet.
    ///
    /// Panics when it cannot: the case cannot go on.
    fn start(case: &'static str) -> impl Future<Output = Self>;

    /// The case's schema.
    fn db(&self) -> &TestDb;

    /// A new source on the case's schema, for relay `relay_id`, leasing what it claims (and
    /// whatever it holds besides, such as a cursor) for `lease`. The suite opens a source
    /// before it writes the events the source must find.
    fn open(&self, relay_id: &str, lease: Duration) -> impl Future<Output = Self::Source>;

    /// Whether the source writes its acknowledged progress at an interval rather than at each
    /// acknowledgement (the log source's [`advance_every`](handoff_postgres::LogConfig)): then
    /// the events a dead instance acknowledged since its last write may be handed out again by
    /// its heir, once, in order, as at-least-once allows. A clean stop writes them first.
    const PACES_PROGRESS: bool = false;

    /// A source publishing the global lane ([`OrderMode::Global`]); `None` where the source
    /// has none (the case is then skipped by the driver's suite).
    fn open_global(&self, relay_id: &str) -> impl Future<Output = Option<Self::Source>> {
        let _ = relay_id;
        async { None }
    }
}

/// An aggregate: its id (every case's events have [`factory::AGGREGATE_TYPE`]).
type Aggregate = String;

/// What the sources of one case handed out and what was acknowledged, checked at every claim.
#[derive(Debug, Default)]
pub struct Ledger {
    /// The highest acknowledged sequence of each aggregate.
    acked: HashMap<Aggregate, i64>,
    /// Acknowledged event ids.
    acked_ids: HashSet<EventId>,
    /// Events handed out and not settled yet.
    in_flight: HashSet<EventId>,
    /// Every event handed out, in order, with the claim's instant.
    handed_out: Vec<(Instant, OutboxEvent)>,
}

impl Ledger {
    /// Checks a claim `who` got against what was handed out and acknowledged so far, and
    /// records it as in flight. Panics naming the source when the claim breaks the contract.
    pub fn claimed(&mut self, name: &str, who: &str, claim: &Claim) {
        let now = Instant::now();
        // The relay publishes a claim as one lane per aggregate in sequence order, one lane in
        // global order for the global lane (`lanes_of` in handoff-relay): the contract is that
        // each aggregate's events in a claim are an unbroken run from its next sequence.
        let mut events: Vec<&OutboxEvent> = claim.events.iter().collect();
        events.sort_by_key(|e| (e.global_sequence, e.aggregate_sequence));
        let mut in_claim: HashMap<&str, i64> = HashMap::new();
        for e in events {
            let what = format!(
                "{name}: {who} handed out {}#{}",
                e.aggregate_id, e.aggregate_sequence
            );
            assert!(
                !self.acked_ids.contains(&e.event_id),
                "{what} again after it was acknowledged"
            );
            assert!(
                self.in_flight.insert(e.event_id),
                "{what} while another claim holds it"
            );
            let before = in_claim
                .get(e.aggregate_id.as_str())
                .copied()
                .or_else(|| self.acked.get(&e.aggregate_id).copied())
                .unwrap_or(0);
            assert_eq!(
                e.aggregate_sequence,
                before + 1,
                "{what} when its aggregate's last event acknowledged or earlier in the claim is #{before} (the claim: {})",
                summary(&claim.events)
            );
            in_claim.insert(&e.aggregate_id, e.aggregate_sequence);
            self.handed_out.push((now, e.clone()));
        }
    }

    /// Records `events` as acknowledged.
    pub fn acked<'a>(&mut self, events: impl IntoIterator<Item = &'a OutboxEvent>) {
        for e in events {
            self.in_flight.remove(&e.event_id);
            self.acked_ids.insert(e.event_id);
            let top = self.acked.entry(e.aggregate_id.clone()).or_default();
            *top = (*top).max(e.aggregate_sequence);
        }
    }

    /// Records `events` as given back (failed, released, or left by a dead source): they may be
    /// handed out again.
    pub fn settled_unpublished<'a>(&mut self, events: impl IntoIterator<Item = &'a OutboxEvent>) {
        for e in events {
            self.in_flight.remove(&e.event_id);
        }
    }

    /// Forgets that `events` were acknowledged, by a source whose progress since its last
    /// write died with it ([`SourceDriver::PACES_PROGRESS`]): they, and what followed them in
    /// their aggregates, may be handed out again, in order.
    pub fn forgotten<'a>(&mut self, events: impl IntoIterator<Item = &'a OutboxEvent>) {
        for e in events {
            self.acked_ids.remove(&e.event_id);
            if let Some(top) = self.acked.get_mut(&e.aggregate_id) {
                *top = (*top).min(e.aggregate_sequence - 1);
            }
        }
    }

    /// The acknowledged sequences of `aggregate`: 1 ..= the highest acknowledged.
    pub fn acked_through(&self, aggregate: &str) -> i64 {
        self.acked.get(aggregate).copied().unwrap_or(0)
    }

    /// How many events were acknowledged.
    pub fn acked_count(&self) -> usize {
        self.acked_ids.len()
    }

    /// Every event of `aggregate` handed out, with when, in order.
    pub fn handed_out_of<'a>(
        &'a self,
        aggregate: &'a str,
    ) -> impl Iterator<Item = &'a (Instant, OutboxEvent)> + 'a {
        self.handed_out
            .iter()
            .filter(move |(_, e)| e.aggregate_id == aggregate)
    }
}

/// `aggregate#sequence` of each event, for failure messages.
fn summary<'a>(events: impl IntoIterator<Item = &'a OutboxEvent>) -> String {
    let named: Vec<String> = events
        .into_iter()
        .map(|e| format!("{}#{}", e.aggregate_id, e.aggregate_sequence))
        .collect();
    named.join(" ")
}

/// The test outbox on the driver's schema, in `order` mode.
fn outbox<D: SourceDriver>(driver: &D, order: OrderMode) -> Outbox {
    let config = OutboxConfig {
        schema: schema(driver),
        order,
        ..OutboxConfig::default()
    };
    Outbox::new(config, factory::catalog()).expect("the test catalog is valid")
}

fn schema<D: SourceDriver>(driver: &D) -> Schema {
    Schema::named(driver.db().schema()).expect("a test schema's name is a plain identifier")
}

/// Commits `events` in one transaction.
async fn commit<D: SourceDriver>(driver: &D, outbox: &Outbox, events: &[NewEvent]) {
    let mut tx = driver.db().pool.begin().await.expect("begin");
    outbox
        .enqueue(&mut tx, events)
        .await
        .unwrap_or_else(|e| panic!("{}: enqueue: {e}", D::NAME));
    tx.commit().await.expect("commit");
}

/// Claims up to `max` events and checks them against the ledger.
async fn claim<D: SourceDriver>(
    source: &D::Source,
    ledger: &mut Ledger,
    who: &str,
    max: usize,
) -> Claim {
    let claim = source
        .claim(max, usize::MAX)
        .await
        .unwrap_or_else(|e| panic!("{}: {who}'s claim: {e}", D::NAME));
    ledger.claimed(D::NAME, who, &claim);
    claim
}

/// Acknowledges `events` of `claim`, as the relay does once the broker acked them.
async fn ack<'a, D: SourceDriver>(
    source: &D::Source,
    ledger: &mut Ledger,
    claim: &Claim,
    events: impl IntoIterator<Item = &'a OutboxEvent> + Clone,
) {
    let published: Vec<Published> = events
        .clone()
        .into_iter()
        .map(|e| Published {
            event_id: e.event_id,
            receipt: Receipt::new("source conformance"),
            lease: claim.lease,
        })
        .collect();
    if published.is_empty() {
        return;
    }
    source
        .mark_published(&published)
        .await
        .unwrap_or_else(|e| panic!("{}: mark published: {e}", D::NAME));
    ledger.acked(events);
}

/// Gives `events` of `claim` back unpublished, as the relay does at shutdown or behind a
/// failed event of the same aggregate.
async fn release<'a, D: SourceDriver>(
    source: &D::Source,
    ledger: &mut Ledger,
    claim: &Claim,
    events: impl IntoIterator<Item = &'a OutboxEvent> + Clone,
) {
    let released: Vec<Released> = events
        .clone()
        .into_iter()
        .map(|e| Released {
            event_id: e.event_id,
            lease: claim.lease,
        })
        .collect();
    if released.is_empty() {
        return;
    }
    let settled = source
        .release(&released)
        .await
        .unwrap_or_else(|e| panic!("{}: release: {e}", D::NAME));
    assert_eq!(
        settled.stale,
        0,
        "{}: a release under a live lease",
        D::NAME
    );
    ledger.settled_unpublished(events);
}

/// Records `failure` for the event `failed` of `claim` and releases the events of its
/// aggregate behind it in the claim, as the relay does.
async fn fail<D: SourceDriver>(
    source: &D::Source,
    ledger: &mut Ledger,
    claim: &Claim,
    failed: &OutboxEvent,
    retry_after: Option<Duration>,
    hold_reason: Option<&'static str>,
) {
    let failure = Failure {
        event_id: failed.event_id,
        error: "refused by the conformance suite".into(),
        retry_after,
        counts_as_attempt: true,
        hold_reason,
        lease: claim.lease,
    };
    let settled = source
        .record_failures(&[failure])
        .await
        .unwrap_or_else(|e| panic!("{}: record failure: {e}", D::NAME));
    assert_eq!(
        settled.stale,
        0,
        "{}: a failure under a live lease",
        D::NAME
    );
    ledger.settled_unpublished([failed]);
    let behind: Vec<&OutboxEvent> = claim
        .events
        .iter()
        .filter(|e| {
            e.aggregate_id == failed.aggregate_id
                && e.aggregate_sequence > failed.aggregate_sequence
        })
        .collect();
    release::<D>(source, ledger, claim, behind).await;
}

/// Claims (up to `max` at a time) and acknowledges everything, as a healthy relay does, until
/// `done` holds of the ledger; panics after [`DEADLINE`].
async fn drain_until<D: SourceDriver>(
    source: &D::Source,
    ledger: &mut Ledger,
    max: usize,
    what: &str,
    done: impl Fn(&Ledger) -> bool,
) {
    let what = format!("{}: {what}", D::NAME);
    eventually(&what, DEADLINE, async || {
        let claim = claim::<D>(source, ledger, "the relay", max).await;
        ack::<D>(source, ledger, &claim, &claim.events).await;
        if done(ledger) {
            Ok(())
        } else {
            Err(format!(
                "{} acknowledged, handed out: {}",
                ledger.acked_count(),
                summary(ledger.handed_out.iter().map(|(_, e)| e))
            ))
        }
    })
    .await;
}

/// Claims and acknowledges everything for `window`, waiting between claims on the source's
/// own wake-up: what comes out in it is in the ledger. For what must not come out, there is no
/// event to wait for, so the case looks for a while.
async fn drain_for<D: SourceDriver>(source: &D::Source, ledger: &mut Ledger, window: Duration) {
    let until = Instant::now() + window;
    while Instant::now() < until {
        let claim = claim::<D>(source, ledger, "the relay", 100).await;
        let empty = claim.events.is_empty();
        ack::<D>(source, ledger, &claim, &claim.events).await;
        if empty {
            source
                .wait_for_work(crate::POLL_INTERVAL * 5)
                .await
                .unwrap_or_else(|e| panic!("{}: wait for work: {e}", D::NAME));
        }
    }
}

/// Opens the case's first source and claims once, before any event is written: a source that
/// starts from "now" (the log source's cursor) starts before the case's events.
async fn open_first<D: SourceDriver>(driver: &D, relay_id: &str, lease: Duration) -> D::Source {
    let source = driver.open(relay_id, lease).await;
    let claim = source
        .claim(100, usize::MAX)
        .await
        .unwrap_or_else(|e| panic!("{}: the first claim: {e}", D::NAME));
    assert!(
        claim.events.is_empty(),
        "{}: a claim on an empty outbox handed out {:?}",
        D::NAME,
        claim.events
    );
    source
}

/// Order per aggregate across batches: 12 aggregates of 15 events each, written interleaved
/// in transactions of several aggregates, claimed 7 at a time and every claim acknowledged:
/// each aggregate's events come out 1, 2, 3 … 15, each once; nothing comes out after.
pub async fn order_per_aggregate_across_batches<D: SourceDriver>() {
    const AGGREGATES: usize = 12;
    const EVENTS: u64 = 15;
    let driver = D::start("order_per_aggregate_across_batches").await;
    let source = open_first(&driver, "relay-a", LONG_LEASE).await;
    let outbox = outbox(&driver, OrderMode::Aggregate);
    let names: Vec<String> = (0..AGGREGATES).map(|n| format!("order-{n}")).collect();
    for n in 0..EVENTS {
        // Two transactions per round, each with half the aggregates, so that a claim's
        // boundary falls inside transactions and between them.
        for half in names.chunks(AGGREGATES / 2) {
            let events: Vec<NewEvent> = half.iter().map(|a| factory::event(a, n)).collect();
            commit(&driver, &outbox, &events).await;
        }
    }
    let mut ledger = Ledger::default();
    let total = AGGREGATES * EVENTS as usize;
    drain_until::<D>(&source, &mut ledger, 7, "every event acknowledged", |l| {
        l.acked_count() >= total
    })
    .await;
    drain_for::<D>(&source, &mut ledger, QUIET / 2).await;
    for name in &names {
        assert_eq!(
            ledger.acked_through(name),
            EVENTS as i64,
            "{}: {name}",
            D::NAME
        );
    }
    assert_eq!(
        ledger.handed_out.len(),
        total,
        "{}: each event handed out once",
        D::NAME
    );
}

/// A transaction that began before others and commits after them is published (a source that
/// reads in commit order or by position must not have passed it); one that rolls back never
/// comes out.
pub async fn late_commit_is_not_missed_and_rollback_never_comes_out<D: SourceDriver>() {
    let driver = D::start("late_commit_is_not_missed_and_rollback_never_comes_out").await;
    let source = open_first(&driver, "relay-a", LONG_LEASE).await;
    let outbox = outbox(&driver, OrderMode::Aggregate);
    let mut late = driver.db().pool.begin().await.expect("begin");
    outbox
        .enqueue(&mut late, &[factory::event("late", 1)])
        .await
        .expect("enqueue the late event");
    let mut undone = driver.db().pool.begin().await.expect("begin");
    outbox
        .enqueue(&mut undone, &[factory::event("undone", 1)])
        .await
        .expect("enqueue the rolled-back event");
    for n in 1..=3 {
        commit(&driver, &outbox, &[factory::event("early", n)]).await;
    }
    let mut ledger = Ledger::default();
    drain_until::<D>(&source, &mut ledger, 100, "the early events", |l| {
        l.acked_through("early") == 3
    })
    .await;
    assert_eq!(ledger.handed_out_of("late").count(), 0, "{}", D::NAME);
    undone.rollback().await.expect("rollback");
    late.commit().await.expect("commit the late transaction");
    commit(&driver, &outbox, &[factory::event("after", 1)]).await;
    drain_until::<D>(&source, &mut ledger, 100, "the late event", |l| {
        l.acked_through("late") == 1 && l.acked_through("after") == 1
    })
    .await;
    drain_for::<D>(&source, &mut ledger, QUIET / 2).await;
    assert_eq!(
        ledger.handed_out_of("undone").count(),
        0,
        "{}: a rolled-back event came out",
        D::NAME
    );
}

/// A failure counted as an attempt, retried after [`RETRY_DELAY`]: the event does not come
/// out before the delay and does after it, with the attempt counted; its aggregate's later
/// events (written before and after the failure) never overtake it; another aggregate's
/// events, also those written after the failure, come out while it waits.
pub async fn a_retry_comes_back_after_its_delay_and_holds_only_its_aggregate<D: SourceDriver>() {
    let driver = D::start("a_retry_comes_back_after_its_delay_and_holds_only_its_aggregate").await;
    let source = open_first(&driver, "relay-a", LONG_LEASE).await;
    let outbox = outbox(&driver, OrderMode::Aggregate);
    for n in 1..=3 {
        commit(
            &driver,
            &outbox,
            &[factory::event("slow", n), factory::event("other", n)],
        )
        .await;
    }
    let mut ledger = Ledger::default();
    let first = eventually(
        &format!("{}: slow#1 handed out", D::NAME),
        DEADLINE,
        async || {
            let claim = claim::<D>(&source, &mut ledger, "the relay", 100).await;
            let others: Vec<&OutboxEvent> = claim
                .events
                .iter()
                .filter(|e| e.aggregate_id != "slow")
                .collect();
            ack::<D>(&source, &mut ledger, &claim, others).await;
            if claim.events.iter().any(|e| e.aggregate_id == "slow") {
                Ok(claim)
            } else {
                Err(format!("{} acknowledged", ledger.acked_count()))
            }
        },
    )
    .await;
    let failed = first
        .events
        .iter()
        .find(|e| e.aggregate_id == "slow")
        .expect("found above")
        .clone();
    assert_eq!(failed.aggregate_sequence, 1, "{}", D::NAME);
    let failed_at = Instant::now();
    fail::<D>(
        &source,
        &mut ledger,
        &first,
        &failed,
        Some(RETRY_DELAY),
        None,
    )
    .await;
    commit(
        &driver,
        &outbox,
        &[factory::event("slow", 4), factory::event("other", 4)],
    )
    .await;

    drain_until::<D>(&source, &mut ledger, 100, "the other aggregate", |l| {
        l.acked_through("other") == 4
    })
    .await;
    assert!(
        failed_at.elapsed() < RETRY_DELAY,
        "{}: the other aggregate waited for the retry delay of slow#1 ({:?})",
        D::NAME,
        failed_at.elapsed()
    );
    drain_until::<D>(
        &source,
        &mut ledger,
        100,
        "slow#1..4 after the delay",
        |l| l.acked_through("slow") == 4,
    )
    .await;
    let again: Vec<&(Instant, OutboxEvent)> = ledger
        .handed_out_of("slow")
        .filter(|(at, _)| *at > failed_at)
        .collect();
    let (at, retried) = again.first().expect("slow came out again");
    assert_eq!(
        (retried.event_id, retried.attempt_count),
        (failed.event_id, failed.attempt_count + 1),
        "{}: the failed event first, its attempt counted",
        D::NAME
    );
    assert!(
        *at >= failed_at + RETRY_DELAY,
        "{}: slow#1 came out {:?} after its failure, before its retry delay of {RETRY_DELAY:?}",
        D::NAME,
        *at - failed_at
    );
}

/// A failure held as `rejected`: nothing more of its aggregate comes out, also what is
/// written after it, while other aggregates flow; once an operator retries it
/// ([`Quarantine::retry`]) all of it comes out, in order.
pub async fn a_held_aggregate_waits_for_an_operator_retry<D: SourceDriver>() {
    let driver = D::start("a_held_aggregate_waits_for_an_operator_retry").await;
    let source = open_first(&driver, "relay-a", LONG_LEASE).await;
    let outbox = outbox(&driver, OrderMode::Aggregate);
    for n in 1..=3 {
        commit(
            &driver,
            &outbox,
            &[factory::event("poison", n), factory::event("ok", n)],
        )
        .await;
    }
    let mut ledger = Ledger::default();
    let first = eventually(
        &format!("{}: poison#1 handed out", D::NAME),
        DEADLINE,
        async || {
            let claim = claim::<D>(&source, &mut ledger, "the relay", 100).await;
            let others: Vec<&OutboxEvent> = claim
                .events
                .iter()
                .filter(|e| e.aggregate_id != "poison")
                .collect();
            ack::<D>(&source, &mut ledger, &claim, others).await;
            if claim.events.iter().any(|e| e.aggregate_id == "poison") {
                Ok(claim)
            } else {
                Err(format!("{} acknowledged", ledger.acked_count()))
            }
        },
    )
    .await;
    let held = first
        .events
        .iter()
        .find(|e| e.aggregate_id == "poison")
        .expect("found above")
        .clone();
    let held_at = Instant::now();
    fail::<D>(&source, &mut ledger, &first, &held, None, Some("rejected")).await;
    commit(
        &driver,
        &outbox,
        &[factory::event("poison", 4), factory::event("ok", 4)],
    )
    .await;
    drain_until::<D>(&source, &mut ledger, 100, "the healthy aggregate", |l| {
        l.acked_through("ok") == 4
    })
    .await;
    drain_for::<D>(&source, &mut ledger, QUIET).await;
    let out_while_held: Vec<OutboxEvent> = ledger
        .handed_out_of("poison")
        .filter(|(at, _)| *at > held_at)
        .map(|(_, e)| e.clone())
        .collect();
    assert!(
        out_while_held.is_empty(),
        "{}: handed out while poison#1 is held: {}",
        D::NAME,
        summary(&out_while_held)
    );

    let quarantine = Quarantine::new(&schema(&driver));
    let mut conn = driver.db().pool.acquire().await.expect("acquire");
    let listed = quarantine
        .list(&mut conn, 100)
        .await
        .unwrap_or_else(|e| panic!("{}: quarantine list: {e}", D::NAME));
    assert_eq!(
        listed
            .iter()
            .map(|q| (q.event_id, q.hold_reason.as_deref()))
            .collect::<Vec<_>>(),
        vec![(held.event_id, Some("rejected"))],
        "{}: the quarantine lists the held event",
        D::NAME
    );
    quarantine
        .retry(&mut conn, held.event_id, "conformance")
        .await
        .unwrap_or_else(|e| panic!("{}: quarantine retry: {e}", D::NAME));
    drop(conn);
    drain_until::<D>(
        &source,
        &mut ledger,
        100,
        "poison#1..4 after the retry",
        |l| l.acked_through("poison") == 4,
    )
    .await;
}

/// Release at shutdown: a claim of several aggregates is given back unpublished (part of it
/// after its first events were acknowledged); every released event comes out again, in order,
/// and once all is acknowledged each event was acknowledged once and nothing more comes out.
pub async fn released_events_come_out_again<D: SourceDriver>() {
    let driver = D::start("released_events_come_out_again").await;
    let source = open_first(&driver, "relay-a", LONG_LEASE).await;
    let outbox = outbox(&driver, OrderMode::Aggregate);
    let names: Vec<String> = (0..5).map(|n| format!("rel-{n}")).collect();
    for n in 1..=4 {
        let events: Vec<NewEvent> = names.iter().map(|a| factory::event(a, n)).collect();
        commit(&driver, &outbox, &events).await;
    }
    let mut ledger = Ledger::default();
    let claim = eventually(&format!("{}: a claim", D::NAME), DEADLINE, async || {
        let claim = claim::<D>(&source, &mut ledger, "the relay", 12).await;
        if claim.events.is_empty() {
            Err("nothing claimed")
        } else {
            Ok(claim)
        }
    })
    .await;
    // Each aggregate's first event in the claim published, the rest in flight at shutdown.
    let mut firsts = HashSet::new();
    let (acked, released): (Vec<&OutboxEvent>, Vec<&OutboxEvent>) = claim
        .events
        .iter()
        .partition(|e| firsts.insert(e.aggregate_id.clone()));
    ack::<D>(&source, &mut ledger, &claim, acked).await;
    release::<D>(&source, &mut ledger, &claim, released.iter().copied()).await;
    drain_until::<D>(
        &source,
        &mut ledger,
        5,
        "every event after the release",
        |l| l.acked_count() == 20,
    )
    .await;
    drain_for::<D>(&source, &mut ledger, QUIET / 2).await;
    for e in released {
        assert!(
            ledger
                .handed_out
                .iter()
                .filter(|(_, o)| o.event_id == e.event_id)
                .count()
                == 2,
            "{}: released {}#{} came out again, once",
            D::NAME,
            e.aggregate_id,
            e.aggregate_sequence
        );
    }
}

/// Two instances (two relay ids) beside each other, claiming in turns and acknowledging
/// everything: no event comes out twice, no aggregate's events out of order, everything
/// comes out. Where a source's second instance stands by (the log source's cursor has one
/// reader), it gets nothing, which passes: the case is about duplicates and order.
pub async fn a_second_instance_never_duplicates_or_reorders<D: SourceDriver>() {
    let driver = D::start("a_second_instance_never_duplicates_or_reorders").await;
    let a = open_first(&driver, "relay-a", LONG_LEASE).await;
    let b = open_first(&driver, "relay-b", LONG_LEASE).await;
    let outbox = outbox(&driver, OrderMode::Aggregate);
    let names: Vec<String> = (0..8).map(|n| format!("two-{n}")).collect();
    let mut ledger = Ledger::default();
    let mut written = 0;
    for n in 1..=10 {
        let events: Vec<NewEvent> = names.iter().map(|a| factory::event(a, n)).collect();
        commit(&driver, &outbox, &events).await;
        written += events.len();
        // Claims taken while writers write: both hold claims at once, then settle.
        let from_a = claim::<D>(&a, &mut ledger, "relay-a", 5).await;
        let from_b = claim::<D>(&b, &mut ledger, "relay-b", 5).await;
        ack::<D>(&b, &mut ledger, &from_b, &from_b.events).await;
        ack::<D>(&a, &mut ledger, &from_a, &from_a.events).await;
    }
    let what = format!("{}: everything from the two instances", D::NAME);
    eventually(&what, DEADLINE, async || {
        let from_a = claim::<D>(&a, &mut ledger, "relay-a", 5).await;
        let from_b = claim::<D>(&b, &mut ledger, "relay-b", 5).await;
        ack::<D>(&a, &mut ledger, &from_a, &from_a.events).await;
        ack::<D>(&b, &mut ledger, &from_b, &from_b.events).await;
        if ledger.acked_count() == written {
            Ok(())
        } else {
            Err(format!(
                "{} of {written} acknowledged",
                ledger.acked_count()
            ))
        }
    })
    .await;
    assert_eq!(
        ledger.handed_out.len(),
        written,
        "{}: each event handed out once",
        D::NAME
    );
}

/// Takeover: a source with a short lease claims, acknowledges part of its claim and dies
/// (dropped: nothing released, nothing said to the database). Another instance publishes
/// what it left, in order and each once, but none of its leased events before that lease ran
/// out.
pub async fn a_dead_instance_is_taken_over_after_its_lease<D: SourceDriver>() {
    let driver = D::start("a_dead_instance_is_taken_over_after_its_lease").await;
    let dead = open_first(&driver, "relay-dead", SHORT_LEASE).await;
    let outbox = outbox(&driver, OrderMode::Aggregate);
    for n in 1..=10 {
        commit(&driver, &outbox, &[factory::event("k", n)]).await;
    }
    let mut ledger = Ledger::default();
    let claim = eventually(
        &format!("{}: the first instance claims 4", D::NAME),
        DEADLINE,
        async || {
            let claim = claim::<D>(&dead, &mut ledger, "relay-dead", 4).await;
            if claim.events.is_empty() {
                Err("nothing claimed")
            } else {
                Ok(claim)
            }
        },
    )
    .await;
    assert_eq!(
        claim.events.len(),
        4,
        "{}: a claim of 4 of 10 ready events",
        D::NAME
    );
    let lease_end = claim.lease_deadline;
    ack::<D>(&dead, &mut ledger, &claim, &claim.events[..2]).await;
    drop(dead);
    let died_at = Instant::now();
    // Another process, started after the first died.
    let heir = driver.open("relay-heir", SHORT_LEASE).await;
    // What it left in flight may be handed out again, once its lease ran out; and what it
    // acknowledged just before it died, where the source writes its progress at an interval.
    ledger.settled_unpublished(&claim.events[2..]);
    if D::PACES_PROGRESS {
        ledger.forgotten(&claim.events[..2]);
    }
    drain_until::<D>(&heir, &mut ledger, 3, "the heir publishes k#3..10", |l| {
        l.acked_through("k") == 10
    })
    .await;
    let (at, first) = ledger
        .handed_out_of("k")
        .find(|(at, _)| *at > died_at)
        .map(|(at, e)| (*at, e.clone()))
        .expect("the heir handed k out");
    // From k#3, where the dead instance's acknowledgements stopped; or from k#1, where they
    // had not been written yet.
    let resumed_at = if D::PACES_PROGRESS {
        vec![1, 3]
    } else {
        vec![3]
    };
    assert!(
        resumed_at.contains(&first.aggregate_sequence),
        "{}: the heir began at k#{}",
        D::NAME,
        first.aggregate_sequence
    );
    let taken = ledger
        .handed_out_of("k")
        .filter(|(_, e)| e.event_id == first.event_id)
        .count();
    assert_eq!(
        taken,
        2,
        "{}: k#{} once by each instance",
        D::NAME,
        first.aggregate_sequence
    );
    if let Some(lease_end) = lease_end {
        // The claim's deadline is measured from before the claim: never later than the lease.
        assert!(
            at >= lease_end,
            "{}: the heir took k#{} {:?} before the dead instance's lease ran out",
            D::NAME,
            first.aggregate_sequence,
            lease_end - at
        );
    }
}

/// A hole: an event whose predecessor was never written (an outside writer's INSERT) is not
/// published, while its aggregate's earlier events and other aggregates are; once an operator
/// skips the missing sequence ([`Quarantine::skip_missing`]), the skip marker and the event
/// come out, in order.
pub async fn a_hole_holds_its_aggregate_until_skipped<D: SourceDriver>() {
    let driver = D::start("a_hole_holds_its_aggregate_until_skipped").await;
    let source = open_first(&driver, "relay-a", LONG_LEASE).await;
    let outbox = outbox(&driver, OrderMode::Aggregate);
    commit(&driver, &outbox, &[factory::event("holed", 1)]).await;
    // An outside writer, bypassing enqueue's check: holed#3, never holed#2.
    let outbox_table = schema(&driver).qualify("outbox");
    sqlx::query(&format!(
        "INSERT INTO {outbox_table} (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                                     event_type, schema_version, payload)
         SELECT $1, aggregate_type, aggregate_id, 3, event_type, schema_version, payload
         FROM {outbox_table} WHERE aggregate_id = 'holed' AND aggregate_sequence = 1"
    ))
    .bind(uuid::Uuid::now_v7())
    .execute(&driver.db().pool)
    .await
    .unwrap_or_else(|e| panic!("{}: the outside INSERT: {e}", D::NAME));
    commit(&driver, &outbox, &[factory::event("whole", 1)]).await;
    let mut ledger = Ledger::default();
    drain_until::<D>(&source, &mut ledger, 100, "holed#1 and whole#1", |l| {
        l.acked_through("holed") == 1 && l.acked_through("whole") == 1
    })
    .await;
    commit(&driver, &outbox, &[factory::event("whole", 2)]).await;
    drain_until::<D>(&source, &mut ledger, 100, "whole#2 beside the hole", |l| {
        l.acked_through("whole") == 2
    })
    .await;
    drain_for::<D>(&source, &mut ledger, QUIET).await;
    assert_eq!(
        ledger.handed_out_of("holed").count(),
        1,
        "{}: holed#3 came out across the hole",
        D::NAME
    );

    let quarantine = Quarantine::new(&schema(&driver));
    let mut conn = driver.db().pool.acquire().await.expect("acquire");
    quarantine
        .skip_missing(
            &mut conn,
            factory::AGGREGATE_TYPE,
            "holed",
            2,
            "never written",
            "conformance",
        )
        .await
        .unwrap_or_else(|e| panic!("{}: skip the hole: {e}", D::NAME));
    drop(conn);
    drain_until::<D>(&source, &mut ledger, 100, "the marker and holed#3", |l| {
        l.acked_through("holed") == 3
    })
    .await;
    let marker = ledger
        .handed_out_of("holed")
        .find(|(_, e)| e.aggregate_sequence == 2)
        .map(|(_, e)| e.clone())
        .expect("the marker came out");
    assert_eq!(
        marker.payload,
        "null",
        "{}: holed#2 is a skip marker",
        D::NAME
    );
}

/// The global lane: events written in [`OrderMode::Global`] by several aggregates, in several
/// transactions, claimed a few at a time, come out in their global sequence (1, 2, 3 … over the
/// lane) and each once. For a source without a global lane
/// ([`SourceDriver::open_global`] is `None`) the driver's suite skips the case.
pub async fn a_global_lane_comes_out_in_global_order<D: SourceDriver>() {
    let driver = D::start("a_global_lane_comes_out_in_global_order").await;
    let Some(source) = driver.open_global("relay-global").await else {
        panic!(
            "{}: no global lane: skip the case in the driver's suite, saying why",
            D::NAME
        );
    };
    let outbox = outbox(&driver, OrderMode::Global);
    for n in 1..=5 {
        commit(
            &driver,
            &outbox,
            &[factory::event("g-a", n), factory::event("g-b", n)],
        )
        .await;
        commit(&driver, &outbox, &[factory::event("g-c", n)]).await;
    }
    let mut ledger = Ledger::default();
    drain_until::<D>(&source, &mut ledger, 4, "the global lane", |l| {
        l.acked_count() == 15
    })
    .await;
    let globals: Vec<Option<i64>> = ledger
        .handed_out
        .iter()
        .map(|(_, e)| e.global_sequence)
        .collect();
    let first = globals.first().copied().flatten().unwrap_or_default();
    let expected: Vec<Option<i64>> = (first..first + 15).map(Some).collect();
    assert_eq!(
        globals,
        expected,
        "{}: the lane in global order, each once",
        D::NAME
    );
}

/// Writes one `#[tokio::test]` per case of the [source conformance suite](self) for a
/// [`SourceDriver`]: `run` lists the cases that apply, `skip` each other case with why (an
/// `#[ignore]`d test with that reason). Also writes `every_case_is_run_or_skipped`.
#[macro_export]
macro_rules! source_conformance_suite {
    ($driver:ty; run: [$($case:ident),* $(,)?], skip: [$($skipped:ident = $why:literal),* $(,)?] $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::source_conformance::$case::<$driver>().await;
            }
        )*
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = $why]
            async fn $skipped() {
                $crate::source_conformance::$skipped::<$driver>().await;
            }
        )*

        #[test]
        fn every_case_is_run_or_skipped() {
            let mut listed: ::std::vec::Vec<&str> =
                ::std::vec![$(stringify!($case),)* $(stringify!($skipped),)*];
            listed.sort_unstable();
            let mut cases = $crate::source_conformance::CASES.to_vec();
            cases.sort_unstable();
            assert_eq!(listed, cases, "run or skip every case of the suite, once");
        }
    };
}
