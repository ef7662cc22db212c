//! The migrator against the real PostgreSQL.

use handoff_postgres::{MigrateErrorKind, Migrator, Schema, HANDOFF_MIGRATIONS};
use handoff_test::TestDb;

/// Every handoff migration's version, in order.
fn versions() -> Vec<i64> {
    HANDOFF_MIGRATIONS.iter().map(|m| m.version).collect()
}

const SEED_COLUMNS: [&str; 14] = [
    "event_id",
    "aggregate_type",
    "aggregate_id",
    "aggregate_sequence",
    "event_type",
    "schema_version",
    "payload",
    "occurred_at",
    "available_at",
    "claimed_by",
    "claim_until",
    "published_at",
    "attempt_count",
    "last_error",
];

#[tokio::test]
async fn migrate_creates_the_seed_schema_in_the_default_schema_and_is_idempotent() {
    let db = TestDb::new("migrate_idempotent").await;
    let mut conn = db.pool.acquire().await.unwrap();
    let migrator = Migrator::handoff(Schema::default());

    let first = migrator.run(&mut conn).await.unwrap();
    assert_eq!(first.applied, versions());
    let second = migrator.run(&mut conn).await.unwrap();
    assert!(second.applied.is_empty());
    assert_eq!(second.already_applied, versions());

    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns
         WHERE table_schema = $1 AND table_name = 'outbox'",
    )
    .bind(db.schema())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for seed in SEED_COLUMNS {
        assert!(columns.iter().any(|c| c == seed), "outbox lacks {seed}");
    }
    let constraints: Vec<String> = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
         JOIN pg_namespace n ON n.oid = c.connamespace
         WHERE n.nspname = $1 AND c.conname = 'outbox_aggregate_sequence_key'",
    )
    .bind(db.schema())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        constraints,
        ["UNIQUE (aggregate_type, aggregate_id, aggregate_sequence)"]
    );
    let pending_index: String = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'outbox_pending_idx'",
    )
    .bind(db.schema())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        pending_index.contains("WHERE (published_at IS NULL)"),
        "{pending_index}"
    );
    assert_eq!(db.count("processed_events").await, 0);
}

#[tokio::test]
async fn concurrent_migrations_apply_each_file_once() {
    let db = TestDb::new("migrate_concurrent").await;
    let runs = (0..6).map(|_| {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            Migrator::handoff(Schema::default()).run(&mut conn).await
        })
    });
    let reports: Vec<_> = futures::future::join_all(runs)
        .await
        .into_iter()
        .map(|r| r.unwrap().expect("every concurrent run succeeds"))
        .collect();
    let applied: usize = reports.iter().map(|r| r.applied.len()).sum();
    let all = HANDOFF_MIGRATIONS.len();
    assert_eq!(
        applied, all,
        "each migration is applied by exactly one run: {reports:?}"
    );
    assert!(
        reports.iter().any(|r| r.applied.len() == all),
        "the run that took the lock first applied them all: {reports:?}"
    );
    assert_eq!(db.count("handoff_migrations").await, all as i64);
}

#[tokio::test]
async fn a_changed_migration_is_refused() {
    let db = TestDb::new("migrate_checksum").await;
    let mut conn = db.pool.acquire().await.unwrap();
    let migrator = Migrator::handoff(Schema::default());
    migrator.run(&mut conn).await.unwrap();
    sqlx::query("UPDATE handoff_migrations SET checksum = '\\x00' WHERE version = 1")
        .execute(&mut *conn)
        .await
        .unwrap();

    let err = migrator.run(&mut conn).await.unwrap_err();
    assert_eq!(err.kind(), MigrateErrorKind::ChecksumMismatch);
    let err = migrator.check(&mut conn).await.unwrap_err();
    assert_eq!(err.kind(), MigrateErrorKind::ChecksumMismatch);
}

#[tokio::test]
async fn check_refuses_a_schema_that_is_behind() {
    let db = TestDb::new("migrate_behind").await;
    let mut conn = db.pool.acquire().await.unwrap();
    let migrator = Migrator::handoff(Schema::default());

    let err = migrator.check(&mut conn).await.unwrap_err();
    assert_eq!(err.kind(), MigrateErrorKind::Behind);
    migrator.run(&mut conn).await.unwrap();
    migrator.check(&mut conn).await.expect("current after run");
}

#[tokio::test]
async fn a_named_schema_holds_the_tables_and_revert_removes_them() {
    let db = TestDb::new("migrate_named").await;
    let named = format!("{}_named", db.schema());
    let mut conn = db.pool.acquire().await.unwrap();
    let migrator = Migrator::handoff(Schema::named(named.clone()).unwrap());

    migrator.run(&mut conn).await.unwrap();
    let outbox: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{named}.outbox"))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert!(outbox.is_some(), "outbox created in {named}");
    let in_default: Option<String> = sqlx::query_scalar("SELECT to_regclass('outbox')::text")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(
        in_default, None,
        "nothing leaks into the search_path schema"
    );

    let mut reverted = versions();
    reverted.reverse();
    assert_eq!(migrator.revert(&mut conn, 0).await.unwrap(), reverted);
    let outbox: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{named}.outbox"))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(outbox, None);
    // The down file is right if up applies again on top of it.
    assert_eq!(migrator.run(&mut conn).await.unwrap().applied, versions());
    sqlx::raw_sql(&format!("DROP SCHEMA \"{named}\" CASCADE"))
        .execute(&mut *conn)
        .await
        .unwrap();
}
