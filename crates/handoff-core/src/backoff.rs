//! [`Backoff`]: how long to wait before trying again, shared by the relay and the consumer.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff with jitter: the `n`th delay (from 1) is drawn between half and all of
/// `initial * 2^(n-1)`, capped at `max`. The jitter keeps relays that failed together from
/// retrying together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay's upper bound.
    pub initial: Duration,
    /// The largest delay.
    pub max: Duration,
}

impl Backoff {
    /// The delay before try `n + 1` after `n` failures (`n` from 1).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use handoff_core::Backoff;
    ///
    /// let backoff = Backoff { initial: Duration::from_secs(1), max: Duration::from_secs(60) };
    /// let third = backoff.delay(3);
    /// assert!(third >= Duration::from_secs(2) && third <= Duration::from_secs(4));
    /// assert!(backoff.delay(40) <= Duration::from_secs(60));
    /// ```
    pub fn delay(&self, failures: u32) -> Duration {
        let exponent = failures.saturating_sub(1).min(30);
        let ceiling = self.initial.saturating_mul(1 << exponent).min(self.max);
        ceiling.mul_f64(rand::rng().random_range(0.5..=1.0))
    }
}
