//! `handoff relay` as a real process against the real PostgreSQL and nats-server: the message
//! contract, crash windows, several relays under kills, a broker outage, bad configuration.

use crate::common;

use std::time::{Duration, Instant};

use crate::common::{check_stream, migrated, shared_target, wait_drained, RelayProcess, Target};
use handoff_core::NewEvent;
use handoff_test::nats::{read_stream, shared_url, unique_name};
use handoff_test::{factory, TestDb};

#[tokio::test]
async fn committed_events_reach_the_stream_with_the_contract_headers_and_rolled_back_ones_never() {
    let (db, outbox) = migrated("relay_contract").await;
    let (target, client, _cleanup) = shared_target(&db, "contract").await;

    let mut tx = db.pool.begin().await.unwrap();
    let traced = factory::event("order-1", 1).with_header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let events = [
        traced,
        factory::event("order-1", 2),
        factory::event("eu.west/42", 3),
    ];
    outbox.enqueue(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("ghost", 4)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let mut relay = RelayProcess::start(&target, "contract-relay", &[], &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    assert!(
        relay.terminate().success(),
        "exit 0 on SIGTERM:\n{}",
        relay.log()
    );

    let messages = read_stream(&client, &target.stream).await;
    let report = check_stream(&db.pool, &messages).await;
    assert_eq!((report.messages, report.duplicates), (3, 0));

    let first = messages
        .iter()
        .find(|m| m.subject.ends_with(".order-1"))
        .unwrap();
    let row: (uuid::Uuid, String) = sqlx::query_as(
        "SELECT event_id, payload::text FROM outbox WHERE aggregate_id = 'order-1' AND aggregate_sequence = 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let id = row.0.to_string();
    assert_eq!(first.subject, format!("{}.thing.order-1", target.prefix));
    assert_eq!(first.header("Nats-Msg-Id"), Some(id.as_str()));
    assert_eq!(first.header("ce-id"), Some(id.as_str()));
    assert_eq!(first.header("ce-specversion"), Some("1.0"));
    assert_eq!(first.header("ce-type"), Some(factory::EVENT_TYPE));
    assert_eq!(first.header("ce-source"), Some("handoff"));
    let time = first.header("ce-time").expect("ce-time");
    assert!(
        chrono::DateTime::parse_from_rfc3339(time).is_ok(),
        "ce-time {time:?} is RFC 3339"
    );
    assert_eq!(
        first.header("Handoff-Aggregate-Type"),
        Some(factory::AGGREGATE_TYPE)
    );
    assert_eq!(first.header("Handoff-Aggregate-Id"), Some("order-1"));
    assert_eq!(first.header("Handoff-Sequence"), Some("1"));
    assert_eq!(first.header("Handoff-Schema-Version"), Some("1"));
    assert_eq!(
        first.header("traceparent"),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    let body: serde_json::Value = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(
        body,
        serde_json::from_str::<serde_json::Value>(&row.1).unwrap()
    );
    let second = messages
        .iter()
        .find(|m| m.subject.ends_with(".order-1") && m.header("Handoff-Sequence") == Some("2"));
    assert_eq!(
        second.unwrap().header("traceparent"),
        None,
        "only the writer's own headers travel"
    );

    // An id that is not a plain token is encoded reversibly in the subject.
    let odd = messages
        .iter()
        .find(|m| m.header("Handoff-Sequence") == Some("1") && m.subject.ends_with("42"))
        .unwrap();
    assert_eq!(
        odd.subject,
        format!("{}.thing.eu%2Ewest%2F42", target.prefix)
    );
    assert!(messages.iter().all(|m| !m.subject.contains("ghost")));
}

#[tokio::test]
async fn events_written_by_another_writer_with_explicit_sequences_are_published() {
    let (db, _outbox) = migrated("relay_foreign").await;
    let (target, client, _cleanup) = shared_target(&db, "foreign").await;
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence, \
         event_type, schema_version, payload) \
         SELECT gen_random_uuid(), 'invoice', 'inv-7', s, 'InvoiceIssued', 2, \
                jsonb_build_object('line', s) FROM generate_series(1, 5) s",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut relay = RelayProcess::start(&target, "foreign-relay", &[], &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    assert!(relay.terminate().success());
    let messages = read_stream(&client, &target.stream).await;
    check_stream(&db.pool, &messages).await;
    assert_eq!(messages.len(), 5);
    assert_eq!(messages[4].header("Handoff-Schema-Version"), Some("2"));
    assert_eq!(
        messages[4].subject,
        format!("{}.invoice.inv-7", target.prefix)
    );
}

#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_relay_killed_after_the_ack_is_republished_after_lease_expiry_and_deduplicated() {
    let (db, outbox) = migrated("relay_after_ack").await;
    let (target, client, _cleanup) = shared_target(&db, "after_ack").await;
    let mut tx = db.pool.begin().await.unwrap();
    let enqueued = outbox
        .enqueue(&mut tx, &[factory::event("a", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let event_id = enqueued[0].event_id;

    // Relay A stops dead right after the broker's ack, before published_at is written.
    let mut a = RelayProcess::start(
        &target,
        "relay-a",
        &[],
        &[("FAILPOINTS", "relay.after_ack=return")],
    );
    a.wait_for_log("failpoint fired", Duration::from_secs(30))
        .await;
    assert_eq!(
        read_stream(&client, &target.stream).await.len(),
        1,
        "the broker holds it"
    );
    let (published, owner): (bool, Option<String>) = sqlx::query_as(
        "SELECT published_at IS NOT NULL, claimed_by FROM outbox WHERE event_id = $1",
    )
    .bind(event_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((published, owner.as_deref()), (false, Some("relay-a")));
    a.kill();

    // Its lease runs out (moved into the past rather than waited for).
    sqlx::query("UPDATE outbox SET claim_until = now() - interval '1s', available_at = now() - interval '1s'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut b = RelayProcess::start(&target, "relay-b", &[], &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || b.log()).await;
    assert!(b.terminate().success());
    assert!(
        b.log().contains("published: 1") || b.log().contains("published=1"),
        "relay-b republished it:\n{}",
        b.log()
    );

    let messages = read_stream(&client, &target.stream).await;
    assert_eq!(
        messages.len(),
        1,
        "JetStream dropped the republish by its Nats-Msg-Id"
    );
    let owner: String = sqlx::query_scalar("SELECT claimed_by FROM outbox WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(owner, "relay-b");
}

#[tokio::test]
async fn three_relays_keep_per_aggregate_order_while_one_is_killed_again_and_again() {
    const AGGREGATES: usize = 40;
    const TRANSACTIONS: usize = 900;
    let (db, outbox) = migrated("relay_three_kills").await;
    let (target, client, _cleanup) = shared_target(&db, "three_kills").await;
    let mut relays: Vec<RelayProcess> = ["relay-a", "relay-b", "relay-c"]
        .iter()
        .map(|id| RelayProcess::start(&target, id, &[], &[]))
        .collect();

    // Writers: transactions of 1 to 3 events of one aggregate, four connections at once.
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (pool, outbox) = (db.pool.clone(), outbox.clone());
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(w);
                for n in 0..TRANSACTIONS / 4 {
                    let aggregate = format!("agg-{}", rng.usize(..AGGREGATES));
                    let events: Vec<NewEvent> = (0..rng.u64(1..=3))
                        .map(|k| factory::event(&aggregate, (n as u64) * 10 + k))
                        .collect();
                    let mut tx = pool.begin().await.unwrap();
                    outbox.enqueue(&mut tx, &events).await.unwrap();
                    tx.commit().await.unwrap();
                    if n % 25 == 0 {
                        tokio::time::sleep(Duration::from_millis(10)).await; // spread the load
                    }
                }
            })
        })
        .collect();

    // Meanwhile relay-a is SIGKILLed and restarted, at seeded random moments.
    let mut rng = fastrand::Rng::with_seed(7);
    let mut kills = 0;
    let started = Instant::now();
    while kills < 6 {
        tokio::time::sleep(Duration::from_millis(rng.u64(200..700))).await;
        relays[0].kill();
        kills += 1;
        relays[0] = RelayProcess::start(&target, "relay-a", &[], &[]);
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let logs = || {
        relays
            .iter()
            .map(|r| format!("--- {}\n{}", r.id, r.log()))
            .collect::<String>()
    };
    wait_drained(&db.pool, Duration::from_secs(60), logs).await;
    let elapsed = started.elapsed();
    for relay in &mut relays {
        assert!(
            relay.terminate().success(),
            "{} exits 0:\n{}",
            relay.id,
            relay.log()
        );
    }

    let messages = read_stream(&client, &target.stream).await;
    let report = check_stream(&db.pool, &messages).await;
    eprintln!(
        "{kills} kills, {} messages, {} duplicates, {elapsed:?}",
        report.messages, report.duplicates
    );
    let events: i64 = db.count("outbox").await;
    assert!(events as usize >= TRANSACTIONS);
}

#[tokio::test]
async fn bad_configuration_stops_at_once_with_one_clear_line() {
    let cases: [(&[&str], &str); 6] = [
        (&["--database-url", "not a url"], "invalid database url"),
        (
            &[
                "--database-url",
                "postgres://x@127.0.0.1/db",
                "--stream",
                "a b",
            ],
            "invalid stream name",
        ),
        (
            &[
                "--database-url",
                "postgres://x@127.0.0.1/db",
                "--subject-prefix",
                "out.*",
            ],
            "subject prefix",
        ),
        (
            &[
                "--database-url",
                "postgres://x@127.0.0.1/db",
                "--nats-url",
                "http://[::1",
            ],
            "nats url",
        ),
        (
            &[
                "--database-url",
                "postgres://x@127.0.0.1/db",
                "--lease",
                "10m",
            ],
            "duplicate window",
        ),
        (
            &[
                "--database-url",
                "postgres://x@127.0.0.1/db",
                "--mark-interval",
                "6s",
            ],
            "mark interval",
        ),
    ];
    for (args, needle) in cases {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
            .arg("relay")
            .args(args)
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} must fail");
        assert!(
            stderr.to_lowercase().contains(needle),
            "{args:?}: {needle:?} not in {stderr:?}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        let lines: Vec<_> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(lines.len(), 1, "one error line: {stderr}");
    }
}

#[tokio::test]
async fn an_unreachable_database_at_start_is_waited_for_and_said() {
    let target = Target {
        database_url: "postgres://postgres:secret-pw@127.0.0.1:1/none".into(),
        nats_url: shared_url(),
        stream: unique_name("unreachable"),
        prefix: unique_name("unreachable"),
    };
    let mut relay = RelayProcess::start(&target, "waiting-relay", &[], &[]);
    relay
        .wait_for_log("waiting for PostgreSQL", Duration::from_secs(30))
        .await;
    assert!(relay.try_status().is_none(), "it keeps trying");
    assert!(
        !relay.log().contains("secret-pw"),
        "the password never reaches the log"
    );
    assert!(relay.terminate().success());
}

/// Kills relay A frozen at `failpoint` (its claim taken, nothing published yet), lets its lease
/// run out, and has relay B publish everything: each event once, in order per aggregate.
#[cfg(feature = "failpoints")]
async fn killed_before_anything_was_published(name: &str, failpoint: &str) {
    let (db, outbox) = migrated(name).await;
    let (target, client, _cleanup) = shared_target(&db, name).await;
    common::enqueue_spread(&db.pool, &outbox, 1, 6, 2).await;

    let mut a = RelayProcess::start(
        &target,
        "relay-a",
        &[],
        &[("FAILPOINTS", &format!("{failpoint}=return"))],
    );
    a.wait_for_log("failpoint fired", Duration::from_secs(30))
        .await;
    let leased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE claimed_by = 'relay-a' AND published_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(leased > 0, "relay-a holds a lease on what it claimed");
    a.kill();
    assert!(
        read_stream(&client, &target.stream).await.is_empty(),
        "nothing reached the broker"
    );

    sqlx::query("UPDATE outbox SET claim_until = now() - interval '1s', available_at = now() - interval '1s' WHERE claimed_by IS NOT NULL")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut b = RelayProcess::start(&target, "relay-b", &[], &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || b.log()).await;
    assert!(b.terminate().success());
    let check = check_stream(&db.pool, &read_stream(&client, &target.stream).await).await;
    assert_eq!((check.messages, check.duplicates), (6, 0));
}

#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_relay_killed_right_after_its_claim_leaves_the_rows_to_the_next_relay() {
    killed_before_anything_was_published("relay_claim_kill", "relay.claim").await;
}

#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_relay_killed_before_it_publishes_leaves_the_rows_to_the_next_relay() {
    killed_before_anything_was_published("relay_before_publish_kill", "relay.before_publish").await;
}

#[tokio::test]
async fn sigterm_while_the_broker_is_awaited_at_start_stops_the_relay_cleanly() {
    // The signal handlers are installed before any start-up work, so a SIGTERM during it is a
    // clean stop (exit 0), not death by the signal's default action.
    let db = TestDb::new("relay_sigterm_at_start").await;
    let mut relay = RelayProcess::spawn(
        &db.url(),
        "starting-relay",
        &["--nats-url", "nats://127.0.0.1:1"],
        &[],
    );
    relay
        .wait_for_log("waiting for NATS", Duration::from_secs(30))
        .await;
    let status = relay.terminate();
    assert!(status.success(), "{status:?}:\n{}", relay.log());
    assert!(relay.log().contains("SIGTERM received"), "{}", relay.log());
}

#[tokio::test]
async fn a_relay_stopped_the_moment_it_starts_exits_cleanly() {
    // What a test (or an orchestrator) does to a relay that had nothing to do: SIGTERM at
    // once. `terminate` sends it once the handler is in place, whatever start-up is then
    // doing (connecting, checking the schema, claiming); each of those must end in exit 0.
    let db = TestDb::migrated("relay_stopped_at_start").await;
    let (target, _client, _cleanup) = shared_target(&db, "stopped_at_start").await;
    for round in 0..5 {
        let mut relay = RelayProcess::start(&target, &format!("stopped-{round}"), &[], &[]);
        let status = relay.terminate();
        assert!(
            status.success(),
            "round {round}: {status:?}:\n{}",
            relay.log()
        );
    }
}

/// The longest any `handoff relay` statement has been waiting for a lock on this test's outbox
/// (seconds; 0 when none waits).
async fn longest_relay_lock_wait(db: &TestDb) -> f64 {
    sqlx::query_scalar(
        "SELECT coalesce(max(extract(epoch FROM now() - a.query_start)), 0)::float8
         FROM pg_stat_activity a
         JOIN pg_locks l ON l.pid = a.pid
         WHERE l.relation = 'outbox'::regclass
           AND NOT l.granted
           AND a.application_name = 'handoff-relay'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_claim_the_relay_gave_up_on_is_ended_by_the_server_too() {
    // Past --query-timeout the relay closes its connection, but the server would only notice
    // when it next wrote to it: a claim stuck in the server would hold on for as long as what
    // it waits for (here a table lock; in production, a slow plan holding its front's row
    // locks). The relay's sessions carry a statement_timeout a second above the query timeout.
    let (db, outbox) = migrated("relay_server_timeout").await;
    let (target, _client, _cleanup) = shared_target(&db, "server_timeout").await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("order-1", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // Every claim now waits in the server for the outbox.
    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let relay = RelayProcess::start(
        &target,
        "relay-server-timeout",
        &["--query-timeout", "1s"],
        &[],
    );
    handoff_test::eventually(
        "a claim of the relay waits for the outbox",
        Duration::from_secs(30),
        async || longest_relay_lock_wait(&db).await > 0.0,
    )
    .await;
    // Held for six seconds: without the server-side bound the first claim would wait all of
    // them; with it, no statement waits much past query timeout + 1 s = 2 s.
    let mut longest: f64 = 0.0;
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        longest = longest.max(longest_relay_lock_wait(&db).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        longest < 4.0,
        "a relay statement waited {longest:.1} s in the server; relay log:\n{}",
        relay.log()
    );

    // Released, the relay publishes as usual.
    locker.commit().await.unwrap();
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
}

/// The relay id a relay takes when given none has the format docs/relay.md's flag table
/// states: `relay-<host>-<pid>-<random>`, the random part 8 hex digits.
#[test]
fn the_default_relay_id_has_the_documented_format() {
    let page = include_str!("../../../../docs/relay.md");
    assert!(
        page.contains("| `--relay-id` | `HANDOFF_RELAY_ID` | `relay-<host>-<pid>-<random>` |"),
        "docs/relay.md's --relay-id row names another default"
    );
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["relay", "--check-config"])
        .args(["--database-url", "postgres://127.0.0.1:1/db"])
        .env_remove("HANDOFF_RELAY_ID")
        .env_remove("HANDOFF_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let id = stdout
        .strip_prefix("configuration ok: relay ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no relay id in {stdout:?}"));
    let random = id.rsplit('-').next().unwrap();
    assert!(id.starts_with("relay-"), "{id}");
    assert!(id.contains(&format!("-{pid}-")), "{id}: pid {pid}");
    assert!(
        random.len() == 8 && random.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
}
