//! What a saga is made of: its steps, in order, each with the participant that does it, the
//! command that asks for it, the command that undoes it, and how long to wait for replies.

use std::time::Duration;

use handoff_core::EventCatalog;

use crate::message::{command_aggregate_type, SCHEMA_VERSION};

/// How long the orchestrator waits for a reply, and how often it asks again.
///
/// A forward step with no reply after `attempts` sends turns the saga back; a compensation that
/// failed or went unanswered `attempts` times parks the saga as `stuck`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// How long a reply may take before the command counts as unanswered.
    pub reply_timeout: Duration,
    /// Sends of one command, the first included.
    pub attempts: u32,
    /// The pause before a failed compensation is sent again; doubled each time, up to
    /// `max_backoff`.
    pub backoff: Duration,
    /// The longest pause between two sends of a failed compensation.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            reply_timeout: Duration::from_secs(30),
            attempts: 5,
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The pause after failed attempt `attempt` (1-based).
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::time::Duration;
    /// use handoff_saga::RetryPolicy;
    /// let policy = RetryPolicy { backoff: Duration::from_secs(1), max_backoff: Duration::from_secs(5), ..RetryPolicy::default() };
    /// assert_eq!(policy.pause_after(1), Duration::from_secs(1));
    /// assert_eq!(policy.pause_after(3), Duration::from_secs(4));
    /// assert_eq!(policy.pause_after(9), Duration::from_secs(5));
    /// ```
    pub fn pause_after(&self, attempt: u32) -> Duration {
        let exponent = attempt.saturating_sub(1).min(20);
        self.backoff
            .saturating_mul(1 << exponent)
            .min(self.max_backoff)
    }
}

/// One step of a saga.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The step's name, such as `"reserve-stock"`.
    pub name: String,
    /// The participant that does it, such as `"inventory"`: its commands go out as events of
    /// aggregate type `<participant>-commands`.
    pub participant: String,
    /// The command's event type, such as `"ReserveStock"`.
    pub action: String,
    /// The event type of the command that undoes it, such as `"ReleaseStock"`; `None` for a
    /// step with nothing to undo.
    pub compensation: Option<String>,
    /// Replies and resends for this step and its compensation.
    pub retry: RetryPolicy,
}

impl Step {
    /// A step `name`, done by `participant` on command `action`, with nothing to undo and the
    /// default [`RetryPolicy`].
    pub fn new(
        name: impl Into<String>,
        participant: impl Into<String>,
        action: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            participant: participant.into(),
            action: action.into(),
            compensation: None,
            retry: RetryPolicy::default(),
        }
    }

    /// Undone by command `action`.
    pub fn compensated_by(mut self, action: impl Into<String>) -> Self {
        self.compensation = Some(action.into());
        self
    }

    /// With `retry` instead of the default policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }
}

/// A saga type: a name and its steps, run in order and compensated in reverse order.
///
/// # Examples
///
/// ```
/// use handoff_saga::{SagaDefinition, Step};
///
/// let place_order = SagaDefinition::new("place-order")
///     .step(Step::new("reserve-stock", "inventory", "ReserveStock").compensated_by("ReleaseStock"))
///     .step(Step::new("charge", "payments", "Charge").compensated_by("Refund"));
/// place_order.validate()?;
/// assert_eq!(place_order.steps().len(), 2);
/// # Ok::<(), handoff_saga::DefinitionError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SagaDefinition {
    saga_type: String,
    steps: Vec<Step>,
}

/// Why a saga definition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DefinitionError {
    /// A saga needs at least one step.
    #[error("saga {0} has no steps")]
    NoSteps(String),
    /// Names must be non-empty tokens of letters, digits, `-` and `_` (participant names
    /// become subject tokens).
    #[error("saga {saga_type}: {what} {name:?} must be letters, digits, '-' or '_'")]
    InvalidName {
        /// The saga type.
        saga_type: String,
        /// Which name: saga type, step, participant, action.
        what: &'static str,
        /// The name given.
        name: String,
    },
    /// Two steps of one saga share a name.
    #[error("saga {saga_type} has two steps named {step}")]
    DuplicateStep {
        /// The saga type.
        saga_type: String,
        /// The step name.
        step: String,
    },
    /// A retry policy that could never send a command, or never wait for its reply.
    #[error("saga {saga_type}, step {step}: attempts and reply timeout must be above zero")]
    InvalidRetry {
        /// The saga type.
        saga_type: String,
        /// The step name.
        step: String,
    },
    /// Two definitions share a saga type.
    #[error("saga type {0} is defined twice")]
    DuplicateSagaType(String),
}

impl SagaDefinition {
    /// A saga type with no steps yet.
    pub fn new(saga_type: impl Into<String>) -> Self {
        Self {
            saga_type: saga_type.into(),
            steps: Vec::new(),
        }
    }

    /// Appends a step.
    pub fn step(mut self, step: Step) -> Self {
        self.steps.push(step);
        self
    }

    /// The saga type's name.
    pub fn saga_type(&self) -> &str {
        &self.saga_type
    }

    /// The steps, in forward order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Checks names and policies.
    ///
    /// # Errors
    ///
    /// [`DefinitionError`] for the first problem found.
    pub fn validate(&self) -> Result<(), DefinitionError> {
        let invalid = |what: &'static str, name: &str| DefinitionError::InvalidName {
            saga_type: self.saga_type.clone(),
            what,
            name: name.to_owned(),
        };
        if !is_token(&self.saga_type) {
            return Err(invalid("saga type", &self.saga_type));
        }
        if self.steps.is_empty() {
            return Err(DefinitionError::NoSteps(self.saga_type.clone()));
        }
        for (i, step) in self.steps.iter().enumerate() {
            for (what, name) in [
                ("step", step.name.as_str()),
                ("participant", step.participant.as_str()),
                ("action", step.action.as_str()),
            ]
            .into_iter()
            .chain(step.compensation.as_deref().map(|c| ("compensation", c)))
            {
                if !is_token(name) {
                    return Err(invalid(what, name));
                }
            }
            if self.steps[..i].iter().any(|s| s.name == step.name) {
                return Err(DefinitionError::DuplicateStep {
                    saga_type: self.saga_type.clone(),
                    step: step.name.clone(),
                });
            }
            if step.retry.attempts == 0 || step.retry.reply_timeout.is_zero() {
                return Err(DefinitionError::InvalidRetry {
                    saga_type: self.saga_type.clone(),
                    step: step.name.clone(),
                });
            }
        }
        Ok(())
    }

    /// The commands this saga sends, declared for the orchestrator's outbox.
    pub fn declare_commands(&self, mut catalog: EventCatalog) -> EventCatalog {
        for step in &self.steps {
            let aggregate_type = command_aggregate_type(&step.participant);
            catalog = catalog.declare(&aggregate_type, &step.action, SCHEMA_VERSION);
            if let Some(compensation) = &step.compensation {
                catalog = catalog.declare(&aggregate_type, compensation, SCHEMA_VERSION);
            }
        }
        catalog
    }

    /// The step at `index`, if the definition has it.
    pub(crate) fn step_at(&self, index: i32) -> Option<&Step> {
        usize::try_from(index).ok().and_then(|i| self.steps.get(i))
    }

    /// The highest step at or below `from` that has a compensation.
    pub(crate) fn compensable_at_or_below(&self, from: i32) -> Option<i32> {
        (0..=from)
            .rev()
            .find(|&i| self.step_at(i).is_some_and(|s| s.compensation.is_some()))
    }
}

fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order() -> SagaDefinition {
        SagaDefinition::new("order")
            .step(Step::new("reserve", "inventory", "Reserve").compensated_by("Release"))
            .step(Step::new("notify", "mail", "Notify"))
            .step(Step::new("charge", "payments", "Charge").compensated_by("Refund"))
    }

    #[test]
    fn compensation_skips_steps_with_nothing_to_undo() {
        let order = order();
        assert_eq!(order.compensable_at_or_below(2), Some(2));
        assert_eq!(order.compensable_at_or_below(1), Some(0));
        assert_eq!(order.compensable_at_or_below(-1), None);
    }

    #[test]
    fn bad_definitions_are_refused() {
        assert!(order().validate().is_ok());
        assert_eq!(
            SagaDefinition::new("empty").validate(),
            Err(DefinitionError::NoSteps("empty".into()))
        );
        let dotted = SagaDefinition::new("x").step(Step::new("a", "inv.entory", "A"));
        assert!(matches!(
            dotted.validate(),
            Err(DefinitionError::InvalidName {
                what: "participant",
                ..
            })
        ));
        let twice = SagaDefinition::new("x")
            .step(Step::new("a", "p", "A"))
            .step(Step::new("a", "p", "B"));
        assert!(matches!(
            twice.validate(),
            Err(DefinitionError::DuplicateStep { .. })
        ));
        let never =
            SagaDefinition::new("x").step(Step::new("a", "p", "A").with_retry(RetryPolicy {
                attempts: 0,
                ..RetryPolicy::default()
            }));
        assert!(matches!(
            never.validate(),
            Err(DefinitionError::InvalidRetry { .. })
        ));
    }

    #[test]
    fn the_catalog_declares_every_command() {
        let catalog = order().declare_commands(EventCatalog::new());
        assert!(catalog.is_declared("inventory-commands", "Release", 1));
        assert!(catalog.is_declared("payments-commands", "Charge", 1));
        assert!(!catalog.is_declared("mail-commands", "Release", 1));
    }
}
