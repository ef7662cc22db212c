//! `handoff-bench drain-bound --candidates`: the relay's claim and mark SQL as it is, beside two
//! ways of settling a lease that the relay does not use (yet), each draining the same backlog in
//! the same loop (claim 500, mark them, repeat; no broker), so the SQL cost of a design can be
//! weighed before the relay is rebuilt around it (docs/relay.md, *What was weighed*).
//!
//! - `sql_row_lease`: today's claim (`queries/claim.sql`) and mark, each a statement in
//!   autocommit. The control: the same loop as the others, so only the SQL differs.
//! - `sql_async_claim`: the same statements, the claim's commit with `synchronous_commit = off`.
//!   A lease lost with a server crash only sends its events again (at least once).
//! - `sql_lock_lease`: no lease written into the event rows. The claim's own row locks are the
//!   lease: its transaction stays open while the batch is out and the mark runs in it, so the
//!   rows get one new version each (the mark's) instead of two. A dead relay's locks go with its
//!   session (a stalled one's after `idle_in_transaction_session_timeout`); what a takeover
//!   must still count (crash loops) is kept as one row per batch in a side table, written on
//!   a second connection before the batch goes out and deleted by the mark's transaction.
//!
//! - `sql_row_lease_x2`, `sql_lock_lease_x2`: the control and the lock lease with two claim
//!   loops at once, as a relay with two claimers (or two relays) would run them: what
//!   concurrency adds on this machine's cores.
//!
//! The claim SQL is the relay's own file, changed only where a candidate differs (see
//! [`lock_lease_claim`]), so a change to the claim is measured by every candidate.

use std::time::Instant;

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use handoff_postgres::PollingConfig;
use serde::Serialize;
use sqlx::postgres::{PgPool, PgRow};
use sqlx::{Connection, Executor, PgConnection, Row};

use crate::relay::cpu;
use crate::relay::drain::{self, sql_loop_run, DrainRun, DrainVariant, SQL_BATCH};
use crate::relay::probe::Marked;
use crate::relay::{workload, Bench};

/// The relay's claim, as `handoff-postgres` ships it.
const CLAIM_SQL: &str = include_str!("../../../../crates/handoff-postgres/queries/claim.sql");

/// The relay's mark, as `handoff-postgres` ships it.
const MARK_SQL: &str =
    include_str!("../../../../crates/handoff-postgres/queries/mark_published.sql");

/// How far below its previous front a claim reads (the relay's `LOOKBACK`).
const LOOKBACK: chrono::TimeDelta = chrono::TimeDelta::milliseconds(500);

/// The lock lease's record of the batches out: one row per claim, for takeovers to count.
const BATCHES_TABLE: &str = "
CREATE TABLE IF NOT EXISTS bench_lease_batches (
    batch_id    bigserial   PRIMARY KEY,
    relay_id    text        NOT NULL,
    lease_xid   xid8        NOT NULL,
    lease_until timestamptz NOT NULL,
    event_ids   uuid[]      NOT NULL
)";

/// A way of leasing and settling, measured by [`drain()`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Candidate {
    /// Today's claim and mark, each in autocommit.
    RowLease,
    /// Today's statements, the claim committed asynchronously.
    AsyncClaim,
    /// Row locks held by the claim's open transaction as the lease; the mark in it.
    LockLease,
}

impl Candidate {
    /// What is measured, as (candidate, claim loops): the control first.
    pub const MEASURED: [(Candidate, usize); 5] = [
        (Candidate::RowLease, 1),
        (Candidate::AsyncClaim, 1),
        (Candidate::LockLease, 1),
        (Candidate::RowLease, 2),
        (Candidate::LockLease, 2),
    ];

    /// The candidate and claim loops a drain variant measures, if it is one of them.
    pub fn of(variant: DrainVariant) -> Option<(Candidate, usize)> {
        Self::MEASURED
            .into_iter()
            .find(|&(candidate, loops)| candidate.variant(loops) == variant)
    }

    /// The drain variant that reports it with `loops` claim loops (1 or 2).
    pub fn variant(self, loops: usize) -> DrainVariant {
        match (self, loops) {
            (Candidate::RowLease, 1) => DrainVariant::SqlRowLease,
            (Candidate::RowLease, _) => DrainVariant::SqlRowLease2,
            (Candidate::AsyncClaim, _) => DrainVariant::SqlAsyncClaim,
            (Candidate::LockLease, 1) => DrainVariant::SqlLockLease,
            (Candidate::LockLease, _) => DrainVariant::SqlLockLease2,
        }
    }
}

/// The claim with its `leased` step reading the rows it locked instead of writing a lease into
/// them, and the transaction's id in every row (for the batch record). Everything before it
/// (front, heads, runs, parking, crash-loop and suspect rules) is the relay's claim unchanged.
pub fn lock_lease_claim() -> Result<String> {
    let start = CLAIM_SQL
        .find("leased AS (\n    UPDATE")
        .context("claim.sql has no leased step")?;
    let end = start
        + CLAIM_SQL[start..]
            .find("\n)\n")
            .context("claim.sql's leased step has no end")?;
    // The rows the relay's lease returns, read instead of written: its RETURNING list, with
    // the lease's end computed rather than read from the row.
    let returned = CLAIM_SQL[start..end]
        .split_once("RETURNING ")
        .context("claim.sql's leased step returns nothing")?
        .1;
    let lease_end = "o.claim_until";
    anyhow::ensure!(
        returned.trim_end().ends_with(lease_end),
        "claim.sql's leased step no longer returns the lease's end last"
    );
    let columns = format!(
        "{}now() + make_interval(secs => $3) AS claim_until",
        &returned[..returned.trim_end().len() - lease_end.len()]
    );
    let read = format!(
        "leased AS (\n    SELECT {columns}\n    FROM {{schema}}outbox o\n    \
         JOIN picked ON o.event_id = picked.event_id"
    );
    let claim = format!("{}{}{}", &CLAIM_SQL[..start], read, &CLAIM_SQL[end..]);
    let last = "SELECT l.*, c.parked";
    anyhow::ensure!(claim.contains(last), "claim.sql's last SELECT changed");
    // The session the relay's lease would name ($8), read back so that the statement takes the
    // same parameters as the relay's claim.
    Ok(claim.replace(
        last,
        "SELECT l.*, pg_current_xact_id()::text AS lease_xid, $8::uuid AS lease_session, \
         c.parked",
    ))
}

/// Where the next claim reads from, as the relay keeps it.
#[derive(Default)]
struct Front {
    at: Option<DateTime<Utc>>,
    rows: Option<i64>,
}

impl Front {
    /// Notes what a claim returned; its event ids.
    fn read(&mut self, rows: &[PgRow]) -> Result<Vec<uuid::Uuid>> {
        if let Some(row) = rows.first() {
            if let Some(at) = row.try_get::<Option<DateTime<Utc>>, _>("front_at")? {
                self.at = Some(at);
            }
            self.rows = row.try_get("next_front")?;
        }
        let mut ids = Vec::with_capacity(rows.len());
        for row in rows {
            if let Some(id) = row.try_get::<Option<uuid::Uuid>, _>("event_id")? {
                ids.push(id);
            }
        }
        Ok(ids)
    }

    fn scan_from(&self) -> Option<DateTime<Utc>> {
        self.at.map(|at| at - LOOKBACK)
    }
}

/// Binds the claim's parameters as the relay does with `config` (its defaults: lease, takeovers
/// before a hold, suspects from the second takeover), for the SQL bound's batch.
fn claim<'q>(
    sql: &'q str,
    config: &'q PollingConfig,
    front: &Front,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .persistent(false)
        .bind(&config.relay_id)
        .bind(SQL_BATCH as i64)
        .bind(config.lease.as_secs_f64())
        .bind(config.max_takeovers)
        .bind(config.max_takeovers.min(2))
        .bind(front.scan_from())
        .bind(front.rows)
        // The lease's session: none, as a relay that does not register (the bench keeps no
        // heartbeat; its takeovers, if any, all count).
        .bind(None::<uuid::Uuid>)
        // No byte budget ($9): the candidates compare claim statements, not memory bounds.
        .bind(i64::MAX)
}

/// Marks `ids` published (no receipts).
async fn mark(conn: &mut PgConnection, ids: &[uuid::Uuid]) -> Result<()> {
    let receipts: Vec<Option<String>> = vec![None; ids.len()];
    sqlx::query(&MARK_SQL.replace("{schema}", ""))
        .bind(ids)
        .bind(receipts)
        .execute(conn)
        .await
        .context("while marking")?;
    Ok(())
}

/// One candidate drains the preloaded backlog with `loops` claim loops at once (as a relay with
/// that many claimers would): claim 500, mark them, until nothing is pending.
pub async fn drain(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    candidate: Candidate,
    loops: usize,
) -> Result<DrainRun> {
    let transport = bench.transport().await?;
    bench.reset(admin, &transport, true).await?;
    if candidate == Candidate::LockLease {
        admin.execute(BATCHES_TABLE).await?;
        admin.execute("TRUNCATE bench_lease_batches").await?;
    }
    let pool = bench.pool().await?;
    let sql = match candidate {
        Candidate::RowLease | Candidate::AsyncClaim => CLAIM_SQL.to_owned(),
        Candidate::LockLease => lock_lease_claim()?,
    }
    .replace("{schema}", "");

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let marked = Marked::new(Instant::now(), Some(bench.workload.events));
    futures::future::try_join_all((0..loops).map(|_| claim_loop(&pool, candidate, &sql, &marked)))
        .await?;
    pool.close().await;
    let variant = candidate.variant(loops);
    sql_loop_run(
        bench,
        admin,
        variant,
        round,
        &cpu_start,
        &marked,
        Vec::new(),
    )
    .await
}

/// One claimer: claims and marks with `candidate`'s statements until nothing is pending.
async fn claim_loop(pool: &PgPool, candidate: Candidate, sql: &str, marked: &Marked) -> Result<()> {
    let config = drain::polling_config("bench-candidate", false);
    let lease = config.lease.as_secs_f64();
    // The lock lease's batch record is written on a connection of its own, in autocommit,
    // before the batch would go out.
    let mut record = match candidate {
        Candidate::LockLease => Some(pool.acquire().await?),
        _ => None,
    };
    let mut front = Front::default();
    let mut empty_claims = 0;
    loop {
        let ids = match (candidate, record.as_mut()) {
            (Candidate::LockLease, Some(record)) => {
                let mut conn = pool.acquire().await?;
                let mut tx = conn.begin().await?;
                tx.execute(
                    format!("SET LOCAL idle_in_transaction_session_timeout = '{lease}s'").as_str(),
                )
                .await?;
                let rows = claim(sql, &config, &front).fetch_all(&mut *tx).await?;
                let ids = front.read(&rows)?;
                if !ids.is_empty() {
                    let xid: String = rows[0].try_get("lease_xid")?;
                    let batch: i64 = sqlx::query_scalar(
                        "INSERT INTO bench_lease_batches (relay_id, lease_xid, lease_until, event_ids)
                         VALUES ($1, $2::text::xid8, now() + make_interval(secs => $3), $4)
                         RETURNING batch_id",
                    )
                    .bind(&config.relay_id)
                    .bind(&xid)
                    .bind(lease)
                    .bind(&ids)
                    .fetch_one(&mut **record)
                    .await?;
                    mark(&mut tx, &ids).await?;
                    sqlx::query("DELETE FROM bench_lease_batches WHERE batch_id = $1")
                        .bind(batch)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                ids
            }
            _ => {
                let rows = if candidate == Candidate::AsyncClaim {
                    let mut tx = pool.begin().await?;
                    tx.execute("SET LOCAL synchronous_commit = off").await?;
                    let rows = claim(sql, &config, &front).fetch_all(&mut *tx).await?;
                    tx.commit().await?;
                    rows
                } else {
                    let mut conn = pool.acquire().await?;
                    claim(sql, &config, &front).fetch_all(&mut *conn).await?
                };
                let ids = front.read(&rows)?;
                if !ids.is_empty() {
                    let mut conn = pool.acquire().await?;
                    mark(&mut conn, &ids).await?;
                }
                ids
            }
        };
        if ids.is_empty() {
            // Nothing leased: done when nothing is pending; else the rest is in another loop's
            // hands (or was parked), and the next claim looks again.
            let mut conn = pool.acquire().await?;
            if workload::unpublished(&mut conn).await? == 0 {
                return Ok(());
            }
            empty_claims += 1;
            anyhow::ensure!(
                empty_claims < 10_000,
                "{candidate:?}'s claims found nothing while events were pending"
            );
            continue;
        }
        empty_claims = 0;
        marked.record(&ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_lease_claim_is_the_relays_claim_without_the_lease_write() {
        let claim = lock_lease_claim().expect("claim.sql's leased step and last SELECT are found");
        // The relay's claim writes the lease into the rows; the candidate does not ...
        assert!(CLAIM_SQL.contains("SET claimed_by = CASE"));
        assert!(!claim.contains("SET claimed_by"));
        // ... and keeps everything else: the front, heads, runs and parking.
        for step in [
            "front AS MATERIALIZED",
            "head AS MATERIALIZED",
            "parked AS (",
            "hole AS (",
        ] {
            assert!(claim.contains(step), "{step} is kept");
        }
        assert!(claim.contains("pg_current_xact_id()::text AS lease_xid"));
        assert!(claim.contains("JOIN picked ON o.event_id = picked.event_id\n)\n"));
    }
}
