//! The saga state machine, as a pure function: given where a saga stands and what just
//! happened (a reply, a deadline), what it does next. The orchestrator applies the result in
//! one transaction with the reply's inbox row or the deadline's row lock; keeping the decision
//! free of I/O is what lets every path be tested on its own.

use std::time::Duration;

use serde_json::{Map, Value};
use uuid::Uuid;

use crate::definition::{SagaDefinition, Step};
use crate::message::{Direction, Outcome, Reply};
use crate::state::SagaState;

/// Where a saga stands, as far as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    pub state: SagaState,
    pub step: i32,
    pub attempt: i32,
    pub retry_due: bool,
    /// The event id of the command last sent: only a reply naming it answers the current
    /// attempt. `None` only for a row written without one (then the attempt number decides).
    pub command_id: Option<Uuid>,
    /// For a saga stuck because its deadline transition kept failing: the state it had.
    pub resume_state: Option<SagaState>,
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
    /// Set when the saga is parked because its deadline transition kept failing.
    pub give_up: Option<GiveUp>,
}

/// A deadline transition that kept failing: kept on the stuck saga's row, so `show` says why
/// and `resume` can restore the saga and try the transition again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GiveUp {
    /// Failed tries in a row.
    pub failures: i32,
    /// The last one's error.
    pub error: String,
    /// The state `resume` restores.
    pub state: SagaState,
    /// The deadline kind `resume` restores, due at once: `reply` or `retry`.
    pub deadline_kind: &'static str,
}

/// What the saga does about the input.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Decision {
    /// Nothing: a reply to a command that is no longer current (an earlier attempt, a step the
    /// saga has left), or anything reaching an ended or stuck saga. For a deadline, the
    /// orchestrator counts it as a failed transition (the deadline must not stay due).
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
        // A success of the compensation it is stuck on is a fact (the undo is done, whichever
        // send did it): the saga moves on. Nothing else moves a stuck saga.
        SagaState::Stuck => {
            return match input {
                Input::Reply(reply)
                    if at.resume_state != Some(SagaState::Running)
                        && reply.step == at.step
                        && reply.direction == Direction::Compensate
                        && reply.outcome == Outcome::Succeeded =>
                {
                    compensation_succeeded(definition, at, step, reply)
                }
                _ => Decision::Ignore("the saga is stuck: an operator resumes or resolves it"),
            }
        }
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
            give_up: None,
        })
    };
    match input {
        Input::Reply(reply) if reply.step != at.step || reply.direction != direction => {
            Decision::Ignore("the reply answers a command that is no longer current")
        }
        Input::Reply(reply) if !answers_current(at, reply) => match (direction, reply.outcome) {
            // An earlier send of the compensation in progress did the undo: done is done.
            (Direction::Compensate, Outcome::Succeeded) => {
                compensation_succeeded(definition, at, step, reply)
            }
            // Anything else from a superseded send says nothing about the current one, which
            // the participant answers the same way in its own reply.
            _ => Decision::Ignore("the reply answers an earlier attempt"),
        },
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
                        give_up: None,
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
                        give_up: None,
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
                compensation_succeeded(definition, at, step, reply)
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
                        give_up: None,
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

/// Whether `reply` answers the command last sent (not an earlier send of it).
fn answers_current(at: Position, reply: &Reply) -> bool {
    match at.command_id {
        Some(command_id) => reply.command_id == command_id,
        None => reply.attempt == at.attempt,
    }
}

/// The compensation of `at.step` is done: undo the next step down, or end compensated. The
/// failure that turned the saga back stays as it was.
fn compensation_succeeded(
    definition: &SagaDefinition,
    at: Position,
    step: &Step,
    reply: &Reply,
) -> Decision {
    let mut decision = turn_back(
        definition,
        at.step - 1,
        at.step,
        String::new(),
        "compensation_succeeded",
    );
    if let Decision::Transition(t) = &mut decision {
        t.failure = None;
        t.merge = reply.data.clone();
        t.detail = Some(
            if answers_current(at, reply) && at.state != SagaState::Stuck {
                step.name.clone()
            } else {
                format!(
                    "{} (a late success of attempt {}, the saga being {} at attempt {})",
                    step.name, reply.attempt, at.state, at.attempt
                )
            },
        );
    }
    decision
}

/// Parks a saga whose deadline transition failed `failures` times in a row, the last with
/// `error`: it turns stuck with the error as its reason, and keeps what `resume` restores.
/// `at` must be in flight (only those have deadlines).
pub(crate) fn give_up(at: Position, failures: i32, error: &str) -> Transition {
    let deadline_kind = if at.retry_due { "retry" } else { "reply" };
    let reason = format!(
        "the transition due at its {deadline_kind} deadline failed {failures} times in a row; \
         last: {error}"
    );
    Transition {
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
        give_up: Some(GiveUp {
            failures,
            error: error.to_owned(),
            state: at.state,
            deadline_kind,
        }),
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
                give_up: None,
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
            give_up: None,
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
        give_up: None,
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

    /// The command id of send `attempt` of step `step` (each send has its own).
    fn command(step: i32, attempt: i32) -> Uuid {
        Uuid::from_u128((u128::try_from(step).unwrap() << 64) | u128::try_from(attempt).unwrap())
    }

    /// A saga whose command out is send `attempt` of step `step`.
    fn at(state: SagaState, step: i32, attempt: i32) -> Position {
        Position {
            state,
            step,
            attempt,
            retry_due: false,
            command_id: Some(command(step, attempt)),
            resume_state: None,
        }
    }

    /// A reply to the first send of step `step`.
    fn reply(step: i32, direction: Direction, outcome: Outcome) -> Reply {
        answer(step, 1, direction, outcome)
    }

    /// A reply to send `attempt` of step `step`.
    fn answer(step: i32, attempt: i32, direction: Direction, outcome: Outcome) -> Reply {
        Reply {
            saga_id: Uuid::nil(),
            step,
            direction,
            attempt,
            command_id: command(step, attempt),
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
            Input::Reply(&answer(0, 3, Direction::Compensate, Outcome::Failed)),
        ));
        assert_eq!(t.state, SagaState::Stuck);
        assert_eq!(
            t.give_up, None,
            "stuck on the compensation, not on a transition"
        );
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

    #[test]
    fn a_failure_answering_a_superseded_send_changes_nothing() {
        let def = order();
        // Attempt 1 of the release timed out, attempt 3 (the last) is out; attempt 1's
        // failure arriving now must not park the saga.
        for outcome in [Outcome::Failed, Outcome::Succeeded] {
            assert!(matches!(
                decide(
                    &def,
                    at(SagaState::Running, 2, 2),
                    Input::Reply(&answer(2, 1, Direction::Forward, outcome))
                ),
                Decision::Ignore("the reply answers an earlier attempt")
            ));
        }
        assert!(matches!(
            decide(
                &def,
                at(SagaState::Compensating, 0, 3),
                Input::Reply(&answer(0, 1, Direction::Compensate, Outcome::Failed))
            ),
            Decision::Ignore("the reply answers an earlier attempt")
        ));
        // Same attempt number, another command (the send after an operator's resume starts
        // again at 1): the command id decides, not the number.
        let mut stale = answer(0, 1, Direction::Compensate, Outcome::Failed);
        stale.command_id = Uuid::now_v7();
        assert!(matches!(
            decide(
                &def,
                at(SagaState::Compensating, 0, 1),
                Input::Reply(&stale)
            ),
            Decision::Ignore(_)
        ));
    }

    #[test]
    fn a_late_success_of_a_superseded_compensation_send_is_applied() {
        let def = order();
        let t = transition(decide(
            &def,
            at(SagaState::Compensating, 2, 3),
            Input::Reply(&answer(2, 1, Direction::Compensate, Outcome::Succeeded)),
        ));
        assert_eq!(
            (t.state, t.step, t.kind),
            (SagaState::Compensating, 0, "compensation_succeeded")
        );
        assert_eq!(
            t.detail.as_deref(),
            Some("charge (a late success of attempt 1, the saga being compensating at attempt 3)")
        );
        // Also while a resend of it is scheduled.
        let due = Position {
            retry_due: true,
            ..at(SagaState::Compensating, 0, 2)
        };
        let t = transition(decide(
            &def,
            due,
            Input::Reply(&answer(0, 1, Direction::Compensate, Outcome::Succeeded)),
        ));
        assert_eq!(t.state, SagaState::Compensated);
    }

    #[test]
    fn only_a_success_of_its_compensation_moves_a_stuck_saga() {
        let def = order();
        let stuck = at(SagaState::Stuck, 2, 3);
        let t = transition(decide(
            &def,
            stuck,
            Input::Reply(&answer(2, 3, Direction::Compensate, Outcome::Succeeded)),
        ));
        assert_eq!((t.state, t.step), (SagaState::Compensating, 0));
        assert_eq!(t.stuck_reason, None);
        for ignored in [
            Input::Reply(&answer(2, 3, Direction::Compensate, Outcome::Failed)),
            Input::Reply(&answer(2, 1, Direction::Forward, Outcome::Succeeded)),
            Input::Reply(&answer(0, 1, Direction::Compensate, Outcome::Succeeded)),
            Input::Deadline,
        ] {
            assert!(matches!(decide(&def, stuck, ignored), Decision::Ignore(_)));
        }
        // Stuck going forward (its timeout's transition kept failing): nothing to undo yet.
        let forward = Position {
            resume_state: Some(SagaState::Running),
            ..stuck
        };
        assert!(matches!(
            decide(
                &def,
                forward,
                Input::Reply(&answer(2, 3, Direction::Compensate, Outcome::Succeeded))
            ),
            Decision::Ignore(_)
        ));
    }

    #[test]
    fn without_a_command_id_the_attempt_number_decides() {
        let def = order();
        let at = Position {
            command_id: None,
            ..at(SagaState::Running, 2, 2)
        };
        let mut current = answer(2, 2, Direction::Forward, Outcome::Succeeded);
        current.command_id = Uuid::now_v7();
        assert_eq!(
            transition(decide(&def, at, Input::Reply(&current))).state,
            SagaState::Completed
        );
        assert!(matches!(
            decide(
                &def,
                at,
                Input::Reply(&answer(2, 1, Direction::Forward, Outcome::Succeeded))
            ),
            Decision::Ignore(_)
        ));
    }

    #[test]
    fn a_deadline_at_a_step_the_definition_lacks_is_not_a_transition() {
        // The orchestrator counts it as a failed transition: it backs off, then parks the saga.
        assert!(matches!(
            decide(&order(), at(SagaState::Running, 7, 1), Input::Deadline),
            Decision::Ignore(_)
        ));
    }

    #[test]
    fn giving_up_parks_the_saga_with_what_resume_restores() {
        let due = Position {
            retry_due: true,
            ..at(SagaState::Compensating, 0, 2)
        };
        let t = give_up(due, 5, "saga hook failed: poisoned");
        assert_eq!((t.state, t.step, t.attempt), (SagaState::Stuck, 0, 2));
        assert_eq!((t.send, t.timer), (None, None));
        assert_eq!(
            t.stuck_reason.as_deref(),
            Some(
                "the transition due at its retry deadline failed 5 times in a row; \
                 last: saga hook failed: poisoned"
            )
        );
        assert_eq!(
            t.give_up,
            Some(GiveUp {
                failures: 5,
                error: "saga hook failed: poisoned".into(),
                state: SagaState::Compensating,
                deadline_kind: "retry",
            })
        );
        let t = give_up(at(SagaState::Running, 1, 1), 1, "lock timeout");
        assert_eq!(
            t.give_up.map(|g| (g.state, g.deadline_kind)),
            Some((SagaState::Running, "reply"))
        );
    }
}
