//! [`Report`]: what a check found, and [`Failure`]: the seed that breaks a handler.

use std::fmt;

/// What a [`HandlerCheck`](crate::HandlerCheck) found.
#[derive(Debug, Clone)]
pub struct Report<S> {
    /// The state after the clean run: each event delivered once, in commit order, no fault.
    pub expected: S,
    /// The seeds run (the failing one included), in order.
    pub seeds_run: Vec<u64>,
    /// The first seed whose run broke the handler's exactly-once effect, if any.
    pub failure: Option<Failure<S>>,
}

impl<S: fmt::Debug> Report<S> {
    /// Whether every seed left the same state as the clean run.
    pub fn passed(&self) -> bool {
        self.failure.is_none()
    }

    /// Panics, with the failing seed, the difference and the run's trace, unless every seed
    /// left the same state as the clean run.
    ///
    /// # Panics
    ///
    /// When a seed failed: that is the point, in a test.
    #[track_caller]
    pub fn assert_exactly_once(&self) {
        if let Some(failure) = &self.failure {
            panic!("{failure}");
        }
    }
}

/// One seed whose run left another state than the clean run.
#[derive(Debug, Clone)]
pub struct Failure<S> {
    /// The seed: `HANDOFF_TESTKIT_SEED=<seed>` (or
    /// [`HandlerCheck::seeds`](crate::HandlerCheck::seeds)`(seed..seed + 1)`) runs it again,
    /// with the same deliveries, faults and trace.
    pub seed: u64,
    /// What differed.
    pub problem: Problem<S>,
    /// What the broker did in the run, one line per step: deliveries, acknowledgements, the
    /// faults, the consumer's restarts.
    pub trace: Vec<String>,
    /// The run's schema, kept for a look at what the handler left.
    pub schema: String,
}

/// What a failing run did differently from the clean run.
#[derive(Debug, Clone, PartialEq)]
pub enum Problem<S> {
    /// The scenario observed another state: an effect applied twice or lost.
    StateDiffers {
        /// After the clean run.
        expected: S,
        /// After this run.
        found: S,
    },
    /// Other events ended in the consumer quarantine than in the clean run (a handler that
    /// fails when an event comes again, or after another aggregate's event).
    QuarantineDiffers {
        /// Quarantined in the clean run.
        expected: Vec<String>,
        /// Quarantined in this run.
        found: Vec<String>,
    },
    /// Events still not acknowledged when the run's time was up.
    Unfinished {
        /// Each with how often it was delivered.
        unsettled: Vec<String>,
    },
}

impl<S: fmt::Debug> fmt::Display for Failure<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seed = self.seed;
        match &self.problem {
            Problem::StateDiffers { expected, found } => write!(
                f,
                "seed {seed}: the handler's effects differ from each event applied once \
                 (exactly-once effect broken)\nexpected (clean run): {expected:#?}\n\
                 found: {found:#?}"
            )?,
            Problem::QuarantineDiffers { expected, found } => write!(
                f,
                "seed {seed}: other events were quarantined than in the clean run\n\
                 expected: {expected:#?}\nfound: {found:#?}"
            )?,
            Problem::Unfinished { unsettled } => write!(
                f,
                "seed {seed}: the run did not finish in time; not yet acknowledged: \
                 {unsettled:#?}"
            )?,
        }
        writeln!(f, "\ntrace of seed {seed}:")?;
        for line in &self.trace {
            writeln!(f, "  {line}")?;
        }
        write!(
            f,
            "the run's schema is kept: {}\nreplay: HANDOFF_TESTKIT_SEED={seed}",
            self.schema
        )
    }
}
