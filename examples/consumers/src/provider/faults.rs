//! Fault injection after apply: the provider commits a charge, then fails to answer normally,
//! which is the ambiguous case a payment client must survive (did the charge happen or not?).

use std::fmt;
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// How a request chosen for a fault fails, once its transaction has committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultMode {
    /// Hold the response for [`FaultSettings::hang`] (the client times out first), then answer
    /// `504`.
    Timeout,
    /// Answer `500 {"error":"injected_failure"}` at once.
    Error,
}

impl FaultMode {
    /// The mode's name: `timeout` or `error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Error => "error",
        }
    }
}

impl fmt::Display for FaultMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A fault mode name that is neither `timeout` nor `error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fault mode {0:?}: expected timeout or error")]
pub struct UnknownFaultMode(pub String);

impl FromStr for FaultMode {
    type Err = UnknownFaultMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "timeout" => Ok(Self::Timeout),
            "error" => Ok(Self::Error),
            other => Err(UnknownFaultMode(other.to_owned())),
        }
    }
}

/// The fault injection settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultSettings {
    /// Probability, from 0.0 to 1.0, that a `POST /charges` whose transaction committed (it
    /// created or replayed a charge) does not answer normally.
    pub fail_after_apply: f64,
    /// How such a request fails.
    pub mode: FaultMode,
    /// How long a request fails in [`FaultMode::Timeout`] holds its response.
    pub hang: Duration,
}

impl Default for FaultSettings {
    /// No faults; `timeout` mode with a 30 s hang once a rate is set.
    fn default() -> Self {
        Self {
            fail_after_apply: 0.0,
            mode: FaultMode::Timeout,
            hang: Duration::from_secs(30),
        }
    }
}

/// Settings that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum FaultSettingsError {
    /// The rate is not a probability.
    #[error("fail_after_apply must be between 0.0 and 1.0, got {0}")]
    RateOutOfRange(f64),
}

impl FaultSettings {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// [`FaultSettingsError::RateOutOfRange`] when `fail_after_apply` is not within 0.0..=1.0
    /// (NaN included).
    pub fn validate(&self) -> Result<(), FaultSettingsError> {
        if (0.0..=1.0).contains(&self.fail_after_apply) {
            Ok(())
        } else {
            Err(FaultSettingsError::RateOutOfRange(self.fail_after_apply))
        }
    }
}

/// A change to some of the settings; `None` keeps the current value.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FaultPatch {
    /// New [`FaultSettings::fail_after_apply`].
    pub fail_after_apply: Option<f64>,
    /// New [`FaultSettings::mode`].
    pub mode: Option<FaultMode>,
    /// New [`FaultSettings::hang`].
    pub hang: Option<Duration>,
}

/// The fault a request must suffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Hold the response this long, then answer `504`.
    Timeout(Duration),
    /// Answer `500` now.
    Error,
}

/// The current settings and the random source that picks the requests to fail; shared by all
/// requests and changeable at runtime.
#[derive(Debug)]
pub struct FaultInjector {
    // std Mutex: held for a few instructions, never across `.await`.
    state: Mutex<(FaultSettings, StdRng)>,
}

impl FaultInjector {
    /// An injector with `settings`, drawing from a generator seeded with `seed`: the same seed
    /// and the same sequence of requests fail the same requests.
    ///
    /// # Errors
    ///
    /// [`FaultSettingsError`] when the settings are invalid.
    pub fn new(settings: FaultSettings, seed: u64) -> Result<Self, FaultSettingsError> {
        settings.validate()?;
        Ok(Self {
            state: Mutex::new((settings, StdRng::seed_from_u64(seed))),
        })
    }

    /// The current settings.
    pub fn settings(&self) -> FaultSettings {
        self.lock().0
    }

    /// Applies `patch` and returns the new settings; nothing changes if they would be invalid.
    ///
    /// # Errors
    ///
    /// [`FaultSettingsError`] when the patched settings are invalid.
    pub fn update(&self, patch: FaultPatch) -> Result<FaultSettings, FaultSettingsError> {
        let mut state = self.lock();
        let mut settings = state.0;
        if let Some(rate) = patch.fail_after_apply {
            settings.fail_after_apply = rate;
        }
        if let Some(mode) = patch.mode {
            settings.mode = mode;
        }
        if let Some(hang) = patch.hang {
            settings.hang = hang;
        }
        settings.validate()?;
        state.0 = settings;
        Ok(settings)
    }

    /// Whether the request whose transaction just committed must fail, and how.
    pub fn draw(&self) -> Option<Fault> {
        let mut state = self.lock();
        let (settings, rng) = &mut *state;
        // A zero rate draws nothing, so turning faults off and on again keeps a seeded run's
        // sequence of draws aligned with its faulty requests.
        if settings.fail_after_apply <= 0.0 {
            return None;
        }
        // In 0.0..1.0: a rate of 1.0 always fails, and no rate can make this panic.
        if rng.random::<f64>() >= settings.fail_after_apply {
            return None;
        }
        Some(match settings.mode {
            FaultMode::Timeout => Fault::Timeout(settings.hang),
            FaultMode::Error => Fault::Error,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (FaultSettings, StdRng)> {
        // A panic while holding the lock cannot leave the settings half-written (they are
        // replaced whole), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(rate: f64, mode: FaultMode) -> FaultSettings {
        FaultSettings {
            fail_after_apply: rate,
            mode,
            hang: Duration::from_millis(250),
        }
    }

    #[test]
    fn rates_outside_zero_to_one_are_refused() {
        for rate in [-0.1, 1.01, f64::NAN, f64::INFINITY] {
            assert!(
                settings(rate, FaultMode::Error).validate().is_err(),
                "{rate}"
            );
            assert!(FaultInjector::new(settings(rate, FaultMode::Error), 1).is_err());
        }
        for rate in [0.0, 0.5, 1.0] {
            assert!(
                settings(rate, FaultMode::Error).validate().is_ok(),
                "{rate}"
            );
        }
    }

    #[test]
    fn rate_zero_never_fails_and_rate_one_always_fails() {
        let never = FaultInjector::new(settings(0.0, FaultMode::Error), 7).unwrap();
        assert!((0..1000).all(|_| never.draw().is_none()));
        let always = FaultInjector::new(settings(1.0, FaultMode::Timeout), 7).unwrap();
        assert!(
            (0..1000).all(|_| always.draw() == Some(Fault::Timeout(Duration::from_millis(250))))
        );
    }

    #[test]
    fn the_same_seed_fails_the_same_requests() {
        let draws = |seed| {
            let injector = FaultInjector::new(settings(0.3, FaultMode::Error), seed).unwrap();
            (0..200)
                .map(|_| injector.draw().is_some())
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(42), draws(42));
        assert_ne!(draws(42), draws(43));
        let failed = draws(42).into_iter().filter(|f| *f).count();
        assert!((30..90).contains(&failed), "{failed} of 200 at rate 0.3");
    }

    #[test]
    fn an_invalid_patch_changes_nothing() {
        let injector = FaultInjector::new(FaultSettings::default(), 1).unwrap();
        let patch = FaultPatch {
            fail_after_apply: Some(2.0),
            mode: Some(FaultMode::Error),
            hang: None,
        };
        assert!(injector.update(patch).is_err());
        assert_eq!(injector.settings(), FaultSettings::default());
        let patch = FaultPatch {
            fail_after_apply: Some(0.5),
            mode: Some(FaultMode::Error),
            hang: Some(Duration::from_secs(2)),
        };
        let updated = injector.update(patch).unwrap();
        let expected = FaultSettings {
            fail_after_apply: 0.5,
            mode: FaultMode::Error,
            hang: Duration::from_secs(2),
        };
        assert_eq!(updated, expected);
        assert_eq!(injector.settings(), updated);
    }

    #[test]
    fn modes_parse_from_their_names() {
        for mode in [FaultMode::Timeout, FaultMode::Error] {
            assert_eq!(mode.as_str().parse::<FaultMode>(), Ok(mode));
        }
        assert!("crash".parse::<FaultMode>().is_err());
    }
}
