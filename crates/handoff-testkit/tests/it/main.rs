//! The testkit against the real PostgreSQL and the real consumer: a handler whose effects all go
//! through the transaction passes every seed; one that counts outside the transaction (through
//! another connection, or in memory) is caught, and its failing seed replays the same run.

mod example;

use std::sync::atomic::{AtomicU64, Ordering};

use handoff_consumer::{ConsumerConfig, Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_testkit::{
    BoxError, Database, Events, Faults, HandlerCheck, Problem, Scenario, TestkitErrorKind,
};
use serde_json::json;
use sqlx::{PgConnection, PgPool};

/// Where a handler's effect goes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Effect {
    /// Through the consumer's transaction: exactly once.
    InTransaction,
    /// Through another connection of the pool: repeated by a redelivery after a rollback.
    OtherConnection,
    /// Into the handler's memory: the same.
    InMemory,
}

/// Keeps a running total per account, and a count of the events applied.
struct Ledger {
    effect: Effect,
    pool: PgPool,
    in_memory: AtomicU64,
    /// Fails permanently on this event type (a poison event), to check the quarantine.
    refuse: Option<&'static str>,
}

impl Handler for Ledger {
    async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
        if Some(e.event_type.as_str()) == self.refuse {
            return Err(HandlerError::permanent("refused on purpose"));
        }
        let amount: serde_json::Value =
            serde_json::from_str(&e.payload).map_err(|e| HandlerError::permanent(e.to_string()))?;
        let amount = amount["amount"].as_i64().unwrap_or(0);
        let upsert = "INSERT INTO balances (account, total) VALUES ($1, $2) \
                      ON CONFLICT (account) DO UPDATE SET total = balances.total + $2";
        sqlx::query(upsert)
            .bind(&e.aggregate_id)
            .bind(amount)
            .execute(&mut *tx)
            .await?;
        match self.effect {
            Effect::InTransaction => {
                sqlx::query("UPDATE applied SET n = n + 1")
                    .execute(&mut *tx)
                    .await?;
            }
            Effect::OtherConnection => {
                sqlx::query("UPDATE applied SET n = n + 1")
                    .execute(&self.pool)
                    .await?;
            }
            Effect::InMemory => {
                self.in_memory.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }
}

struct Accounts {
    effect: Effect,
    refuse: Option<&'static str>,
}

impl Scenario for Accounts {
    type Handler = Ledger;
    /// Each account's total, and how many events were applied.
    type State = (Vec<(String, i64)>, i64);

    async fn setup(&self, db: &Database) -> Result<Ledger, BoxError> {
        sqlx::raw_sql(
            "CREATE TABLE balances (account text PRIMARY KEY, total bigint NOT NULL); \
             CREATE TABLE applied (n bigint NOT NULL); INSERT INTO applied VALUES (0)",
        )
        .execute(db.pool())
        .await?;
        Ok(Ledger {
            effect: self.effect,
            pool: db.pool().clone(),
            in_memory: AtomicU64::new(0),
            refuse: self.refuse,
        })
    }

    async fn observe(&self, db: &Database, ledger: &Ledger) -> Result<Self::State, BoxError> {
        let totals = sqlx::query_as("SELECT account, total FROM balances ORDER BY account")
            .fetch_all(db.pool())
            .await?;
        let applied: i64 = match self.effect {
            Effect::InMemory => ledger.in_memory.load(Ordering::SeqCst) as i64,
            _ => {
                sqlx::query_scalar("SELECT n FROM applied")
                    .fetch_one(db.pool())
                    .await?
            }
        };
        Ok((totals, applied))
    }
}

/// 40 deposits and withdrawals over 5 accounts, plus one `Frozen` event on account a-2.
fn deposits() -> Events {
    let mut events = Events::new();
    for i in 0..40_i64 {
        let account = format!("a-{}", i % 5);
        let amount = if i % 3 == 0 { -i } else { i * 10 };
        events = events.event("account", &account, "Moved", json!({ "amount": amount }));
    }
    events.event("account", "a-2", "Frozen", json!({}))
}

fn check(effect: Effect) -> HandlerCheck<Accounts> {
    HandlerCheck::new(
        handoff_test::database_url(),
        Accounts {
            effect,
            refuse: None,
        },
        deposits(),
    )
}

#[tokio::test]
async fn a_handler_that_writes_only_through_its_transaction_passes_every_seed() {
    let report = check(Effect::InTransaction)
        .seeds(0..12)
        .run()
        .await
        .unwrap();
    report.assert_exactly_once();
    assert_eq!(report.seeds_run.len(), 12);
    // The clean run applied every event once (the check compares against it, so it must be
    // right itself).
    assert_eq!(report.expected.1, 41);
    assert_eq!(report.expected.0.len(), 5);
}

#[tokio::test]
async fn a_handler_that_counts_through_another_connection_is_caught_and_its_seed_replays() {
    let report = check(Effect::OtherConnection)
        .seeds(0..20)
        .run()
        .await
        .unwrap();
    let failure = report.failure.expect("a seed breaks exactly-once effect");
    match &failure.problem {
        Problem::StateDiffers { expected, found } => {
            // Balances went through the transaction and are right; the count did not.
            assert_eq!(expected.0, found.0);
            assert!(found.1 > expected.1, "{found:?} vs {expected:?}");
        }
        other => panic!("expected a state difference, got {other:?}"),
    }
    assert!(
        failure
            .trace
            .iter()
            .any(|l| l.contains("crash before the commit")),
        "the trace shows the crash that repeated the effect: {:#?}",
        failure.trace
    );
    let shown = failure.to_string();
    assert!(
        shown.contains(&format!("HANDOFF_TESTKIT_SEED={}", failure.seed)),
        "{shown}"
    );

    // The seed alone runs it again: the same deliveries, faults and trace, and the same
    // broken count.
    let replay = check(Effect::OtherConnection)
        .seeds(failure.seed..failure.seed + 1)
        .run()
        .await
        .unwrap();
    let again = replay.failure.expect("the replay fails too");
    assert_eq!(again.trace, failure.trace);
    assert_eq!(again.problem, failure.problem);
}

#[tokio::test]
async fn a_handler_that_counts_in_memory_is_caught() {
    let report = check(Effect::InMemory).seeds(0..20).run().await.unwrap();
    assert!(
        matches!(
            report.failure.map(|f| f.problem),
            Some(Problem::StateDiffers { .. })
        ),
        "a counter in memory is repeated by a redelivery"
    );
}

#[tokio::test]
async fn without_crashes_a_duplicate_delivery_is_absorbed_by_the_inbox() {
    // Redelivery, reordering and lost acknowledgements only: the inbox drops every copy before
    // the handler, so even the handler that counts outside its transaction passes. What breaks
    // it is the crash between the effect and the commit.
    let report = check(Effect::OtherConnection)
        .faults(Faults {
            crash_before_commit: 0.0,
            ..Faults::default()
        })
        .seeds(0..8)
        .run()
        .await
        .unwrap();
    report.assert_exactly_once();
}

#[tokio::test]
async fn a_poison_event_is_quarantined_in_every_run_alike() {
    let report = HandlerCheck::new(
        handoff_test::database_url(),
        Accounts {
            effect: Effect::InTransaction,
            refuse: Some("Frozen"),
        },
        deposits(),
    )
    .config(ConsumerConfig {
        name: "ledger".into(),
        batch: None,
        ..ConsumerConfig::default()
    })
    .seeds(0..6)
    .run()
    .await
    .unwrap();
    report.assert_exactly_once();
    // The refused event is not counted, in the clean run as in every seeded one.
    assert_eq!(report.expected.1, 40);
}

#[tokio::test]
async fn an_unreachable_database_is_a_typed_error() {
    let port = handoff_test::free_port().unwrap();
    let error = HandlerCheck::new(
        format!("postgres://postgres@127.0.0.1:{port}/test"),
        Accounts {
            effect: Effect::InTransaction,
            refuse: None,
        },
        deposits(),
    )
    .run()
    .await
    .unwrap_err();
    assert_eq!(error.kind(), TestkitErrorKind::Database);
}

/// docs/consumers.md shows `example.rs` as it is, so the example a user copies compiles and
/// passes.
#[test]
fn the_guide_shows_the_example_that_runs() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let page = std::fs::read_to_string(format!("{root}/docs/consumers.md")).unwrap();
    let section = &page[page.find("## Test your handler").expect("the section")..];
    let start = section.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let shown = &section[start..start + section[start..].find("```\n").unwrap()];
    let file = include_str!("example.rs");
    let code = &file[file.find("\n\n").unwrap() + 2..];
    assert_eq!(
        shown, code,
        "docs/consumers.md and tests/it/example.rs differ"
    );
}
