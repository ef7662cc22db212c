//! The simulated outbox source: `handoff_core::delivery::Source` over [`World::rows`], modelling
//! the polling source's contract (`handoff-postgres`'s `PollingSource`). Each behaviour names
//! the real test that shows the polling source does it (see docs/simulation.md's table).

use std::time::{Duration, SystemTime};

use handoff_core::delivery::{
    Claim, Failure, Lease, OutboxEvent, Published, Released, Settled, Source, SourceError,
    SourceErrorKind,
};

use crate::world::{Ms, Shared, World};
use crate::Plant;

/// The lease a claim takes (`PollingConfig::claim_timeout`, 30 s by default; shorter here so
/// takeovers happen within a run).
pub const LEASE_MS: Ms = 10_000;
/// Leases that ran out unsettled after which a row is held as a crash loop
/// (crash_loop.rs: `leases_of_a_relay_that_is_gone_count_until_the_event_is_held_as_a_crash_loop`).
pub const MAX_TAKEOVERS: u32 = 4;

/// The source one relay process sees.
pub struct SimSource {
    /// The world.
    pub shared: Shared,
    /// The relay process this source belongs to.
    pub process: usize,
}

/// A statement's error, as the driver would report it.
#[derive(Debug, thiserror::Error)]
#[error("simulated: {0}")]
struct Simulated(&'static str);

fn unavailable(what: &'static str) -> SourceError {
    SourceError::with_kind(
        SourceErrorKind::Unavailable,
        what,
        Simulated("connection reset"),
    )
}

/// What a statement does about faults: how long it takes, and whether it fails before or after
/// it took effect (a commit whose answer is lost).
struct Statement {
    latency: Ms,
    fails_before: bool,
    fails_after: bool,
}

impl SimSource {
    fn plan(&self, w: &mut World) -> Statement {
        let slow = w.faults.slow_statement;
        let latency = if w.fault(slow) {
            w.between(200, 3_000)
        } else {
            w.between(1, 4)
        };
        let error = w.faults.source_error;
        let fails = w.fault(error);
        let after = fails && w.rng.random_bool(0.5);
        Statement {
            latency,
            fails_before: fails && !after,
            fails_after: after,
        }
    }

    /// Runs one statement: waits while the process is frozen, takes the statement's time, applies
    /// it (the database does, whatever becomes of the process), then hands the answer back to a
    /// process that may have been frozen or killed meanwhile.
    async fn statement<T>(
        &self,
        op: &'static str,
        apply: impl FnOnce(&mut World) -> T,
    ) -> Result<T, SourceError> {
        self.shared.gate(self.process).await;
        let plan = {
            let mut w = self.shared.lock();
            w.calls += 1;
            self.plan(&mut w)
        };
        Shared::sleep(plan.latency).await;
        if plan.fails_before {
            {
                let mut w = self.shared.lock();
                w.log(
                    &relay(self.process),
                    format_args!("{op} failed (nothing written)"),
                );
            }
            self.shared.gate(self.process).await;
            return Err(unavailable(op));
        }
        let out = {
            let mut w = self.shared.lock();
            apply(&mut w)
        };
        if plan.fails_after {
            let mut w = self.shared.lock();
            w.log(
                &relay(self.process),
                format_args!("{op} committed, answer lost"),
            );
        }
        self.shared.gate(self.process).await;
        if plan.fails_after {
            return Err(unavailable(op));
        }
        Ok(out)
    }
}

/// A relay's name in the trace.
pub fn relay(process: usize) -> String {
    format!("r{process}")
}

impl Source for SimSource {
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        let asked_at = tokio::time::Instant::now();
        let process = self.process;
        self.statement("claim", move |w| {
            claim(w, process, max, max_bytes, asked_at)
        })
        .await
    }

    async fn mark_published(&self, published: &[Published]) -> Result<(), SourceError> {
        let process = self.process;
        self.statement("mark", move |w| {
            let now = w.now();
            let mut names = Vec::new();
            for p in published {
                let row = w.row_of(&p.event_id);
                // Not fenced by the lease: the destination holds the event whoever holds the
                // lease now (Published::lease's doc; source.rs's tests mark under any lease).
                let r = &mut w.rows[row];
                if r.marked_at.is_none() {
                    r.marked_at = Some(now);
                }
                r.lease = None;
                r.takeovers = 0;
                names.push(w.name(row));
            }
            w.log(&relay(process), format_args!("mark {}", names.join(" ")));
        })
        .await
    }

    async fn record_failures(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        let process = self.process;
        self.statement("fail", move |w| {
            let now = w.now();
            let mut stale = 0;
            for f in failures {
                let row = w.row_of(&f.event_id);
                if !holds(w, row, f.lease) {
                    stale += 1;
                    let name = w.name(row);
                    w.log(&relay(process), format_args!("failure of {name} stale"));
                    continue;
                }
                let name = w.name(row);
                let r = &mut w.rows[row];
                r.lease = None;
                r.attempts += i32::from(f.counts_as_attempt);
                match f.retry_after {
                    Some(after) => {
                        r.available_at = now + after.as_millis() as Ms;
                        let at = r.available_at;
                        w.log(
                            &relay(process),
                            format_args!("failure of {name}: retry at {at} ms ({})", f.error),
                        );
                    }
                    None => {
                        r.held = Some(f.hold_reason.unwrap_or("held"));
                        w.log(
                            &relay(process),
                            format_args!("failure of {name}: held ({})", f.error),
                        );
                    }
                }
            }
            Settled { stale }
        })
        .await
    }

    async fn release(&self, released: &[Released]) -> Result<Settled, SourceError> {
        let process = self.process;
        self.statement("release", move |w| {
            let mut stale = 0;
            let mut names = Vec::new();
            for r in released {
                let row = w.row_of(&r.event_id);
                if !holds(w, row, r.lease) {
                    stale += 1;
                    continue;
                }
                w.rows[row].lease = None;
                names.push(w.name(row));
            }
            w.log(
                &relay(process),
                format_args!("release {} ({stale} stale)", names.join(" ")),
            );
            Settled { stale }
        })
        .await
    }

    async fn wait_for_work(&self, at_most: Duration) -> Result<(), SourceError> {
        self.shared.gate(self.process).await;
        self.shared.lock().calls += 1;
        tokio::select! {
            biased;
            () = self.shared.commits.notified() => {}
            () = tokio::time::sleep(at_most) => {}
        }
        self.shared.gate(self.process).await;
        Ok(())
    }
}

/// Whether `row` is still held under `lease` (and unpublished): the fence of failures and
/// releases (fencing.rs: `a_failure_and_a_release_under_a_lease_that_ran_out_change_nothing`,
/// `an_outcome_without_a_lease_changes_nothing`).
fn holds(w: &World, row: usize, lease: Option<Lease>) -> bool {
    let r = &w.rows[row];
    if w.plant == Some(Plant::UnfencedOutcomes) {
        // PLANTED BUG: any lease will do.
        return r.lease.is_some() && r.marked_at.is_none();
    }
    match (r.lease, lease) {
        (Some((_, token, _)), Some(lease)) => token == lease.token() && r.marked_at.is_none(),
        _ => false,
    }
}

/// The claim: per aggregate, the unbroken run from its first unpublished event, if that head is
/// committed, not held, not leased under a live lease, and due; up to `max` events and
/// `max_bytes` (at least one event).
///
/// Modelled on source.rs: `a_claim_leases_rows_that_other_relays_then_skip`,
/// `a_later_event_is_never_claimed_while_an_earlier_one_is_unpublished`,
/// `an_expired_lease_lets_another_relay_take_the_rows_over`,
/// `a_failure_backs_off_counts_the_attempt_and_blocks_the_aggregate`,
/// `a_held_event_stays_out_of_every_claim`, `rolled_back_events_are_never_claimed`,
/// `events_stuck_behind_a_failed_head_never_starve_other_aggregates`; byte_budget.rs:
/// `a_claim_stops_at_its_byte_budget_with_unbroken_runs`,
/// `an_event_larger_than_the_budget_is_claimed_alone_and_never_blocks_progress`.
fn claim(
    w: &mut World,
    process: usize,
    max: usize,
    max_bytes: usize,
    asked_at: tokio::time::Instant,
) -> Claim {
    let now = w.now();
    w.lease_counter += 1;
    let token = w.lease_counter;
    let until = now + LEASE_MS;
    let past_failures = w.plant == Some(Plant::PublishAfterFailure);
    // Rows of each aggregate in sequence order (rows are appended at commit, and an aggregate's
    // writers are serialised by its lock, so sequence order is row order).
    let mut per_aggregate: Vec<Vec<usize>> = vec![Vec::new(); w.aggregates.len()];
    for (i, r) in w.rows.iter().enumerate() {
        if r.marked_at.is_none() {
            per_aggregate[r.aggregate].push(i);
        }
    }
    let mut taken = Vec::new();
    let mut bytes = 0usize;
    let mut waiting_on_in_flight = false;
    let mut taken_over = 0;
    let mut held = 0;
    let mut bytes_full = false;
    'aggregates: for rows in per_aggregate {
        for (k, &row) in rows.iter().enumerate() {
            let r = &w.rows[row];
            if r.held.is_some() {
                continue 'aggregates;
            }
            if let Some((_, _, lease_until)) = r.lease {
                if lease_until > now {
                    waiting_on_in_flight = true;
                    continue 'aggregates;
                }
            }
            if r.available_at > now {
                if past_failures && k == 0 {
                    // PLANTED BUG: the head waits out a failure's backoff, and its successors
                    // are handed out anyway.
                    continue;
                }
                continue 'aggregates;
            }
            if taken.len() >= max {
                break 'aggregates;
            }
            if !taken.is_empty() && bytes.saturating_add(r.size) > max_bytes {
                bytes_full = true;
                break 'aggregates;
            }
            if r.lease.is_some() {
                // The lease ran out unsettled: a relay died or stalled holding it.
                let r = &mut w.rows[row];
                r.takeovers += 1;
                if r.takeovers > MAX_TAKEOVERS {
                    r.held = Some("crash loop");
                    r.lease = None;
                    held += 1;
                    let name = w.name(row);
                    w.log(&relay(process), format_args!("hold {name} (crash loop)"));
                    continue 'aggregates;
                }
                taken_over += 1;
            }
            bytes = bytes.saturating_add(w.rows[row].size);
            w.rows[row].lease = Some((process, token, until));
            w.claimed_at.insert((process, row), (now, token, until));
            taken.push(row);
        }
    }
    let names: Vec<String> = taken.iter().map(|&row| w.name(row)).collect();
    if !taken.is_empty() || held > 0 {
        w.log(
            &relay(process),
            format_args!(
                "claim L{token} [{}] taken_over={taken_over}",
                names.join(" ")
            ),
        );
    }
    let events = taken.iter().map(|&row| event(w, row)).collect();
    Claim {
        events,
        lease: Some(Lease::new(token)),
        lease_deadline: Some(asked_at.into_std() + Duration::from_millis(LEASE_MS)),
        taken_over,
        held,
        isolate: false,
        waiting_on_in_flight,
        bytes_full,
    }
}

fn event(w: &World, row: usize) -> OutboxEvent {
    let r = &w.rows[row];
    OutboxEvent {
        event_id: r.id,
        aggregate_type: "sim".into(),
        aggregate_id: format!("a{}", r.aggregate),
        aggregate_sequence: r.seq,
        global_sequence: None,
        event_type: "Happened".into(),
        schema_version: 1,
        payload: "x".repeat(r.size),
        headers: Vec::new(),
        occurred_at: SystemTime::UNIX_EPOCH + Duration::from_millis(r.committed_at),
        attempt_count: r.attempts,
    }
}

use rand::Rng as _;
