//! `handoff cleanup`: the binary's flags and refusals, and a million published rows cleaned
//! in batches beside a loaded relay with short transactions (design O2, C5, V4).

use crate::common;

use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{Cleanup, CleanupConfig, PollingConfig, PollingSource};
use handoff_relay::{Relay, RelayConfig};
use handoff_test::counting::CountingSource;
use handoff_test::faults::Faulty;
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::{factory, TestDb};
use sqlx::postgres::PgPoolOptions;
use sqlx::ConnectOptions;
use tokio::sync::watch;

fn cleanup(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_handoff"))
        .arg("cleanup")
        .args(args)
        .env("DATABASE_URL", db.url())
        .env_remove("HANDOFF_SCHEMA")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run handoff cleanup")
}

/// `published` rows published 30 days ago, `young` published an hour ago, `pending` never
/// published and `quarantined` held, all of distinct aggregates, written by one statement each
/// (with their heads).
async fn bulk(db: &TestDb, published: i64, young: i64, pending: i64, quarantined: i64) {
    let kinds = [
        (
            "old",
            published,
            "now() - interval '30 days'",
            "now() - interval '30 days'",
            "NULL",
        ),
        (
            "young",
            young,
            "now() - interval '1 hour'",
            "now() - interval '1 hour'",
            "NULL",
        ),
        ("pending", pending, "NULL", "now()", "NULL"),
        (
            "held",
            quarantined,
            "NULL",
            "'infinity'",
            "now() - interval '40 days'",
        ),
    ];
    for (kind, count, published_at, available_at, quarantined_at) in kinds {
        // The values are this test's own literals, never input; the counts are bound.
        sqlx::raw_sql(&format!(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                                 event_type, schema_version, payload, occurred_at,
                                 available_at, published_at, quarantined_at)
             SELECT ('{:08x}-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
                    'thing', '{kind}-' || g, 1, 'ThingHappened', 1,
                    jsonb_build_object('n', g, 'note', repeat('x', 100)),
                    now() - interval '30 days', {available_at}, {published_at},
                    {quarantined_at}
             FROM generate_series(1, {count}) g;
             INSERT INTO outbox_heads (aggregate_type, aggregate_id, last_sequence)
             SELECT 'thing', '{kind}-' || g, 1 FROM generate_series(1, {count}) g;",
            // Each kind its own id range, old rows last: they sort after the rows that stay.
            match kind {
                "old" => 0xf000_0000u32,
                "young" => 0x1000_0000,
                "pending" => 0x2000_0000,
                _ => 0x3000_0000,
            },
        ))
        .execute(&db.pool)
        .await
        .unwrap();
    }
}

async fn counts(db: &TestDb) -> (i64, i64, i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE aggregate_id LIKE 'old-%'),
                count(*) FILTER (WHERE aggregate_id LIKE 'young-%'),
                count(*) FILTER (WHERE aggregate_id LIKE 'pending-%'),
                count(*) FILTER (WHERE aggregate_id LIKE 'held-%')
         FROM outbox",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_binary_deletes_old_published_rows_and_prints_a_json_summary() {
    let (db, _outbox) = common::migrated("cli_cleanup_json").await;
    bulk(&db, 120, 10, 10, 10).await;

    let out = cleanup(&db, &["--json", "--batch-size", "50", "--retention", "2d"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["outbox_deleted"], 120);
    assert_eq!(summary["outbox_scanned"], 150);
    // 150 rows, 50 per batch: three full batches and the empty one that ends the walk.
    assert_eq!(summary["batches"], 4);
    assert_eq!(summary["dedup_deleted"], 0);
    assert_eq!(summary["archived"], false);
    assert!(summary["longest_batch_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(counts(&db).await, (0, 10, 10, 10));
    let (finished, deleted): (bool, i64) =
        sqlx::query_as("SELECT finished_at IS NOT NULL, outbox_deleted FROM handoff_cleanup_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(finished);
    assert_eq!(deleted, 120);
}

#[tokio::test]
async fn the_binary_archives_and_cleans_dedup_rows_when_asked() {
    let (db, _outbox) = common::migrated("cli_cleanup_archive").await;
    bulk(&db, 30, 5, 5, 5).await;
    sqlx::raw_sql(
        "INSERT INTO processed_events (consumer_name, event_id, processed_at)
         SELECT 'c-' || (g % 3), ('00000000-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
                now() - CASE WHEN g % 2 = 0 THEN interval '40 days' ELSE interval '1 day' END
         FROM generate_series(1, 40) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let out = cleanup(
        &db,
        &[
            "--archive",
            "--dedup-retention",
            "30d",
            "--batch-size",
            "7",
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["outbox_deleted"], 30);
    assert_eq!(summary["dedup_deleted"], 20);
    assert_eq!(summary["archived"], true);
    assert_eq!(db.count("outbox_archive").await, 30);
    assert_eq!(db.count("processed_events").await, 20);
    assert_eq!(counts(&db).await, (0, 5, 5, 5));
}

#[tokio::test]
async fn the_binary_refuses_horizons_out_of_order_and_changes_nothing() {
    let (db, _outbox) = common::migrated("cli_cleanup_refuse").await;
    bulk(&db, 20, 5, 5, 5).await;
    sqlx::raw_sql(
        "INSERT INTO processed_events (consumer_name, event_id, processed_at)
         VALUES ('c', '00000000-0000-7000-8000-000000000001', now() - interval '90 days')",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let cases: [(&[&str], &str); 4] = [
        (
            &["--retention", "5m"],
            "shorter than the broker durability horizon",
        ),
        (
            &["--retention", "1h", "--broker-durability-horizon", "2h"],
            "shorter than the broker durability horizon",
        ),
        (
            &["--dedup-retention", "1d"],
            "dedup retention 1d is shorter than retention 7d",
        ),
        (&["--batch-size", "100001"], "outside 1..=100000"),
    ];
    for (args, message) in cases {
        let out = cleanup(&db, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    assert_eq!(counts(&db).await, (20, 5, 5, 5));
    assert_eq!(db.count("processed_events").await, 1);
    assert_eq!(db.count("handoff_cleanup_runs").await, 0);
}

/// Published rows in the bulk load.
const BULK: i64 = 1_000_000;

/// The bound on the cleanup's longest transaction.
const LONGEST_TRANSACTION_BOUND: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_published_rows_go_in_short_batches_beside_a_loaded_relay() {
    let started = Instant::now();
    let (db, outbox) = common::migrated("cli_cleanup_million").await;
    bulk(&db, BULK, 100, 0, 10).await;
    sqlx::raw_sql("ANALYZE outbox")
        .execute(&db.pool)
        .await
        .unwrap();
    let loaded = started.elapsed();

    // The relay, in this process, on its own pool and stream.
    prepare_shared_server().await;
    let stream = unique_name("cleanup_million");
    let _delete_stream = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let transport = JetStreamTransport::connect(
        &shared_url(),
        JetStreamConfig {
            stream: stream.clone(),
            subject_prefix: stream.clone(),
            ..JetStreamConfig::default()
        },
    )
    .await
    .unwrap();
    transport.ensure_stream().await.unwrap();
    let relay_pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(db.connect_options())
        .await
        .unwrap();
    let source = Arc::new(CountingSource::new(
        PollingSource::new(
            relay_pool,
            PollingConfig {
                relay_id: "cleanup-test-relay".into(),
                ..PollingConfig::default()
            },
        )
        .unwrap(),
    ));
    // Counts failed publishes.
    let transport = Arc::new(Faulty::new(transport));
    let publishes = transport.stats();
    let relay =
        Relay::from_shared(source.clone(), transport.clone(), RelayConfig::default()).unwrap();
    let (relay_stop, mut relay_stop_rx) = watch::channel(false);
    let relay = tokio::spawn(relay.run(async move {
        let _ = relay_stop_rx.wait_for(|stop| *stop).await;
    }));

    // The writer: a steady stream of fresh events over 50 aggregates while the cleanup runs.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let pool = db.pool.clone();
        let writing = writing.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(5));
            let mut n = 0u64;
            while writing.load(Ordering::Relaxed) {
                tick.tick().await;
                let mut tx = pool.begin().await.unwrap();
                let event = factory::event(&format!("fresh-{}", n % 50), n);
                ids.push(event.event_id());
                outbox.enqueue(&mut tx, &[event]).await.unwrap();
                tx.commit().await.unwrap();
                n += 1;
            }
            ids
        })
    };

    // The cleanup, in this process, on a connection named so the sampler can find it.
    let application = format!("cleanup-{}", db.schema());
    let mut conn = db
        .connect_options()
        .application_name(&application)
        .connect()
        .await
        .unwrap();
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let pool = db.pool.clone();
        let sampling = sampling.clone();
        let application = application.clone();
        tokio::spawn(async move {
            let mut oldest = 0f64;
            let mut samples = 0u64;
            while sampling.load(Ordering::Relaxed) {
                let age: Option<f64> = sqlx::query_scalar(
                    "SELECT max(extract(epoch FROM clock_timestamp() - xact_start))::float8
                     FROM pg_stat_activity
                     WHERE application_name = $1 AND xact_start IS NOT NULL",
                )
                .bind(&application)
                .fetch_one(&pool)
                .await
                .unwrap();
                oldest = oldest.max(age.unwrap_or(0.0));
                samples += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (oldest, samples)
        })
    };
    let (_stop_tx, stop) = watch::channel(false);
    let cleanup = Cleanup::new(CleanupConfig {
        retention: Duration::from_secs(24 * 3600),
        ..CleanupConfig::default()
    })
    .unwrap();
    let cleanup_started = Instant::now();
    let report = cleanup.run(&mut conn, stop, |_| {}).await.unwrap();
    let cleanup_took = cleanup_started.elapsed();
    sampling.store(false, Ordering::Relaxed);
    let (oldest_xact, samples) = sampler.await.unwrap();
    writing.store(false, Ordering::Relaxed);
    let fresh = writer.await.unwrap();

    // Every fresh event is published.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let unpublished: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE event_id = ANY($1) AND published_at IS NULL",
        )
        .bind(&fresh)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if unpublished == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{unpublished} of {} fresh events still unpublished",
            fresh.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay_stop.send_replace(true);
    let relay_report = relay.await.unwrap();

    let longest_run_log: f64 = sqlx::query_scalar(
        "SELECT longest_batch_ms FROM handoff_cleanup_runs WHERE finished_at IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    println!(
        "loaded {BULK} rows in {:.1} s; cleanup deleted {} of {} scanned in {} batches, \
         {:.1} s ({:.0} rows/s); longest batch {longest_run_log:.0} ms (run log), oldest \
         cleanup transaction seen {:.0} ms over {samples} samples; relay published {} \
         ({} fresh), retried {}, source errors {}, publish failures {}",
        loaded.as_secs_f64(),
        report.outbox_deleted,
        report.outbox_scanned,
        report.batches,
        cleanup_took.as_secs_f64(),
        report.outbox_scanned as f64 / cleanup_took.as_secs_f64(),
        oldest_xact * 1000.0,
        relay_report.published,
        fresh.len(),
        relay_report.retried,
        source.errors(),
        publishes.failed_total(),
    );

    assert_eq!(report.outbox_deleted, BULK as u64);
    assert_eq!(counts(&db).await, (0, 100, 0, 10));
    assert!(
        fresh.len() > 100,
        "the writer wrote only {} events",
        fresh.len()
    );
    let fresh_left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE event_id = ANY($1)")
            .bind(&fresh)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        fresh_left,
        fresh.len() as i64,
        "fresh published rows are young: they stay"
    );
    assert_eq!(source.errors(), 0);
    assert_eq!(publishes.failed_total(), 0);
    assert_eq!((relay_report.retried, relay_report.held), (0, 0));
    assert!(relay_report.published >= fresh.len() as u64);
    assert!(samples > 10, "the sampler ran only {samples} times");
    assert!(
        Duration::from_secs_f64(longest_run_log / 1000.0) < LONGEST_TRANSACTION_BOUND,
        "longest batch {longest_run_log} ms"
    );
    assert!(
        Duration::from_secs_f64(oldest_xact) < LONGEST_TRANSACTION_BOUND,
        "a cleanup transaction was {oldest_xact} s old"
    );
}

/// A cleanup SIGKILLed in the middle of a batch (its deletes done, not committed) loses that
/// batch whole, never half of it, and never a pending or held row; the next run finishes.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_cleanup_killed_in_the_middle_of_a_batch_rolls_it_back_and_the_next_run_finishes() {
    let (db, _outbox) = common::migrated("cli_cleanup_kill").await;
    bulk(&db, 120, 10, 10, 10).await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["cleanup", "--batch-size", "50", "--retention", "2d"])
        .env("DATABASE_URL", db.url())
        .env_remove("HANDOFF_SCHEMA")
        .env("RUST_LOG", "warn")
        .env("FAILPOINTS", "cleanup.batch=return")
        .stdout(std::process::Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(log.path())
        .unwrap_or_default()
        .contains("failpoint fired")
    {
        assert!(Instant::now() < deadline, "the failpoint never fired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();

    // The frozen batch had deleted 50 rows in its transaction; the kill rolled them back.
    let deadline = Instant::now() + Duration::from_secs(30);
    while counts(&db).await != (120, 10, 10, 10) {
        assert!(
            Instant::now() < deadline,
            "the killed batch was not rolled back: {:?}",
            counts(&db).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let unfinished: bool =
        sqlx::query_scalar("SELECT finished_at IS NULL FROM handoff_cleanup_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(unfinished, "the run log shows the killed run as unfinished");

    let out = cleanup(&db, &["--batch-size", "50", "--retention", "2d"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(counts(&db).await, (0, 10, 10, 10));
}
