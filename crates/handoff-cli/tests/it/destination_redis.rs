//! `handoff relay --destination redis` as real processes against the real PostgreSQL and the
//! local Redis: writers commit events over many aggregates while relays are SIGKILLed and
//! restarted; the stream then holds every committed event, nothing rolled back, per aggregate
//! in sequence order, and none twice (every republish fell inside the dedup window).
//! `handoff reconcile --destination redis` finds entries deleted behind handoff's back and
//! republishes them, in order; `handoff replay --destination redis` adds marked copies.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::time::Duration;

use crate::common::{
    check_delivered, kill_in_rounds, logs, migrated, pending, wait_drained, Delivered,
    RelayProcess, Writers,
};
use handoff_redis::redis;
use handoff_test::redis::ScratchStream;
use uuid::Uuid;

/// A relay into `stream`, the URL from the environment as a deployment would set it.
fn redis_relay(database_url: &str, stream: &str, id: &str, env: &[(&str, &str)]) -> RelayProcess {
    let flags = [
        "--destination",
        "redis",
        "--redis-stream",
        stream,
        "--poll-interval",
        "100ms",
    ];
    let url = handoff_test::redis::url();
    let mut env = env.to_vec();
    env.push(("REDIS_URL", url.as_str()));
    RelayProcess::spawn(database_url, id, &flags, &env)
}

/// Every entry of the stream, in stream order, through the read-back seam.
async fn read_stream(stream: &str) -> Vec<Delivered> {
    handoff_test::redis::read_stream(stream)
        .await
        .into_iter()
        .map(|message| {
            let header = |name: &str| {
                message
                    .header(name)
                    .unwrap_or_else(|| panic!("entry {}: no {name}", message.position))
                    .to_owned()
            };
            Delivered {
                event_id: message.event_id.unwrap(),
                aggregate_id: handoff_core::subject::decode_token(&header("Handoff-Aggregate-Id"))
                    .unwrap()
                    .into_owned(),
                sequence: header("Handoff-Sequence").parse().unwrap(),
                position: format!("entry {}", message.position),
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committed_event_reaches_redis_once_in_order_through_relay_sigkills() {
    let (db, outbox) = migrated("destination_redis").await;
    let stream = ScratchStream::new("dest-redis");
    let url = db.url();

    let writer = Writers {
        connections: 2,
        transactions: 400,
        aggregates: 30,
        rollback_every: 50,
    }
    .spawn(&db.pool, &outbox);

    // A relay frozen right after Redis's answer (failpoint), then SIGKILLed: what it appended
    // stays unmarked until its lease runs out, and the others publish it again.
    let frozen = redis_relay(
        &url,
        stream.key(),
        "r-frozen",
        &[("FAILPOINTS", "relay.after_ack=return")],
    );
    if cfg!(feature = "failpoints") {
        frozen
            .wait_for_log("failpoint fired", Duration::from_secs(30))
            .await;
    }
    drop(frozen);

    let mut relays: Vec<RelayProcess> = (0..2)
        .map(|n| redis_relay(&url, stream.key(), &format!("r-{n}"), &[]))
        .collect();
    // Three rounds: once the relays have published 100 more, SIGKILL one (leaving whatever it
    // had appended but not marked) and start a fresh one in its place.
    kill_in_rounds(&db.pool, &mut relays, 3, 100, |round| {
        redis_relay(&url, stream.key(), &format!("r-{}", round + 2), &[])
    })
    .await;
    let rolled_back = writer.await.unwrap();
    assert!(!rolled_back.is_empty());
    wait_drained(&db.pool, Duration::from_secs(45), || logs(&relays)).await;
    assert_eq!(pending(&db.pool).await, 0);
    let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();

    let delivered = read_stream(stream.key()).await;
    let check = check_delivered(&db.pool, &delivered).await;
    assert_eq!(
        check.duplicates, 0,
        "a republish inside the dedup window appended a second entry"
    );
    assert_eq!(check.messages as i64, committed);
    let absorbed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE delivery_receipt LIKE '%(duplicate)'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    if cfg!(feature = "failpoints") {
        assert!(
            absorbed > 0,
            "the frozen relay's events were published again and absorbed by the dedup window"
        );
    }
    eprintln!(
        "{} entries for {committed} events ({} rolled back): {absorbed} republishes absorbed by \
         the dedup window",
        check.messages,
        rolled_back.len(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_file_names_the_redis_stream() {
    let (db, outbox) = migrated("destination_redis_toml").await;
    let stream = ScratchStream::new("dest-redis-toml");
    common::enqueue_spread(&db.pool, &outbox, 0, 5, 2).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    std::fs::write(
        &file,
        format!(
            "destination = \"redis\"\nredis_url = \"{}\"\nredis_stream = \"{}\"\n\
             redis_dedup_window = \"5m\"\n",
            handoff_test::redis::url(),
            stream.key()
        ),
    )
    .unwrap();
    let relays = [RelayProcess::spawn(
        &db.url(),
        "r-toml",
        &["--config", file.to_str().unwrap()],
        &[],
    )];
    wait_drained(&db.pool, Duration::from_secs(30), || logs(&relays)).await;
    let check = check_delivered(&db.pool, &read_stream(stream.key()).await).await;
    assert_eq!((check.messages, check.duplicates), (5, 0));
}

/// `handoff <command> --destination redis --redis-stream <stream> <args>`: exit code, stdout.
async fn handoff(database_url: &str, stream: &str, command: &str, args: &[&str]) -> (i32, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
        .arg(command)
        .args(["--destination", "redis", "--redis-stream", stream])
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("REDIS_URL", handoff_test::redis::url())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .expect("handoff finished within 60 s")
        .expect("run handoff");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let code = output.status.code().unwrap_or_else(|| {
        panic!(
            "killed; stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (code, stdout)
}

fn missing_ids(summary: &serde_json::Value) -> HashSet<Uuid> {
    summary["missing_events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event_id"].as_str().unwrap().parse().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_republishes_entries_deleted_behind_handoffs_back_in_order() {
    let (db, outbox) = migrated("destination_redis_reconcile").await;
    let stream = ScratchStream::new("dest-redis-reconcile");
    common::enqueue_spread(&db.pool, &outbox, 0, 24, 4).await;
    let relays = [redis_relay(&db.url(), stream.key(), "r-reconcile", &[])];
    wait_drained(&db.pool, Duration::from_secs(30), || logs(&relays)).await;
    drop(relays);
    let url = db.url();
    let reconcile = |args: &'static [&'static str]| {
        let (url, stream) = (url.clone(), stream.key().to_owned());
        async move {
            let mut all = vec!["--since", "10m", "--json"];
            all.extend_from_slice(args);
            let (code, stdout) = handoff(&url, &stream, "reconcile", &all).await;
            let summary: serde_json::Value =
                serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
            (code, summary)
        }
    };

    let (code, summary) = reconcile(&[]).await;
    assert_eq!(code, 0, "{summary}");
    assert_eq!(
        (&summary["checked"], &summary["missing"]),
        (&24.into(), &0.into())
    );

    // Redis "loses" five entries: sequences 2, 3 and 5 of agg-1 (so the republish order within
    // one aggregate shows), 1 of agg-2 and 4 of agg-3.
    let before = read_stream(stream.key()).await;
    assert_eq!(before.len(), 24);
    let lost: Vec<&Delivered> = before
        .iter()
        .filter(|m| match m.aggregate_id.as_str() {
            "agg-1" => [2, 3, 5].contains(&m.sequence),
            "agg-2" => m.sequence == 1,
            "agg-3" => m.sequence == 4,
            _ => false,
        })
        .collect();
    assert_eq!(lost.len(), 5);
    let mut connection = handoff_test::redis::connection();
    for message in &lost {
        let id = message.position.trim_start_matches("entry ");
        let deleted: i64 = redis::cmd("XDEL")
            .arg(stream.key())
            .arg(id)
            .query(&mut connection)
            .unwrap();
        assert_eq!(deleted, 1);
    }
    let lost_ids: HashSet<Uuid> = lost.iter().map(|m| m.event_id).collect();

    let (code, summary) = reconcile(&[]).await;
    assert_eq!(code, 2, "{summary}");
    assert_eq!(
        (&summary["missing"], &summary["republished"]),
        (&5.into(), &0.into())
    );
    assert_eq!(missing_ids(&summary), lost_ids);
    assert_eq!(
        read_stream(stream.key()).await.len(),
        19,
        "a check publishes nothing"
    );

    let (code, summary) = reconcile(&["--republish"]).await;
    assert_eq!(code, 0, "{summary}");
    assert_eq!(
        (&summary["missing"], &summary["republished"]),
        (&5.into(), &5.into())
    );
    let after = read_stream(stream.key()).await;
    assert_eq!(after.len(), 24, "19 kept + 5 republished, nothing else");
    let added = &after[19..];
    assert_eq!(
        added.iter().map(|m| m.event_id).collect::<HashSet<_>>(),
        lost_ids
    );
    let mut last: HashMap<&str, i64> = HashMap::new();
    for message in added {
        let previous = last
            .insert(&message.aggregate_id, message.sequence)
            .unwrap_or(0);
        assert!(
            message.sequence > previous,
            "{}: {} republished after {previous}",
            message.aggregate_id,
            message.sequence
        );
    }
    assert_eq!(last["agg-1"], 5);

    // The copies count as present.
    let (code, summary) = reconcile(&[]).await;
    assert_eq!(code, 0, "{summary}");
    assert_eq!(
        (&summary["missing"], &summary["present_as_replayed_copy"]),
        (&0.into(), &5.into())
    );
}

#[tokio::test]
async fn a_dedup_window_within_the_lease_or_without_redis_is_refused() {
    let (db, _outbox) = migrated("destination_redis_refusals").await;
    let short = common::handoff(
        &db,
        &[
            "relay",
            "--destination",
            "redis",
            "--lease",
            "30s",
            "--redis-dedup-window",
            "10s",
        ],
    );
    common::assert_refused(&short, "must be longer than the lease");
    let stray = common::handoff(&db, &["relay", "--redis-dedup-window", "5m"]);
    common::assert_refused(&stray, "--redis-dedup-window needs --destination redis");
    let unknown = common::handoff(
        &db,
        &[
            "reconcile",
            "--since",
            "10m",
            "--destination",
            "redis",
            "--redis-stream",
            "handoff-test:none",
        ],
    );
    assert_ne!(unknown.status.code(), Some(0));
    assert!(
        common::stderr(&unknown).contains("does not exist (check --redis-stream)"),
        "{}",
        common::stderr(&unknown)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_into_redis_adds_marked_copies_of_one_aggregate_in_order() {
    let (db, outbox) = migrated("replay_redis").await;
    let stream = ScratchStream::new("replay-redis");
    common::enqueue_spread(&db.pool, &outbox, 0, 12, 3).await;
    let relays = [redis_relay(&db.url(), stream.key(), "r-replay", &[])];
    wait_drained(&db.pool, Duration::from_secs(30), || logs(&relays)).await;
    drop(relays);
    let before = handoff_test::redis::read_stream(stream.key()).await;
    assert_eq!(before.len(), 12);

    let replay = [
        "replay",
        "--aggregate-type",
        handoff_test::factory::AGGREGATE_TYPE,
        "--aggregate-id",
        "agg-1",
        "--destination",
        "redis",
        "--redis-url",
        &handoff_test::redis::url(),
        "--redis-stream",
        stream.key(),
        "--json",
    ];
    let run = common::handoff(&db, &replay);
    assert_eq!(run.status.code(), Some(0), "{}", common::stderr(&run));
    let summary = common::stdout_json(&run);
    assert_eq!(
        (&summary["matched"], &summary["published"]),
        (&4.into(), &4.into())
    );
    assert_eq!(summary["destination"], "redis");
    assert_eq!(summary["stream"], stream.key());
    let replay_id = summary["replay_id"].as_str().unwrap();

    let after = handoff_test::redis::read_stream(stream.key()).await;
    assert_eq!(after.len(), 16);
    let copies = &after[12..];
    for copy in copies {
        assert_eq!(copy.replay.as_deref(), Some(replay_id));
        assert_eq!(copy.header("Handoff-Aggregate-Id"), Some("agg-1"));
        let original = before.iter().find(|m| m.event_id == copy.event_id).unwrap();
        assert_eq!(copy.payload, original.payload);
    }
    let sequences: Vec<_> = copies
        .iter()
        .map(|m| m.header("Handoff-Sequence").unwrap())
        .collect();
    assert_eq!(sequences, ["1", "2", "3", "4"]);
}
