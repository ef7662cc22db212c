//! `Cleanup` against a real PostgreSQL: what goes, what stays, the archive, the horizons, the
//! run log, locks and the stop signal (design O2, C5).

use crate::common;

use std::time::Duration;

use handoff_postgres::{
    Cleanup, CleanupConfig, CleanupError, CleanupErrorKind, CleanupReport, Outbox,
};
use handoff_test::{factory, TestDb};
use sqlx::Connection;
use tokio::sync::watch;
use uuid::Uuid;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Commits one event of aggregate `aggregate` with id `id`, and sets its delivery state with
/// `state` (an SQL assignment list over the row, such as `published_at = now()`).
async fn row(db: &TestDb, outbox: &Outbox, aggregate: &str, id: Uuid, state: &str) {
    let mut tx = db.pool.begin().await.unwrap();
    let event = factory::event(aggregate, 1).with_event_id(id);
    outbox.enqueue(&mut tx, &[event]).await.unwrap();
    sqlx::query(&format!("UPDATE outbox SET {state} WHERE event_id = $1"))
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// The kinds of rows a cleanup meets. Ids are chosen so that the rows that must go sort both
/// before and after the ones that must stay: the walk cannot stop early on id order.
struct Seeded {
    old_published: Vec<Uuid>,
    stays: Vec<Uuid>,
}

async fn seed(db: &TestDb, outbox: &Outbox) -> Seeded {
    let mut old_published = Vec::new();
    let mut stays = Vec::new();
    for n in 0..10u128 {
        // Old published rows at both ends of the key space.
        let low = Uuid::from_u128(n + 1);
        let high = Uuid::from_u128(u128::MAX - n);
        for id in [low, high] {
            let state = "published_at = now() - interval '30 days', claimed_by = 'r1', \
                         claim_until = now() - interval '30 days', attempt_count = 2, \
                         last_error = 'timeout once'";
            row(db, outbox, &format!("old-{id}"), id, state).await;
            old_published.push(id);
        }
        // Stays: published a day ago (inside 7 days), pending, old pending, quarantined.
        let mid = |k: u128| Uuid::from_u128((1u128 << 120) * (k + 1) + n);
        let young = mid(1);
        row(
            db,
            outbox,
            &format!("young-{n}"),
            young,
            "published_at = now() - interval '1 day'",
        )
        .await;
        let pending = mid(2);
        row(
            db,
            outbox,
            &format!("pending-{n}"),
            pending,
            "attempt_count = 0",
        )
        .await;
        let old_pending = mid(3);
        row(
            db,
            outbox,
            &format!("oldpending-{n}"),
            old_pending,
            "occurred_at = now() - interval '60 days', available_at = now() - interval '60 days'",
        )
        .await;
        let quarantined = mid(4);
        row(
            db,
            outbox,
            &format!("quarantined-{n}"),
            quarantined,
            "available_at = 'infinity', quarantined_at = now() - interval '40 days', \
             occurred_at = now() - interval '40 days', attempt_count = 20, last_error = 'refused'",
        )
        .await;
        stays.extend([young, pending, old_pending, quarantined]);
    }
    Seeded {
        old_published,
        stays,
    }
}

async fn ids(db: &TestDb, table: &str) -> Vec<Uuid> {
    let mut ids: Vec<Uuid> = sqlx::query_scalar(&format!("SELECT event_id FROM {table}"))
        .fetch_all(&db.pool)
        .await
        .unwrap();
    ids.sort();
    ids
}

fn sorted(mut ids: Vec<Uuid>) -> Vec<Uuid> {
    ids.sort();
    ids
}

async fn run(db: &TestDb, config: CleanupConfig) -> Result<CleanupReport, CleanupError> {
    let mut conn = db.pool.acquire().await.unwrap();
    let (_stop_tx, stop) = watch::channel(false);
    Cleanup::new(config)?.run(&mut conn, stop, |_| {}).await
}

/// Small batches, so a run of a few dozen rows takes several.
fn small_batches() -> CleanupConfig {
    CleanupConfig {
        batch_size: 7,
        ..CleanupConfig::default()
    }
}

#[tokio::test]
async fn old_published_rows_go_and_young_pending_and_quarantined_rows_stay() {
    let (db, outbox) = common::migrated("cleanup_what_goes").await;
    let seeded = seed(&db, &outbox).await;

    let report = run(&db, small_batches()).await.unwrap();

    assert_eq!(ids(&db, "outbox").await, sorted(seeded.stays.clone()));
    assert_eq!(report.outbox_deleted, seeded.old_published.len() as u64);
    assert_eq!(
        report.outbox_scanned,
        (seeded.old_published.len() + seeded.stays.len()) as u64
    );
    // 60 rows, 7 per batch: 9 batches, the last one short.
    assert_eq!(report.batches, 9);
    assert!(!report.interrupted);
    assert_eq!(db.count("outbox_archive").await, 0);

    // A second run finds nothing more to do.
    let again = run(&db, small_batches()).await.unwrap();
    assert_eq!(again.outbox_deleted, 0);
    assert_eq!(ids(&db, "outbox").await, sorted(seeded.stays));
}

#[tokio::test]
async fn the_run_is_recorded_with_its_counts_and_horizons() {
    let (db, outbox) = common::migrated("cleanup_run_log").await;
    let seeded = seed(&db, &outbox).await;

    let report = run(&db, small_batches()).await.unwrap();

    let (run_id, finished, deleted, batches, longest_ms, archived, retention_days, dedup): (
        i64,
        bool,
        i64,
        i64,
        f64,
        bool,
        f64,
        Option<chrono::DateTime<chrono::Utc>>,
    ) = sqlx::query_as(
        "SELECT run_id, finished_at IS NOT NULL, outbox_deleted, batches, longest_batch_ms,
                archived, extract(epoch FROM started_at - outbox_cutoff)::float8 / 86400,
                dedup_cutoff
         FROM handoff_cleanup_runs",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(Some(run_id), report.run_id);
    assert!(finished);
    assert_eq!(deleted, seeded.old_published.len() as i64);
    assert_eq!(batches, report.batches as i64);
    assert!(longest_ms > 0.0 && longest_ms < 60_000.0, "{longest_ms}");
    assert!(!archived);
    assert!((retention_days - 7.0).abs() < 1e-6, "{retention_days}");
    assert_eq!(dedup, None);
}

#[tokio::test]
async fn archive_moves_the_rows_with_identical_columns() {
    let (db, outbox) = common::migrated("cleanup_archive").await;
    let seeded = seed(&db, &outbox).await;
    let before: Vec<(Uuid, serde_json::Value)> = sqlx::query_as(
        "SELECT event_id, to_jsonb(o) FROM outbox o WHERE event_id = ANY($1) ORDER BY event_id",
    )
    .bind(&seeded.old_published)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(before.len(), seeded.old_published.len());

    let report = run(
        &db,
        CleanupConfig {
            archive: true,
            ..small_batches()
        },
    )
    .await
    .unwrap();
    assert!(report.archived);
    assert_eq!(report.outbox_deleted, seeded.old_published.len() as u64);

    let after: Vec<(Uuid, serde_json::Value)> = sqlx::query_as(
        "SELECT event_id, to_jsonb(a) - 'archived_at' FROM outbox_archive a ORDER BY event_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(after, before);
    assert_eq!(ids(&db, "outbox").await, sorted(seeded.stays));
    let archived_flag: bool = sqlx::query_scalar("SELECT archived FROM handoff_cleanup_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(archived_flag);
}

#[tokio::test]
async fn dry_run_counts_and_changes_nothing() {
    let (db, outbox) = common::migrated("cleanup_dry_run").await;
    let seeded = seed(&db, &outbox).await;
    let report = run(
        &db,
        CleanupConfig {
            dry_run: true,
            ..small_batches()
        },
    )
    .await
    .unwrap();
    assert_eq!(report.outbox_deleted, seeded.old_published.len() as u64);
    assert_eq!(report.run_id, None);
    assert_eq!(db.count("outbox").await, 60);
    assert_eq!(db.count("handoff_cleanup_runs").await, 0);
}

/// Dedup rows of three consumers, 30 and 1 days old; returns the young ones.
async fn seed_dedup(db: &TestDb) -> Vec<(String, Uuid)> {
    let mut young = Vec::new();
    for consumer in ["billing", "inventory", "mail"] {
        for n in 0..10u128 {
            let old = Uuid::from_u128(u128::MAX - n);
            let new = Uuid::from_u128(n);
            sqlx::query(
                "INSERT INTO processed_events (consumer_name, event_id, processed_at)
                 VALUES ($1, $2, now() - interval '30 days'), ($1, $3, now() - interval '1 day')",
            )
            .bind(consumer)
            .bind(old)
            .bind(new)
            .execute(&db.pool)
            .await
            .unwrap();
            young.push((consumer.to_owned(), new));
        }
    }
    young.sort();
    young
}

#[tokio::test]
async fn dedup_rows_past_their_retention_go_when_asked() {
    let (db, _outbox) = common::migrated("cleanup_dedup").await;
    let young = seed_dedup(&db).await;

    // Without a dedup retention the dedup rows are not touched.
    let report = run(&db, small_batches()).await.unwrap();
    assert_eq!((report.dedup_scanned, report.dedup_deleted), (0, 0));
    assert_eq!(db.count("processed_events").await, 60);

    let report = run(
        &db,
        CleanupConfig {
            dedup_retention: Some(10 * DAY),
            ..small_batches()
        },
    )
    .await
    .unwrap();
    assert_eq!((report.dedup_scanned, report.dedup_deleted), (60, 30));
    let left: Vec<(String, Uuid)> = sqlx::query_as(
        "SELECT consumer_name, event_id FROM processed_events ORDER BY consumer_name, event_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(left, young);
    let dedup_deleted: i64 = sqlx::query_scalar(
        "SELECT dedup_deleted FROM handoff_cleanup_runs WHERE dedup_cutoff IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(dedup_deleted, 30);
}

#[tokio::test]
async fn horizons_out_of_order_are_refused_before_anything_is_touched() {
    let (db, outbox) = common::migrated("cleanup_horizons").await;
    seed(&db, &outbox).await;
    seed_dedup(&db).await;

    let error = run(
        &db,
        CleanupConfig {
            retention: Duration::from_secs(5 * 60),
            ..CleanupConfig::default()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, CleanupError::RetentionBelowDurabilityHorizon { .. }),
        "{error}"
    );
    let error = run(
        &db,
        CleanupConfig {
            dedup_retention: Some(DAY),
            ..CleanupConfig::default()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, CleanupError::DedupRetentionBelowRetention { .. }),
        "{error}"
    );
    assert_eq!(error.kind(), CleanupErrorKind::InvalidConfig);
    assert_eq!(db.count("outbox").await, 60);
    assert_eq!(db.count("processed_events").await, 60);
    assert_eq!(db.count("handoff_cleanup_runs").await, 0);
}

#[tokio::test]
async fn a_held_row_lock_makes_the_batch_back_off_and_retry_not_wait() {
    let (db, outbox) = common::migrated("cleanup_lock").await;
    let seeded = seed(&db, &outbox).await;

    // Someone else's transaction holds a lock on a row the cleanup wants to delete.
    let mut holder = sqlx::PgConnection::connect_with(&db.connect_options())
        .await
        .unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox WHERE event_id = $1 FOR UPDATE")
        .bind(seeded.old_published[0])
        .execute(&mut *tx)
        .await
        .unwrap();

    // With the lock never released, the run gives up after its attempts.
    let config = CleanupConfig {
        lock_timeout: Duration::from_millis(50),
        lock_attempts: 2,
        ..small_batches()
    };
    let error = run(&db, config.clone()).await.unwrap_err();
    assert_eq!(error.kind(), CleanupErrorKind::LockTimeout, "{error}");
    let finished: Option<bool> =
        sqlx::query_scalar("SELECT finished_at IS NOT NULL FROM handoff_cleanup_runs")
            .fetch_optional(&db.pool)
            .await
            .unwrap();
    assert_eq!(finished, Some(false), "a failed run keeps finished_at NULL");

    // Released during the back-off, the retry goes through.
    let release = async move {
        tokio::time::sleep(Duration::from_millis(80)).await;
        tx.rollback().await.unwrap();
    };
    let retried = run(
        &db,
        CleanupConfig {
            lock_attempts: 20,
            ..config
        },
    );
    let (report, ()) = tokio::join!(retried, release);
    let report = report.unwrap();
    assert!(report.lock_retries >= 1, "{report:?}");
    assert!(report.longest_batch < Duration::from_secs(1), "{report:?}");
    assert_eq!(ids(&db, "outbox").await, sorted(seeded.stays));
}

#[tokio::test]
async fn a_stop_ends_the_run_between_batches_and_leaves_it_unfinished() {
    let (db, outbox) = common::migrated("cleanup_stop").await;
    seed(&db, &outbox).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let (stop_tx, stop) = watch::channel(false);
    let cleanup = Cleanup::new(small_batches()).unwrap();
    // Asked to stop right after the first batch.
    let report = cleanup
        .run(&mut conn, stop, |_| {
            stop_tx.send_replace(true);
        })
        .await
        .unwrap();
    assert!(report.interrupted);
    assert_eq!(report.batches, 1);
    assert_eq!(report.outbox_scanned, 7);
    let (finished, batches): (bool, i64) =
        sqlx::query_as("SELECT finished_at IS NOT NULL, batches FROM handoff_cleanup_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(!finished);
    assert_eq!(batches, 1);
}
