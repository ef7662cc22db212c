//! Size and shape limits checked before an event is written.

use std::io::Write;

use crate::ValidationError;

/// NATS's default `max_payload`: 1 MiB. A message larger than the server's limit is refused at
/// publish time, which is too late: the event would already be committed and could never leave.
pub const NATS_DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// Room kept for the headers the relay adds (CloudEvents `ce-*`, `Handoff-*`, `Nats-Msg-Id`) and
/// the caller's own headers, which together are limited to well under this.
pub const HEADER_ROOM_BYTES: usize = 8 * 1024;

/// The most bytes of caller headers (names plus values, all headers together) one event may
/// carry; with the relay's own headers this stays well inside [`HEADER_ROOM_BYTES`].
const MAX_USER_HEADER_BYTES: usize = 4 * 1024;

/// PostgreSQL `numeric` holds up to 131072 digits before the decimal point (a weight of 32767
/// base-10000 digits)...
const NUMERIC_MAX_INTEGER_DIGITS: i64 = 131_072;
/// ... and up to 16383 after it (the 14-bit display scale).
const NUMERIC_MAX_SCALE: i64 = 16_383;
/// `numeric_in` refuses an exponent whose absolute value reaches `INT_MAX / 2`, before looking
/// at the digits, so that its own `int` arithmetic cannot overflow.
const NUMERIC_MAX_EXPONENT: i64 = i32::MAX as i64 / 2;

/// Limits an event must respect to be enqueued.
///
/// # Examples
///
/// ```
/// use handoff_core::Limits;
///
/// // A broker configured with 8 MiB messages.
/// let limits = Limits { max_payload_bytes: 8 * 1024 * 1024, ..Limits::default() };
/// assert!(limits.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// The largest payload accepted, in bytes of compact JSON (the form the relay publishes).
    /// Default: [`NATS_DEFAULT_MAX_PAYLOAD`] − [`HEADER_ROOM_BYTES`].
    pub max_payload_bytes: usize,
    /// The longest aggregate id accepted, in bytes of UTF-8. Default: 255.
    pub max_aggregate_id_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload_bytes: NATS_DEFAULT_MAX_PAYLOAD - HEADER_ROOM_BYTES,
            max_aggregate_id_bytes: 255,
        }
    }
}

/// Why a [`Limits`] value is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// A limit is zero, which would refuse every event.
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
}

impl Limits {
    /// Checks that the limits can accept some event.
    ///
    /// # Errors
    ///
    /// [`LimitsError::Zero`] when a limit is zero.
    pub fn validate(&self) -> Result<(), LimitsError> {
        if self.max_payload_bytes == 0 {
            return Err(LimitsError::Zero("max_payload_bytes"));
        }
        if self.max_aggregate_id_bytes == 0 {
            return Err(LimitsError::Zero("max_aggregate_id_bytes"));
        }
        Ok(())
    }

    pub(crate) fn check_aggregate_type(&self, aggregate_type: &str) -> Result<(), ValidationError> {
        let ok = (1..=64).contains(&aggregate_type.len())
            && aggregate_type
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if ok {
            Ok(())
        } else {
            Err(ValidationError::InvalidAggregateType(
                aggregate_type.to_owned(),
            ))
        }
    }

    pub(crate) fn check_aggregate_id(&self, aggregate_id: &str) -> Result<(), ValidationError> {
        if aggregate_id.is_empty() {
            return Err(ValidationError::EmptyAggregateId);
        }
        if aggregate_id.len() > self.max_aggregate_id_bytes {
            return Err(ValidationError::AggregateIdTooLong {
                len: aggregate_id.len(),
                max: self.max_aggregate_id_bytes,
            });
        }
        if aggregate_id.contains('\0') {
            return Err(ValidationError::AggregateIdHasNul);
        }
        Ok(())
    }

    /// Checks that the payload is JSON that `jsonb` can store and that its text, as PostgreSQL
    /// returns it to the relay, fits the limit.
    ///
    /// PostgreSQL's `jsonb` text is not the caller's text: it puts a space after every `,` and
    /// `:`, and prints numbers in full (`1e300` comes back as 301 digits). The size checked is
    /// therefore an upper bound of that form: compact JSON, plus one byte per separator, plus
    /// what each number grows by when printed in full.
    pub(crate) fn check_payload(&self, payload: &str) -> Result<(), ValidationError> {
        // Refuse obviously oversized text before parsing it: compact JSON is never shorter
        // than a sixth of the text it came from (a 6-byte escape decodes to one character).
        if payload.len() / 6 > self.max_payload_bytes {
            return Err(ValidationError::PayloadTooLarge {
                size: payload.len(),
                max: self.max_payload_bytes,
            });
        }
        let value: serde_json::Value =
            serde_json::from_str(payload).map_err(ValidationError::PayloadNotJson)?;
        let size = compact_len(&value) + postgres_growth(payload)?;
        if size > self.max_payload_bytes {
            return Err(ValidationError::PayloadTooLarge {
                size,
                max: self.max_payload_bytes,
            });
        }
        // Only walk the tree when the text could hold the escape at all.
        if payload.contains("\\u0000") && has_nul(&value) {
            return Err(ValidationError::PayloadHasNul);
        }
        Ok(())
    }

    pub(crate) fn check_headers<'a>(
        &self,
        headers: impl IntoIterator<Item = (&'a String, &'a String)>,
    ) -> Result<(), ValidationError> {
        let mut total = 0;
        for (name, value) in headers {
            self.check_header(name, value)?;
            total += name.len() + value.len();
            if total > MAX_USER_HEADER_BYTES {
                return Err(ValidationError::InvalidHeader {
                    name: name.clone(),
                    reason: "an event's headers are limited to 4 KiB together",
                });
            }
        }
        Ok(())
    }

    pub(crate) fn check_header(&self, name: &str, value: &str) -> Result<(), ValidationError> {
        let invalid = |reason| ValidationError::InvalidHeader {
            name: name.to_owned(),
            reason,
        };
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(invalid(
                "a header name is a non-empty token of [A-Za-z0-9-_.]",
            ));
        }
        let lower = name.to_ascii_lowercase();
        if ["ce-", "handoff-", "nats-"]
            .iter()
            .any(|p| lower.starts_with(p))
        {
            return Err(invalid(
                "the ce-, handoff- and nats- prefixes are set by the relay",
            ));
        }
        if value.bytes().any(|b| matches!(b, b'\r' | b'\n' | b'\0')) {
            return Err(invalid("a header value cannot hold CR, LF or NUL"));
        }
        Ok(())
    }
}

/// The length of `value` serialised as compact JSON, without building the string.
fn compact_len(value: &serde_json::Value) -> usize {
    struct Count(usize);
    impl Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a Value to an infallible sink cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// How many bytes PostgreSQL's `jsonb` text of `payload` (valid JSON) can exceed its compact
/// JSON by: one per `,` and `:` separator, plus, per number, its full-digit length beyond the
/// length serde prints it with.
///
/// # Errors
///
/// [`ValidationError::PayloadNumberOutOfRange`] for a number `numeric` cannot hold.
fn postgres_growth(payload: &str) -> Result<usize, ValidationError> {
    let bytes = payload.as_bytes();
    let (mut growth, mut i, mut in_string) = (0usize, 0usize, false);
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            match b {
                b'\\' => i += 1, // skip the escaped byte
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        match b {
            b'"' => in_string = true,
            b',' | b':' => growth += 1,
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < bytes.len()
                    && matches!(bytes[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                let token = &payload[start..i];
                let full =
                    numeric_text_len(token).ok_or(ValidationError::PayloadNumberOutOfRange)?;
                let compact = serde_json::from_str::<serde_json::Value>(token)
                    .map(|v| compact_len(&v))
                    .unwrap_or(token.len());
                growth += full.saturating_sub(compact);
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    Ok(growth)
}

/// The length of `numeric_out` for a JSON number token (what PostgreSQL's `jsonb` prints), or
/// `None` when `numeric` refuses it. `numeric` prints in plain notation, keeping the input's
/// scale: `1e3` is `1000`, `2.50e-3` is `0.00250`, `-0.0` is `0.0`.
///
/// `numeric_in` (PostgreSQL 15, `set_var_from_str` and `make_result`) refuses, with "value
/// overflows numeric format":
/// - an exponent of [`NUMERIC_MAX_EXPONENT`] or more in absolute value, whatever the digits
///   (`0e9223372036854775807`), and one beyond `long` (`1e99999999999999999999`);
/// - a scale (digits after the point once the exponent is applied) above [`NUMERIC_MAX_SCALE`];
/// - a non-zero value with more than [`NUMERIC_MAX_INTEGER_DIGITS`] digits before the point
///   (zero never is: `0e131073` is `0`).
///
/// All arithmetic is on `i64` values bounded first, so no token overflows it.
fn numeric_text_len(token: &str) -> Option<usize> {
    let (negative, unsigned) = match token.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, token),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        // Beyond i64 is beyond `long`, which PostgreSQL's `strtol` clamps and then refuses.
        Some(at) => (&unsigned[..at], unsigned[at + 1..].parse::<i64>().ok()?),
        None => (unsigned, 0),
    };
    if exponent.unsigned_abs() >= NUMERIC_MAX_EXPONENT.unsigned_abs() {
        return None;
    }
    let (integer, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    // Lengths are below isize::MAX and the exponent below 2^30: nothing here overflows i64.
    let (integer_len, fraction_len) = (integer.len() as i64, fraction.len() as i64);
    let scale = (fraction_len - exponent).max(0);
    if scale > NUMERIC_MAX_SCALE {
        return None;
    }
    let fraction_text = if scale > 0 { scale + 1 } else { 0 };
    let leading_zeros = integer
        .bytes()
        .chain(fraction.bytes())
        .position(|b| b != b'0');
    let Some(leading_zeros) = leading_zeros else {
        // Zero: printed unsigned, as `0` and its scale.
        return usize::try_from(1 + fraction_text).ok();
    };
    // Digits of the value before the point, leading zeros aside.
    let integer_digits = integer_len + exponent - leading_zeros as i64;
    if integer_digits > NUMERIC_MAX_INTEGER_DIGITS {
        return None;
    }
    usize::try_from(i64::from(negative) + integer_digits.max(1) + fraction_text).ok()
}

fn has_nul(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ValidationErrorKind as K;

    fn payload_kind(limits: &Limits, payload: &str) -> Option<K> {
        limits.check_payload(payload).err().map(|e| e.kind())
    }

    #[test]
    fn payload_limit_counts_the_text_postgres_returns_not_the_input() {
        let limits = Limits {
            max_payload_bytes: 8,
            ..Limits::default()
        };
        // `{"a": 1}` (8 bytes) as PostgreSQL prints it, whatever the input's spacing.
        assert_eq!(payload_kind(&limits, r#"{ "a" : 1 }"#), None);
        assert_eq!(
            payload_kind(&limits, r#"{"a":12}"#),
            Some(K::PayloadTooLarge)
        );
    }

    #[test]
    fn payload_must_be_json_and_storable() {
        let limits = Limits::default();
        assert_eq!(payload_kind(&limits, "{"), Some(K::PayloadNotJson));
        assert_eq!(payload_kind(&limits, ""), Some(K::PayloadNotJson));
        assert_eq!(
            payload_kind(&limits, r#"{"a":"x\u0000"}"#),
            Some(K::PayloadHasNul)
        );
        // An escaped backslash followed by "u0000" is an ordinary string.
        assert_eq!(payload_kind(&limits, r#"{"a":"\\u0000"}"#), None);
        assert_eq!(payload_kind(&limits, "[1, null, true]"), None);
    }

    #[test]
    fn payload_limit_counts_what_postgres_prints() {
        let limits = Limits {
            max_payload_bytes: 40,
            ..Limits::default()
        };
        // Three bytes of JSON that PostgreSQL prints as 301 digits.
        assert_eq!(payload_kind(&limits, "1e300"), Some(K::PayloadTooLarge));
        assert_eq!(payload_kind(&limits, "[1e3, 2.5e-3]"), None);
        // Separators cost a byte each: 31 bytes of compact JSON, 45 as PostgreSQL prints it.
        let many = format!("[{}]", vec!["1"; 15].join(","));
        assert_eq!(payload_kind(&limits, &many), Some(K::PayloadTooLarge));
        // serde refuses what overflows f64; numeric refuses scales past 16383 digits.
        assert_eq!(payload_kind(&limits, "1e200000"), Some(K::PayloadNotJson));
        assert_eq!(
            payload_kind(&limits, "1e-20000"),
            Some(K::PayloadNumberOutOfRange)
        );
    }

    #[test]
    fn numeric_text_length_is_what_postgres_prints() {
        // Each pair as PostgreSQL 15 prints `token::jsonb`.
        for (token, printed) in [
            ("1e3", "1000"),
            ("2.5e-3", "0.0025"),
            ("-12.50", "-12.50"),
            ("1e-2", "0.01"),
            ("0", "0"),
            ("-0", "0"),
            ("-0.0", "0.0"),
            ("-0.000e2", "0.0"),
            ("0.10e1", "1.0"),
            ("0.001", "0.001"),
            ("-0.001", "-0.001"),
            ("1E+2", "100"),
            ("1e00000000000000000000000001", "10"),
            ("0e1073741822", "0"),
        ] {
            assert_eq!(numeric_text_len(token), Some(printed.len()), "{token}");
        }
        let long = |digits: usize, suffix: &str| format!("1{}{suffix}", "0".repeat(digits));
        assert_eq!(numeric_text_len(&long(131_071, "")), Some(131_072));
        assert_eq!(numeric_text_len("1e131071"), Some(131_072));
        assert_eq!(numeric_text_len("0.0001e131075"), Some(131_072));
        assert_eq!(numeric_text_len("1e-16383"), Some(16_385));
        assert_eq!(numeric_text_len("0e131073"), Some(1));
    }

    #[test]
    fn numbers_numeric_refuses_are_out_of_range_and_never_overflow() {
        // Each refused by PostgreSQL 15 with "value overflows numeric format".
        for token in [
            "0e9223372036854775807",
            "-0e9223372036854775807",
            "0e-9223372036854775808",
            "1e9223372036854775807",
            "1e-9223372036854775808",
            "1e99999999999999999999",
            "0e1073741823",
            "0.00e1073741823",
            "1e131072",
            "10e131071",
            "0.0001e131076",
            "1e-16384",
            "0e-16384",
            "0.5e-16383",
            "-0.0e-16383",
        ] {
            assert_eq!(numeric_text_len(token), None, "{token}");
        }
        let limits = Limits::default();
        for payload in [
            "0e9223372036854775807",
            r#"{"n":0e9223372036854775807}"#,
            "[1E-9223372036854775808]",
            "[0e1073741823]",
        ] {
            assert_eq!(
                payload_kind(&limits, payload),
                Some(K::PayloadNumberOutOfRange),
                "{payload}"
            );
        }
        // Zero takes any exponent below the bound, and prints as `0`.
        assert_eq!(payload_kind(&limits, "[0e1073741822]"), None);
    }

    #[test]
    fn nul_anywhere_in_a_string_or_key_is_refused() {
        let limits = Limits::default();
        for payload in [
            r#""\u0000""#,
            r#"{"\u0000":1}"#,
            r#"[[["a\u0000b"]]]"#,
            r#"{"k":{"\\":"\u0000"}}"#,
        ] {
            assert_eq!(
                payload_kind(&limits, payload),
                Some(K::PayloadHasNul),
                "{payload}"
            );
        }
    }

    #[test]
    fn aggregate_ids_are_bounded_but_otherwise_free() {
        let limits = Limits {
            max_aggregate_id_bytes: 4,
            ..Limits::default()
        };
        let kind = |id| limits.check_aggregate_id(id).err().map(|e| e.kind());
        assert_eq!(kind(""), Some(K::EmptyAggregateId));
        assert_eq!(kind("abcde"), Some(K::AggregateIdTooLong));
        assert_eq!(kind("a\0"), Some(K::AggregateIdHasNul));
        assert_eq!(kind("a.*>"), None);
    }

    #[test]
    fn aggregate_types_are_plain_tokens() {
        let limits = Limits::default();
        assert!(limits.check_aggregate_type("order_line-2").is_ok());
        for bad in ["", "order.line", "order*", "or der", &"x".repeat(65)] {
            assert!(limits.check_aggregate_type(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reserved_and_malformed_headers_are_refused() {
        let limits = Limits::default();
        let big = |n| {
            [
                ("a".to_owned(), "x".repeat(n)),
                ("b".to_owned(), "y".repeat(n)),
            ]
        };
        assert!(limits
            .check_headers(big(1000).iter().map(|(k, v)| (k, v)))
            .is_ok());
        assert!(limits
            .check_headers(big(2100).iter().map(|(k, v)| (k, v)))
            .is_err());
        assert!(limits.check_header("traceparent", "00-abc-01").is_ok());
        assert!(limits.check_header("Ce-Id", "x").is_err());
        assert!(limits.check_header("Nats-Msg-Id", "x").is_err());
        assert!(limits.check_header("bad name", "x").is_err());
        assert!(limits.check_header("x-a", "line\nbreak").is_err());
    }

    #[test]
    fn zero_limits_are_refused() {
        let limits = Limits {
            max_payload_bytes: 0,
            ..Limits::default()
        };
        assert_eq!(
            limits.validate(),
            Err(LimitsError::Zero("max_payload_bytes"))
        );
    }
}
