//! The destination's health, kept apart from each event's: whose fault is a failed publish?
//!
//! An event's attempt count exists to find poison events, so it must only be charged for
//! failures that say something about that event. A destination that is down, throttling, or
//! failing every request is not any event's fault: charging every event it touches would
//! quarantine them all in a long enough outage, and nothing would flow after it recovers. And
//! the other way round: an event the destination refuses (one tenant's, answered 503 while
//! every other tenant gets 200) must not pause everyone, and must reach its attempt cap.
//!
//! The rule (the decision table of docs/relay.md, "Failures (P3): whose fault is it?"):
//! - a refusal ([`PublishErrorKind::Rejected`]) is the event's: charged, no pause;
//! - `Unavailable`, `Throttled` and `Misconfigured` are the destination's: not charged, the
//!   destination pauses (for at least a `Retry-After` it named);
//! - an ambiguous failure (`Timeout`, `Transient`, including an HTTP 429/503) is the event's
//!   when the destination accepted another event since this event last failed, and no other
//!   event failed after that success: charged, and only its aggregate waits (for at least its
//!   `Retry-After`). Otherwise (another event failed last, or nothing else was accepted since
//!   this event's previous failure, or for a whole health window) it is the destination's: not
//!   charged, and the destination pauses.
//!
//! While paused, the relay claims nothing; when the pause ends it sends one probe event, and
//! only its success resumes full claims. The events that failed wait until after the probe
//! (the relay gives them a later retry time), so the probe is another event whenever there is
//! one: a destination that refuses only them resumes at once. A failed probe pauses again,
//! longer, and from then on a `Retry-After` it names is honoured for the whole destination:
//! two different events were refused in a row, and the probe too.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

// tokio's clock, which is the system's in production and can be paused in simulation
// (tools/sim): the relay's decisions then follow simulated time, not the host's.
use tokio::time::Instant;

use handoff_core::delivery::PublishErrorKind;
use handoff_core::{Backoff, EventId};

/// Why the destination is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PauseReason {
    /// It cannot be reached.
    Unavailable,
    /// It asked senders to back off (`connection.blocked`, `OOM`, or a `Retry-After` that
    /// several events met).
    Throttled,
    /// Different events failed one after another, whatever the event.
    Failing,
    /// It refuses the relay's credentials or address (401/403, 404/410, authorization errors).
    Misconfigured,
}

impl PauseReason {
    /// Every reason, for the gauge's series.
    pub(crate) const ALL: [PauseReason; 4] = [
        PauseReason::Unavailable,
        PauseReason::Throttled,
        PauseReason::Failing,
        PauseReason::Misconfigured,
    ];

    /// The metric label and log field.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PauseReason::Unavailable => "unavailable",
            PauseReason::Throttled => "throttled",
            PauseReason::Failing => "failing",
            PauseReason::Misconfigured => "misconfigured",
        }
    }

    fn of(kind: PublishErrorKind, retry_after: Option<Duration>) -> PauseReason {
        match kind {
            PublishErrorKind::Unavailable => PauseReason::Unavailable,
            PublishErrorKind::Throttled => PauseReason::Throttled,
            PublishErrorKind::Misconfigured => PauseReason::Misconfigured,
            _ if retry_after.is_some() => PauseReason::Throttled,
            _ => PauseReason::Failing,
        }
    }
}

/// What one failed publish means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Whether the event's attempt count is charged.
    pub(crate) charged: bool,
    /// The pause this failure started (or extended), if any.
    pub(crate) paused: Option<PauseReason>,
    /// How long the pause in force still lasts (zero when none is): the event is retried only
    /// after it, so that the probe ending it is another event.
    pub(crate) pause_left: Duration,
}

/// A pause in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pause {
    /// Not before this instant does the relay probe again.
    pub(crate) until: Instant,
    pub(crate) reason: PauseReason,
    /// Pauses in a row without a success in between (1 for the first).
    pub(crate) rounds: u32,
    /// Tells pauses apart (each new one gets the next number), so each is announced once.
    pub(crate) serial: u64,
    /// The error that started (or last extended) it, as the transport said it: for `/readyz`
    /// and the log. Transports never put secrets in their errors.
    pub(crate) cause: String,
}

#[derive(Debug, Default)]
struct State {
    /// When the destination last accepted an event.
    last_success: Option<Instant>,
    /// The latest ambiguous or destination-wide failures of two different events, newest
    /// first.
    recent_failures: [Option<(EventId, Instant)>; 2],
    /// Each event's latest failure within the health window.
    failures: HashMap<EventId, Instant>,
    pause: Option<Pause>,
    /// The pause that ended without a success (its probe is on its way, or found nothing to
    /// send): still what the relay reports until an event gets through.
    ended: Option<Pause>,
    /// Pauses since the last success, for the backoff.
    rounds: u32,
    /// Pauses ever started.
    started: u64,
}

impl State {
    fn remember_failure(&mut self, event_id: EventId, now: Instant, window: Duration) {
        if self.recent_failures[0].is_some_and(|(id, _)| id != event_id) {
            self.recent_failures[1] = self.recent_failures[0];
        }
        self.recent_failures[0] = Some((event_id, now));
        if self.failures.len() >= 4096 {
            self.failures
                .retain(|_, at| now.saturating_duration_since(*at) <= window);
        }
        self.failures.insert(event_id, now);
    }

    /// The latest failure of an event other than `event_id`.
    fn other_failure(&self, event_id: EventId) -> Option<Instant> {
        self.recent_failures
            .iter()
            .flatten()
            .find(|(id, _)| *id != event_id)
            .map(|(_, at)| *at)
    }
}

/// Shared by every lane of one relay. std mutex: never held across an `.await`.
#[derive(Debug)]
pub(crate) struct Health {
    state: Mutex<State>,
    /// How recent a success must be for an ambiguous failure to count as the event's.
    window: Duration,
    backoff: Backoff,
}

impl Health {
    pub(crate) fn new(window: Duration, backoff: Backoff) -> Health {
        Health {
            state: Mutex::new(State::default()),
            window,
            backoff,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The destination accepted `event_id`: it is healthy, and a probe's success ends a pause.
    /// Returns the pause that ended, if any: the one in force, or the last one if no event got
    /// through since it ran out.
    pub(crate) fn succeeded(&self, event_id: EventId, now: Instant) -> Option<Pause> {
        let mut state = self.state();
        state.last_success = Some(now);
        state.failures.remove(&event_id);
        state.rounds = 0;
        // A pause that ended without a success (its probe found nothing to send) ends here.
        let ended = state.ended.take();
        state.pause.take().or(ended)
    }

    /// Judges one failed publish of `event_id`, of `kind` (with the destination's own
    /// `retry_after`, if it named one, and its message `cause`), that ended at `now`.
    pub(crate) fn failed(
        &self,
        event_id: EventId,
        kind: PublishErrorKind,
        retry_after: Option<Duration>,
        cause: &str,
        now: Instant,
    ) -> Verdict {
        let mut state = self.state();
        if kind == PublishErrorKind::Rejected {
            // The destination answered, about this event only.
            return Verdict {
                charged: true,
                paused: None,
                pause_left: Duration::ZERO,
            };
        }
        let within = |at: Instant| now.saturating_duration_since(at) <= self.window;
        // The destination accepted another event since this one last failed, and no other
        // event failed after that: this failure is about the event.
        let others_accepted = state
            .last_success
            .filter(|at| within(*at))
            .is_some_and(|ok| {
                let previous = state
                    .failures
                    .get(&event_id)
                    .copied()
                    .filter(|at| within(*at));
                let other = state.other_failure(event_id).filter(|at| within(*at));
                previous.is_none_or(|failed| ok > failed) && other.is_none_or(|failed| ok > failed)
            });
        let charged = !kind.is_destination_wide() && others_accepted && state.pause.is_none();
        state.remember_failure(event_id, now, self.window);
        if charged {
            return Verdict {
                charged,
                paused: None,
                pause_left: Duration::ZERO,
            };
        }
        let reason = PauseReason::of(kind, retry_after);
        let pause = match state.pause.take() {
            // Lanes that were in flight when the pause began fail too: one pause, not many. A
            // destination-wide error says more than an ambiguous one: it names the pause.
            Some(mut pause) => {
                if kind.is_destination_wide() {
                    if let Some(asked) = retry_after {
                        pause.until = pause.until.max(now + asked);
                    }
                    pause.reason = reason;
                    cause.clone_into(&mut pause.cause);
                }
                pause
            }
            None => {
                state.rounds = state.rounds.saturating_add(1);
                state.started += 1;
                let delay = self.backoff.delay(state.rounds);
                // An ambiguous failure's Retry-After holds everyone only once a probe met it
                // too; before that it may be one tenant's, and holds that event alone.
                let honoured = if kind.is_destination_wide() || state.rounds >= 2 {
                    retry_after
                } else {
                    None
                };
                Pause {
                    until: now + honoured.map_or(delay, |asked| asked.max(delay)),
                    reason,
                    rounds: state.rounds,
                    serial: state.started,
                    cause: cause.to_owned(),
                }
            }
        };
        let pause_left = pause.until.saturating_duration_since(now);
        state.pause = Some(pause);
        Verdict {
            charged,
            paused: Some(reason),
            pause_left,
        }
    }

    /// The pause in force, if any.
    pub(crate) fn pause(&self) -> Option<Pause> {
        self.state().pause.clone()
    }

    /// Whether publishing should stop now: a pause is in force.
    pub(crate) fn is_paused(&self) -> bool {
        self.state().pause.is_some()
    }

    /// Ends a pause without a success: the probe found nothing to send, or the transport says
    /// the destination is reachable again. The next failure starts a longer pause.
    pub(crate) fn resume(&self) {
        let mut state = self.state();
        if let Some(pause) = state.pause.take() {
            state.ended = Some(pause);
        }
    }

    /// The pause in force, else the last one if no event got through since it ended.
    pub(crate) fn last_pause(&self) -> Option<Pause> {
        let state = self.state();
        state.pause.clone().or_else(|| state.ended.clone())
    }
}

/// A running relay's view of its destination, from [`Relay::status`](crate::Relay::status).
#[derive(Debug, Clone)]
pub struct RelayStatus {
    pub(crate) health: std::sync::Arc<Health>,
}

/// Why a relay paused its destination: no claims and no attempts charged until a probe event
/// gets through.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DestinationPause {
    /// `unavailable` (cannot be reached), `throttled` (asked senders to back off), `failing`
    /// (different events failed one after another) or `misconfigured` (refuses the relay's
    /// credentials or address): the `reason` label of `handoff_destination_paused`.
    pub reason: &'static str,
    /// The destination's error that started the pause (never holds secrets).
    pub cause: String,
    /// Pauses in a row without an accepted event between (1 for the first).
    pub rounds: u32,
}

impl RelayStatus {
    /// The pause in force, if any; also while its probe event is on its way, until an event
    /// gets through.
    pub fn destination_pause(&self) -> Option<DestinationPause> {
        self.health.last_pause().map(|pause| DestinationPause {
            reason: pause.reason.as_str(),
            cause: pause.cause,
            rounds: pause.rounds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PublishErrorKind::*;

    fn health() -> Health {
        Health::new(
            Duration::from_secs(30),
            Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(10),
            },
        )
    }

    fn id() -> EventId {
        uuid::Uuid::now_v7()
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_failure_while_others_are_accepted_is_the_events() {
        let h = health();
        let t = Instant::now();
        h.succeeded(id(), t);
        for kind in [Timeout, Transient] {
            let verdict = h.failed(id(), kind, None, "", t + secs(1));
            assert_eq!(
                verdict,
                Verdict {
                    charged: true,
                    paused: None,
                    pause_left: Duration::ZERO,
                },
                "{kind:?}"
            );
            h.succeeded(id(), t + secs(2));
        }
        assert!(!h.is_paused());
    }

    #[test]
    fn one_tenant_refused_with_retry_after_is_charged_and_pauses_nobody() {
        let h = health();
        let t = Instant::now();
        let refused = id();
        for round in 0..5 {
            let at = t + secs(round * 2);
            h.succeeded(id(), at);
            let verdict = h.failed(refused, Transient, Some(secs(600)), "503", at + secs(1));
            assert!(verdict.charged, "round {round}: {verdict:?}");
            assert_eq!(verdict.paused, None);
        }
        assert!(!h.is_paused());
    }

    #[test]
    fn the_same_event_failing_again_with_nothing_accepted_between_is_no_evidence() {
        let h = health();
        let t = Instant::now();
        let poison = id();
        h.succeeded(id(), t);
        assert!(
            h.failed(poison, Transient, None, "500", t + secs(1))
                .charged
        );
        // Retried at once: nothing else was accepted meanwhile, so it may be an outage.
        let again = h.failed(poison, Transient, None, "500", t + secs(2));
        assert!(!again.charged);
        assert_eq!(again.paused, Some(PauseReason::Failing));
        assert!(again.pause_left > Duration::ZERO);
        // Another event gets through (the probe): the next failure is the event's again.
        assert!(h.succeeded(id(), t + secs(3)).is_some());
        assert!(
            h.failed(poison, Transient, None, "500", t + secs(4))
                .charged
        );
    }

    #[test]
    fn failures_of_different_events_with_no_success_between_are_the_destinations() {
        let h = health();
        let t = Instant::now();
        h.succeeded(id(), t);
        // The outage begins: the first failure still looks like the event's ...
        assert!(h.failed(id(), Transient, None, "", t).charged);
        // ... a second event failing next does not, and the destination pauses.
        let second = h.failed(id(), Transient, None, "", t);
        assert!(!second.charged);
        assert_eq!(second.paused, Some(PauseReason::Failing));
        assert_eq!(h.pause().expect("paused").rounds, 1);
        // A failure during the pause is not charged either, and does not stack pauses.
        assert!(!h.failed(id(), Timeout, None, "", t).charged);
        assert_eq!(h.pause().map(|p| p.rounds), Some(1));
        // The probe fails: a longer pause.
        h.resume();
        assert!(!h.failed(id(), Transient, None, "", t).charged);
        assert_eq!(h.pause().map(|p| p.rounds), Some(2));
        // The probe succeeds: the pause ends and the backoff starts over.
        assert!(h.succeeded(id(), t + secs(1)).is_some());
        assert!(!h.is_paused());
        assert!(h.failed(id(), Transient, None, "", t + secs(2)).charged);
    }

    #[test]
    fn a_retry_after_holds_everyone_only_once_a_probe_met_it_too() {
        let h = health();
        let t = Instant::now();
        h.succeeded(id(), t);
        h.failed(id(), Transient, Some(secs(600)), "503", t);
        let first = h.failed(id(), Transient, Some(secs(600)), "503", t);
        assert_eq!(first.paused, Some(PauseReason::Throttled));
        // Two events refused in a row may both be one tenant's: a short pause, then a probe.
        assert!(first.pause_left < secs(1), "{first:?}");
        h.resume();
        // The probe, a third event, is refused too: now the destination asked everyone.
        let probe = h.failed(id(), Transient, Some(secs(600)), "503", t);
        assert_eq!(probe.pause_left, secs(600));
    }

    #[test]
    fn a_success_long_ago_is_no_evidence() {
        let h = health();
        let t = Instant::now();
        h.succeeded(id(), t);
        let verdict = h.failed(id(), Timeout, None, "", t + secs(31));
        assert!(!verdict.charged);
        assert_eq!(verdict.paused, Some(PauseReason::Failing));
    }

    #[test]
    fn outages_throttling_and_misconfiguration_are_never_charged_and_pause() {
        for (kind, reason) in [
            (Unavailable, PauseReason::Unavailable),
            (Throttled, PauseReason::Throttled),
            (Misconfigured, PauseReason::Misconfigured),
        ] {
            let h = health();
            let t = Instant::now();
            h.succeeded(id(), t);
            let verdict = h.failed(id(), kind, None, "401 Unauthorized", t);
            assert!(!verdict.charged, "{kind:?}");
            assert_eq!(verdict.paused, Some(reason));
            assert_eq!(h.pause().expect("paused").cause, "401 Unauthorized");
        }
    }

    #[test]
    fn a_destination_wide_retry_after_pauses_for_at_least_that_long() {
        let h = health();
        let t = Instant::now();
        h.succeeded(id(), t);
        let verdict = h.failed(id(), Throttled, Some(secs(7)), "", t);
        assert_eq!(verdict.paused, Some(PauseReason::Throttled));
        assert!(h.pause().expect("paused").until >= t + secs(7));
        // A longer ask from a lane that was still in flight extends the same pause.
        h.failed(id(), Throttled, Some(secs(20)), "", t);
        let pause = h.pause().expect("paused");
        assert!(pause.until >= t + secs(20));
        assert_eq!(pause.rounds, 1);
    }

    #[test]
    fn a_refusal_is_charged_and_pauses_nothing() {
        let h = health();
        let t = Instant::now();
        let verdict = h.failed(id(), Rejected, None, "", t);
        assert_eq!(
            verdict,
            Verdict {
                charged: true,
                paused: None,
                pause_left: Duration::ZERO,
            }
        );
        assert!(!h.is_paused());
    }
}
