//! The rolling-upgrade rules of docs/compatibility.md, held against the binary: a relay runs on a
//! schema that a newer release has migrated further (it warns and publishes), and refuses, with
//! one line naming `handoff migrate`, a schema that is behind it.

use std::time::Duration;

use crate::common::{enqueue_spread, migrated, wait_drained, RelayProcess, Target};
use handoff_postgres::{Migrator, Schema};
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};

#[tokio::test]
async fn a_relay_publishes_on_a_schema_a_newer_release_migrated() {
    let (db, outbox) = migrated("compat_newer_schema").await;
    // What a newer release's `handoff migrate` leaves: a version this binary does not know.
    sqlx::query(
        "INSERT INTO handoff_migrations (version, name, checksum, duration_ms) \
         VALUES (9999, 'from_a_newer_release', '\\x00', 0)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    prepare_shared_server().await;
    let stream = unique_name("compat");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream,
    };
    enqueue_spread(&db.pool, &outbox, 0, 20, 4).await;
    let relay = RelayProcess::start(&target, "compat-newer", &[], &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    relay
        .wait_for_log(
            "migrations this binary does not know",
            Duration::from_secs(5),
        )
        .await;
    // `migrate --check` (a deploy's gate) calls that schema current for this binary.
    let check = crate::common::handoff(&db, &["migrate", "--check"]);
    assert_eq!(check.status.code(), Some(0), "{check:?}");
}

#[tokio::test]
async fn a_relay_refuses_a_schema_behind_it() {
    let (db, _outbox) = migrated("compat_older_schema").await;
    // The schema as the previous migration left it.
    let mut conn = db.pool.acquire().await.unwrap();
    let schema = Schema::named(db.schema()).unwrap();
    let latest: i64 = sqlx::query_scalar("SELECT max(version) FROM handoff_migrations")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    Migrator::handoff(schema)
        .revert(&mut conn, latest - 1)
        .await
        .unwrap();
    drop(conn);
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: unique_name("compat_old"),
        prefix: unique_name("compat_old"),
    };
    let mut relay = RelayProcess::start(&target, "compat-older", &[], &[]);
    let status = handoff_test::eventually("the relay exits", Duration::from_secs(30), async || {
        relay.try_status()
    })
    .await;
    assert_eq!(status.code(), Some(1), "{}", relay.log());
    let log = relay.log();
    assert!(log.contains("handoff migrate"), "{log}");
    let errors: Vec<_> = log.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{log}");
}
