//! An idle outbox in a busy database must not pin WAL (design P9, F4): while nothing is written
//! to the outbox, the CDC source confirms the server's keepalive positions, so the slot's
//! confirmed position follows the WAL other tables write and PostgreSQL can recycle it.

use std::time::Duration;

use crate::common::{eventually, Fixture, SlotState};
use handoff_cdc::RowMode;

const MB: u64 = 1024 * 1024;
/// WAL written into the other table per round.
const BALLAST: u64 = 32 * MB;
/// What "bounded" means here: far below the ballast, well above one confirm interval's drift.
const BOUND: u64 = 4 * MB;

/// Writes at least [`BALLAST`] bytes of WAL into `ballast`, in several transactions; returns
/// how many bytes it wrote.
async fn write_ballast(fx: &Fixture) -> u64 {
    let start = fx.current_wal_lsn().await;
    loop {
        // ~2,000 rows of 1,920 bytes of text each: under the TOAST threshold, so stored (and
        // logged) uncompressed, about 4 MB of WAL per transaction.
        sqlx::query(
            "INSERT INTO ballast (pad)
             SELECT repeat(md5(g::text || random()::text), 60) FROM generate_series(1, 2000) g",
        )
        .execute(&fx.db.pool)
        .await
        .unwrap();
        let written = fx.current_wal_lsn().await - start;
        if written >= BALLAST {
            return written;
        }
    }
}

/// A checkpoint logs a running-transactions record: decoding it is what lets a logical slot's
/// restart position move (once the client confirms past it).
async fn checkpoint(fx: &Fixture) {
    sqlx::query("CHECKPOINT")
        .execute(&fx.db.pool)
        .await
        .unwrap();
}

fn describe(slot: &SlotState) -> String {
    format!(
        "retained {:.1} MB, confirmed lag {:.1} MB",
        slot.retained() as f64 / MB as f64,
        slot.confirmed_lag() as f64 / MB as f64
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_in_a_busy_database_does_not_pin_wal_and_a_stopped_relay_does() {
    let fx = Fixture::start("cdc_wal_idle", RowMode::Keep, &[]).await;
    sqlx::query("CREATE TABLE ballast (id bigserial PRIMARY KEY, pad text NOT NULL)")
        .execute(&fx.db.pool)
        .await
        .unwrap();

    // The relay runs; the outbox stays empty; another table writes plenty of WAL.
    let relay = fx.relay().await;
    let written = write_ballast(&fx).await;
    let after_writes = fx.current_wal_lsn().await;
    // The confirmed position follows the keepalives past everything written (on PostgreSQL
    // 15 within one confirm interval, no checkpoint needed)...
    eventually(
        "the slot confirmed past the ballast",
        Duration::from_secs(10),
        || async { fx.slot().await.confirmed_flush_lsn >= after_writes },
    )
    .await;
    // ...while the restart position moves only once a running-transactions record past it is
    // decoded and confirmed. The bgwriter logs one every 15 s of activity; a checkpoint logs
    // one now.
    checkpoint(&fx).await;
    eventually(
        "the retained WAL shrank below the bound",
        Duration::from_secs(10),
        || async {
            let slot = fx.slot().await;
            slot.retained() < BOUND && slot.confirmed_lag() < BOUND
        },
    )
    .await;
    let running = fx.slot().await;
    eprintln!(
        "relay running: wrote {:.1} MB into another table; {}",
        written as f64 / MB as f64,
        describe(&running)
    );
    let report = relay.stop().await;
    assert_eq!(report.published, 0, "nothing was written to the outbox");

    // The negative control: nobody reads the slot, the same writes stay retained.
    let before = fx.released_slot().await;
    let written = write_ballast(&fx).await;
    checkpoint(&fx).await;
    let stopped = fx.slot().await;
    eprintln!(
        "relay stopped: wrote {:.1} MB into another table; {}",
        written as f64 / MB as f64,
        describe(&stopped)
    );
    assert_eq!(stopped.restart_lsn, before.restart_lsn);
    assert_eq!(stopped.confirmed_flush_lsn, before.confirmed_flush_lsn);
    assert!(
        stopped.retained() >= written,
        "without a relay the slot retains all {written} bytes: {}",
        describe(&stopped)
    );
    assert!(stopped.confirmed_lag() >= written);
}
