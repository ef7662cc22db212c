//! Idempotency keys and request fingerprints (design W5).

use sha2::{Digest, Sha256};

/// The longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// A client-chosen `Idempotency-Key`: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

/// A header value that is not a usable key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Idempotency-Key must be 1 to {MAX_KEY_BYTES} visible ASCII characters")]
pub struct InvalidKey;

impl IdempotencyKey {
    /// Parses a header value.
    ///
    /// # Errors
    ///
    /// [`InvalidKey`] when the value is empty, too long, or not visible ASCII.
    pub fn parse(value: &[u8]) -> Result<Self, InvalidKey> {
        let ok = !value.is_empty()
            && value.len() <= MAX_KEY_BYTES
            && value.iter().all(|b| b.is_ascii_graphic());
        if !ok {
            return Err(InvalidKey);
        }
        // Visible ASCII is UTF-8.
        String::from_utf8(value.to_vec())
            .map(Self)
            .map_err(|_| InvalidKey)
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// SHA-256 over the method, the path and the request in canonical JSON: the same request sent
/// again (whatever its whitespace or key order) has the same fingerprint, another one does not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a parsed request.
    pub fn of<T: serde::Serialize>(method: &str, path: &str, request: &T) -> Self {
        let mut hash = Sha256::new();
        for part in [method.as_bytes(), b"\n", path.as_bytes(), b"\n"] {
            hash.update(part);
        }
        // Serialising a parsed request back to JSON cannot fail: it came from JSON.
        hash.update(serde_json::to_vec(request).unwrap_or_default());
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

    #[test]
    fn keys_are_visible_ascii_of_bounded_length() {
        assert!(IdempotencyKey::parse(b"0192f3a4-7c1e").is_ok());
        for bad in [
            &b""[..],
            b"with space",
            b"tab\t",
            "ü".as_bytes(),
            &[b'k'; 256],
        ] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn fingerprints_differ_by_method_path_and_body() {
        let body = serde_json::json!({"a": 1});
        let base = Fingerprint::of("POST", "/orders", &body);
        assert_eq!(
            base,
            Fingerprint::of("POST", "/orders", &serde_json::json!({"a": 1}))
        );
        assert_ne!(base, Fingerprint::of("POST", "/orders/x/lines", &body));
        assert_ne!(base, Fingerprint::of("PUT", "/orders", &body));
        assert_ne!(
            base,
            Fingerprint::of("POST", "/orders", &serde_json::json!({"a": 2}))
        );
    }
}
