//! Idempotency keys and request fingerprints, as a payment provider such as Stripe checks them:
//! a key names one request, and a retry must send the same request again.

use sha2::{Digest, Sha256};

use super::store::ChargeRequest;

/// The longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// A client-chosen `Idempotency-Key`: 1 to [`MAX_KEY_BYTES`] bytes of UTF-8.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// A header value that is not a usable key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Idempotency-Key must be 1 to {MAX_KEY_BYTES} bytes of UTF-8")]
pub struct InvalidKey;

impl IdempotencyKey {
    /// Parses a header value.
    ///
    /// # Errors
    ///
    /// [`InvalidKey`] when the value is empty, longer than [`MAX_KEY_BYTES`] or not UTF-8 (the
    /// key is stored as PostgreSQL `text`).
    pub fn parse(value: &[u8]) -> Result<Self, InvalidKey> {
        if value.is_empty() || value.len() > MAX_KEY_BYTES {
            return Err(InvalidKey);
        }
        std::str::from_utf8(value)
            .map(|key| Self(key.to_owned()))
            .map_err(|_| InvalidKey)
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// SHA-256 over the parsed charge request: the same request sent again (whatever its
/// whitespace or key order) has the same fingerprint, another one does not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a charge request.
    pub fn of(request: &ChargeRequest) -> Self {
        let mut hash = Sha256::new();
        // The route first, so a fingerprint never matches one of another kind of request; then
        // fixed-width fields, so no two requests hash the same bytes.
        hash.update(b"POST /charges\n");
        hash.update(request.order_id.as_bytes());
        hash.update(request.amount_cents.to_be_bytes());
        Self(hash.finalize().into())
    }

    /// The 32 bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn keys_are_one_to_255_bytes_of_utf8() {
        assert_eq!(IdempotencyKey::parse(b"k-1").unwrap().as_str(), "k-1");
        assert!(IdempotencyKey::parse(&[b'k'; 255]).is_ok());
        assert!(IdempotencyKey::parse("clé".as_bytes()).is_ok());
        for bad in [&b""[..], &[b'k'; 256], &[0xff, 0xfe]] {
            assert_eq!(IdempotencyKey::parse(bad), Err(InvalidKey), "{bad:?}");
        }
    }

    #[test]
    fn fingerprints_differ_by_order_and_amount() {
        let order_id = Uuid::now_v7();
        let request = |order_id, amount_cents| ChargeRequest {
            order_id,
            amount_cents,
        };
        let base = Fingerprint::of(&request(order_id, 100));
        assert_eq!(base, Fingerprint::of(&request(order_id, 100)));
        assert_ne!(base, Fingerprint::of(&request(order_id, 101)));
        assert_ne!(base, Fingerprint::of(&request(Uuid::now_v7(), 100)));
    }
}
