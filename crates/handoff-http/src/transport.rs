//! [`HttpTransport`]: the relay's [`Transport`] onto one HTTP endpoint.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use handoff_core::contract;
use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind, Receipt, Transport};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Response, StatusCode};
use serde_json::value::RawValue;
use tokio::sync::Semaphore;

use crate::config::shown;
use crate::receipt::Recorder;
use crate::{signature, ConfigError, HttpConfig, HttpMode};

/// The header carrying the event id, the endpoint's deduplication key.
pub const IDEMPOTENCY_KEY: &str = contract::header::IDEMPOTENCY_KEY;
/// The media type of a structured-mode body.
pub const CLOUDEVENTS_JSON: &str = "application/cloudevents+json";
/// The longest `Retry-After` honoured; a longer one is cut to this (one hour).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);
/// How much of an error response's body goes into the error message, in bytes.
const EXCERPT_BYTES: usize = 200;

/// Headers the transport sets itself, which a caller header may not duplicate.
const RESERVED: [&str; 4] = [
    IDEMPOTENCY_KEY,
    signature::WEBHOOK_ID,
    signature::WEBHOOK_TIMESTAMP,
    signature::WEBHOOK_SIGNATURE,
];

/// Why [`HttpTransport::new`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The [`HttpConfig`] is unusable.
    #[error("invalid http configuration: {0}")]
    InvalidConfig(#[from] ConfigError),
    /// The HTTP client could not be built (no TLS roots could be loaded, for instance).
    #[error("while building the http client: {0}")]
    Client(#[source] reqwest::Error),
}

/// POSTs each outbox event to one HTTP endpoint and finishes only on a 2xx answer.
///
/// Every request carries `Idempotency-Key: <event id>`: a retry of the same event (after a
/// timeout, a reset connection, a relay crash) carries the same key, so an endpoint that
/// remembers keys applies each event once (design F1, C2). The layout follows
/// [`HttpConfig::mode`]; with a [`signing secret`](HttpConfig::signing_secret) every request is
/// signed the Standard Webhooks way (see [`signature`](crate::signature)).
///
/// How answers count (see [`PublishErrorKind`]):
///
/// | answer | result |
/// |---|---|
/// | 2xx | published; the receipt records the answer: a [`RecordedResponse`](crate::RecordedResponse) (status, a few headers, the body's first 4 KiB, its length and SHA-256) as one line of JSON |
/// | 429, 503 | `Transient` with its `Retry-After`: the event's aggregate waits at least that long; charged only while other events get through (one tenant refused), otherwise the destination pauses (everyone refused) |
/// | 408, 409, other 5xx | `Transient`: retried with backoff; charged only while other events get through, otherwise the destination pauses |
/// | 401, 403, 407, 404, 410 | `Misconfigured`: credentials refused or no such endpoint, whatever the event: the relay pauses the destination, charges nothing, and resumes once a probe gets through |
/// | 3xx | `Unavailable`: redirects are not followed, the endpoint is misconfigured |
/// | other 4xx | `Rejected`: the event is quarantined |
/// | connection refused, DNS or TLS failure, no request slot free within half the timeout | `Unavailable` (not charged to the event; nothing sent) |
/// | timeout, reset after sending | `Timeout`: ambiguous, retried with the same key |
///
/// # Examples
///
/// ```no_run
/// use handoff_core::delivery::Transport;
/// use handoff_http::{HttpConfig, HttpTransport};
///
/// # use handoff_core::delivery::OutboxEvent;
/// # async fn example(event: OutboxEvent) -> Result<(), Box<dyn std::error::Error>> {
/// let config = HttpConfig { endpoint: "http://127.0.0.1:8080/events".into(), ..HttpConfig::default() };
/// let transport = HttpTransport::new(config)?;
/// let receipt = transport.publish(&event).await?;
/// println!("{receipt:?}");
/// # Ok(())
/// # }
/// ```
///
/// Its `Debug` shows the endpoint without credentials or query, and the configuration's own
/// redacted `Debug`.
pub struct HttpTransport {
    client: reqwest::Client,
    url: reqwest::Url,
    /// The endpoint without credentials or query, for messages.
    shown: String,
    /// One permit per request in flight: [`HttpConfig::concurrency`].
    permits: Arc<Semaphore>,
    config: HttpConfig,
}

// Hand-written: the parsed URL's own `Debug` prints its password and query.
impl std::fmt::Debug for HttpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpTransport")
            .field("endpoint", &self.shown)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A structured-mode body. A struct rather than `json!`, which would re-encode the payload:
/// `data` must be the payload's text byte for byte.
#[derive(serde::Serialize)]
struct Envelope<'a> {
    specversion: &'static str,
    id: String,
    #[serde(rename = "type")]
    event_type: &'a str,
    source: &'a str,
    time: String,
    datacontenttype: &'static str,
    handoffaggregatetype: &'a str,
    handoffaggregateid: std::borrow::Cow<'a, str>,
    handoffsequence: String,
    handoffschemaversion: String,
    data: &'a RawValue,
}

/// One request, ready to send.
struct Prepared {
    headers: HeaderMap,
    body: Vec<u8>,
}

impl HttpTransport {
    /// Validates `config` and builds the client. Nothing is sent: an endpoint that is down is
    /// found by the first publish (as [`PublishErrorKind::Unavailable`]) or by
    /// [`wait_until_ready`](Transport::wait_until_ready).
    ///
    /// # Errors
    ///
    /// [`BuildError::InvalidConfig`] for an unusable configuration; [`BuildError::Client`] when
    /// the HTTP client cannot be built.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_http::{BuildError, HttpConfig, HttpTransport};
    ///
    /// let error = HttpTransport::new(HttpConfig::default()).unwrap_err();
    /// assert!(matches!(error, BuildError::InvalidConfig(_)));
    /// ```
    pub fn new(config: HttpConfig) -> Result<HttpTransport, BuildError> {
        config.validate()?;
        let url = config.endpoint_url()?;
        let client = reqwest::Client::builder()
            // Total time, from connecting to the end of the response body.
            .timeout(config.request_timeout)
            .connect_timeout(config.request_timeout)
            // A redirected POST may be replayed as a GET or lose its body; the endpoint must
            // be configured with its final URL (a 3xx is reported as Unavailable).
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(config.concurrency)
            .user_agent(concat!("handoff/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(BuildError::Client)?;
        Ok(HttpTransport {
            client,
            shown: shown(&url),
            url,
            permits: Arc::new(Semaphore::new(config.concurrency)),
            config,
        })
    }

    /// The configuration the transport was built with.
    ///
    /// # Examples
    ///
    /// ```
    /// # use handoff_http::{HttpConfig, HttpTransport};
    /// let config = HttpConfig { endpoint: "http://127.0.0.1:9/".into(), ..HttpConfig::default() };
    /// let transport = HttpTransport::new(config).unwrap();
    /// assert_eq!(transport.config().concurrency, 64);
    /// ```
    pub fn config(&self) -> &HttpConfig {
        &self.config
    }

    /// The endpoint as `scheme://host:port/path`, without user information or query (which may
    /// hold credentials): what logs and errors show.
    ///
    /// # Examples
    ///
    /// ```
    /// # use handoff_http::{HttpConfig, HttpTransport};
    /// let config = HttpConfig {
    ///     endpoint: "https://user:pw@hooks.example.com/in?token=x".into(),
    ///     ..HttpConfig::default()
    /// };
    /// let transport = HttpTransport::new(config).unwrap();
    /// assert_eq!(transport.endpoint(), "https://hooks.example.com:443/in");
    /// ```
    pub fn endpoint(&self) -> &str {
        &self.shown
    }

    /// The headers and body of `event`'s request, without the signature.
    fn prepare(&self, event: &OutboxEvent) -> Result<Prepared, PublishError> {
        for (name, _) in &event.headers {
            if RESERVED.iter().any(|own| own.eq_ignore_ascii_case(name)) {
                return Err(rejected(format!(
                    "caller header {name:?} clashes with a header the http transport sets"
                )));
            }
        }
        // Checks the caller's headers in both modes (names, values, clashes).
        let contract = contract::headers(event, &self.config.ce_source)?;
        let (pairs, body) = match self.config.mode {
            HttpMode::Binary => (contract, event.payload.clone().into_bytes()),
            HttpMode::Structured => {
                // The contract lists the caller's headers last: only they travel as headers,
                // the attributes are in the body.
                let callers = contract.len() - event.headers.len();
                let mut pairs = vec![("Content-Type".to_owned(), CLOUDEVENTS_JSON.to_owned())];
                pairs.extend(contract.into_iter().skip(callers));
                (pairs, self.envelope(event)?)
            }
        };
        let mut headers = HeaderMap::with_capacity(pairs.len() + 4);
        for (name, value) in pairs {
            headers.append(header_name(&name)?, header_value(&name, &value)?);
        }
        let event_id = event.event_id.hyphenated().to_string();
        headers.insert(
            HeaderName::from_static("idempotency-key"),
            header_value(IDEMPOTENCY_KEY, &event_id)?,
        );
        Ok(Prepared { headers, body })
    }

    /// The structured-mode body: a CloudEvents JSON object whose `data` is the payload, byte
    /// for byte, and whose `handoff*` extension attributes carry the `Handoff-*` header values.
    fn envelope(&self, event: &OutboxEvent) -> Result<Vec<u8>, PublishError> {
        let data: &RawValue = serde_json::from_str(&event.payload)
            .map_err(|e| rejected(format!("the payload is not JSON: {e}")))?;
        let envelope = Envelope {
            specversion: "1.0",
            id: event.event_id.hyphenated().to_string(),
            event_type: &event.event_type,
            source: &self.config.ce_source,
            time: contract::format_time(event.occurred_at),
            datacontenttype: "application/json",
            handoffaggregatetype: &event.aggregate_type,
            handoffaggregateid: handoff_core::subject::encode_token(&event.aggregate_id),
            handoffsequence: event.aggregate_sequence.to_string(),
            handoffschemaversion: event.schema_version.to_string(),
            data,
        };
        serde_json::to_vec(&envelope).map_err(|e| rejected(format!("while encoding: {e}")))
    }

    async fn send(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        let Prepared { mut headers, body } = self.prepare(event)?;
        let timeout = self.config.request_timeout;
        // One deadline for the whole publish, the wait for a request slot included, so the
        // relay's lease margin (a multiple of the timeout) covers it.
        let deadline = tokio::time::Instant::now() + timeout;
        // Waiting for a slot until less than half the timeout is left means the endpoint is
        // saturated or not answering: that is the destination's state, not the event's, and a
        // request sent with so little time left would likely end as an ambiguous timeout.
        // Nothing is sent.
        let saturated = || {
            PublishError::new(
                PublishErrorKind::Unavailable,
                format!(
                    "all {} request slots to {} stayed busy for most of {timeout:?}",
                    self.config.concurrency, self.shown
                ),
            )
        };
        let _permit = tokio::time::timeout_at(deadline - timeout / 2, self.permits.acquire())
            .await
            .map_err(|_| saturated())?
            .map_err(|_| PublishError::new(PublishErrorKind::Unavailable, "transport closed"))?;
        if let Some(secret) = &self.config.signing_secret {
            // Signed at sending, so every retry carries a fresh timestamp under the same id.
            let id = event.event_id.hyphenated().to_string();
            let now = unix_now();
            let signed = signature::sign(secret, &id, now, &body);
            headers.insert(
                HeaderName::from_static(signature::WEBHOOK_ID),
                header_value(signature::WEBHOOK_ID, &id)?,
            );
            headers.insert(
                HeaderName::from_static(signature::WEBHOOK_TIMESTAMP),
                HeaderValue::from(now),
            );
            headers.insert(
                HeaderName::from_static(signature::WEBHOOK_SIGNATURE),
                header_value(signature::WEBHOOK_SIGNATURE, &signed)?,
            );
        }
        let response = self
            .client
            .post(self.url.clone())
            .headers(headers)
            .body(body)
            .timeout(deadline.saturating_duration_since(tokio::time::Instant::now()))
            .send()
            .await
            .map_err(|e| self.request_error(e))?;
        self.answer(response).await
    }

    /// Sorts a 2xx into a receipt and anything else into a [`PublishError`].
    async fn answer(&self, mut response: Response) -> Result<Receipt, PublishError> {
        let status = response.status();
        if status.is_success() {
            let mut recorder = Recorder::new(status.as_u16(), response.headers());
            while let Some(chunk) = response.chunk().await.map_err(|e| {
                // The endpoint answered 2xx, so it took the event; only the body was lost.
                // Retrying with the same key is safe and records a complete receipt.
                PublishError::new(
                    PublishErrorKind::Timeout,
                    format!(
                        "{} answered {status} but its body failed: {}",
                        self.shown,
                        chain(&e.without_url())
                    ),
                )
            })? {
                recorder.update(&chunk);
            }
            return Ok(Receipt::new(recorder.finish().to_receipt()));
        }
        let retry_after = match status {
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                retry_after(response.headers(), SystemTime::now())
            }
            _ => None,
        };
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(|v| excerpt(v.as_bytes()));
        let body = read_excerpt(&mut response).await;
        let kind = classify(status);
        let message = match (kind, location) {
            (PublishErrorKind::Unavailable, Some(location)) => format!(
                "{} answered {status} to {location:?}; redirects are not followed, configure \
                 the final url",
                self.shown
            ),
            _ if body.is_empty() => format!("{} answered {status}", self.shown),
            _ => format!("{} answered {status}: {body}", self.shown),
        };
        let error = PublishError::new(kind, message);
        Err(match retry_after {
            Some(wait) => error.with_retry_after(wait),
            None => error,
        })
    }

    fn request_error(&self, error: reqwest::Error) -> PublishError {
        let error = error.without_url();
        let (kind, what) = if error.is_connect() {
            (PublishErrorKind::Unavailable, "cannot connect to")
        } else if error.is_timeout() {
            (PublishErrorKind::Timeout, "no answer in time from")
        } else if error.is_builder() {
            (PublishErrorKind::Rejected, "cannot build a request to")
        } else {
            // Sent, at least in part, then the connection failed: the endpoint may have acted.
            (
                PublishErrorKind::Timeout,
                "connection failed after sending to",
            )
        };
        PublishError::new(kind, format!("{what} {}: {}", self.shown, chain(&error)))
    }
}

impl Transport for HttpTransport {
    /// POSTs `event` and waits for the answer, at most [`HttpConfig::request_timeout`] in all
    /// (the wait for a free request slot included). See [`HttpTransport`] for how answers
    /// count.
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        self.send(event).await
    }

    /// Returns `true` as soon as a TCP connection to the endpoint's host and port opens, within
    /// `at_most`. It does not prove the endpoint answers 2xx.
    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        let Some(host) = self.url.host_str() else {
            return false;
        };
        // `[::1]` is written with brackets in the URL, not in a socket address.
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let Some(port) = self.url.port_or_known_default() else {
            return false;
        };
        let deadline = tokio::time::Instant::now() + at_most;
        let mut pause = Duration::from_millis(50);
        loop {
            match tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect((host, port)))
                .await
            {
                Ok(Ok(_)) => return true,
                Ok(Err(_)) => {}
                Err(_) => return false,
            }
            if tokio::time::Instant::now() + pause >= deadline {
                return false;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}

/// How a non-2xx status counts. 5xx, 429, 408 and 409 may be the event's (an endpoint that
/// refuses one tenant) or the endpoint's (down, or throttling everyone); the relay tells them
/// apart by what other events meet. 401, 403 and 407 (credentials), 404 and 410 (no such
/// endpoint) are the relay's setup, never the event's.
fn classify(status: StatusCode) -> PublishErrorKind {
    match status.as_u16() {
        401 | 403 | 407 | 404 | 410 => PublishErrorKind::Misconfigured,
        408 | 409 | 429 | 500..=599 => PublishErrorKind::Transient,
        300..=399 => PublishErrorKind::Unavailable,
        400..=499 => PublishErrorKind::Rejected,
        _ => PublishErrorKind::Transient,
    }
}

/// `Retry-After` as delay-seconds or an HTTP date, from `now`; cut to [`MAX_RETRY_AFTER`].
fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    let wait = if value.bytes().all(|b| b.is_ascii_digit()) && !value.is_empty() {
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        let at = httpdate::parse_http_date(value).ok()?;
        at.duration_since(now).unwrap_or(Duration::ZERO)
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

/// At most [`EXCERPT_BYTES`] of the body, on one line; empty when it cannot be read.
async fn read_excerpt(response: &mut Response) -> String {
    let mut bytes = Vec::new();
    while bytes.len() < EXCERPT_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => bytes.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
    excerpt(&bytes)
}

fn excerpt(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(EXCERPT_BYTES)];
    let text: String = String::from_utf8_lossy(cut)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let text = text.trim().to_owned();
    if bytes.len() > EXCERPT_BYTES {
        format!("{text}...")
    } else {
        text
    }
}

/// The error and its causes, `: `-separated (hyper's "connection refused" sits two levels down).
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn rejected(message: String) -> PublishError {
    PublishError::new(PublishErrorKind::Rejected, message)
}

fn header_name(name: &str) -> Result<HeaderName, PublishError> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| rejected(format!("header name {name:?} is not a valid header name")))
}

fn header_value(name: &str, value: &str) -> Result<HeaderValue, PublishError> {
    HeaderValue::from_str(value).map_err(|_| {
        rejected(format!(
            "the value of header {name:?} is not a valid header value"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_sort_into_kinds() {
        use PublishErrorKind::*;
        for (status, kind) in [
            (408, Transient),
            (409, Transient),
            (429, Transient),
            (500, Transient),
            (502, Transient),
            (503, Transient),
            (599, Transient),
            (301, Unavailable),
            (308, Unavailable),
            (400, Rejected),
            (401, Misconfigured),
            (403, Misconfigured),
            (404, Misconfigured),
            (410, Misconfigured),
            (413, Rejected),
            (422, Rejected),
        ] {
            assert_eq!(
                classify(StatusCode::from_u16(status).unwrap()),
                kind,
                "{status}"
            );
        }
    }

    #[test]
    fn retry_after_takes_seconds_or_a_date() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers, now), None);
        headers.insert(RETRY_AFTER, HeaderValue::from_static("7"));
        assert_eq!(retry_after(&headers, now), Some(Duration::from_secs(7)));
        let date = httpdate::fmt_http_date(now + Duration::from_secs(90));
        headers.insert(RETRY_AFTER, HeaderValue::from_str(&date).unwrap());
        assert_eq!(retry_after(&headers, now), Some(Duration::from_secs(90)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(90));
        headers.insert(RETRY_AFTER, HeaderValue::from_str(&past).unwrap());
        assert_eq!(retry_after(&headers, now), Some(Duration::ZERO));
        headers.insert(
            RETRY_AFTER,
            HeaderValue::from_static("99999999999999999999"),
        );
        assert_eq!(retry_after(&headers, now), Some(MAX_RETRY_AFTER));
        headers.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&headers, now), None);
    }

    #[test]
    fn debug_of_the_transport_shows_no_credentials() {
        let transport = HttpTransport::new(HttpConfig {
            endpoint: "https://bot:pa55word@hooks.example.com/in?token=t0k3n".into(),
            ..HttpConfig::default()
        })
        .unwrap();
        let shown = format!("{transport:?}");
        assert!(
            !shown.contains("pa55word") && !shown.contains("t0k3n"),
            "{shown}"
        );
        assert!(
            shown.contains("https://hooks.example.com:443/in"),
            "{shown}"
        );
    }

    #[test]
    fn excerpts_are_short_single_lines() {
        assert_eq!(excerpt(b"bad\r\nrequest"), "bad  request");
        let long = excerpt(&[b'x'; 500]);
        assert_eq!(long.len(), EXCERPT_BYTES + 3);
    }
}
