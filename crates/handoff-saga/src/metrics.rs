//! The orchestrator's Prometheus metrics, through the `metrics` facade.
//!
//! | name | type | what |
//! |---|---|---|
//! | `handoff_saga_transitions_total{saga_type, kind}` | counter | transitions: `started`, `step_succeeded`, `step_failed`, `timed_out`, `retried`, `compensating`, `compensation_succeeded`, `compensation_failed`, `completed`, `compensated`, `stuck` |
//! | `handoff_saga_ignored_replies_total{saga_type}` | counter | replies to commands that were no longer current (an earlier attempt, a step already left) |
//! | `handoff_saga_transition_failures_total{saga_type}` | counter | deadline transitions that failed and were put off (a hook error, a lock timeout, a step the definition lacks); past the orchestrator's bound the saga turns stuck |
//! | `handoff_sagas{saga_type, state}` | gauge | sagas `running`, `compensating` or `stuck`, counted every `gauge_interval` |
//!
//! Alert on `handoff_sagas{state="stuck"} > 0`: a stuck saga waits for an operator.

use metrics::{counter, gauge};

use crate::state::SagaState;

pub(crate) fn transition(saga_type: &str, kind: &'static str) {
    counter!(
        "handoff_saga_transitions_total",
        "saga_type" => saga_type.to_owned(),
        "kind" => kind
    )
    .increment(1);
}

pub(crate) fn ignored_reply(saga_type: &str) {
    counter!("handoff_saga_ignored_replies_total", "saga_type" => saga_type.to_owned())
        .increment(1);
}

pub(crate) fn transition_failed(saga_type: &str) {
    counter!("handoff_saga_transition_failures_total", "saga_type" => saga_type.to_owned())
        .increment(1);
}

pub(crate) fn open(saga_type: &str, state: SagaState, count: i64) {
    gauge!("handoff_sagas", "saga_type" => saga_type.to_owned(), "state" => state.as_str())
        .set(count as f64);
}
