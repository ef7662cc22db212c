//! The simulated destination and its transport: `handoff_core::delivery::Transport` over
//! [`World::log`]. Each behaviour names the real test that shows a real transport does it (see
//! docs/simulation.md's table).

use std::time::Duration;

use handoff_core::delivery::{
    OutboxEvent, PublishError, PublishErrorKind, Published, Receipt, Source, Transport,
};

use crate::source::{relay, SimSource};
use crate::world::{Dedup, Ms, Shared, World};
use crate::Plant;

/// The transport's own publish timeout (below the relay's `lease_margin`, as the relay's
/// config asks).
pub const PUBLISH_TIMEOUT_MS: Ms = 1_500;

/// The transport one relay process uses.
pub struct SimTransport {
    /// The world.
    pub shared: Shared,
    /// The relay process it belongs to.
    pub process: usize,
    /// The process's source: only the planted bug `mark-before-ack` writes through it.
    pub source: std::sync::Arc<SimSource>,
}

/// What the destination does with one publish.
enum Fate {
    /// Stored (or dropped as a duplicate) and acknowledged.
    Ack,
    /// Stored, and the acknowledgement lost: the relay sees a timeout (transports' conformance:
    /// `a_relay_killed_after_the_ack_is_republished_after_lease_expiry_and_deduplicated`;
    /// handoff-http `no_answer_in_time_is_an_ambiguous_timeout`).
    LostAck,
    /// Refused.
    Error(PublishError),
}

impl SimTransport {
    /// Stores one copy in the destination's log, unless its dedup drops it
    /// (handoff-nats `republishing_an_event_id_is_deduplicated`; handoff-redis
    /// `a_republish_inside_the_window_appends_nothing_but_a_replay_gets_through_once`).
    fn store(w: &mut World, process: usize, row: usize) {
        let now = w.now();
        let name = w.name(row);
        let last = w.stored.get(&row).and_then(|copies| copies.last().copied());
        if let (Dedup::Window(window), Some(last)) = (w.dedup, last) {
            if now.saturating_sub(last) <= window {
                w.log(
                    &relay(process),
                    format_args!("publish {name}: deduplicated"),
                );
                return;
            }
        }
        // Checked as it happens: no phantom, and per-aggregate order of first deliveries.
        let r = w.rows[row].clone();
        if last.is_none() {
            let earlier_missing = w.rows.iter().enumerate().find(|(i, o)| {
                o.aggregate == r.aggregate && o.seq < r.seq && !w.stored.contains_key(i)
            });
            if let Some((i, _)) = earlier_missing {
                let earlier = w.name(i);
                w.violate(
                    format!("order: {name} delivered before {earlier}"),
                    Some(row),
                );
            }
            w.log(&relay(process), format_args!("publish {name}: delivered"));
        } else {
            w.log(
                &relay(process),
                format_args!("publish {name}: stored again"),
            );
        }
        if let Some(marked) = r.marked_at {
            let claimed = w.claimed_at.get(&(process, row)).map_or(0, |c| c.0);
            if claimed > marked {
                w.violate(
                    format!("{name} claimed at {claimed} ms and published again after its mark at {marked} ms"),
                    Some(row),
                );
            }
        }
        w.stored.entry(row).or_default().push(now);
        w.log.push((row, now));
        let aggregate = r.aggregate;
        w.partitions.entry(aggregate).or_default().push(row);
    }

    fn fate(&self, w: &mut World, row: usize) -> Fate {
        let now = w.now();
        if w.rows[row].poison {
            // handoff-http `one_tenant_refused...` / byte limits: a refusal for good.
            return Fate::Error(PublishError::new(
                PublishErrorKind::Rejected,
                "message too large",
            ));
        }
        if now < w.outage_until {
            return Fate::Error(PublishError::new(
                PublishErrorKind::Unavailable,
                "no responders",
            ));
        }
        if now < w.throttle_until {
            let left = w.throttle_until - now;
            return Fate::Error(
                PublishError::new(PublishErrorKind::Throttled, "connection.blocked")
                    .with_retry_after(Duration::from_millis(left)),
            );
        }
        let refusal = w.faults.refusal;
        if w.fault(refusal) {
            let mut error = PublishError::new(PublishErrorKind::Transient, "503 tenant busy");
            if w.rng.random_bool(0.5) {
                let after = w.between(100, 5_000);
                error = error.with_retry_after(Duration::from_millis(after));
            }
            return Fate::Error(error);
        }
        let lost = w.faults.lost_ack;
        if w.fault(lost) {
            return Fate::LostAck;
        }
        Fate::Ack
    }
}

impl Transport for SimTransport {
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        self.shared.gate(self.process).await;
        let (latency, stall, row) = {
            let mut w = self.shared.lock();
            let row = w.row_of(&event.event_id);
            let stall = w.faults.stall;
            let stall = w.fault(stall);
            let latency = if stall {
                PUBLISH_TIMEOUT_MS
            } else {
                w.between(1, 20)
            };
            (latency, stall, row)
        };
        {
            // Leases: a relay publishes an event under its own lease, or under one that ran out
            // (it overstayed, frozen or slow: the destination's dedup covers it); never under a
            // lease taken from it while it still ran (fencing.rs).
            let mut w = self.shared.lock();
            let now = w.now();
            if let Some(&(_, token, until)) = w.claimed_at.get(&(self.process, row)) {
                let current = w.rows[row].lease.map(|(_, t, _)| t);
                if until > now && current != Some(token) && w.rows[row].marked_at.is_none() {
                    let name = w.name(row);
                    w.violate(
                        format!(
                            "lease: r{} publishes {name} under L{token}, which ran until {until} ms \
                             but was taken from it (now {current:?})",
                            self.process
                        ),
                        Some(row),
                    );
                }
            }
        }
        if self.shared.lock().plant == Some(Plant::MarkBeforeAck) {
            // PLANTED BUG: the event is marked before the destination acknowledged it.
            let _ = self
                .source
                .mark_published(&[Published::id(event.event_id)])
                .await;
        }
        Shared::sleep(latency).await;
        let fate = {
            let mut w = self.shared.lock();
            let process_dead = w.processes[self.process].dead;
            if process_dead {
                // Killed mid-publish: the bytes may or may not have reached the broker.
                if w.rng.random_bool(0.5) {
                    SimTransport::store(&mut w, self.process, row);
                }
                None
            } else if stall {
                let name = w.name(row);
                w.log(
                    &relay(self.process),
                    format_args!("publish {name}: stalled"),
                );
                if w.rng.random_bool(0.5) {
                    SimTransport::store(&mut w, self.process, row);
                }
                Some(Fate::LostAck)
            } else {
                let fate = self.fate(&mut w, row);
                match &fate {
                    Fate::Ack | Fate::LostAck => {
                        SimTransport::store(&mut w, self.process, row);
                        let dup = w.faults.duplicate;
                        if w.fault(dup) {
                            // The network delivered the publish twice.
                            SimTransport::store(&mut w, self.process, row);
                        }
                    }
                    Fate::Error(error) => {
                        let name = w.name(row);
                        w.log(
                            &relay(self.process),
                            format_args!("publish {name}: {} {error}", error.kind().as_str()),
                        );
                    }
                }
                Some(fate)
            }
        };
        self.shared.deliveries.notify_one();
        self.shared.gate(self.process).await;
        match fate {
            None => std::future::pending().await,
            Some(Fate::Ack) => Ok(Receipt::none()),
            Some(Fate::LostAck) => Err(PublishError::new(
                PublishErrorKind::Timeout,
                "no acknowledgement in time",
            )),
            Some(Fate::Error(error)) => Err(error),
        }
    }

    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        let left = {
            let w = self.shared.lock();
            w.outage_until.saturating_sub(w.now())
        };
        let wait = left.min(at_most.as_millis() as Ms);
        Shared::sleep(wait).await;
        let w = self.shared.lock();
        w.now() >= w.outage_until
    }
}

use rand::Rng as _;
