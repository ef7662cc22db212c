//! Where the Redis transport appends, how long it remembers event ids, and how long it waits.

use std::time::Duration;

/// The stream key used when none is configured.
pub const DEFAULT_STREAM: &str = "handoff:outbox";

/// Where and how [`RedisTransport`](crate::RedisTransport) appends events.
///
/// The `Debug` output shows the URL without its password.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use handoff_redis::RedisConfig;
///
/// let config = RedisConfig {
///     url: "redis://:s3cret@redis.internal:6379/0".into(),
///     stream: "orders:outbox".into(),
///     dedup_window: Duration::from_secs(300),
///     ..RedisConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// The server: `redis://[[user]:password@]host[:port][/db]`. TLS (`rediss://`) and
    /// Redis Cluster are not supported in this version. Default: `"redis://127.0.0.1:6379"`.
    pub url: String,
    /// The stream key every event is appended to, in publish order. Non-empty, at most 1024
    /// bytes, no control characters. Default: [`DEFAULT_STREAM`] (`"handoff:outbox"`).
    pub stream: String,
    /// How long an event id is remembered after its append: a republish of the same event
    /// inside the window appends nothing (the transport's stand-in for JetStream's duplicate
    /// window; Redis has no deduplication of its own). Whole milliseconds, at least 1 ms.
    /// Default: 2 minutes, as JetStream's.
    pub dedup_window: Duration,
    /// The largest event accepted, in bytes: the payload plus every field name and value.
    /// A larger one fails with
    /// [`PublishErrorKind::Rejected`](handoff_core::delivery::PublishErrorKind::Rejected)
    /// without being sent. 1 byte to 512 MiB (Redis's own limit on one value). Default: 1 MiB.
    pub max_event_bytes: usize,
    /// How long one publish (or one read-back page) waits for the server's answer before it
    /// fails with
    /// [`PublishErrorKind::Timeout`](handoff_core::delivery::PublishErrorKind::Timeout).
    /// Default: 5 seconds.
    pub publish_timeout: Duration,
    /// How long one connection attempt (TCP, `AUTH`, `SELECT`) may take. Default: 5 seconds.
    pub connect_timeout: Duration,
    /// The CloudEvents `ce-source` field of every event: which system produced it. Non-empty,
    /// without CR, LF or NUL. Default: `"handoff"`.
    pub ce_source: String,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".to_owned(),
            stream: DEFAULT_STREAM.to_owned(),
            dedup_window: Duration::from_secs(120),
            max_event_bytes: 1024 * 1024,
            publish_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            ce_source: "handoff".to_owned(),
        }
    }
}

// Hand-written so that the URL's password never reaches a log line.
impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact(&self.url))
            .field("stream", &self.stream)
            .field("dedup_window", &self.dedup_window)
            .field("max_event_bytes", &self.max_event_bytes)
            .field("publish_timeout", &self.publish_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("ce_source", &self.ce_source)
            .finish()
    }
}

/// Why a [`RedisConfig`] or an [`IntakeConfig`](crate::IntakeConfig) is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key or name (stream, group, consumer) cannot be used.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        /// Which setting: `"stream"`, `"group"`, `"consumer"`.
        what: &'static str,
        /// The value as configured.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// A duration that must be positive is zero (or below a millisecond where milliseconds
    /// count).
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
    /// [`RedisConfig::max_event_bytes`] is out of range.
    #[error("max_event_bytes must be between 1 and 536870912, not {0}")]
    MaxEventBytes(usize),
    /// A count that must be positive is zero.
    #[error("{0} must be greater than zero")]
    ZeroCount(&'static str),
    /// The CloudEvents source cannot be sent as a field value.
    #[error("invalid ce-source {value:?}: {reason}")]
    InvalidSource {
        /// The source as configured.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
}

/// Redis's own limit on one value (`proto-max-bulk-len`'s default): 512 MiB.
const MAX_VALUE_BYTES: usize = 512 * 1024 * 1024;

impl RedisConfig {
    /// Checks every field but the URL (which [`RedisTransport::connect`] parses) against the
    /// rules in its documentation.
    ///
    /// [`RedisTransport::connect`]: crate::RedisTransport::connect
    ///
    /// # Errors
    ///
    /// The first [`ConfigError`] found, naming the field's value and the rule it breaks.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_redis::{ConfigError, RedisConfig};
    ///
    /// let config = RedisConfig { stream: String::new(), ..RedisConfig::default() };
    /// assert!(matches!(config.validate(), Err(ConfigError::InvalidName { .. })));
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_name("stream", &self.stream)?;
        if self.dedup_window.as_millis() == 0 {
            return Err(ConfigError::ZeroDuration("dedup_window"));
        }
        if self.max_event_bytes == 0 || self.max_event_bytes > MAX_VALUE_BYTES {
            return Err(ConfigError::MaxEventBytes(self.max_event_bytes));
        }
        check_positive("publish_timeout", self.publish_timeout)?;
        check_positive("connect_timeout", self.connect_timeout)?;
        handoff_core::contract::check_ce_source(&self.ce_source).map_err(|reason| {
            ConfigError::InvalidSource {
                value: self.ce_source.clone(),
                reason,
            }
        })?;
        Ok(())
    }
}

/// A stream key, group or consumer name: non-empty, at most 1024 bytes, no control characters
/// (Redis would take them, but they make keys unreadable in logs and `redis-cli`).
pub(crate) fn check_name(what: &'static str, value: &str) -> Result<(), ConfigError> {
    let invalid = |reason| ConfigError::InvalidName {
        what,
        value: value.to_owned(),
        reason,
    };
    if value.is_empty() {
        return Err(invalid("it cannot be empty"));
    }
    if value.len() > 1024 {
        return Err(invalid("it is at most 1024 bytes"));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid("it cannot hold control characters"));
    }
    Ok(())
}

pub(crate) fn check_positive(what: &'static str, value: Duration) -> Result<(), ConfigError> {
    if value.is_zero() {
        return Err(ConfigError::ZeroDuration(what));
    }
    Ok(())
}

/// `url` with its password replaced by `***`, for messages and logs; `"<invalid url>"` when it
/// cannot be parsed (a malformed URL cannot be stripped of its credentials reliably).
///
/// # Examples
///
/// ```
/// assert_eq!(
///     handoff_redis::redact_url("redis://app:hunter2@cache:6379/1"),
///     "redis://app:***@cache:6379/1"
/// );
/// assert_eq!(handoff_redis::redact_url("redis://cache"), "redis://cache");
/// ```
pub fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                // Only fails for URLs that cannot have a password, which this one has.
                let _ = parsed.set_password(Some("***"));
            }
            parsed.to_string()
        }
        Err(_) => "<invalid url>".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        assert_eq!(RedisConfig::default().validate(), Ok(()));
        assert_eq!(RedisConfig::default().stream, "handoff:outbox");
        assert_eq!(
            RedisConfig::default().dedup_window,
            Duration::from_secs(120)
        );
    }

    #[test]
    fn names_are_short_and_printable() {
        for good in ["handoff:outbox", "a", &"k".repeat(1024)] {
            assert_eq!(check_name("stream", good), Ok(()), "{good:?}");
        }
        for bad in ["", "a\nb", "a\0", &"k".repeat(1025)] {
            assert!(check_name("stream", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn limits_and_durations_are_checked() {
        let sub_ms = RedisConfig {
            dedup_window: Duration::from_micros(500),
            ..RedisConfig::default()
        };
        assert_eq!(
            sub_ms.validate(),
            Err(ConfigError::ZeroDuration("dedup_window"))
        );
        let zero = RedisConfig {
            max_event_bytes: 0,
            ..RedisConfig::default()
        };
        assert_eq!(zero.validate(), Err(ConfigError::MaxEventBytes(0)));
        let no_timeout = RedisConfig {
            publish_timeout: Duration::ZERO,
            ..RedisConfig::default()
        };
        assert_eq!(
            no_timeout.validate().unwrap_err().to_string(),
            "publish_timeout must be greater than zero"
        );
        let bad_source = RedisConfig {
            ce_source: "a\r\nb".into(),
            ..RedisConfig::default()
        };
        assert!(matches!(
            bad_source.validate(),
            Err(ConfigError::InvalidSource { .. })
        ));
    }

    #[test]
    fn debug_hides_the_password() {
        let config = RedisConfig {
            url: "redis://relay:hunter2@h:6379".into(),
            ..RedisConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("relay:***@h"), "{shown}");
        assert_eq!(redact("not a url"), "<invalid url>");
    }
}
