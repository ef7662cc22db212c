//! `handoff relay --source log` as real processes against the real PostgreSQL and nats-server:
//! relays SIGKILLed again and again while writers write, and every event reaches the stream
//! once or more, the first copies in order, with no event row rewritten.

use std::time::{Duration, Instant};

use crate::common::{
    check_stream, free_addr, logs, migrated, sample, scrape_until, shared_target, RelayProcess,
    Writers,
};
use handoff_test::nats::read_stream;
use handoff_test::{eventually, TestDb, Verbatim};

/// Events the default cursor has not settled: outbox_published (migration 0021) dates what it
/// settled; NULL is still to go.
async fn unsettled(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_published WHERE published_at IS NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn log_relays_killed_again_and_again_lose_nothing_reorder_nothing_and_rewrite_no_row() {
    const AGGREGATES: usize = 30;
    const TRANSACTIONS: u64 = 600;
    let (db, outbox) = migrated("log_kills").await;
    let (target, client, _cleanup) = shared_target(&db, "log_kills").await;
    let start =
        |id: &str| RelayProcess::start(&target, id, &["--source", "log", "--lease", "3500ms"], &[]);
    let mut relays = vec![start("relay-a"), start("relay-b")];
    // The cursor first: what is written before it exists is a backlog its lane publishes (the
    // upgrade path, tested in handoff-postgres), with rows written as the polling source does.
    eventually(
        "the cursor exists",
        Duration::from_secs(30),
        async || match db.count("outbox_cursors").await {
            1 => Ok(()),
            _ => Err("no cursor yet"),
        },
    )
    .await;

    // Paced, so that writes go on through every takeover; nothing rolled back.
    let writers = Writers {
        connections: 4,
        transactions: TRANSACTIONS,
        aggregates: AGGREGATES,
        rollback_every: u64::MAX,
    }
    .spawn_paced(&db.pool, &outbox, Some(Duration::from_millis(70)));

    // The cursor's holder, whichever it is, at seeded moments after it took the cursor over.
    let mut rng = fastrand::Rng::with_seed(41);
    let started = Instant::now();
    const KILLS: i64 = 4;
    for kill in 0..KILLS {
        eventually(
            "the cursor is taken over",
            Duration::from_secs(30),
            async || {
                let token: i64 = sqlx::query_scalar("SELECT lease_token FROM outbox_cursors")
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
                if token > kill {
                    Ok(())
                } else {
                    Err(format!("lease token {token}"))
                }
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.u64(200..800))).await;
        let holder: String = sqlx::query_scalar("SELECT owner_relay FROM outbox_cursors")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let victim = relays.iter().position(|r| r.id == holder).unwrap();
        relays[victim].kill();
        relays[victim] = start(&holder);
    }
    writers.await.unwrap();
    // The last kill's takeover too: a standby takes the cursor once the lease has run out,
    // whether or not events are left to publish by then.
    eventually(
        "the last kill's takeover",
        Duration::from_secs(30),
        async || {
            let token: i64 = sqlx::query_scalar("SELECT lease_token FROM outbox_cursors")
                .fetch_one(&db.pool)
                .await
                .unwrap();
            if token > KILLS {
                Ok(())
            } else {
                Err(format!("lease token {token}"))
            }
        },
    )
    .await;
    eventually(
        "the cursor settled every event",
        Duration::from_secs(60),
        async || match unsettled(&db).await {
            0 => Ok(()),
            left => Err(Verbatim(format!(
                "{left} events not settled\n{}",
                logs(&relays)
            ))),
        },
    )
    .await;
    // A standby relay reports the cursor's lag, read from the cursor's row: none is left.
    let addr = free_addr();
    let observer = RelayProcess::start(
        &target,
        "relay-observer",
        &[
            "--source",
            "log",
            "--lease",
            "3500ms",
            "--metrics-addr",
            &addr.to_string(),
        ],
        &[],
    );
    scrape_until(
        addr,
        Duration::from_secs(30),
        "no cursor lag",
        |text| sample(text, "handoff_cursor_lag_events{cursor=\"default\"}") == Some(0.0),
        || observer.log(),
    )
    .await;
    relays.push(observer);
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
        "{KILLS} kills, {} messages, {} duplicates, {:?}",
        report.messages,
        report.duplicates,
        started.elapsed()
    );
    let rewritten: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE xmin::text::bigint <> (txid::text::bigint % 4294967296)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // The kills did hit the cursor's holder: each takeover moved the lease token on.
    let token: i64 = sqlx::query_scalar("SELECT lease_token FROM outbox_cursors")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    eprintln!("lease token {token}");
    assert!(token > KILLS, "the cursor changed hands {token} times");
    let lane: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT aggregate_id, from_sequence, reason FROM outbox_cursor_lanes")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rewritten, 0,
        "no event row was written after its insert; lane: {lane:?}"
    );
}
