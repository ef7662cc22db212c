//! The receiver's memory: which keys were answered, what each aggregate has applied, and the
//! applied effects in order. One lock guards all three, so recording an effect and remembering
//! its key and answer is one atomic step.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// What a request says about its event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    /// The event id (`ce-id` or the structured `id`).
    pub event_id: String,
    /// The aggregate's type.
    pub aggregate_type: String,
    /// The aggregate's id, decoded.
    pub aggregate_id: String,
    /// The event's place in its aggregate's history.
    pub sequence: i64,
}

/// One applied effect, as `GET /received` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Applied {
    /// The event id.
    pub event_id: String,
    /// The aggregate's id.
    pub aggregate_id: String,
    /// The event's sequence.
    pub sequence: i64,
}

/// An answer: status and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The body.
    pub body: String,
}

/// What [`Ledger::offer`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The event was applied now; the answer is remembered under its key.
    Applied(Answer),
    /// The key was seen before: the remembered answer, nothing applied.
    Repeat(Answer),
    /// Not applied and not remembered (a gap, or a position already taken).
    Refused(Answer),
}

/// Keys, per-aggregate positions and the applied effects.
#[derive(Debug, Default)]
pub struct Ledger {
    answers: HashMap<String, Answer>,
    /// (aggregate type, aggregate id) -> last applied sequence.
    last: HashMap<(String, String), i64>,
    applied: Vec<Applied>,
}

impl Ledger {
    /// Applies `event` under `key` unless the key was seen, or the event is not the next of its
    /// aggregate.
    ///
    /// - a known key returns its remembered answer (the duplicate of an ambiguous request);
    /// - sequence = last applied + 1: applied, answered 200, remembered;
    /// - sequence > last + 1: 409, a gap (the earlier event has not arrived; retrying is right);
    /// - sequence <= last under a new key: 422, that position was filled by another event, and
    ///   no retry can change that (the sender quarantines it for an operator).
    pub fn offer(&mut self, key: &str, event: Incoming) -> Outcome {
        if let Some(answer) = self.answers.get(key) {
            return Outcome::Repeat(answer.clone());
        }
        let position = (event.aggregate_type.clone(), event.aggregate_id.clone());
        let last = self.last.get(&position).copied().unwrap_or(0);
        let refuse = |status, error: String| {
            Outcome::Refused(Answer {
                status,
                body: serde_json::json!({ "error": error }).to_string(),
            })
        };
        if event.sequence <= last {
            return refuse(
                422,
                format!(
                    "sequence {} of {} was already applied under another key",
                    event.sequence, event.aggregate_id
                ),
            );
        }
        if event.sequence != last + 1 {
            return refuse(
                409,
                format!(
                    "out of order: {} expects sequence {}, got {}",
                    event.aggregate_id,
                    last + 1,
                    event.sequence
                ),
            );
        }
        let applied = Applied {
            event_id: event.event_id,
            aggregate_id: event.aggregate_id,
            sequence: event.sequence,
        };
        let answer = Answer {
            status: 200,
            body: serde_json::json!({ "applied": &applied }).to_string(),
        };
        self.last.insert(position, event.sequence);
        self.applied.push(applied);
        self.answers.insert(key.to_owned(), answer.clone());
        Outcome::Applied(answer)
    }

    /// Every applied effect, in applied order.
    pub fn applied(&self) -> &[Applied] {
        &self.applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: &str, aggregate: &str, sequence: i64) -> Incoming {
        Incoming {
            event_id: id.into(),
            aggregate_type: "order".into(),
            aggregate_id: aggregate.into(),
            sequence,
        }
    }

    #[test]
    fn a_repeated_key_gets_the_same_answer_and_applies_nothing() {
        let mut ledger = Ledger::default();
        let Outcome::Applied(first) = ledger.offer("k1", event("e1", "a", 1)) else {
            panic!("not applied");
        };
        assert_eq!(
            ledger.offer("k1", event("e1", "a", 1)),
            Outcome::Repeat(first)
        );
        assert_eq!(ledger.applied().len(), 1);
    }

    #[test]
    fn gaps_are_409_and_filled_positions_422_and_neither_is_remembered() {
        let mut ledger = Ledger::default();
        let Outcome::Refused(gap) = ledger.offer("k2", event("e2", "a", 2)) else {
            panic!("gap applied");
        };
        assert_eq!(gap.status, 409);
        assert!(matches!(
            ledger.offer("k1", event("e1", "a", 1)),
            Outcome::Applied(_)
        ));
        assert!(matches!(
            ledger.offer("k2", event("e2", "a", 2)),
            Outcome::Applied(_)
        ));
        let Outcome::Refused(taken) = ledger.offer("k9", event("e9", "a", 2)) else {
            panic!("position applied twice");
        };
        assert_eq!(taken.status, 422);
        // Aggregates are independent.
        assert!(matches!(
            ledger.offer("k3", event("e3", "b", 1)),
            Outcome::Applied(_)
        ));
        let order: Vec<_> = ledger
            .applied()
            .iter()
            .map(|a| a.event_id.as_str())
            .collect();
        assert_eq!(order, ["e1", "e2", "e3"]);
    }
}
