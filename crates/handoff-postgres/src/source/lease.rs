//! Lease tokens: how a claim's `claim_until` travels with its outcomes and fences their writes.

use chrono::{DateTime, Utc};
use handoff_core::delivery::{Lease, Settled};

/// A claim's `claim_until` as the [`Lease`] its outcomes carry: microseconds since the Unix
/// epoch, the precision PostgreSQL keeps, so [`claim_until`] gives back the very value.
pub(super) fn lease_token(claim_until: DateTime<Utc>) -> Lease {
    Lease::new(claim_until.timestamp_micros())
}

/// The `claim_until` a [`Lease`] of [`lease_token`] stands for; `None` (the write then fences
/// itself out) for a token no claim of this source made.
pub(super) fn claim_until(lease: Lease) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_micros(lease.token())
}

/// What a fenced write of `given` outcomes that updated `written` rows did: the rest found
/// their event no longer held under the lease they carried (or settled already).
pub(super) fn stale(given: usize, written: u64) -> Settled {
    Settled {
        stale: given.saturating_sub(usize::try_from(written).unwrap_or(usize::MAX)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_token_gives_back_the_exact_claim_until() {
        let at = DateTime::from_timestamp_micros(1_765_000_000_123_457).unwrap();
        assert_eq!(claim_until(lease_token(at)), Some(at));
        assert_eq!(lease_token(at).token(), 1_765_000_000_123_457);
    }
}
