//! The CDC source (`handoff relay --source logical`) as real processes against a private
//! logical-replication PostgreSQL and the shared nats-server (design P9, F4, V1, V2): a relay
//! SIGKILLed between the broker's ack and the slot's confirmation, and the lost-slot drill with
//! its alert and its recovery (`handoff cdc setup --recreate-lost-slot`).
//!
//! Each test has a cluster of its own (a slot is cluster-wide state, and the drill destroys
//! it), set up the way an operator would: `handoff migrate`, then `handoff cdc setup`.

// Built without `failpoints`, the crash-window test is left out, and its helpers go unused.
#![cfg_attr(not(feature = "failpoints"), allow(dead_code, unused_imports))]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::{
    check_stream, free_addr, pending, sample, scrape_until, wait_drained, RelayProcess, Target,
};
use handoff_postgres::{Outbox, OutboxConfig};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use handoff_test::{eventually, factory};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

/// The slot and publication `handoff cdc setup` creates in every test's cluster.
const SLOT: &str = "handoff_drill";
const PUBLICATION: &str = "handoff_drill_outbox";

/// A second slot the crash-window test reads without consuming, to learn each transaction's
/// exact commit position: the very `Commit.end_lsn` the relay confirms.
const PROBE_SLOT: &str = "drill_probe";

/// Runs the `handoff` binary to completion, with nothing inherited that could redirect it.
fn handoff(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("HANDOFF_SCHEMA")
        .env_remove("HANDOFF_SLOT")
        .env_remove("HANDOFF_PUBLICATION")
        .env_remove("FAILPOINTS")
        .output()
        .expect("run handoff")
}

/// Like [`handoff`], and the command must succeed.
fn handoff_ok(args: &[&str]) -> Output {
    let output = handoff(args);
    assert!(
        output.status.success(),
        "handoff {args:?} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// `handoff cdc setup` for the test's slot and publication on `url`, with `extra` flags.
fn cdc_setup(url: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "cdc",
        "setup",
        "--database-url",
        url,
        "--slot",
        SLOT,
        "--publication",
        PUBLICATION,
    ];
    args.extend_from_slice(extra);
    handoff(&args)
}

/// `handoff cdc status --json` for the test's slot on `url`, with `extra` flags.
fn cdc_status(url: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "cdc",
        "status",
        "--database-url",
        url,
        "--slot",
        SLOT,
        "--json",
    ];
    args.extend_from_slice(extra);
    handoff(&args)
}

/// A test's world: its own cluster (migrated, publication and slot set up by the CLI), a pool
/// on it, and a stream of its own on the shared nats-server.
struct Drill {
    pool: PgPool,
    outbox: Outbox,
    url: String,
    target: Target,
    client: async_nats::Client,
    _delete: DeleteStreamOnDrop,
    // Last: fields drop in order, and the pool must go before the server does.
    _cluster: PrivatePostgres,
}

impl Drill {
    async fn start(name: &str, extra: &[&str]) -> Drill {
        let mut settings = vec!["wal_level=logical".to_owned()];
        settings.extend(extra.iter().map(|s| (*s).to_owned()));
        let cluster = tokio::task::spawn_blocking(move || {
            let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
            PrivatePostgres::start_with(&settings)
        })
        .await
        .unwrap()
        .expect("start a private PostgreSQL");
        let url = cluster.url("postgres");
        handoff_ok(&["migrate", "--database-url", &url]);
        let setup = cdc_setup(&url, &[]);
        assert!(
            setup.status.success(),
            "handoff cdc setup failed:\n{}",
            String::from_utf8_lossy(&setup.stderr)
        );
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .unwrap();
        let client = prepare_shared_server().await;
        let stream = unique_name(name);
        Drill {
            pool,
            outbox: Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap(),
            target: Target {
                database_url: url.clone(),
                nats_url: shared_url(),
                stream: stream.clone(),
                prefix: stream.clone(),
            },
            url,
            client,
            _delete: DeleteStreamOnDrop::new(&shared_url(), &stream),
            _cluster: cluster,
        }
    }

    /// A `handoff relay --source logical` on the drill's slot, with `extra` flags and `env`.
    fn relay(&self, id: &str, extra: &[&str], env: &[(&str, &str)]) -> RelayProcess {
        let mut args = vec![
            "--source",
            "logical",
            "--slot",
            SLOT,
            "--publication",
            PUBLICATION,
        ];
        args.extend_from_slice(extra);
        RelayProcess::start(&self.target, id, &args, env)
    }

    /// Commits one event of `aggregate` (payload `n`); returns its id and the transaction's id.
    async fn commit(&self, aggregate: &str, n: u64) -> (Uuid, String) {
        let mut tx = self.pool.begin().await.unwrap();
        let enqueued = self
            .outbox
            .enqueue(&mut tx, &[factory::event(aggregate, n)])
            .await
            .unwrap();
        let xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        (enqueued[0].event_id, xid)
    }

    /// Writes an event of `aggregate` and rolls it back: it must never reach the stream.
    async fn roll_back(&self, aggregate: &str) {
        let mut tx = self.pool.begin().await.unwrap();
        self.outbox
            .enqueue(&mut tx, &[factory::event(aggregate, 0)])
            .await
            .unwrap();
        tx.rollback().await.unwrap();
    }

    /// The slot's confirmed position.
    async fn confirmed(&self) -> u64 {
        let text: String = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(SLOT)
        .fetch_one(&self.pool)
        .await
        .unwrap();
        lsn(&text)
    }

    /// The end of transaction `xid`'s commit record, as the probe slot decodes it.
    async fn commit_end(&self, xid: &str) -> u64 {
        let text: Option<String> = sqlx::query_scalar(
            "SELECT max(lsn)::text FROM pg_logical_slot_peek_binary_changes(
                 $1, NULL, NULL, 'proto_version', '1', 'publication_names', $2)
             WHERE xid::text = $3",
        )
        .bind(PROBE_SLOT)
        .bind(PUBLICATION)
        .bind(xid)
        .fetch_one(&self.pool)
        .await
        .unwrap();
        lsn(&text.unwrap_or_else(|| panic!("the probe slot never saw transaction {xid}")))
    }

    async fn published(&self, event_id: Uuid) -> bool {
        sqlx::query_scalar("SELECT published_at IS NOT NULL FROM outbox WHERE event_id = $1")
            .bind(event_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn wal_status(&self) -> Option<String> {
        sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
            .bind(SLOT)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// `0/16B3748` as a number.
fn lsn(text: &str) -> u64 {
    let (hi, lo) = text.split_once('/').expect("an LSN");
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

/// V1's "after broker accept but before the commit of the position", for the CDC source: the
/// relay is frozen right after the broker acknowledged an event and SIGKILLed there. The slot
/// must not have been confirmed past that transaction, even though a later transaction was
/// acknowledged and marked meanwhile, so the next relay gets both again from the slot,
/// republishes them (JetStream drops the copies by `Nats-Msg-Id`), and confirms past them.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_the_ack_and_the_confirmation_gets_the_transaction_again() {
    let drill = Drill::start("cdc_after_ack", &[]).await;
    // Only the first acknowledged event freezes its lane; the other lanes go on.
    let mut a = drill.relay(
        "relay-a",
        &[],
        &[("FAILPOINTS", "relay.after_ack=1*return")],
    );

    // Relay A streams and confirms: WAL of another table, written while it is idle, is
    // confirmed by following the server's keepalives.
    for statement in [
        "CREATE TABLE filler (n int)",
        "INSERT INTO filler VALUES (1)",
    ] {
        sqlx::query(statement).execute(&drill.pool).await.unwrap();
    }
    let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&drill.pool)
        .await
        .unwrap();
    eventually(
        "relay A confirms an idle position",
        Duration::from_secs(20),
        async || a.log_unless(drill.confirmed().await >= lsn(&written)),
    )
    .await;
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(PROBE_SLOT)
        .execute(&drill.pool)
        .await
        .unwrap();

    // Transaction 1: acknowledged by the broker, then the lane freezes: never marked, never
    // settled.
    let (first, first_xid) = drill.commit("a", 1).await;
    a.wait_for_log("failpoint fired", Duration::from_secs(30))
        .await;
    let stored = read_stream(&drill.client, &drill.target.stream).await;
    assert_eq!(stored.len(), 1, "the broker holds the first event");
    assert_eq!(
        stored[0].header("Nats-Msg-Id"),
        Some(first.to_string().as_str())
    );

    // Transaction 2, another aggregate: acknowledged and marked published by relay A.
    let (second, second_xid) = drill.commit("b", 2).await;
    eventually(
        "relay A marks the second event published",
        Duration::from_secs(20),
        async || a.log_unless(drill.published(second).await),
    )
    .await;
    let first_end = drill.commit_end(&first_xid).await;
    let second_end = drill.commit_end(&second_xid).await;
    assert!(first_end < second_end);

    // A confirmation that must not happen cannot be awaited: watch three confirm intervals
    // (the CLI confirms every second) in which relay A, streaming, has settled transaction 2.
    let watch_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < watch_until {
        let confirmed = drill.confirmed().await;
        assert!(
            confirmed < first_end,
            "the slot was confirmed at {confirmed:X}, past the unsettled commit ending at \
             {first_end:X}:\n{}",
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    a.kill();
    assert!(
        drill.confirmed().await < first_end,
        "after the kill, the slot is still before the unsettled transaction"
    );
    assert!(
        !drill.published(first).await,
        "the first event was never marked"
    );

    // While no relay runs, aggregate a gets its second event.
    let (third, third_xid) = drill.commit("a", 3).await;

    let addr = free_addr();
    let mut b = drill.relay("relay-b", &["--metrics-addr", &addr.to_string()], &[]);
    wait_drained(&drill.pool, Duration::from_secs(30), || b.log()).await;
    // The slot hands relay B all three transactions: 1 and 2 again (never confirmed), and 3.
    // B publishes 1 and 3 from the table (their aggregate had unpublished rows at its start)
    // and 2 from the stream; the broker already held 1 and 2.
    let text = scrape_until(
        addr,
        Duration::from_secs(20),
        "3 streamed and 3 published events",
        |text| {
            sample(text, "handoff_cdc_streamed_events_total") >= Some(3.0)
                && sample(text, "handoff_events_published_total") >= Some(3.0)
        },
        || b.log(),
    )
    .await;
    assert_eq!(
        sample(&text, "handoff_cdc_streamed_events_total"),
        Some(3.0),
        "the slot redelivered transactions 1 and 2 and delivered 3"
    );
    assert_eq!(
        sample(&text, "handoff_events_published_total"),
        Some(3.0),
        "relay B published each event once"
    );

    let messages = read_stream(&drill.client, &drill.target.stream).await;
    let check = check_stream(&drill.pool, &messages).await;
    assert_eq!(
        (check.messages, check.duplicates),
        (3, 0),
        "JetStream dropped the republished copies by their Nats-Msg-Id"
    );
    // What a consumer deduplicating by event id applies: each event exactly once.
    let ids: std::collections::HashSet<&str> = messages
        .iter()
        .filter_map(|m| m.header("Nats-Msg-Id"))
        .collect();
    let expected: std::collections::HashSet<String> =
        [first, second, third].iter().map(Uuid::to_string).collect();
    assert_eq!(
        ids,
        expected.iter().map(String::as_str).collect(),
        "every event id once"
    );
    assert_eq!(pending(&drill.pool).await, 0, "every row marked published");

    assert!(b.terminate().success(), "exit 0 on SIGTERM:\n{}", b.log());
    // The shutdown confirmed what relay B settled: a next relay starts after transaction 3.
    let third_end = drill.commit_end(&third_xid).await;
    let confirmed = drill.confirmed().await;
    assert!(
        confirmed >= third_end,
        "confirmed {confirmed:X}, before the last commit ending at {third_end:X}:\n{}",
        b.log()
    );
}

/// F4: the relay is down while events commit and PostgreSQL writes far more WAL than
/// `max_slot_wal_keep_size` lets the slot retain, so PostgreSQL invalidates the slot. The loss
/// must be alerted (`handoff cdc status` exits 2; a relay on the lost slot reports
/// `handoff_cdc_slot_status{wal_status="lost"} 1` and says what to do), and after the runbook
/// (`handoff cdc setup --recreate-lost-slot`, restart) every committed event (before, during
/// and after the loss) is in the stream, the first copies of each aggregate in order, and no
/// rolled-back one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_alerted_and_after_recreating_it_every_committed_event_is_published() {
    // The smallest retention PostgreSQL takes (in MB); with max_wal_size at its minimum of two
    // 16 MB segments, a few segment switches and a checkpoint are enough to invalidate the slot.
    let drill = Drill::start(
        "cdc_slot_lost",
        &[
            "max_slot_wal_keep_size=1MB",
            "max_wal_size=32MB",
            "min_wal_size=32MB",
        ],
    )
    .await;

    // Before: a relay streams and publishes.
    let mut a = drill.relay("relay-a", &[], &[]);
    for n in 0..6 {
        drill.commit(&format!("agg-{}", n % 3), n).await;
    }
    drill.roll_back("ghost-before").await;
    wait_drained(&drill.pool, Duration::from_secs(30), || a.log()).await;
    assert!(a.terminate().success(), "exit 0 on SIGTERM:\n{}", a.log());

    // During: no relay runs; events commit, one rolls back, and other WAL piles up.
    for n in 6..12 {
        drill.commit(&format!("agg-{}", n % 4), n).await;
    }
    drill.roll_back("ghost-during").await;
    sqlx::query("CREATE TABLE filler (n int)")
        .execute(&drill.pool)
        .await
        .unwrap();
    let mut rounds = 0;
    while drill.wal_status().await.as_deref() != Some("lost") {
        rounds += 1;
        assert!(
            rounds <= 30,
            "the slot is still {:?} after {rounds} WAL segments and checkpoints",
            drill.wal_status().await
        );
        // A switch needs WAL in the current segment; the checkpoint removes the old segments
        // and, past max_slot_wal_keep_size, invalidates the slot.
        sqlx::query("INSERT INTO filler VALUES (1)")
            .execute(&drill.pool)
            .await
            .unwrap();
        sqlx::query("SELECT pg_switch_wal()")
            .execute(&drill.pool)
            .await
            .unwrap();
        sqlx::query("CHECKPOINT")
            .execute(&drill.pool)
            .await
            .unwrap();
    }

    // The alert: `handoff cdc status` exits 2 and says what to run.
    let status = cdc_status(&drill.url, &[]);
    let stdout = String::from_utf8_lossy(&status.stdout);
    assert_eq!(
        status.status.code(),
        Some(2),
        "exit 2 for a lost slot:\n{stdout}"
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["health"]["wal_status"], "lost", "{report}");
    assert_eq!(report["healthy"], false);
    let alert = report["alerts"][0].as_str().unwrap_or_default();
    assert!(
        alert.contains("lost") && alert.contains("--recreate-lost-slot"),
        "{report}"
    );
    // Plain setup refuses to paper over the loss.
    let refused = cdc_setup(&drill.url, &[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "setup on a lost slot must fail");
    assert!(stderr.contains("--recreate-lost-slot"), "{stderr}");

    // A relay started on the lost slot cannot stream; its metrics and its log say why.
    let addr = free_addr();
    let mut b = drill.relay("relay-b", &["--metrics-addr", &addr.to_string()], &[]);
    scrape_until(
        addr,
        Duration::from_secs(20),
        "a lost slot that does not stream",
        |text| {
            sample(text, r#"handoff_cdc_slot_status{wal_status="lost"}"#) == Some(1.0)
                && sample(text, r#"handoff_cdc_slot_status{wal_status="reserved"}"#) == Some(0.0)
                && sample(text, "handoff_cdc_streaming") == Some(0.0)
                && sample(text, "handoff_cdc_stream_errors_total") >= Some(1.0)
        },
        || b.log(),
    )
    .await;
    b.wait_for_log("replication slot is LOST", Duration::from_secs(20))
        .await;
    assert!(b.terminate().success(), "exit 0 on SIGTERM:\n{}", b.log());

    // The runbook: recreate the slot; it reports the backlog the relay will publish from the
    // table.
    let recreated = cdc_setup(&drill.url, &["--recreate-lost-slot", "--json"]);
    assert!(
        recreated.status.success(),
        "recreating the lost slot failed:\n{}",
        String::from_utf8_lossy(&recreated.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&recreated.stdout).unwrap();
    assert_eq!(report["slot_recreated"], true, "{report}");
    assert_eq!(report["unpublished_rows"], 6, "{report}");
    assert_eq!(drill.wal_status().await.as_deref(), Some("reserved"));

    // After: events commit before the relay is back (on an aggregate with a backlog and on a
    // new one), then while it streams (on aggregates with a backlog, whose streamed events
    // wait behind their table rows, and on a new one, published from the stream).
    drill.commit("agg-0", 12).await;
    drill.commit("agg-9", 13).await;
    drill.roll_back("ghost-after").await;
    let addr = free_addr();
    let mut c = drill.relay("relay-c", &["--metrics-addr", &addr.to_string()], &[]);
    c.wait_for_log("source: streaming", Duration::from_secs(20))
        .await;
    for (n, aggregate) in [(14, "agg-0"), (15, "agg-10"), (16, "agg-10"), (17, "agg-3")] {
        drill.commit(aggregate, n).await;
    }
    wait_drained(&drill.pool, Duration::from_secs(30), || c.log()).await;
    // The new slot streamed what committed after it was created; nothing before.
    let text = scrape_until(
        addr,
        Duration::from_secs(20),
        "6 streamed events",
        |text| sample(text, "handoff_cdc_streamed_events_total") >= Some(6.0),
        || c.log(),
    )
    .await;
    assert_eq!(
        sample(&text, "handoff_cdc_streamed_events_total"),
        Some(6.0)
    );
    assert!(c.terminate().success(), "exit 0 on SIGTERM:\n{}", c.log());

    // Every intent in the stream, first copies in order per aggregate, nothing the outbox
    // does not hold (so no rolled-back event).
    let messages = read_stream(&drill.client, &drill.target.stream).await;
    let check = check_stream(&drill.pool, &messages).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&drill.pool)
        .await
        .unwrap();
    assert_eq!(rows, 18);
    assert_eq!(check.messages - check.duplicates, 18);
    assert!(messages.iter().all(|m| !m.subject.contains("ghost")));

    // The new slot is healthy again (the margin check is off: the drill's retention is 1 MB).
    let status = cdc_status(&drill.url, &["--min-safe-wal", "0"]);
    assert_eq!(
        status.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&status.stdout)
    );
}
