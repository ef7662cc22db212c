//! What the JetStream transport publishes to, and how long it waits.

use std::time::Duration;

use crate::ConnectSecurity;

/// The most replicas JetStream keeps of a stream.
pub const MAX_REPLICAS: usize = 5;

/// Where and how [`JetStreamTransport`](crate::JetStreamTransport) publishes.
///
/// The stream is created with file storage and [`replicas`](Self::replicas) replicas when it does
/// not exist (see
/// [`JetStreamTransport::ensure_stream`](crate::JetStreamTransport::ensure_stream)); an existing
/// stream is left as it is, with a warning when it is weaker than configured.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use handoff_nats::JetStreamConfig;
///
/// let config = JetStreamConfig {
///     stream: "ORDERS_OUTBOX".into(),
///     subject_prefix: "orders.outbox".into(),
///     publish_timeout: Duration::from_secs(2),
///     ..JetStreamConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JetStreamConfig {
    /// The stream's name. 1 to 255 bytes, none of them whitespace, a control character, `.`,
    /// `*`, `>`, `/` or `\`. Default: `"OUTBOX"`.
    pub stream: String,
    /// The first tokens of every subject: events go to
    /// `<subject_prefix>.<aggregate_type>.<encoded aggregate_id>` and the stream captures
    /// `<subject_prefix>.>`. Dot-separated tokens, each non-empty printable ASCII without `*` or
    /// `>`. Default: `"outbox"`.
    pub subject_prefix: String,
    /// How long JetStream remembers a `Nats-Msg-Id` to drop a second publish of the same event,
    /// set on the stream when it is created. It must be longer than the relay's lease: an event
    /// whose lease expired after the broker stored it (but before the relay marked it) is
    /// published again by the next relay, and only this window keeps that republish out of the
    /// stream. Default: 2 minutes.
    pub duplicate_window: Duration,
    /// How long one publish waits for the broker's acknowledgement before it fails with
    /// [`PublishErrorKind::Timeout`](handoff_core::delivery::PublishErrorKind::Timeout).
    /// Default: 5 seconds.
    pub publish_timeout: Duration,
    /// The CloudEvents `ce-source` header of every event: which system produced it. Non-empty,
    /// without CR, LF or NUL ([`check_ce_source`](handoff_core::contract::check_ce_source)).
    /// Default: `"handoff"`.
    ///
    /// The other destinations' configs call this field `ce_source`; it keeps its older name
    /// here because the config is a public struct built with field syntax, where a rename (or
    /// a second, deprecated field holding the same fact) would break or confuse every caller.
    pub source: String,
    /// How often the client pings the server. The client drops a connection that left two
    /// pings in a row unanswered and reconnects, so a connection that went silent (a partition,
    /// a failover, a NAT that forgot it) is found within about three intervals; without pings
    /// nothing tells it, and publishes time out until then. The NATS client's own default is
    /// 60 s, which would leave a relay or consumer stalled for about three minutes. Default:
    /// 10 seconds.
    pub ping_interval: Duration,
    /// How many servers of a cluster keep the stream, for a stream this transport creates: 1
    /// (the default) survives no server loss; 3 on a 3-node cluster survives the loss of one
    /// server, its leader included, with nothing acknowledged lost. 1 to [`MAX_REPLICAS`], and
    /// no more than the cluster has servers (JetStream refuses the stream otherwise).
    pub replicas: usize,
    /// Credentials and TLS files for the connection; see [`ConnectSecurity`]. Default: none.
    pub security: ConnectSecurity,
}

impl Default for JetStreamConfig {
    fn default() -> Self {
        Self {
            stream: "OUTBOX".to_owned(),
            subject_prefix: "outbox".to_owned(),
            duplicate_window: Duration::from_secs(120),
            publish_timeout: Duration::from_secs(5),
            source: "handoff".to_owned(),
            ping_interval: Duration::from_secs(10),
            replicas: 1,
            security: ConnectSecurity::default(),
        }
    }
}

/// Why a [`JetStreamConfig`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The stream name breaks JetStream's naming rules.
    #[error("invalid stream name {name:?}: {reason}")]
    InvalidStreamName {
        /// The name as configured.
        name: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The subject prefix is not a list of literal subject tokens.
    #[error("invalid subject prefix {prefix:?}: {reason}")]
    InvalidSubjectPrefix {
        /// The prefix as configured.
        prefix: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The replica count is 0 or more than [`MAX_REPLICAS`].
    #[error("stream replicas must be 1 to {MAX_REPLICAS}, not {0}")]
    InvalidReplicas(usize),
    /// A duration that must be positive is zero.
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
    /// The CloudEvents source cannot be sent as a header value.
    #[error("invalid ce-source {value:?}: {reason}")]
    InvalidSource {
        /// The source as configured.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
}

impl JetStreamConfig {
    /// Checks every field against the rules in its documentation.
    ///
    /// # Errors
    ///
    /// The first [`ConfigError`] found, naming the field's value and the rule it breaks.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_nats::{ConfigError, JetStreamConfig};
    ///
    /// let config = JetStreamConfig { stream: "a b".into(), ..JetStreamConfig::default() };
    /// assert!(matches!(config.validate(), Err(ConfigError::InvalidStreamName { .. })));
    /// assert_eq!(
    ///     config.validate().unwrap_err().to_string(),
    ///     r#"invalid stream name "a b": a stream name cannot hold whitespace"#
    /// );
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_stream_name(&self.stream)?;
        check_subject_prefix(&self.subject_prefix)?;
        if self.duplicate_window.is_zero() {
            return Err(ConfigError::ZeroDuration("duplicate_window"));
        }
        if self.publish_timeout.is_zero() {
            return Err(ConfigError::ZeroDuration("publish_timeout"));
        }
        if self.ping_interval.is_zero() {
            return Err(ConfigError::ZeroDuration("ping_interval"));
        }
        if !(1..=MAX_REPLICAS).contains(&self.replicas) {
            return Err(ConfigError::InvalidReplicas(self.replicas));
        }
        handoff_core::contract::check_ce_source(&self.source).map_err(|reason| {
            ConfigError::InvalidSource {
                value: self.source.clone(),
                reason,
            }
        })?;
        Ok(())
    }
}

/// JetStream's rules for stream names, plus the path separators the server refuses because a
/// stream's name is also its directory in the store.
fn check_stream_name(name: &str) -> Result<(), ConfigError> {
    let invalid = |reason| ConfigError::InvalidStreamName {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("a stream name cannot be empty"));
    }
    if name.len() > 255 {
        return Err(invalid("a stream name is at most 255 bytes"));
    }
    for c in name.chars() {
        let reason = match c {
            c if c.is_whitespace() => "a stream name cannot hold whitespace",
            c if c.is_control() => "a stream name cannot hold control characters",
            '.' => "a stream name cannot hold '.' (it is a subject token of the JetStream API)",
            '*' | '>' => "a stream name cannot hold the wildcards '*' or '>'",
            '/' | '\\' => "a stream name cannot hold path separators '/' or '\\'",
            _ => continue,
        };
        return Err(invalid(reason));
    }
    Ok(())
}

fn check_subject_prefix(prefix: &str) -> Result<(), ConfigError> {
    let invalid = |reason| ConfigError::InvalidSubjectPrefix {
        prefix: prefix.to_owned(),
        reason,
    };
    if prefix.is_empty() {
        return Err(invalid("the subject prefix cannot be empty"));
    }
    for token in prefix.split('.') {
        if token.is_empty() {
            return Err(invalid(
                "a subject token cannot be empty (leading, trailing or double '.')",
            ));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                "a subject token is printable ASCII without whitespace",
            ));
        }
        if token.contains(['*', '>']) {
            return Err(invalid(
                "a subject prefix cannot hold the wildcards '*' or '>'",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_stream(stream: &str) -> JetStreamConfig {
        JetStreamConfig {
            stream: stream.to_owned(),
            ..JetStreamConfig::default()
        }
    }

    fn with_prefix(prefix: &str) -> JetStreamConfig {
        JetStreamConfig {
            subject_prefix: prefix.to_owned(),
            ..JetStreamConfig::default()
        }
    }

    #[test]
    fn default_is_valid() {
        assert_eq!(JetStreamConfig::default().validate(), Ok(()));
    }

    #[test]
    fn stream_names_follow_jetstream_rules() {
        for good in ["OUTBOX", "orders-outbox_2", "Ünïcode", &"a".repeat(255)] {
            assert_eq!(with_stream(good).validate(), Ok(()), "{good:?}");
        }
        for bad in [
            "",
            "a b",
            "a\tb",
            "a.b",
            "a*",
            "a>",
            "a/b",
            "a\\b",
            "a\u{7f}b",
            &"a".repeat(256),
        ] {
            assert!(
                matches!(
                    with_stream(bad).validate(),
                    Err(ConfigError::InvalidStreamName { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn stream_name_errors_quote_the_name() {
        let error = with_stream("a b").validate().unwrap_err();
        assert_eq!(
            error.to_string(),
            r#"invalid stream name "a b": a stream name cannot hold whitespace"#
        );
    }

    #[test]
    fn subject_prefixes_are_literal_tokens() {
        for good in ["outbox", "orders.outbox", "a-b_c.d$e", "X.Y.Z"] {
            assert_eq!(with_prefix(good).validate(), Ok(()), "{good:?}");
        }
        for bad in [
            "", ".", "a.", ".a", "a..b", "a b", "a.*", "a.>", "a*b", "é", "a\tb",
        ] {
            assert!(
                matches!(
                    with_prefix(bad).validate(),
                    Err(ConfigError::InvalidSubjectPrefix { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn durations_must_be_positive() {
        let config = JetStreamConfig {
            duplicate_window: Duration::ZERO,
            ..JetStreamConfig::default()
        };
        assert_eq!(
            config.validate(),
            Err(ConfigError::ZeroDuration("duplicate_window"))
        );
        let config = JetStreamConfig {
            publish_timeout: Duration::ZERO,
            ..JetStreamConfig::default()
        };
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "publish_timeout must be greater than zero"
        );
        let config = JetStreamConfig {
            ping_interval: Duration::ZERO,
            ..JetStreamConfig::default()
        };
        assert_eq!(
            config.validate(),
            Err(ConfigError::ZeroDuration("ping_interval"))
        );
    }

    #[test]
    fn replicas_are_one_to_five() {
        for replicas in [0, 6] {
            let config = JetStreamConfig {
                replicas,
                ..JetStreamConfig::default()
            };
            assert_eq!(
                config.validate(),
                Err(ConfigError::InvalidReplicas(replicas))
            );
        }
        let config = JetStreamConfig {
            replicas: 3,
            ..JetStreamConfig::default()
        };
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn source_must_be_a_header_value() {
        for bad in ["", "a\nb", "a\rb"] {
            let config = JetStreamConfig {
                source: bad.to_owned(),
                ..JetStreamConfig::default()
            };
            assert!(matches!(
                config.validate(),
                Err(ConfigError::InvalidSource { .. })
            ));
        }
    }
}
