//! PostgreSQL crashes under a running relay: the relay backs off, reconnects by itself, and
//! publishes what was committed before and after (design P3); and relays frozen past their
//! lease around such a crash hold nothing as a crash loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{check_stream, enqueue_spread, logs, wait_drained, RelayProcess, Target};
use handoff_postgres::{Migrator, Outbox, OutboxConfig, Schema};
use handoff_test::cluster::PrivatePostgres;
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use handoff_test::{eventually, factory};
use sqlx::postgres::PgPoolOptions;

/// A private PostgreSQL with handoff migrated in its `postgres` database, a pool of
/// `connections` on it, an outbox, and a fresh stream named after `name` on the shared NATS
/// server (deleted when the guard drops).
struct Private {
    server: PrivatePostgres,
    pool: sqlx::PgPool,
    outbox: Outbox,
    client: async_nats::Client,
    target: Target,
    _cleanup: DeleteStreamOnDrop,
}

async fn private(name: &str, connections: u32) -> Private {
    let server = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap()
        .unwrap();
    let url = server.url("postgres");
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&url)
        .await
        .unwrap();
    Migrator::handoff(Schema::default())
        .run(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let client = prepare_shared_server().await;
    let stream = unique_name(name);
    let cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let target = Target {
        database_url: url,
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream,
    };
    Private {
        server,
        pool,
        outbox,
        client,
        target,
        _cleanup: cleanup,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_crash_under_the_relay_is_ridden_out() {
    let Private {
        mut server,
        pool,
        outbox,
        client,
        target,
        _cleanup,
    } = private("pg_restart", 2).await;
    let url = target.database_url.clone();
    let stream = target.stream.clone();
    let mut relay = RelayProcess::start(&target, "pg-restart-relay", &[], &[]);

    enqueue_spread(&pool, &outbox, 0, 30, 7).await;
    wait_drained(&pool, Duration::from_secs(30), || relay.log()).await;
    pool.close().await;

    // The postmaster is SIGKILLed: every connection of the relay dies with it.
    server = tokio::task::spawn_blocking(move || {
        server.kill_postmaster().unwrap();
        server
    })
    .await
    .unwrap();
    relay.wait_for_log("failed", Duration::from_secs(30)).await;
    server = tokio::task::spawn_blocking(move || {
        server.start_again().unwrap();
        server
    })
    .await
    .unwrap();

    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    enqueue_spread(&pool, &outbox, 30, 30, 7).await;
    wait_drained(&pool, Duration::from_secs(60), || relay.log()).await;
    assert!(relay.terminate().success(), "{}", relay.log());
    let messages = read_stream(&client, &stream).await;
    let report = check_stream(&pool, &messages).await;
    assert_eq!(report.messages - report.duplicates, 60);
    pool.close().await;
    drop(server);
}

/// A whole-number setting of the soak from the environment, else `default`.
fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Two relays, each frozen in turn (SIGSTOP, as a paused container or a VM stall) for longer
/// than its lease and then thawed, while writers go on; PostgreSQL crashes and restarts half way.
/// The other relay takes a frozen relay's events over, and a frozen relay's expired leases are
/// not crashes: no event is held as `crash_loop`, and every published event's `takeover_count`
/// is back to 0. Every committed event reaches the stream, first copies in order.
///
/// In the suite, 2 cycles of 8 s (lease 4 s). The soak: `HANDOFF_FREEZE_CYCLES=20
/// HANDOFF_FREEZE_SECONDS=40 cargo nextest run -p handoff-cli --all-features --test it
/// relay_postgres_restart::relays_frozen` (docs/relay.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_frozen_past_their_lease_and_a_postgres_restart_hold_nothing_as_a_crash_loop() {
    let cycles = setting("HANDOFF_FREEZE_CYCLES", 2);
    let freeze = Duration::from_secs(setting("HANDOFF_FREEZE_SECONDS", 8));
    let Private {
        mut server,
        pool,
        outbox,
        client,
        target,
        _cleanup,
    } = private("freeze_soak", 4).await;
    let stream = target.stream.clone();
    // Two takeovers of a crashed relay's lease hold an event: a frozen relay's counted as
    // crashes would hold events within a few cycles.
    let flags = ["--max-takeovers", "2"];
    let relays = [
        RelayProcess::start(&target, "frozen-a", &flags, &[]),
        RelayProcess::start(&target, "frozen-b", &flags, &[]),
    ];

    // Writers: an event every 5 ms over 50 aggregates, riding out the restart.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = tokio::spawn({
        let (pool, outbox, writing) = (pool.clone(), outbox.clone(), writing.clone());
        async move {
            let mut n = 0u64;
            let mut failed = 0u64;
            while writing.load(Ordering::SeqCst) {
                let event = factory::event(&format!("agg-{}", n % 50), n);
                let written = async {
                    let mut tx = pool.begin().await?;
                    outbox
                        .enqueue(&mut tx, &[event])
                        .await
                        .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
                    tx.commit().await
                }
                .await;
                match written {
                    Ok(()) => n += 1,
                    Err(_) => {
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (n, failed)
        }
    });

    for cycle in 0..cycles {
        let relay = &relays[cycle as usize % 2];
        relay.freeze();
        tokio::time::sleep(freeze).await;
        relay.thaw();
        if cycle == cycles / 2 {
            server = tokio::task::spawn_blocking(move || {
                server.kill_postmaster().unwrap();
                server.start_again().unwrap();
                server
            })
            .await
            .unwrap();
        }
        // Both run again: the thawed relay renews its session (after the restart, on a new
        // connection) before the next freeze.
        let heartbeat = async |pool: &sqlx::PgPool| -> Result<Option<f64>, String> {
            sqlx::query_scalar(
                "SELECT extract(epoch FROM max(heartbeat_at))::float8 FROM outbox_relays \
                 WHERE relay_id = $1",
            )
            .bind(&relay.id)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())
        };
        let thawed = eventually("a heartbeat read", Duration::from_secs(60), async || {
            heartbeat(&pool).await
        })
        .await;
        eventually(
            &format!("a heartbeat of {} after its thaw", relay.id),
            Duration::from_secs(60),
            async || match heartbeat(&pool).await {
                Ok(now) if now > thawed => Ok(()),
                other => Err(format!("{other:?}\n{}", relay.log())),
            },
        )
        .await;
    }
    writing.store(false, Ordering::SeqCst);
    let (written, failed) = writer.await.unwrap();
    eprintln!("{cycles} freezes of {freeze:?}: {written} events written, {failed} writes failed");

    wait_drained(&pool, Duration::from_secs(120), || logs(&relays)).await;
    let (held, takeovers): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND available_at = 'infinity'), \
                coalesce(max(takeover_count), 0)::int8 \
         FROM outbox",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(held, 0, "held:\n{}", logs(&relays));
    assert_eq!(takeovers, 0, "a published event kept its takeover count");
    let mut relays = relays;
    for relay in &mut relays {
        assert!(relay.terminate().success(), "{}", relay.log());
    }
    let messages = read_stream(&client, &stream).await;
    let report = check_stream(&pool, &messages).await;
    assert_eq!(report.messages - report.duplicates, written as usize);
    pool.close().await;
    drop(server);
}
