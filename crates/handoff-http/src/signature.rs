//! Standard Webhooks signatures (<https://www.standardwebhooks.com/>): the sender's side used by
//! [`HttpTransport`](crate::HttpTransport) and the receiver's check used by the reference
//! receiver.
//!
//! The signed content is `<webhook-id>.<webhook-timestamp>.<raw body>`; the signature is the
//! standard base64 of its HMAC-SHA256 under the secret's decoded key, sent as
//! `webhook-signature: v1,<base64>` (several space-separated entries are allowed, one matching
//! entry suffices). `webhook-timestamp` is Unix seconds at sending, and receivers refuse one
//! more than [`TOLERANCE`] away from their clock. Any Standard Webhooks verifier library
//! accepts these requests given the same `whsec_...` secret.
//!
//! # Examples
//!
//! ```
//! use handoff_http::signature;
//! use handoff_http::SigningSecret;
//!
//! let secret = SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
//! let now = 1_700_000_000;
//! let header = signature::sign(&secret, "evt-1", now, b"{}");
//! assert!(header.starts_with("v1,"));
//! assert!(signature::verify(&secret, "evt-1", &now.to_string(), &header, b"{}", now).is_ok());
//! assert!(signature::verify(&secret, "evt-1", &now.to_string(), &header, b"[]", now).is_err());
//! ```

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::SigningSecret;

/// The header carrying the message id (the event id).
pub const WEBHOOK_ID: &str = "webhook-id";
/// The header carrying the sending time, in Unix seconds.
pub const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
/// The header carrying the signature(s).
pub const WEBHOOK_SIGNATURE: &str = "webhook-signature";
/// How far a timestamp may be from the receiver's clock, either way: 5 minutes, in seconds.
pub const TOLERANCE: i64 = 5 * 60;

/// Why [`verify`] refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureError {
    /// `webhook-timestamp` is not an integer.
    #[error("webhook-timestamp is not unix seconds")]
    BadTimestamp,
    /// `webhook-timestamp` is more than [`TOLERANCE`] away from now (a replay, or a clock off).
    #[error("webhook-timestamp is more than 5 minutes from now")]
    TimestampOutOfTolerance,
    /// No `v1,` entry of `webhook-signature` matches.
    #[error("no webhook-signature entry matches")]
    NoMatch,
}

fn mac(secret: &SigningSecret, id: &str, timestamp: &str, body: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length, so this never fails.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.key())
        .unwrap_or_else(|_| unreachable!("hmac accepts any key length"));
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The `webhook-signature` value for a request with `id`, sent at `timestamp` (Unix seconds),
/// with `body`: `v1,<base64 HMAC-SHA256 of "id.timestamp.body">`.
pub fn sign(secret: &SigningSecret, id: &str, timestamp: i64, body: &[u8]) -> String {
    let tag = mac(secret, id, &timestamp.to_string(), body).finalize();
    format!("v1,{}", STANDARD.encode(tag.into_bytes()))
}

/// Checks the three Standard Webhooks header values of a request against its raw `body`, at
/// `now` (Unix seconds). The comparison is constant-time.
///
/// # Errors
///
/// [`SignatureError`]: a malformed or stale timestamp, or no matching signature.
pub fn verify(
    secret: &SigningSecret,
    id: &str,
    timestamp: &str,
    signatures: &str,
    body: &[u8],
    now: i64,
) -> Result<(), SignatureError> {
    let sent: i64 = timestamp
        .trim()
        .parse()
        .map_err(|_| SignatureError::BadTimestamp)?;
    if (now - sent).abs() > TOLERANCE {
        return Err(SignatureError::TimestampOutOfTolerance);
    }
    let matches = signatures
        .split(' ')
        .filter_map(|entry| entry.strip_prefix("v1,"))
        .filter_map(|encoded| STANDARD.decode(encoded).ok())
        .any(|tag| {
            mac(secret, id, timestamp.trim(), body)
                .verify_slice(&tag)
                .is_ok()
        });
    if matches {
        Ok(())
    } else {
        Err(SignatureError::NoMatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> SigningSecret {
        SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap()
    }

    /// The example of the Standard Webhooks reference libraries' test suites: this secret, id,
    /// timestamp and body sign to this value.
    #[test]
    fn matches_the_reference_vector() {
        let body = br#"{"test": 2432232314}"#;
        let header = sign(&secret(), "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert_eq!(header, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn any_matching_entry_passes_and_stale_or_forged_ones_fail() {
        let header = sign(&secret(), "id", 100, b"body");
        let several = format!("v1,AAAA {header}");
        assert_eq!(
            verify(&secret(), "id", "100", &several, b"body", 100),
            Ok(())
        );
        assert_eq!(
            verify(
                &secret(),
                "id",
                "100",
                &header,
                b"body",
                100 + TOLERANCE + 1
            ),
            Err(SignatureError::TimestampOutOfTolerance)
        );
        assert_eq!(
            verify(&secret(), "other", "100", &header, b"body", 100),
            Err(SignatureError::NoMatch)
        );
        assert_eq!(
            verify(&secret(), "id", "x", &header, b"body", 100),
            Err(SignatureError::BadTimestamp)
        );
    }
}
