//! The claim: one short statement leasing a batch, then its payloads, read into a [`Claim`].

use std::collections::HashMap;
use std::time::Instant;

use chrono::{DateTime, Utc};
use handoff_core::delivery::{Claim, SourceError};
use handoff_core::EventId;
use handoff_core::OrderMode;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use super::lease::lease_token;
use super::row::{header_pairs, read_claimed_row};
use super::PollingSource;
use crate::pooler::{Pooling, Scoped};
use crate::source_error::source_error;

// Named in the docs only.
#[cfg(doc)]
use crate::PollingConfig;

/// Turns JIT off for the rest of the transaction, where a pooler leaves no session to carry the
/// setting ([`PollingConfig::session_options`] says why).
const CLAIM_WITHOUT_JIT: &str = "SET LOCAL jit = off";

/// Payloads and headers (as JSON text) of leased events, by event id.
type Payloads = HashMap<EventId, (String, String)>;

impl PollingSource {
    /// [`Source::claim`](handoff_core::delivery::Source::claim): leases up to `max` events and
    /// `max_bytes` of them, reads the claim's bookkeeping (parked, held, taken over, suspects,
    /// events waiting on those in flight) and moves where the next claim reads from.
    pub(super) async fn claim_batch(
        &self,
        max: usize,
        max_bytes: usize,
    ) -> Result<Claim, SourceError> {
        let started = Instant::now();
        self.register().await?;
        let max = i64::try_from(max).unwrap_or(i64::MAX);
        let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        // Where the claim reads the claim index from (see LOOKBACK).
        let scan_from = self.scan_from();
        // How deep its front is (see next_front in claim.sql).
        let front_rows = self
            .scan
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .front_rows;
        let what = "while claiming";
        let (rows, mut payloads) = if self.keeps_claim_plan() {
            self.on_kept_session(&self.claim_session, what, async |conn| {
                self.run_claim(conn, true, max, max_bytes, scan_from, front_rows)
                    .await
            })
            .await?
        } else {
            // An unnamed statement, planned at every call: through a transaction pooler
            // nothing lives in the session, and the global lane's claim reads one short queue.
            let mut conn = self.connection(what).await?;
            let query = self.run_claim(&mut conn, false, max, max_bytes, scan_from, front_rows);
            let outcome = tokio::time::timeout(self.config.query_timeout, query).await;
            self.bounded(&mut conn, outcome, what)?
        };
        self.record_claim_cost(started.elapsed());
        // Every row carries how many rows the claim parked; a claim that leased nothing
        // returns one row with no event.
        let parked: i64 = match rows.first() {
            Some(row) => row
                .try_get("parked")
                .map_err(|e| source_error("while reading a claim", e))?,
            None => 0,
        };
        // Every row carries it too: the byte budget cut events the batch had room for.
        let bytes_full: bool = match rows.first() {
            Some(row) => row
                .try_get::<Option<bool>, _>("bytes_full")
                .map_err(|e| source_error("while reading a claim", e))?
                .unwrap_or(false),
            None => false,
        };
        // The global lane is one queue: whatever waits in it waits on the events in flight.
        let mut waiting_on_in_flight = self.config.order == OrderMode::Global;
        if self.config.order == OrderMode::Aggregate {
            if let Some(row) = rows.first() {
                let waiting: i64 = row
                    .try_get("waiting")
                    .map_err(|e| source_error("while reading a claim", e))?;
                waiting_on_in_flight = waiting > 0;
                let front_at: Option<DateTime<Utc>> = row
                    .try_get("front_at")
                    .map_err(|e| source_error("while reading a claim", e))?;
                let next_front: Option<i64> = row
                    .try_get("next_front")
                    .map_err(|e| source_error("while reading a claim", e))?;
                let mut scan = self.scan.lock().unwrap_or_else(|e| e.into_inner());
                scan.front_rows = next_front;
                // An empty front keeps the previous starting point: what waits behind events in
                // flight lies there, and becomes claimable as soon as they are marked.
                if let Some(front_at) = front_at {
                    scan.front_at = Some(front_at);
                }
            }
        }
        let rows: Vec<PgRow> = rows
            .into_iter()
            .filter(|row| {
                matches!(
                    row.try_get::<Option<uuid::Uuid>, _>("event_id"),
                    Ok(Some(_))
                )
            })
            .collect();
        if !rows.is_empty() || parked > 0 {
            // Work, or room made for it: poll again soon rather than sleep (see LINGER).
            *self.last_work.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        }
        if parked > 0 {
            tracing::debug!(
                parked,
                "claim parked events waiting behind unpublished ones"
            );
        }
        let mut events = Vec::with_capacity(rows.len());
        let mut held = 0;
        let mut taken_over = 0;
        let mut isolate = false;
        // Every row a claim leases gets the same `claim_until` (one statement: one `now()`).
        let mut lease: Option<DateTime<Utc>> = None;
        for row in &rows {
            let read = |row: &PgRow| -> Result<_, sqlx::Error> {
                let event = read_claimed_row(row)?;
                let held: bool = row.try_get("held")?;
                let taken_over: bool = row.try_get("taken_over")?;
                let lease: Option<DateTime<Utc>> = row.try_get("claim_until")?;
                let isolate: bool = row.try_get("isolate")?;
                Ok((event, held, taken_over, lease, isolate))
            };
            let (mut event, is_held, is_taken_over, row_lease, is_suspect) =
                read(row).map_err(|e| source_error("while reading a claimed row", e))?;
            if is_held {
                held += 1;
                tracing::error!(
                    event_id = %event.event_id,
                    aggregate_type = %event.aggregate_type,
                    aggregate_id = %event.aggregate_id,
                    sequence = event.aggregate_sequence,
                    max_takeovers = self.config.max_takeovers,
                    "event held for an operator (crash_loop): every relay that leased it \
                     died or stalled before settling it; the later events of its aggregate \
                     wait behind it (`handoff quarantine show`)"
                );
                continue;
            }
            taken_over += usize::from(is_taken_over);
            if is_suspect {
                isolate = true;
                tracing::warn!(
                    event_id = %event.event_id,
                    aggregate_type = %event.aggregate_type,
                    aggregate_id = %event.aggregate_id,
                    sequence = event.aggregate_sequence,
                    "event leased alone: relays holding it died before settling it, so it \
                     is published with nothing else in flight"
                );
            }
            debug_assert!(
                lease.is_none() || lease == row_lease,
                "one claim, one lease: {lease:?} and {row_lease:?}"
            );
            lease = lease.or(row_lease);
            let Some((payload, headers)) = payloads.remove(&event.event_id) else {
                // Not found after its own claim: nothing deletes an unpublished row, so this
                // is a row an outside hand removed. Its lease simply runs out.
                tracing::warn!(
                    event_id = %event.event_id,
                    "a leased event's row was gone when its payload was read: left to its lease"
                );
                continue;
            };
            event.payload = payload;
            event.headers = header_pairs(&headers);
            events.push(event);
        }

        // A full batch means a backlog: this relay will not sleep soon, so writers need not
        // pay for notifying it. (Not under the wake lock's wait: claims never overlap waits.)
        if rows.len() as i64 == max || bytes_full {
            if let Ok(mut wake) = self.wake.try_lock() {
                if wake.registered_until.is_some() {
                    self.unwait(&mut wake).await?;
                }
            }
        }
        Ok(Claim {
            events,
            lease: lease.map(lease_token),
            lease_deadline: Some(started + self.config.lease),
            taken_over,
            held,
            isolate,
            waiting_on_in_flight,
            bytes_full,
        })
    }

    /// Runs `claim.sql` (or `claim_global.sql`) on `conn`: named and cached when `cached`,
    /// else an unnamed statement planned with the real batch size; then, once it committed,
    /// `claimed_payloads.sql` for the payloads and headers of what it leased.
    ///
    /// Two statements, so that the one that locks rows and writes the lease returns little: a
    /// relay that freezes while rows are on their way (SIGSTOP, a paused container, a stalled
    /// network) stops reading, and a statement whose result no longer fits the socket's buffers
    /// waits in `ClientWrite`, where no statement timeout fires. The claim's result fits, so its
    /// lease commits and its locks go whatever the relay does next; a freeze during the second
    /// statement holds no lock, and the lease runs out for another relay to take the events.
    async fn run_claim(
        &self,
        conn: &mut PgConnection,
        cached: bool,
        max: i64,
        max_bytes: i64,
        scan_from: Option<DateTime<Utc>>,
        front_rows: Option<i64>,
    ) -> Result<(Vec<PgRow>, Payloads), sqlx::Error> {
        let mut scope = Scoped::begin(conn, self.config.pooling).await?;
        if self.config.pooling == Pooling::Transaction {
            sqlx::query(CLAIM_WITHOUT_JIT)
                .persistent(false)
                .execute(scope.conn())
                .await?;
        }
        let query = sqlx::query(&self.sql.claim)
            .persistent(cached)
            .bind(&self.config.relay_id)
            .bind(max)
            .bind(self.config.lease.as_secs_f64())
            .bind(self.config.max_takeovers)
            // Suspects from the second takeover on (from the first when one is the bound): a
            // single one is any relay crash's fate for everything in flight, a second is rare.
            .bind(self.config.max_takeovers.min(2));
        let query = match self.config.order {
            OrderMode::Aggregate => query.bind(scan_from).bind(front_rows),
            OrderMode::Global => query,
        };
        // The session the lease names ($8, or $6 in global order), then the byte budget ($9,
        // or $7).
        let query = query.bind(self.session).bind(max_bytes);
        let rows = query.fetch_all(scope.conn()).await?;
        scope.finish().await?;
        let mut leased = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: Option<EventId> = row.try_get("event_id")?;
            let held: Option<bool> = row.try_get("held")?;
            if let (Some(id), Some(false)) = (id, held) {
                leased.push(id);
            }
        }
        let mut payloads = Payloads::with_capacity(leased.len());
        if !leased.is_empty() {
            let mut scope = Scoped::begin(conn, self.config.pooling).await?;
            let found = sqlx::query(&self.sql.claimed_payloads)
                .persistent(cached)
                .bind(&leased)
                .fetch_all(scope.conn())
                .await?;
            scope.finish().await?;
            for row in &found {
                payloads.insert(
                    row.try_get("event_id")?,
                    (row.try_get("payload")?, row.try_get("headers")?),
                );
            }
        }
        Ok((rows, payloads))
    }
}
