//! The destination's health, kept apart from each event's: whose fault is a failed publish?
//!
//! An event's attempt count exists to find poison events, so it must only be charged for
//! failures that say something about that event. A destination that is down, throttling, or
//! failing every request is not any event's fault: charging every event it touches would
//! quarantine them all in a long enough outage, and nothing would flow after it recovers.
//!
//! The rule:
//! - a refusal ([`PublishErrorKind::Rejected`]) is the event's: charged, no pause;
//! - `Unavailable` and `Throttled` are the destination's: not charged, the destination pauses;
//! - a failure that carries a `Retry-After` pauses the destination for at least that long (the
//!   server asked every sender to wait, not one lane);
//! - an ambiguous failure (`Timeout`, `Transient`) is the event's only when the destination was
//!   seen accepting other events: the last outcome before it was a success, recently. Otherwise
//!   it is the destination's: not charged, and the destination pauses.
//!
//! While paused, the relay claims nothing; when the pause ends it sends one probe event, and
//! only its success resumes full claims. A failed probe pauses again, longer.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use handoff_core::delivery::PublishErrorKind;
use handoff_core::Backoff;

/// Why the destination is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PauseReason {
    /// It cannot be reached.
    Unavailable,
    /// It asked senders to back off (429/503, `Retry-After`, `connection.blocked`).
    Throttled,
    /// Every recent publish failed, whatever the event.
    Failing,
}

impl PauseReason {
    /// The metric label and log field.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PauseReason::Unavailable => "unavailable",
            PauseReason::Throttled => "throttled",
            PauseReason::Failing => "failing",
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
}

/// A pause in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pause {
    /// Not before this instant does the relay probe again.
    pub(crate) until: Instant,
    pub(crate) reason: PauseReason,
    /// Pauses in a row without a success in between (1 for the first).
    pub(crate) rounds: u32,
    /// Tells pauses apart (each new one gets the next number), so each is announced once.
    pub(crate) serial: u64,
}

#[derive(Debug, Default)]
struct State {
    /// The last publish outcome, of any event: when, and whether it succeeded.
    last: Option<(Instant, bool)>,
    pause: Option<Pause>,
    /// Pauses since the last success, for the backoff.
    rounds: u32,
    /// Pauses ever started.
    started: u64,
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

    /// The destination accepted an event: it is healthy, and a probe's success ends a pause.
    /// Returns the pause that ended, if any.
    pub(crate) fn succeeded(&self, now: Instant) -> Option<Pause> {
        let mut state = self.state();
        state.last = Some((now, true));
        state.rounds = 0;
        state.pause.take()
    }

    /// Judges one failed publish of `kind` (with the destination's own `retry_after`, if it
    /// named one) that ended at `now`.
    pub(crate) fn failed(
        &self,
        kind: PublishErrorKind,
        retry_after: Option<Duration>,
        now: Instant,
    ) -> Verdict {
        let mut state = self.state();
        if kind == PublishErrorKind::Rejected {
            // The destination answered, about this event only.
            return Verdict {
                charged: true,
                paused: None,
            };
        }
        let others_accepted = state
            .last
            .is_some_and(|(at, ok)| ok && now.saturating_duration_since(at) <= self.window);
        let charged = !kind.is_destination_wide() && others_accepted && state.pause.is_none();
        state.last = Some((now, false));
        let reason = match kind {
            PublishErrorKind::Unavailable => Some(PauseReason::Unavailable),
            PublishErrorKind::Throttled => Some(PauseReason::Throttled),
            _ if retry_after.is_some() => Some(PauseReason::Throttled),
            _ if !charged => Some(PauseReason::Failing),
            _ => None,
        };
        let Some(reason) = reason else {
            return Verdict {
                charged,
                paused: None,
            };
        };
        let pause = match state.pause {
            // Lanes that were in flight when the pause began fail too: one pause, not many.
            Some(mut pause) => {
                if let Some(asked) = retry_after {
                    pause.until = pause.until.max(now + asked);
                }
                pause
            }
            None => {
                state.rounds = state.rounds.saturating_add(1);
                state.started += 1;
                let delay = self.backoff.delay(state.rounds);
                Pause {
                    until: now + retry_after.map_or(delay, |asked| asked.max(delay)),
                    reason,
                    rounds: state.rounds,
                    serial: state.started,
                }
            }
        };
        state.pause = Some(pause);
        Verdict {
            charged,
            paused: Some(reason),
        }
    }

    /// The pause in force, if any.
    pub(crate) fn pause(&self) -> Option<Pause> {
        self.state().pause
    }

    /// Whether publishing should stop now: a pause is in force.
    pub(crate) fn is_paused(&self) -> bool {
        self.state().pause.is_some()
    }

    /// Ends a pause without a success: the probe found nothing to send, or the transport says
    /// the destination is reachable again. The next failure starts a longer pause.
    pub(crate) fn resume(&self) {
        self.state().pause = None;
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

    #[test]
    fn a_failure_while_others_are_accepted_is_the_events() {
        let h = health();
        let t = Instant::now();
        h.succeeded(t);
        for kind in [Timeout, Transient] {
            let verdict = h.failed(kind, None, t + Duration::from_secs(1));
            assert_eq!(
                verdict,
                Verdict {
                    charged: true,
                    paused: None
                },
                "{kind:?}"
            );
            h.succeeded(t + Duration::from_secs(2));
        }
        assert!(!h.is_paused());
    }

    #[test]
    fn failures_with_no_success_between_are_the_destinations() {
        let h = health();
        let t = Instant::now();
        h.succeeded(t);
        // The outage begins: the first failure still looks like the event's ...
        assert!(h.failed(Transient, None, t).charged);
        // ... every later one does not, and the destination pauses.
        let second = h.failed(Transient, None, t);
        assert!(!second.charged);
        assert_eq!(second.paused, Some(PauseReason::Failing));
        let pause = h.pause().expect("paused");
        assert_eq!(pause.rounds, 1);
        // A failure during the pause is not charged either, and does not stack pauses.
        assert!(!h.failed(Timeout, None, t).charged);
        assert_eq!(h.pause().map(|p| p.rounds), Some(1));
        // The probe fails: a longer pause.
        h.resume();
        assert!(!h.failed(Transient, None, t).charged);
        assert_eq!(h.pause().map(|p| p.rounds), Some(2));
        // The probe succeeds: the pause ends and the backoff starts over.
        assert!(h.succeeded(t).is_some());
        assert!(!h.is_paused());
        assert!(h.failed(Transient, None, t).charged);
    }

    #[test]
    fn a_success_long_ago_is_no_evidence() {
        let h = health();
        let t = Instant::now();
        h.succeeded(t);
        let verdict = h.failed(Timeout, None, t + Duration::from_secs(31));
        assert!(!verdict.charged);
        assert_eq!(verdict.paused, Some(PauseReason::Failing));
    }

    #[test]
    fn throttling_and_outages_are_never_charged_and_pause() {
        for (kind, reason) in [
            (Unavailable, PauseReason::Unavailable),
            (Throttled, PauseReason::Throttled),
        ] {
            let h = health();
            let t = Instant::now();
            h.succeeded(t);
            let verdict = h.failed(kind, None, t);
            assert_eq!(
                verdict,
                Verdict {
                    charged: false,
                    paused: Some(reason)
                }
            );
        }
    }

    #[test]
    fn retry_after_pauses_the_destination_for_at_least_that_long() {
        let h = health();
        let t = Instant::now();
        h.succeeded(t);
        let verdict = h.failed(Throttled, Some(Duration::from_secs(7)), t);
        assert_eq!(verdict.paused, Some(PauseReason::Throttled));
        assert!(h.pause().expect("paused").until >= t + Duration::from_secs(7));
        // A longer ask from a lane that was still in flight extends the same pause.
        h.failed(Throttled, Some(Duration::from_secs(20)), t);
        let pause = h.pause().expect("paused");
        assert!(pause.until >= t + Duration::from_secs(20));
        assert_eq!(pause.rounds, 1);
    }

    #[test]
    fn a_refusal_is_charged_and_pauses_nothing() {
        let h = health();
        let t = Instant::now();
        let verdict = h.failed(Rejected, None, t);
        assert_eq!(
            verdict,
            Verdict {
                charged: true,
                paused: None
            }
        );
        assert!(!h.is_paused());
    }
}
