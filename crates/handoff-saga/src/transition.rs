//! The saga state machine, as a pure function: given where a saga stands and what just
//! happened (a reply, a deadline), what it does next. The orchestrator applies the result in
//! one transaction with the reply's inbox row or the deadline's row lock; keeping the decision
//! free of I/O is what lets every path be tested on its own.

use std::time::Duration;

use serde_json::{Map, Value};

use crate::definition::SagaDefinition;
use crate::message::{Direction, Outcome, Reply};
use crate::state::SagaState;

/// Where a saga stands, as far as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    pub state: SagaState,
    pub step: i32,
    pub attempt: i32,
    pub retry_due: bool,
}

/// What happened to the saga.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Input<'a> {
    /// A participant answered.
    Reply(&'a Reply),
    /// The saga's deadline passed with no reply.
    Deadline,
}

/// The command to send in the transition's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Send {
    pub step: i32,
    pub direction: Direction,
    pub attempt: i32,
}

/// The next durable timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timer {
    /// The reply to the command just sent is overdue after this long.
    Reply(Duration),
    /// Send the current compensation again after this long.
    Retry(Duration),
}

/// A transition to write.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Transition {
    pub state: SagaState,
    pub step: i32,
    pub attempt: i32,
    pub send: Option<Send>,
    pub timer: Option<Timer>,
    /// Set when the saga turns back; kept afterwards.
    pub failure: Option<String>,
    pub stuck_reason: Option<String>,
    /// Keys to merge into the saga's data.
    pub merge: Map<String, Value>,
    /// The history row's kind and detail.
    pub kind: &'static str,
    pub detail: Option<String>,
}

/// What the saga does about the input.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Decision {
    /// Nothing: a reply to a command that is no longer current (an earlier attempt, a step the
    /// saga has left), or anything reaching an ended or stuck saga.
    Ignore(&'static str),
    Transition(Transition),
}

/// The first send of step `step` in `direction`.
fn first_send(definition: &SagaDefinition, step: i32, direction: Direction) -> (Send, Timer) {
    let retry = definition.step_at(step).expect("step in range").retry;
    (
        Send {
            step,
            direction,
            attempt: 1,
        },
        Timer::Reply(retry.reply_timeout),
    )
}

/// Decides the saga's next move.
pub(crate) fn decide(definition: &SagaDefinition, at: Position, input: Input<'_>) -> Decision {
    let Some(step) = definition.step_at(at.step) else {
        return Decision::Ignore("the saga is at a step its definition does not have");
    };
    let policy = step.retry;
    let attempts = i32::try_from(policy.attempts).unwrap_or(i32::MAX);
    let direction = match at.state {
        SagaState::Running => Direction::Forward,
        SagaState::Compensating => Direction::Compensate,
        _ => return Decision::Ignore("the saga is not in flight"),
    };
    let action = match direction {
        Direction::Forward => step.action.as_str(),
        Direction::Compensate => step.compensation.as_deref().unwrap_or("?"),
    };
    let send_again = |kind, detail| {
        Decision::Transition(Transition {
            state: at.state,
            step: at.step,
            attempt: at.attempt + 1,
            send: Some(Send {
                step: at.step,
                direction,
                attempt: at.attempt + 1,
            }),
            timer: Some(Timer::Reply(policy.reply_timeout)),
            failure: None,
            stuck_reason: None,
            merge: Map::new(),
            kind,
            detail: Some(detail),
        })
    };
    match input {
        Input::Reply(reply) if reply.step != at.step || reply.direction != direction => {
            Decision::Ignore("the reply answers a command that is no longer current")
        }
        Input::Reply(reply) => match (direction, reply.outcome) {
            (Direction::Forward, Outcome::Succeeded) => {
                let next = at.step + 1;
                if definition.step_at(next).is_some() {
                    let (send, timer) = first_send(definition, next, Direction::Forward);
                    Decision::Transition(Transition {
                        state: SagaState::Running,
                        step: next,
                        attempt: 1,
                        send: Some(send),
                        timer: Some(timer),
                        failure: None,
                        stuck_reason: None,
                        merge: reply.data.clone(),
                        kind: "step_succeeded",
                        detail: Some(step.name.clone()),
                    })
                } else {
                    Decision::Transition(Transition {
                        state: SagaState::Completed,
                        step: at.step,
                        attempt: at.attempt,
                        send: None,
                        timer: None,
                        failure: None,
                        stuck_reason: None,
                        merge: reply.data.clone(),
                        kind: "completed",
                        detail: Some(step.name.clone()),
                    })
                }
            }
            (Direction::Forward, Outcome::Failed) => {
                // Refused with no effect: undo the steps before it.
                let reason = reply.reason.as_deref().unwrap_or("no reason given");
                turn_back(
                    definition,
                    at.step - 1,
                    at.step,
                    format!("{} failed: {reason}", step.name),
                    "step_failed",
                )
            }
            (Direction::Compensate, Outcome::Succeeded) => {
                let mut decision = turn_back(
                    definition,
                    at.step - 1,
                    at.step,
                    String::new(),
                    "compensation_succeeded",
                );
                if let Decision::Transition(t) = &mut decision {
                    // The failure that turned the saga back stays as it was.
                    t.failure = None;
                    t.merge = reply.data.clone();
                    t.detail = Some(step.name.clone());
                }
                decision
            }
            (Direction::Compensate, Outcome::Failed) => {
                let reason = reply.reason.as_deref().unwrap_or("no reason given");
                if at.retry_due {
                    // A second failure while the resend is already scheduled (an earlier
                    // attempt's answer): the schedule stands.
                    Decision::Ignore("a resend of this compensation is already scheduled")
                } else if at.attempt < attempts {
                    let pause = policy.pause_after(u32::try_from(at.attempt).unwrap_or(1));
                    Decision::Transition(Transition {
                        state: SagaState::Compensating,
                        step: at.step,
                        attempt: at.attempt,
                        send: None,
                        timer: Some(Timer::Retry(pause)),
                        failure: None,
                        stuck_reason: None,
                        merge: Map::new(),
                        kind: "compensation_failed",
                        detail: Some(format!(
                            "{action} attempt {} failed: {reason}; next attempt in {}",
                            at.attempt,
                            humanize(pause)
                        )),
                    })
                } else {
                    stuck(
                        at,
                        format!("{action} failed {} times; last: {reason}", at.attempt),
                    )
                }
            }
        },
        Input::Deadline if at.retry_due => send_again(
            "retried",
            format!("{action} sent again (attempt {})", at.attempt + 1),
        ),
        Input::Deadline if at.attempt < attempts => send_again(
            "timed_out",
            format!(
                "no reply to {action} attempt {} within {}; sent again",
                at.attempt,
                humanize(policy.reply_timeout)
            ),
        ),
        Input::Deadline => {
            let reason = format!("no reply to {action} after {} attempts", at.attempt);
            match direction {
                // The step may or may not have taken effect: undo it too. A participant
                // answers the compensation of a step it never did with success, and records
                // it so the late command, should it still come, is refused.
                Direction::Forward => turn_back(definition, at.step, at.step, reason, "timed_out"),
                Direction::Compensate => stuck(at, reason),
            }
        }
    }
}

/// Turns the saga back from step `from` downwards: the highest step at or below it with a
/// compensation is undone first; with none left, the saga is compensated.
fn turn_back(
    definition: &SagaDefinition,
    from: i32,
    current: i32,
    failure: String,
    kind: &'static str,
) -> Decision {
    let detail = Some(failure.clone());
    let failure = Some(failure);
    match definition.compensable_at_or_below(from) {
        Some(step) => {
            let (send, timer) = first_send(definition, step, Direction::Compensate);
            Decision::Transition(Transition {
                state: SagaState::Compensating,
                step,
                attempt: 1,
                send: Some(send),
                timer: Some(timer),
                failure,
                stuck_reason: None,
                merge: Map::new(),
                kind,
                detail,
            })
        }
        None => Decision::Transition(Transition {
            state: SagaState::Compensated,
            step: current,
            attempt: 1,
            send: None,
            timer: None,
            failure,
            stuck_reason: None,
            merge: Map::new(),
            kind: "compensated",
            detail,
        }),
    }
}

fn stuck(at: Position, reason: String) -> Decision {
    Decision::Transition(Transition {
        state: SagaState::Stuck,
        step: at.step,
        attempt: at.attempt,
        send: None,
        timer: None,
        failure: None,
        stuck_reason: Some(reason.clone()),
        merge: Map::new(),
        kind: "stuck",
        detail: Some(reason),
    })
}

fn humanize(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;
    use crate::definition::{RetryPolicy, Step};

    /// reserve (undo: release) -> notify (nothing to undo) -> charge (undo: refund), three sends
    /// per command.
    fn order() -> SagaDefinition {
        let retry = RetryPolicy {
            attempts: 3,
            ..RetryPolicy::default()
        };
        SagaDefinition::new("order")
            .step(
                Step::new("reserve", "inventory", "Reserve")
                    .compensated_by("Release")
                    .with_retry(retry),
            )
            .step(Step::new("notify", "mail", "Notify").with_retry(retry))
            .step(
                Step::new("charge", "payments", "Charge")
                    .compensated_by("Refund")
                    .with_retry(retry),
            )
    }

    fn at(state: SagaState, step: i32, attempt: i32) -> Position {
        Position {
            state,
            step,
            attempt,
            retry_due: false,
        }
    }

    fn reply(step: i32, direction: Direction, outcome: Outcome) -> Reply {
        Reply {
            saga_id: Uuid::nil(),
            step,
            direction,
            attempt: 1,
            command_id: Uuid::nil(),
            participant: "p".into(),
            outcome,
            reason: (outcome == Outcome::Failed).then(|| "no".to_owned()),
            data: Map::new(),
        }
    }

    fn transition(decision: Decision) -> Transition {
        match decision {
            Decision::Transition(t) => t,
            Decision::Ignore(why) => panic!("ignored: {why}"),
        }
    }

    #[test]
    fn success_moves_forward_then_completes() {
        let def = order();
        let t = transition(decide(
            &def,
            at(SagaState::Running, 0, 1),
            Input::Reply(&reply(0, Direction::Forward, Outcome::Succeeded)),
        ));
        assert_eq!((t.state, t.step), (SagaState::Running, 1));
        assert_eq!(
            t.send,
            Some(Send {
                step: 1,
                direction: Direction::Forward,
                attempt: 1
            })
        );
        let t = transition(decide(
            &def,
            at(SagaState::Running, 2, 1),
            Input::Reply(&reply(2, Direction::Forward, Outcome::Succeeded)),
        ));
        assert_eq!(t.state, SagaState::Completed);
        assert_eq!((t.send, t.timer), (None, None));
    }

    #[test]
    fn a_refused_step_undoes_the_steps_before_it_only() {
        let def = order();
        let t = transition(decide(
            &def,
            at(SagaState::Running, 2, 1),
            Input::Reply(&reply(2, Direction::Forward, Outcome::Failed)),
        ));
        // notify has nothing to undo: the compensation starts at reserve.
        assert_eq!((t.state, t.step), (SagaState::Compensating, 0));
        assert_eq!(t.failure.as_deref(), Some("charge failed: no"));
        let t = transition(decide(
            &def,
            at(SagaState::Running, 0, 1),
            Input::Reply(&reply(0, Direction::Forward, Outcome::Failed)),
        ));
        assert_eq!(t.state, SagaState::Compensated);
    }

    #[test]
    fn an_unanswered_step_is_sent_again_then_undone_itself() {
        let def = order();
        let t = transition(decide(&def, at(SagaState::Running, 2, 1), Input::Deadline));
        assert_eq!((t.state, t.step, t.attempt), (SagaState::Running, 2, 2));
        assert_eq!(t.send.map(|s| s.attempt), Some(2));
        let t = transition(decide(&def, at(SagaState::Running, 2, 3), Input::Deadline));
        // Its effect is unknown, so its own compensation runs first.
        assert_eq!((t.state, t.step), (SagaState::Compensating, 2));
        assert_eq!(t.send.map(|s| s.direction), Some(Direction::Compensate));
    }

    #[test]
    fn compensation_goes_down_then_ends_compensated() {
        let def = order();
        let t = transition(decide(
            &def,
            at(SagaState::Compensating, 2, 1),
            Input::Reply(&reply(2, Direction::Compensate, Outcome::Succeeded)),
        ));
        assert_eq!((t.state, t.step), (SagaState::Compensating, 0));
        assert_eq!(t.failure, None, "the first failure is kept, not replaced");
        let t = transition(decide(
            &def,
            at(SagaState::Compensating, 0, 1),
            Input::Reply(&reply(0, Direction::Compensate, Outcome::Succeeded)),
        ));
        assert_eq!(t.state, SagaState::Compensated);
    }

    #[test]
    fn a_failing_compensation_backs_off_then_sticks() {
        let def = order();
        let t = transition(decide(
            &def,
            at(SagaState::Compensating, 0, 1),
            Input::Reply(&reply(0, Direction::Compensate, Outcome::Failed)),
        ));
        assert_eq!(t.timer, Some(Timer::Retry(Duration::from_secs(1))));
        assert_eq!(t.send, None);
        let due = Position {
            retry_due: true,
            ..at(SagaState::Compensating, 0, 1)
        };
        let t = transition(decide(&def, due, Input::Deadline));
        assert_eq!(t.send.map(|s| s.attempt), Some(2));
        let t = transition(decide(
            &def,
            at(SagaState::Compensating, 0, 3),
            Input::Reply(&reply(0, Direction::Compensate, Outcome::Failed)),
        ));
        assert_eq!(t.state, SagaState::Stuck);
        assert_eq!(
            t.stuck_reason.as_deref(),
            Some("Release failed 3 times; last: no")
        );
        let t = transition(decide(
            &def,
            at(SagaState::Compensating, 0, 3),
            Input::Deadline,
        ));
        assert_eq!(t.state, SagaState::Stuck);
    }

    #[test]
    fn stale_and_late_replies_change_nothing() {
        let def = order();
        // A forward reply reaching a saga that already turned back.
        assert!(matches!(
            decide(
                &def,
                at(SagaState::Compensating, 2, 1),
                Input::Reply(&reply(2, Direction::Forward, Outcome::Succeeded))
            ),
            Decision::Ignore(_)
        ));
        // A reply to a step the saga has left.
        assert!(matches!(
            decide(
                &def,
                at(SagaState::Running, 1, 1),
                Input::Reply(&reply(0, Direction::Forward, Outcome::Succeeded))
            ),
            Decision::Ignore(_)
        ));
        for state in [SagaState::Completed, SagaState::Stuck, SagaState::Resolved] {
            assert!(matches!(
                decide(&def, at(state, 0, 1), Input::Deadline),
                Decision::Ignore(_)
            ));
        }
    }
}
