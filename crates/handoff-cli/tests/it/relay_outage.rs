//! A broker outage: the relay must not hammer PostgreSQL while nats-server is down, and must
//! publish everything once it is back (design P3). A relay that freezes while its claim is on
//! the wire holds nothing past its lease.

use crate::common;

use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::common::{check_stream, enqueue_spread, wait_drained, RelayProcess, Target};
use handoff_core::NewEvent;
use handoff_postgres::{Migrator, Outbox, OutboxConfig, Schema};
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop, NatsServer,
};
use handoff_test::proxy::FaultProxy;
use handoff_test::{database_url, eventually, factory, TestDb};
use sqlx::postgres::PgConnectOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

/// Transactions committed in `database` so far, as PostgreSQL counts them.
async fn transactions(admin: &mut PgConnection, database: &str) -> i64 {
    // Counters are flushed by each backend at most once a second (and when it goes idle):
    // drop the snapshot cache so every read sees the latest flushed values.
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *admin)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database WHERE datname = $1",
    )
    .bind(database)
    .fetch_one(admin)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_pauses_claims_and_everything_is_published_after_it() {
    // A database of its own, so its transaction counter is the relay's alone.
    let database = format!("t_outage_{}", std::process::id());
    let base = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .disable_statement_logging();
    let mut admin = PgConnection::connect_with(&base).await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {database}"))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {database}"))
        .execute(&mut admin)
        .await
        .unwrap();
    let own = base.clone().database(&database);
    let url = {
        let mut url = database_url();
        let slash = url.rfind('/').unwrap();
        url.truncate(slash + 1);
        url + &database
    };
    let db = TestDb::in_database(&url, "outage").await;
    Migrator::handoff(Schema::default())
        .run(&mut db.pool.acquire().await.unwrap())
        .await
        .unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let _ = own;
    // The test's own work before the window goes through a pool that is closed before the
    // window opens: a backend flushes its statistics when it exits, so none of them are
    // counted late, inside the window, as if the relay had run them.
    db.pool.close().await;
    let setup = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.connect_options())
        .await
        .unwrap();

    let mut nats = NatsServer::start().unwrap();
    let stream = unique_name("outage");
    let target = Target {
        database_url: db.url(),
        nats_url: nats.url(),
        stream: stream.clone(),
        prefix: stream.clone(),
    };
    let mut relay = RelayProcess::start(&target, "outage-relay", &[], &[]);

    enqueue_spread(&setup, &outbox, 0, 50, 10).await;
    wait_drained(&setup, Duration::from_secs(30), || relay.log()).await;

    // The broker dies; events keep being committed.
    nats.kill().unwrap();
    enqueue_spread(&setup, &outbox, 50, 50, 10).await;
    relay
        .wait_for_log("broker unreachable", Duration::from_secs(30))
        .await;
    // Autovacuum would count too: the migration and the writes left it work (catalog tables
    // included) that it would do during the window. Done now, it has none left.
    sqlx::query("VACUUM ANALYZE").execute(&setup).await.unwrap();
    setup.close().await;
    // An idle backend flushes its counters only after 10 s (PGSTAT_IDLE_INTERVAL), so what the
    // relay and the setup pool did before the outage shows up that late: count from 11 s into
    // the outage to its end, 30 s after it began.
    let outage = Instant::now();
    tokio::time::sleep(Duration::from_secs(11)).await;
    let before = transactions(&mut admin, &database).await;
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(30).saturating_sub(outage.elapsed())).await;
    let during = transactions(&mut admin, &database).await;
    let per_second = (during - before) as f64 / window.elapsed().as_secs_f64();
    eprintln!(
        "{} transactions in {:?} while the broker was down",
        during - before,
        window.elapsed()
    );
    // Nothing per event or per claim: what is left is background, above all the relay's session
    // heartbeat (a beat every quarter of its lease: once a second at the tests' 4 s lease,
    // every 5 s at the default 30 s), which a relay keeps whatever its broker does.
    assert!(
        per_second <= 3.0,
        "{per_second:.1} transactions/s while the broker was down:\n{}",
        relay.log()
    );

    nats.start_again().unwrap();
    let after = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.connect_options())
        .await
        .unwrap();
    wait_drained(&after, Duration::from_secs(60), || relay.log()).await;
    assert!(relay.terminate().success());
    let client = async_nats::connect(nats.url()).await.unwrap();
    let messages = read_stream(&client, &stream).await;
    let report = check_stream(&after, &messages).await;
    after.close().await;
    assert_eq!(report.messages - report.duplicates, 100);

    drop(db);
    sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
}

/// Relay A freezes (a stalled network, then SIGSTOP) while a claim of large events is on its
/// way to it; relay B starts. Every event is published within A's lease and a margin, in
/// order: A's freeze holds no row lock and no uncommitted lease, whatever it froze in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_frozen_while_its_claim_is_on_the_wire_holds_nothing_past_its_lease() {
    const EVENTS: u64 = 1_000;
    const AGGREGATES: u64 = 50;
    let (db, outbox) = common::migrated("freeze_claim").await;
    let client = prepare_shared_server().await;
    let stream = unique_name("freeze");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);

    // Relay A reaches PostgreSQL through a proxy that, like a frozen client, stops reading
    // once 1 MiB more went A's way: the claim of 16 KB events (or what A reads after it) stalls
    // there, with PostgreSQL's writes blocked on the full socket.
    let options = PgConnectOptions::from_str(&database_url()).unwrap();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = FaultProxy::start(upstream.parse().unwrap()).await.unwrap();
    // A frozen client's socket buffer, not loopback's autotuned tens of megabytes: past it (and
    // the server's own send buffer, a few MB) PostgreSQL's writes block.
    proxy.limit_upstream_receive_buffer(64 * 1024);
    let proxied = db.url().replacen(&upstream, &proxy.addr().to_string(), 1);
    assert_ne!(proxied, db.url(), "the test URL names {upstream}");
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream.clone(),
    };
    let frozen_target = Target {
        database_url: proxied,
        ..target.clone()
    };
    let padding = "x".repeat(16 * 1024);
    for chunk in 0..EVENTS / 100 {
        let mut tx = db.pool.begin().await.unwrap();
        let events: Vec<NewEvent> = (chunk * 100..(chunk + 1) * 100)
            .map(|n| {
                NewEvent::new(
                    factory::AGGREGATE_TYPE,
                    format!("agg-{}", n % AGGREGATES),
                    factory::EVENT_TYPE,
                    1,
                    format!(r#"{{"n":{n},"padding":"{padding}"}}"#),
                )
            })
            .collect();
        outbox.enqueue(&mut tx, &events).await.unwrap();
        tx.commit().await.unwrap();
    }
    // Lease 4 s (RelayProcess's default for tests). A's first claim is a full batch of 500
    // events, 8 MB: far more than the buffers between PostgreSQL and the frozen proxy hold.
    proxy.freeze_after(1 << 20);
    let a = RelayProcess::start(&frozen_target, "relay-a", &[], &[]);
    eventually(
        "relay A's reads frozen",
        Duration::from_secs(30),
        async || a.log_unless(proxy.is_frozen()),
    )
    .await;
    a.freeze();
    let frozen_at = Instant::now();

    let mut b = RelayProcess::start(&target, "relay-b", &[], &[]);
    // Lease 4 s, then 15 s to publish what A held and everything behind it.
    wait_drained(&db.pool, Duration::from_secs(4 + 15), || {
        format!("relay B:\n{}\nrelay A:\n{}", b.log(), a.log())
    })
    .await;
    let took = frozen_at.elapsed();
    assert!(b.terminate().success(), "{}", b.log());
    let messages = read_stream(&client, &stream).await;
    let check = check_stream(&db.pool, &messages).await;
    assert!(check.messages >= EVENTS as usize, "{check:?}");
    eprintln!("drained {took:?} after relay A froze: {check:?}");
    drop(a);
}
