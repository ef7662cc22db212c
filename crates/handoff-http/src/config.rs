//! Where the HTTP transport sends events, in which shape, and how long it waits.

use std::fmt;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

/// How an event is laid out in the request (CloudEvents HTTP binding). In config files it is
/// spelled `"binary"` or `"structured"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HttpMode {
    /// CloudEvents binary mode: the body is the payload's JSON text, byte for byte, and the
    /// event's attributes travel as headers (`ce-*`, `Handoff-*`, the caller's headers).
    #[default]
    Binary,
    /// CloudEvents structured mode: the body is one JSON object
    /// (`Content-Type: application/cloudevents+json`) holding the attributes and the payload as
    /// `data`; the `Handoff-*` values are extension attributes.
    Structured,
}

impl HttpMode {
    /// The mode's name as the command line spells it: `binary` or `structured`.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(handoff_http::HttpMode::Structured.as_str(), "structured");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            HttpMode::Binary => "binary",
            HttpMode::Structured => "structured",
        }
    }
}

impl std::str::FromStr for HttpMode {
    type Err = ConfigError;

    /// Parses `binary` or `structured` (ASCII case ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("binary") {
            Ok(HttpMode::Binary)
        } else if s.eq_ignore_ascii_case("structured") {
            Ok(HttpMode::Structured)
        } else {
            Err(ConfigError::InvalidMode(s.to_owned()))
        }
    }
}

/// A Standard Webhooks signing secret: `whsec_` followed by the base64 of 24 to 64 random
/// bytes (the prefix may be left out). The decoded bytes are the HMAC-SHA256 key.
///
/// Its `Debug` prints `SigningSecret(<redacted>)`, and nothing in this crate logs it or puts it
/// in an error.
///
/// # Examples
///
/// ```
/// use handoff_http::SigningSecret;
///
/// let secret = SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
/// assert_eq!(format!("{secret:?}"), "SigningSecret(<redacted>)");
/// assert!(SigningSecret::parse("not base64!").is_err());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct SigningSecret {
    key: Vec<u8>,
}

impl SigningSecret {
    /// The prefix Standard Webhooks puts in front of a serialised secret.
    pub const PREFIX: &'static str = "whsec_";

    /// Parses `whsec_<base64>` (or the bare base64).
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSecret`] when the text is not standard base64 or its key is not
    /// 24 to 64 bytes long. The error never holds the secret.
    pub fn parse(text: &str) -> Result<SigningSecret, ConfigError> {
        let encoded = text
            .trim()
            .strip_prefix(Self::PREFIX)
            .unwrap_or(text.trim());
        let key = STANDARD.decode(encoded).map_err(|_| {
            ConfigError::InvalidSecret("the secret is not whsec_ followed by standard base64")
        })?;
        if !(24..=64).contains(&key.len()) {
            return Err(ConfigError::InvalidSecret(
                "the secret's key must be 24 to 64 bytes (Standard Webhooks)",
            ));
        }
        Ok(SigningSecret { key })
    }

    /// The HMAC key: the decoded bytes.
    pub(crate) fn key(&self) -> &[u8] {
        &self.key
    }
}

impl fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningSecret(<redacted>)")
    }
}

/// Where and how [`HttpTransport`](crate::HttpTransport) sends events.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use handoff_http::{HttpConfig, HttpMode};
///
/// let config = HttpConfig {
///     endpoint: "https://hooks.example.com/orders".into(),
///     mode: HttpMode::Structured,
///     request_timeout: Duration::from_secs(5),
///     ..HttpConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// ```
///
/// Its `Debug` shows the endpoint without secrets (password, query values; see
/// [`handoff_core::redact::url`]) and the signing secret as `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// The URL every event is POSTed to: `http://` or `https://`, with a host. Redirects are
    /// not followed, so it must be the final URL. Default: empty (must be set).
    pub endpoint: String,
    /// The request's layout. Default: [`HttpMode::Binary`].
    pub mode: HttpMode,
    /// How long one publish may take, from waiting for a request slot to the end of the
    /// response body, before it fails with
    /// [`PublishErrorKind::Timeout`](handoff_core::delivery::PublishErrorKind) (ambiguous:
    /// retried with the same `Idempotency-Key`), or with `Unavailable` when no request slot
    /// freed up within half of it (nothing is sent then). The relay's lease margin must exceed it. Default: 5 seconds.
    pub request_timeout: Duration,
    /// Most requests in flight at once, across all aggregates (the relay already sends at most
    /// one per aggregate). Default: 64.
    pub concurrency: usize,
    /// The CloudEvents `source` attribute of every event. Non-empty, without CR, LF or NUL.
    /// Default: `"handoff"`.
    pub ce_source: String,
    /// When set, every request carries a Standard Webhooks signature
    /// (`webhook-id`, `webhook-timestamp`, `webhook-signature`). Default: none.
    pub signing_secret: Option<SigningSecret>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            endpoint: String::new(),
            mode: HttpMode::Binary,
            request_timeout: Duration::from_secs(5),
            concurrency: 64,
            ce_source: "handoff".to_owned(),
            signing_secret: None,
        }
    }
}

// Hand-written so that a `{:?}` never prints credentials or a token in the endpoint.
impl fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpConfig")
            .field("endpoint", &handoff_core::redact::url(&self.endpoint))
            .field("mode", &self.mode)
            .field("request_timeout", &self.request_timeout)
            .field("concurrency", &self.concurrency)
            .field("ce_source", &self.ce_source)
            .field("signing_secret", &self.signing_secret)
            .finish()
    }
}

/// Why an [`HttpConfig`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The endpoint is not an absolute `http(s)://` URL with a host. User information in it is
    /// left out of the message.
    #[error("invalid endpoint: {reason}")]
    InvalidEndpoint {
        /// What is wrong with it.
        reason: String,
    },
    /// The mode is neither `binary` nor `structured`.
    #[error("invalid http mode {0:?}: expected binary or structured")]
    InvalidMode(String),
    /// A duration that must be positive is zero.
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
    /// The concurrency limit is zero.
    #[error("concurrency must be at least 1")]
    ZeroConcurrency,
    /// The CloudEvents source cannot be sent as a header value.
    #[error("invalid ce_source {value:?}: {reason}")]
    InvalidSource {
        /// The source as configured.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The signing secret is malformed (the secret itself is never shown).
    #[error("invalid signing secret: {0}")]
    InvalidSecret(&'static str),
}

impl HttpConfig {
    /// Checks every field against the rules in its documentation.
    ///
    /// # Errors
    ///
    /// The first [`ConfigError`] found.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_http::{ConfigError, HttpConfig};
    ///
    /// let config = HttpConfig { endpoint: "ftp://example.com".into(), ..HttpConfig::default() };
    /// assert!(matches!(config.validate(), Err(ConfigError::InvalidEndpoint { .. })));
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.endpoint_url()?;
        if self.request_timeout.is_zero() {
            return Err(ConfigError::ZeroDuration("request_timeout"));
        }
        if self.concurrency == 0 {
            return Err(ConfigError::ZeroConcurrency);
        }
        handoff_core::contract::check_ce_source(&self.ce_source).map_err(|reason| {
            ConfigError::InvalidSource {
                value: self.ce_source.clone(),
                reason,
            }
        })?;
        Ok(())
    }

    /// The endpoint, parsed and checked.
    pub(crate) fn endpoint_url(&self) -> Result<reqwest::Url, ConfigError> {
        let invalid = |reason: &str| ConfigError::InvalidEndpoint {
            reason: reason.to_owned(),
        };
        if self.endpoint.is_empty() {
            return Err(invalid("the endpoint is not set"));
        }
        let url = reqwest::Url::parse(&self.endpoint)
            // The parser's message never quotes the input, so credentials cannot leak through it.
            .map_err(|e| invalid(&format!("not an absolute url ({e})")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(invalid("the scheme must be http or https"));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid("the url has no host"));
        }
        Ok(url)
    }
}

/// `scheme://host:port/path` of `url`, without user information or query, for logs and errors.
pub(crate) fn shown(url: &reqwest::Url) -> String {
    let host = url.host_str().unwrap_or("");
    match url.port_or_known_default() {
        Some(port) => format!("{}://{host}:{port}{}", url.scheme(), url.path()),
        None => format!("{}://{host}{}", url.scheme(), url.path()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_endpoint(endpoint: &str) -> HttpConfig {
        HttpConfig {
            endpoint: endpoint.to_owned(),
            ..HttpConfig::default()
        }
    }

    #[test]
    fn endpoints_are_absolute_http_urls() {
        for good in [
            "http://127.0.0.1:8080/hook",
            "https://example.com",
            "http://[::1]:9/x?y=1",
        ] {
            assert_eq!(with_endpoint(good).validate(), Ok(()), "{good:?}");
        }
        for bad in [
            "",
            "example.com/x",
            "ftp://example.com",
            "http://",
            "/relative",
        ] {
            assert!(
                matches!(
                    with_endpoint(bad).validate(),
                    Err(ConfigError::InvalidEndpoint { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_default_needs_an_endpoint() {
        assert_eq!(
            HttpConfig::default().validate().unwrap_err().to_string(),
            "invalid endpoint: the endpoint is not set"
        );
    }

    #[test]
    fn zero_timeout_and_concurrency_are_refused() {
        let config = HttpConfig {
            request_timeout: Duration::ZERO,
            ..with_endpoint("http://h")
        };
        assert_eq!(
            config.validate(),
            Err(ConfigError::ZeroDuration("request_timeout"))
        );
        let config = HttpConfig {
            concurrency: 0,
            ..with_endpoint("http://h")
        };
        assert_eq!(config.validate(), Err(ConfigError::ZeroConcurrency));
    }

    #[test]
    fn source_must_be_a_header_value() {
        for bad in ["", "a\nb", "a\rb"] {
            let config = HttpConfig {
                ce_source: bad.to_owned(),
                ..with_endpoint("http://h")
            };
            assert!(matches!(
                config.validate(),
                Err(ConfigError::InvalidSource { .. })
            ));
        }
    }

    #[test]
    fn modes_parse_by_name() {
        assert_eq!("binary".parse::<HttpMode>(), Ok(HttpMode::Binary));
        assert_eq!("Structured".parse::<HttpMode>(), Ok(HttpMode::Structured));
        assert!("json".parse::<HttpMode>().is_err());
    }

    #[test]
    fn secrets_never_show_and_must_be_base64_keys() {
        let text = format!("whsec_{}", STANDARD.encode([7u8; 32]));
        let secret = SigningSecret::parse(&text).unwrap();
        assert_eq!(secret.key(), &[7u8; 32]);
        assert!(!format!("{secret:?}").contains(&text[6..]));
        let config = HttpConfig {
            signing_secret: Some(secret),
            ..with_endpoint("http://h")
        };
        assert!(!format!("{config:?}").contains(&text[6..]));
        // Too short, and not base64: the errors never echo the input.
        let short = format!("whsec_{}", STANDARD.encode([1u8; 8]));
        let error = SigningSecret::parse(&short).unwrap_err().to_string();
        assert!(!error.contains(&short[6..]), "{error}");
        assert!(SigningSecret::parse("whsec_***").is_err());
    }

    #[test]
    fn debug_shows_no_secret_of_the_endpoint_or_the_signing_key() {
        let secret = format!("whsec_{}", STANDARD.encode([9u8; 32]));
        let config = HttpConfig {
            signing_secret: Some(SigningSecret::parse(&secret).unwrap()),
            ..with_endpoint("https://bot:pa55word@hooks.example.com/in?token=t0k3n#frag")
        };
        let shown = format!("{config:?}");
        for hidden in ["pa55word", "t0k3n", &secret[6..], "frag"] {
            assert!(!shown.contains(hidden), "{hidden:?} in {shown}");
        }
        assert!(
            shown.contains("https://bot:***@hooks.example.com/in?token=***"),
            "{shown}"
        );
        assert!(!format!("{config:#?}").contains("pa55word"));
    }

    #[test]
    fn shown_urls_drop_credentials() {
        let url = reqwest::Url::parse("https://user:pw@example.com/h?token=x").unwrap();
        assert_eq!(shown(&url), "https://example.com:443/h");
    }
}
