//! The ordering a writer and a relay agree on: per aggregate (the default) or one global lane.
//!
//! Per-aggregate order lets the relay publish many aggregates at once and writers of different
//! aggregates commit without waiting for each other. Global order (design F3) gives every event a
//! place in one sequence over the whole outbox, at the price of one lane: writers serialise on
//! one counter row and one relay publishes one event at a time. See `docs/global-order.md`.

use std::fmt;
use std::str::FromStr;

/// Which order an outbox writes and a relay publishes in.
///
/// The writer (`OutboxConfig::order` in `handoff-postgres`) and the relay (`handoff relay
/// --order`) must agree: a relay in [`Aggregate`](OrderMode::Aggregate) mode leaves global
/// events alone, and a relay in [`Global`](OrderMode::Global) mode publishes nothing else.
///
/// # Examples
///
/// ```
/// use handoff_core::OrderMode;
///
/// let mode: OrderMode = "global".parse()?;
/// assert_eq!(mode, OrderMode::Global);
/// assert_eq!(OrderMode::default().to_string(), "aggregate");
/// assert!("total".parse::<OrderMode>().is_err());
/// # Ok::<(), handoff_core::ParseOrderModeError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum OrderMode {
    /// Order per aggregate only: events of one aggregate are published in their sequence, and
    /// aggregates go in parallel. The default.
    #[default]
    Aggregate,
    /// One order over every event: each event also takes the next global sequence in its
    /// writer's transaction, and the relay publishes strictly in that order through one lane.
    Global,
}

impl OrderMode {
    /// The mode's name, as the command lines take it: `"aggregate"` or `"global"`.
    pub fn as_str(self) -> &'static str {
        match self {
            OrderMode::Aggregate => "aggregate",
            OrderMode::Global => "global",
        }
    }
}

impl fmt::Display for OrderMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not an [`OrderMode`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown order mode {0:?}: expected \"aggregate\" or \"global\"")]
pub struct ParseOrderModeError(String);

impl FromStr for OrderMode {
    type Err = ParseOrderModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "aggregate" => Ok(OrderMode::Aggregate),
            "global" => Ok(OrderMode::Global),
            other => Err(ParseOrderModeError(other.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for mode in [OrderMode::Aggregate, OrderMode::Global] {
            assert_eq!(mode.to_string().parse::<OrderMode>(), Ok(mode));
        }
        assert!("Global".parse::<OrderMode>().is_err());
    }
}
