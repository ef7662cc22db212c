//! Reversible encoding of aggregate ids into broker subject tokens.
//!
//! Aggregate ids are stored verbatim in the outbox, but a NATS subject token cannot hold `.`
//! (the token separator), `*` or `>` (wildcards) or whitespace, and an id such as `a.b` would
//! otherwise land on another subject than `a_b`'s neighbour `a.b.c` expects. Ids are therefore
//! percent-encoded: every byte outside `[A-Za-z0-9-_~]` becomes `%XX`. Ids made of those
//! characters (UUIDs, slugs) pass through unchanged, and [`decode_token`] gives back the original.
//!
//! # Examples
//!
//! ```
//! use handoff_core::subject::{decode_token, encode_token};
//!
//! assert_eq!(encode_token("0192f3a4-7c1e-7d2a"), "0192f3a4-7c1e-7d2a");
//! assert_eq!(encode_token("eu.west *>"), "eu%2Ewest%20%2A%3E");
//! assert_eq!(decode_token("eu%2Ewest%20%2A%3E").unwrap(), "eu.west *>");
//! ```

use std::borrow::Cow;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// Bytes kept verbatim: alphanumerics plus `-`, `_` and `~`. `%` itself is encoded, which is
/// what makes the mapping reversible.
const TOKEN_UNSAFE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'~');

/// Encodes an aggregate id as one subject token.
pub fn encode_token(aggregate_id: &str) -> Cow<'_, str> {
    utf8_percent_encode(aggregate_id, TOKEN_UNSAFE).into()
}

/// A token that is not the encoding of any aggregate id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("subject token {0:?} does not decode to UTF-8")]
pub struct DecodeTokenError(pub String);

/// Decodes a token made by [`encode_token`] back into the aggregate id.
///
/// # Errors
///
/// [`DecodeTokenError`] when the percent-decoded bytes are not UTF-8.
pub fn decode_token(token: &str) -> Result<Cow<'_, str>, DecodeTokenError> {
    percent_decode_str(token)
        .decode_utf8()
        .map_err(|_| DecodeTokenError(token.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoded_tokens_hold_no_subject_metacharacters_and_round_trip() {
        let ids = [
            "plain-id_1~",
            "a.b",
            "*",
            ">",
            "tab\there",
            "new\nline",
            "50%",
            "%2E",
            "ünïcödé",
            "a b.c*d>e",
        ];
        for id in ids {
            let token = encode_token(id);
            assert!(
                !token.contains(['.', '*', '>', ' ', '\t', '\n', '\r']),
                "{id:?} -> {token:?}"
            );
            assert!(token.is_ascii());
            assert_eq!(decode_token(&token).unwrap(), id);
        }
    }

    #[test]
    fn distinct_ids_get_distinct_tokens() {
        assert_ne!(encode_token("a.b"), encode_token("a%2Eb"));
        assert_ne!(encode_token("a.b"), encode_token("a_b"));
    }

    #[test]
    fn invalid_utf8_is_an_error() {
        assert!(decode_token("%FF").is_err());
    }
}
