//! Where the AMQP transport publishes, and how long it waits.

use std::path::PathBuf;
use std::time::Duration;

/// Where and how [`AmqpTransport`](crate::AmqpTransport) publishes.
///
/// The `Debug` output shows the URL without its password.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use handoff_amqp::AmqpConfig;
///
/// let config = AmqpConfig {
///     url: "amqp://relay:s3cret@rabbit.internal:5672/%2f".into(),
///     exchange: "orders".into(),
///     publish_timeout: Duration::from_secs(2),
///     ..AmqpConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct AmqpConfig {
    /// The broker: `amqp://[user[:password]@]host[:port][/vhost][?heartbeat=S]`, or `amqps://`
    /// for TLS. The vhost is percent-encoded (`%2f` is `/`, the default when the path is
    /// missing); user and password default to `guest`. Default:
    /// `"amqp://127.0.0.1:5672/%2f"`.
    pub url: String,
    /// The exchange every event is published to, with routing key
    /// `<aggregate_type>.<encoded aggregate_id>`. 1 to 255 bytes, no control characters; not
    /// the default (nameless) exchange. Default: `"outbox"`.
    pub exchange: String,
    /// Whether a missing exchange is declared (durable, of type `topic`) at connect time.
    /// When `false`, a missing exchange fails the connection: the operator declares it. An
    /// existing exchange is used as it is, whatever its type. Default: `true`.
    pub declare_exchange: bool,
    /// How long one publish waits for the broker's confirm before it fails with
    /// [`PublishErrorKind::Timeout`](handoff_core::delivery::PublishErrorKind::Timeout).
    /// Default: 5 seconds.
    pub publish_timeout: Duration,
    /// How long one connection attempt (TCP, TLS, AMQP handshake, channel and exchange
    /// setup) may take. Default: 5 seconds.
    pub connect_timeout: Duration,
    /// The AMQP heartbeat asked for when the URL sets none, in whole seconds. A connection
    /// that went silent (a partition, a NAT that forgot it) is found after about two missed
    /// heartbeats; the server then proposes its own value and the lower one wins. Default: 10
    /// seconds.
    pub heartbeat: Duration,
    /// The CloudEvents `ce-source` header of every event: which system produced it. Non-empty,
    /// without CR, LF or NUL. Default: `"handoff"`.
    pub ce_source: String,
    /// The name the connection shows in `rabbitmqctl list_connections` and the management UI.
    /// Default: `"handoff"`.
    pub connection_name: String,
    /// A CA certificate file (PEM, one or more certificates) trusted for an `amqps://` URL
    /// besides the public (webpki) roots: for a broker whose certificate a private CA signed.
    /// The broker's certificate must name the URL's host. Only with `amqps://`. Default: none.
    pub tls_ca: Option<PathBuf>,
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            url: "amqp://127.0.0.1:5672/%2f".to_owned(),
            exchange: "outbox".to_owned(),
            declare_exchange: true,
            publish_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_secs(10),
            ce_source: "handoff".to_owned(),
            connection_name: "handoff".to_owned(),
            tls_ca: None,
        }
    }
}

// Hand-written so that the URL's password never reaches a log line.
impl std::fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &crate::url::redact(&self.url))
            .field("exchange", &self.exchange)
            .field("declare_exchange", &self.declare_exchange)
            .field("publish_timeout", &self.publish_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("heartbeat", &self.heartbeat)
            .field("ce_source", &self.ce_source)
            .field("connection_name", &self.connection_name)
            .field("tls_ca", &self.tls_ca)
            .finish()
    }
}

/// Why an [`AmqpConfig`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The exchange name cannot be used.
    #[error("invalid exchange name {name:?}: {reason}")]
    InvalidExchange {
        /// The name as configured.
        name: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The intake's queue name or prefetch cannot be used.
    #[error("invalid queue {name:?}: {reason}")]
    InvalidQueue {
        /// The queue as configured.
        name: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// A duration that must be positive is zero.
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
    /// The heartbeat does not fit AMQP's 16-bit seconds.
    #[error("heartbeat must be at most 65535 seconds")]
    HeartbeatTooLong,
    /// The CloudEvents source cannot be sent as a header value.
    #[error("invalid ce-source {value:?}: {reason}")]
    InvalidSource {
        /// The source as configured.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
}

impl AmqpConfig {
    /// Checks every field but the URL (which [`AmqpTransport::connect`] parses) against the
    /// rules in its documentation.
    ///
    /// [`AmqpTransport::connect`]: crate::AmqpTransport::connect
    ///
    /// # Errors
    ///
    /// The first [`ConfigError`] found, naming the field's value and the rule it breaks.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_amqp::{AmqpConfig, ConfigError};
    ///
    /// let config = AmqpConfig { exchange: String::new(), ..AmqpConfig::default() };
    /// assert!(matches!(config.validate(), Err(ConfigError::InvalidExchange { .. })));
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_exchange(&self.exchange)?;
        if self.publish_timeout.is_zero() {
            return Err(ConfigError::ZeroDuration("publish_timeout"));
        }
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::ZeroDuration("connect_timeout"));
        }
        if self.heartbeat.as_secs() == 0 {
            return Err(ConfigError::ZeroDuration("heartbeat"));
        }
        if self.heartbeat.as_secs() > u64::from(u16::MAX) {
            return Err(ConfigError::HeartbeatTooLong);
        }
        handoff_core::contract::check_ce_source(&self.ce_source).map_err(|reason| {
            ConfigError::InvalidSource {
                value: self.ce_source.clone(),
                reason,
            }
        })?;
        Ok(())
    }
}

/// An exchange name: an AMQP short string (at most 255 bytes) the broker accepts. The nameless
/// default exchange routes by queue name, which would ignore the routing key's aggregate.
pub(crate) fn check_exchange(name: &str) -> Result<(), ConfigError> {
    let invalid = |reason| ConfigError::InvalidExchange {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid(
            "the default exchange routes by queue name, not by aggregate; name an exchange",
        ));
    }
    if name.len() > 255 {
        return Err(invalid("an exchange name is at most 255 bytes"));
    }
    if name.chars().any(char::is_control) {
        return Err(invalid("an exchange name cannot hold control characters"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        assert_eq!(AmqpConfig::default().validate(), Ok(()));
    }

    #[test]
    fn exchange_names_are_short_strings_without_controls() {
        for good in [
            "outbox",
            "amq.topic",
            "orders.events-v2:x",
            &"a".repeat(255),
        ] {
            assert_eq!(check_exchange(good), Ok(()), "{good:?}");
        }
        for bad in ["", "a\nb", "a\0", &"a".repeat(256)] {
            assert!(
                matches!(
                    check_exchange(bad),
                    Err(ConfigError::InvalidExchange { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn durations_must_be_positive_and_fit() {
        let zero_publish = AmqpConfig {
            publish_timeout: Duration::ZERO,
            ..AmqpConfig::default()
        };
        assert_eq!(
            zero_publish.validate().unwrap_err().to_string(),
            "publish_timeout must be greater than zero"
        );
        let sub_second = AmqpConfig {
            heartbeat: Duration::from_millis(500),
            ..AmqpConfig::default()
        };
        assert_eq!(
            sub_second.validate(),
            Err(ConfigError::ZeroDuration("heartbeat"))
        );
        let long = AmqpConfig {
            heartbeat: Duration::from_secs(70_000),
            ..AmqpConfig::default()
        };
        assert_eq!(long.validate(), Err(ConfigError::HeartbeatTooLong));
    }

    #[test]
    fn source_must_be_a_header_value() {
        for bad in ["", "a\nb", "a\rb"] {
            let config = AmqpConfig {
                ce_source: bad.to_owned(),
                ..AmqpConfig::default()
            };
            assert!(matches!(
                config.validate(),
                Err(ConfigError::InvalidSource { .. })
            ));
        }
    }

    #[test]
    fn debug_hides_the_password() {
        let config = AmqpConfig {
            url: "amqp://relay:hunter2@h:5672/%2f".into(),
            ..AmqpConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("relay"), "{shown}");
    }
}
