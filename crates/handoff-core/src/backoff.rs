//! [`Backoff`]: how long to wait before trying again, shared by the relay and the consumer.

use std::cell::Cell;
use std::time::Duration;

use rand::Rng;

thread_local! {
    /// The state of this thread's seeded jitter, when a simulation asked for one.
    static SEEDED: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Draws this thread's backoff jitter from a sequence seeded by `seed` instead of the thread's
/// random generator (`None`: random again), so a seeded simulation on one thread replays
/// exactly (`tools/sim`). Nothing else calls it.
#[doc(hidden)]
pub fn seed_jitter_on_this_thread(seed: Option<u64>) {
    SEEDED.with(|state| state.set(seed));
}

/// A factor in `0.5..=1.0`.
fn jitter() -> f64 {
    SEEDED.with(|state| match state.get() {
        None => rand::rng().random_range(0.5..=1.0),
        Some(x) => {
            // splitmix64: one step per draw.
            let x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            state.set(Some(x));
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            0.5 + 0.5 * ((z >> 11) as f64 / (1u64 << 53) as f64)
        }
    })
}

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
        ceiling.mul_f64(jitter())
    }
}
