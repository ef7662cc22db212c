//! [`JetStreamTransport`]: the relay's [`Transport`] onto one JetStream stream.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::jetstream::context::{
    CreateStreamErrorKind, GetStreamErrorKind, PublishError as NatsPublishError,
    PublishErrorKind as NatsPublishErrorKind,
};
use async_nats::jetstream::stream::{Config as StreamConfig, Info as StreamInfo, StorageType};
use async_nats::jetstream::{self, ErrorCode};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use handoff_core::contract;
use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind, Receipt, Transport};
use handoff_core::subject::encode_token;

use crate::url::{self, Credentials};
use crate::{header, ConnectError, JetStreamConfig, StreamError};

/// The last subject token of the global lane: `<subject_prefix>.global`.
pub const GLOBAL_TOKEN: &str = "global";

/// The connection name the server shows in its monitoring endpoints.
const CLIENT_NAME: &str = "handoff";

/// Publishes outbox events to one JetStream stream and waits for each acknowledgement.
///
/// Each event goes to `<subject_prefix>.<aggregate_type>.<encode_token(aggregate_id)>` (an
/// event of the global lane, with a [`global_sequence`](OutboxEvent::global_sequence), to the
/// one subject `<subject_prefix>.global`, whose stream order is then the global order) with
/// `Nats-Msg-Id` set to its event id (so JetStream drops a republish inside the
/// [duplicate window](JetStreamConfig::duplicate_window)), CloudEvents binary-mode headers and
/// handoff's own headers; see [`headers`](Self::headers). The body is the payload's JSON text,
/// byte for byte.
///
/// After the first connection the client reconnects by itself, forever. Meanwhile publishes fail
/// with [`PublishErrorKind::Unavailable`] (at once when the client has noticed the
/// disconnection, else when the publish timeout runs out) and
/// [`wait_until_ready`](Transport::wait_until_ready) returns once the client is back.
///
/// # Examples
///
/// ```no_run
/// use handoff_core::delivery::Transport;
/// use handoff_nats::{JetStreamConfig, JetStreamTransport};
///
/// # use handoff_core::delivery::OutboxEvent;
/// # async fn example(event: OutboxEvent) -> Result<(), Box<dyn std::error::Error>> {
/// let transport =
///     JetStreamTransport::connect("nats://127.0.0.1:4222", JetStreamConfig::default()).await?;
/// transport.ensure_stream().await?;
/// transport.publish(&event).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct JetStreamTransport {
    client: async_nats::Client,
    /// Publishes; its timeout is the publish timeout, so its own ack wait never ends a publish
    /// before ours does.
    publisher: jetstream::Context,
    /// Stream management, with the client's (longer) request timeout.
    admin: jetstream::Context,
    config: JetStreamConfig,
    /// What the server last refused this client's publishes with, and when: a `Permissions
    /// Violation for Publish to "<subject>"` (or an authorization violation), which the server
    /// sends as an error of its own while the publish itself only goes unanswered.
    refusals: Arc<std::sync::Mutex<Option<(Instant, String)>>>,
}

/// The stream [`JetStreamTransport::ensure_stream`] found or created.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamSummary {
    /// The stream's name.
    pub name: String,
    /// The subjects it captures.
    pub subjects: Vec<String>,
    /// Its duplicate window (which may differ from the configured one for an existing stream).
    pub duplicate_window: Duration,
    /// Whether this call created it.
    pub created: bool,
    /// How many messages it held when looked at.
    pub messages: u64,
    /// How many servers keep it.
    pub replicas: usize,
}

impl StreamSummary {
    fn from_info(info: &StreamInfo, created: bool) -> Self {
        Self {
            name: info.config.name.clone(),
            subjects: info.config.subjects.clone(),
            duplicate_window: info.config.duplicate_window,
            created,
            messages: info.state.messages,
            replicas: info.config.num_replicas,
        }
    }
}

impl JetStreamTransport {
    /// Validates `config` and connects to the server(s) at `url`.
    ///
    /// `url` is `nats://host:port` (also `tls://`, `ws://`, `wss://`; scheme and port may be left
    /// out), or several such URLs separated by commas. Credentials may be given in it as
    /// `user:password@` or `token@` (percent-encoded); they are passed to the client as options
    /// and never appear in errors or logs. A creds file, an nkey seed and TLS files come from
    /// [`JetStreamConfig::security`] (see [`ConnectSecurity`](crate::ConnectSecurity)); they are
    /// read before the first dial.
    ///
    /// The first connection is tried once (each server at most 5 seconds), so a caller that
    /// waits for the broker retries with its own backoff and can say what it waits for. Once
    /// connected, the client reconnects by itself after every disconnection, with no limit on
    /// attempts.
    ///
    /// # Errors
    ///
    /// [`ConnectError`], whose [`kind`](ConnectError::kind) tells an invalid configuration, file
    /// or URL (permanent) from an unreachable server (retry) and refused credentials.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection attempt; nothing is left behind.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_nats::{ConnectErrorKind, JetStreamConfig, JetStreamTransport};
    ///
    /// # async fn example() {
    /// match JetStreamTransport::connect("nats://127.0.0.1:4222", JetStreamConfig::default()).await
    /// {
    ///     Ok(_transport) => {}
    ///     Err(e) if e.kind() == ConnectErrorKind::Unreachable => { /* retry later */ }
    ///     Err(e) => panic!("{e}"),
    /// }
    /// # }
    /// ```
    pub async fn connect(url: &str, config: JetStreamConfig) -> Result<Self, ConnectError> {
        config.validate()?;
        let urls = url::parse(url)?;
        // Files first: a missing seed or CA is a configuration error, named before any dial.
        let options = config.security.connect_options()?;
        let options = match urls.credentials {
            Some(Credentials::UserPassword { user, password }) => {
                options.user_and_password(user, password)
            }
            Some(Credentials::Token(token)) => options.token(token),
            None => options,
        };
        let refusals = Arc::new(std::sync::Mutex::new(None));
        let seen = Arc::clone(&refusals);
        let client = options
            .event_callback(move |event| {
                let seen = Arc::clone(&seen);
                async move { remember_refusal(&seen, &event) }
            })
            .name(CLIENT_NAME)
            // The default already, stated because the relay depends on it: a relay must outlive
            // any broker outage instead of ending up with a dead client.
            .max_reconnects(None::<usize>)
            // A silent connection is only found by unanswered pings.
            .ping_interval(config.ping_interval)
            .connect(urls.servers)
            .await
            .map_err(|source| connect_error(source, urls.shown))?;
        let publisher = jetstream::ContextBuilder::new()
            .timeout(config.publish_timeout)
            .build(client.clone());
        let admin = jetstream::new(client.clone());
        Ok(Self {
            client,
            publisher,
            admin,
            config,
            refusals,
        })
    }

    /// Makes sure the stream exists and captures `<subject_prefix>.>`.
    ///
    /// A missing stream is created with subjects `[<subject_prefix>.>]`, the configured
    /// duplicate window, file storage and the configured [replicas](JetStreamConfig::replicas).
    /// An existing stream is never changed: it
    /// must have a subject that captures every subject under the prefix, which is
    /// `<subject_prefix>.>` itself, `>`, or a pattern whose tokens are equal to or `*` for the
    /// leading prefix tokens followed by `>` (such as `*.>`). Several narrower subjects that
    /// cover the prefix only together are not recognised. Where the existing stream is weaker
    /// than configured (fewer replicas, memory storage, or a duplicate window other than the
    /// configured one), a warning naming both values is logged, once per call, and the stream
    /// is kept as it is, since it is the operator's stream.
    ///
    /// Safe to call from several relays at once: when another one creates the stream first, its
    /// stream is checked like any existing one.
    ///
    /// # Errors
    ///
    /// [`StreamError`]: the existing stream does not capture the prefix, another stream
    /// already captures these subjects, JetStream did not answer, or it refused the request.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the stream created; a later call finds it.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_nats::{JetStreamTransport, StreamError};
    /// # async fn example(transport: JetStreamTransport) -> Result<(), StreamError> {
    /// let stream = transport.ensure_stream().await?;
    /// println!("stream {} holds {} messages", stream.name, stream.messages);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn ensure_stream(&self) -> Result<StreamSummary, StreamError> {
        let name = &self.config.stream;
        match self.admin.get_stream(name).await {
            Ok(stream) => return self.check_existing(stream.cached_info()),
            Err(error) if is_stream_not_found(&error.kind()) => {}
            Err(source) => {
                return Err(StreamError::Info {
                    stream: name.clone(),
                    source,
                })
            }
        }
        let config = StreamConfig {
            name: name.clone(),
            subjects: vec![self.wanted_subjects()],
            duplicate_window: self.config.duplicate_window,
            storage: StorageType::File,
            num_replicas: self.config.replicas,
            description: Some("handoff outbox events".to_owned()),
            ..StreamConfig::default()
        };
        match self.admin.create_stream(config).await {
            Ok(stream) => {
                let subjects = self.wanted_subjects();
                tracing::info!(stream = %name, %subjects, replicas = self.config.replicas,
                    "created stream");
                Ok(StreamSummary::from_info(stream.cached_info(), true))
            }
            // Another relay created it between our lookup and our create (with a config that
            // differs from ours in some detail): check theirs.
            Err(error) if is_stream_name_taken(&error.kind()) => {
                let stream =
                    self.admin
                        .get_stream(name)
                        .await
                        .map_err(|source| StreamError::Info {
                            stream: name.clone(),
                            source,
                        })?;
                self.check_existing(stream.cached_info())
            }
            Err(source) => Err(StreamError::Create {
                stream: name.clone(),
                source,
            }),
        }
    }

    /// Checks a stream this call did not create; see [`ensure_stream`](Self::ensure_stream).
    fn check_existing(&self, info: &StreamInfo) -> Result<StreamSummary, StreamError> {
        let subjects = &info.config.subjects;
        if !subjects
            .iter()
            .any(|s| subject_covers_prefix(s, &self.config.subject_prefix))
        {
            return Err(StreamError::SubjectsNotCovered {
                stream: info.config.name.clone(),
                subjects: subjects.clone(),
                wanted: self.wanted_subjects(),
            });
        }
        if info.config.duplicate_window != self.config.duplicate_window {
            tracing::warn!(
                stream = %info.config.name,
                stream_window = ?info.config.duplicate_window,
                configured_window = ?self.config.duplicate_window,
                "the stream's duplicate window differs from the configured one; leaving the \
                 stream as it is (a republish after a lease expiry is only deduplicated inside \
                 the stream's window)"
            );
        }
        if info.config.num_replicas < self.config.replicas {
            tracing::warn!(
                stream = %info.config.name,
                stream_replicas = info.config.num_replicas,
                configured_replicas = self.config.replicas,
                "the stream has fewer replicas than configured; leaving the stream as it is \
                 (it does not survive the loss of as many servers; raise its replicas with \
                 `nats stream edit`)"
            );
        }
        if info.config.storage == StorageType::Memory {
            tracing::warn!(
                stream = %info.config.name,
                stream_storage = "memory",
                configured_storage = "file",
                "the stream keeps its messages in memory only; leaving the stream as it is \
                 (a server restart loses what it holds)"
            );
        }
        Ok(StreamSummary::from_info(info, false))
    }

    /// `<subject_prefix>.>`: what the stream must capture.
    fn wanted_subjects(&self) -> String {
        format!("{}.>", self.config.subject_prefix)
    }

    /// The subject `event` is published to:
    /// `<subject_prefix>.<aggregate_type>.<encode_token(aggregate_id)>`, or
    /// `<subject_prefix>.global` for an event of the global lane (global order mode: one
    /// subject, so a consumer of it reads the events in global sequence order).
    ///
    /// The aggregate id is percent-encoded by [`encode_token`], so any id becomes exactly one
    /// token and can be decoded back; consumers subscribe to `<prefix>.<aggregate_type>.*`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::OutboxEvent;
    /// # fn example(transport: &handoff_nats::JetStreamTransport, mut event: OutboxEvent) {
    /// event.aggregate_type = "order".into();
    /// event.aggregate_id = "eu.42".into();
    /// assert_eq!(transport.subject(&event), "outbox.order.eu%2E42");
    /// event.global_sequence = Some(7);
    /// assert_eq!(transport.subject(&event), "outbox.global");
    /// # }
    /// ```
    pub fn subject(&self, event: &OutboxEvent) -> String {
        subject_for(&self.config.subject_prefix, event)
    }

    /// The headers `event` is published with:
    ///
    /// - `Nats-Msg-Id`: the event id (hyphenated lowercase UUID), JetStream's dedup key;
    /// - CloudEvents binary mode: `ce-specversion: 1.0`, `ce-id` (the event id), `ce-type` (the
    ///   event type), `ce-source` ([`JetStreamConfig::source`]), `ce-time` (when the event was
    ///   enqueued, RFC 3339 in UTC with microseconds: `2026-12-02T19:16:34.123456Z`) and
    ///   `Content-Type: application/json`;
    /// - `Handoff-Aggregate-Type`; `Handoff-Aggregate-Id`, the aggregate id encoded by
    ///   [`encode_token`] exactly as in the subject (header-safe whatever the id holds, and
    ///   decoded back by [`handoff_core::subject::decode_token`]); `Handoff-Sequence` (the
    ///   aggregate sequence) and `Handoff-Schema-Version`, both in decimal;
    /// - every entry of [`OutboxEvent::headers`] (such as `traceparent`), as given.
    ///
    /// # Errors
    ///
    /// [`PublishErrorKind::Rejected`] when a header cannot be sent: a caller header whose name
    /// is not a valid header name or clashes with one of the headers above, or a value holding
    /// CR or LF. Events validated by `handoff-core` before enqueueing never fail here.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::{OutboxEvent, PublishError};
    /// # use handoff_nats::JetStreamTransport as T;
    /// # fn example(transport: &T, event: &OutboxEvent) -> Result<(), PublishError> {
    /// let headers = transport.headers(event)?;
    /// let id = event.event_id.to_string();
    /// assert_eq!(headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some(id.as_str()));
    /// # Ok(())
    /// # }
    /// ```
    pub fn headers(&self, event: &OutboxEvent) -> Result<HeaderMap, PublishError> {
        build_headers(&self.config.source, event)
    }

    /// The client, for tests and tools (subscribing, reading the stream, server info).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(transport: &handoff_nats::JetStreamTransport) {
    /// let max_payload = transport.client().server_info().max_payload;
    /// # let _ = max_payload;
    /// # }
    /// ```
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The configured stream's name.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(transport: &handoff_nats::JetStreamTransport) {
    /// assert_eq!(transport.stream_name(), "OUTBOX");
    /// # }
    /// ```
    pub fn stream_name(&self) -> &str {
        &self.config.stream
    }

    /// The configuration the transport was connected with.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(transport: &handoff_nats::JetStreamTransport) {
    /// println!("publishing under {}.>", transport.config().subject_prefix);
    /// # }
    /// ```
    pub fn config(&self) -> &JetStreamConfig {
        &self.config
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.client.connection_state() == State::Connected
    }

    /// The publishing context (its timeout is the publish timeout).
    pub(crate) fn publisher(&self) -> &jetstream::Context {
        &self.publisher
    }
}

impl Transport for JetStreamTransport {
    /// Publishes `event` and waits at most [`JetStreamConfig::publish_timeout`] for the ack. An
    /// ack that reports a duplicate (the stream already held this event id) is a success. The
    /// receipt names the stream and the message's sequence in it: `jetstream OUTBOX 42`, with
    /// ` duplicate` appended when the stream already held the event.
    ///
    /// While the client knows it is disconnected this fails at once with
    /// [`PublishErrorKind::Unavailable`] instead of queueing the event in the client. A publish
    /// sent just before the client noticed stays queued in it and goes out after the reconnect,
    /// which the stream's duplicate window absorbs when the relay republishes the event.
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        check_subject_token(&event.aggregate_type)?;
        let subject = self.subject(event);
        let headers = self.headers(event)?;
        if !self.is_connected() {
            return Err(PublishError::new(
                PublishErrorKind::Unavailable,
                "not connected to the nats server (the client is reconnecting)",
            ));
        }
        let payload = Bytes::from(event.payload.clone().into_bytes());
        let attempt = async {
            let ack = self
                .publisher
                .publish_with_headers(subject.clone(), headers, payload)
                .await?;
            ack.await
        };
        let timeout = self.config.publish_timeout;
        match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(ack)) => {
                if ack.duplicate {
                    tracing::debug!(event_id = %event.event_id, stream = %ack.stream,
                        "the stream already held the event; duplicate dropped");
                }
                if ack.stream != self.config.stream {
                    tracing::warn!(event_id = %event.event_id, stream = %ack.stream,
                        configured = %self.config.stream,
                        "the event was stored by another stream than the configured one");
                }
                let duplicate = if ack.duplicate { " duplicate" } else { "" };
                Ok(Receipt::new(format!(
                    "jetstream {} {}{duplicate}",
                    ack.stream, ack.sequence
                )))
            }
            Ok(Err(error)) => Err(self.refused_or(
                publish_error(error, &subject, self.is_connected()),
                &subject,
            )),
            Err(_elapsed) => {
                // The client's own ack wait has the same length, so this rarely fires; it bounds
                // the wait for an ack permit and for the client's command queue as well.
                let kind = if self.is_connected() {
                    PublishErrorKind::Timeout
                } else {
                    PublishErrorKind::Unavailable
                };
                Err(self.refused_or(
                    PublishError::new(kind, format!("no ack for {subject} within {timeout:?}")),
                    &subject,
                ))
            }
        }
    }

    /// Returns `true` once the client is connected, within `at_most`.
    ///
    /// A flush is queued behind the client's reconnection, so this waits for the reconnect
    /// itself instead of polling. It does not prove that JetStream answers: a publish then
    /// tells with [`PublishErrorKind::Unavailable`].
    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        match tokio::time::timeout(at_most, self.client.flush()).await {
            Ok(Ok(())) => self.is_connected(),
            // The client is closed (it never comes back) or the wait ran out.
            Ok(Err(_)) | Err(_) => false,
        }
    }
}

fn connect_error(source: async_nats::ConnectError, server: String) -> ConnectError {
    use async_nats::ConnectErrorKind as Kind;
    if is_tls_failure(&source) {
        return ConnectError::Tls { server, source };
    }
    match source.kind() {
        Kind::ServerParse => ConnectError::InvalidUrl {
            reason: source.to_string(),
        },
        Kind::Authentication | Kind::AuthorizationViolation => {
            ConnectError::Unauthorized { server, source }
        }
        Kind::Dns | Kind::TimedOut | Kind::Tls | Kind::Io | Kind::MaxReconnects => {
            ConnectError::Unreachable { server, source }
        }
    }
}

/// Whether a connect failed in TLS. async-nats reports a handshake that rustls refused (an
/// unknown CA, another host's certificate) as an I/O error, so its kind alone would make a
/// wrong CA look like a server that is down, retried forever; rustls's error inside tells.
fn is_tls_failure(error: &async_nats::ConnectError) -> bool {
    if error.kind() == async_nats::ConnectErrorKind::Tls {
        return true;
    }
    let mut next = std::error::Error::source(error);
    while let Some(cause) = next {
        if cause.is::<rustls::Error>() {
            return true;
        }
        // io::Error's source() skips the error it wraps: look at that one directly.
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
        }
        next = cause.source();
    }
    false
}

fn is_stream_not_found(kind: &GetStreamErrorKind) -> bool {
    match kind {
        GetStreamErrorKind::JetStream(api) => api.error_code() == ErrorCode::STREAM_NOT_FOUND,
        _ => false,
    }
}

/// "Stream name already in use with a different configuration": another relay's create won.
fn is_stream_name_taken(kind: &CreateStreamErrorKind) -> bool {
    match kind {
        CreateStreamErrorKind::JetStream(api) => api.error_code() == ErrorCode::STREAM_NAME_EXIST,
        _ => false,
    }
}

/// Whether the stream subject `pattern` captures every subject under `prefix`, that is
/// `<prefix>.>`: its tokens are equal to (or `*` for) the leading tokens of `prefix`, and its
/// last token is `>`, standing at most one token after the prefix.
pub(crate) fn subject_covers_prefix(pattern: &str, prefix: &str) -> bool {
    let mut prefix_tokens = prefix.split('.');
    for token in pattern.split('.') {
        if token == ">" {
            // `>` matches one or more tokens; everything from here on is covered provided the
            // pattern ends here (a valid subject has nothing after `>`).
            return true;
        }
        match prefix_tokens.next() {
            Some(wanted) if token == "*" || token == wanted => {}
            // The pattern is longer than the prefix (`<prefix>.*` captures one token only)
            // or differs from it.
            _ => return false,
        }
    }
    // No `>`: the pattern captures a fixed number of tokens, never all of `<prefix>.>`.
    false
}

fn subject_for(prefix: &str, event: &OutboxEvent) -> String {
    if event.global_sequence.is_some() {
        return format!("{prefix}.{GLOBAL_TOKEN}");
    }
    format!(
        "{prefix}.{}.{}",
        event.aggregate_type,
        encode_token(&event.aggregate_id)
    )
}

/// The aggregate type is a subject token as given (unlike the id, it is not encoded: consumers
/// subscribe by it), so it must be one literal token.
pub(crate) fn check_subject_token(aggregate_type: &str) -> Result<(), PublishError> {
    let ok = !aggregate_type.is_empty()
        && aggregate_type
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'.' && b != b'*' && b != b'>');
    if ok {
        Ok(())
    } else {
        Err(PublishError::new(
            PublishErrorKind::Rejected,
            format!("aggregate type {aggregate_type:?} is not a single subject token"),
        ))
    }
}

/// JetStream's dedup key, then the contract every destination sends
/// ([`handoff_core::contract::headers`]).
fn build_headers(source: &str, event: &OutboxEvent) -> Result<HeaderMap, PublishError> {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::NATS_MSG_ID,
        parse_value(
            header::NATS_MSG_ID,
            &event.event_id.hyphenated().to_string(),
        )?,
    );
    for (name, value) in contract::headers(event, source)? {
        // `HeaderMap::append` panics on an invalid name or value; parse first.
        let parsed = HeaderName::from_str(&name).map_err(|_| {
            PublishError::new(
                PublishErrorKind::Rejected,
                format!("header name {name:?} is not a valid header name"),
            )
        })?;
        headers.append(parsed, parse_value(&name, &value)?);
    }
    Ok(headers)
}

fn parse_value(name: &str, value: &str) -> Result<HeaderValue, PublishError> {
    HeaderValue::from_str(value).map_err(|_| {
        PublishError::new(
            PublishErrorKind::Rejected,
            format!("the value of header {name:?} holds CR or LF"),
        )
    })
}

/// A failed publish, with the subject it was for.
#[derive(Debug, thiserror::Error)]
#[error("publish to {subject} failed: {source}")]
struct PublishFailure {
    subject: String,
    #[source]
    source: NatsPublishError,
}

/// Keeps a server error that refuses this client's publishes: a permissions violation for a
/// publish (the relay's user may not write the stream's subjects), or an authorization
/// violation (its credentials were refused on a reconnect).
fn remember_refusal(seen: &std::sync::Mutex<Option<(Instant, String)>>, event: &async_nats::Event) {
    let message = match event {
        async_nats::Event::ServerError(async_nats::ServerError::AuthorizationViolation) => {
            "authorization violation".to_owned()
        }
        async_nats::Event::ServerError(async_nats::ServerError::Other(message))
            if message
                .to_ascii_lowercase()
                .contains("permissions violation for publish") =>
        {
            message.clone()
        }
        _ => return,
    };
    *seen.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), message));
}

impl JetStreamTransport {
    /// `error`, or [`PublishErrorKind::Misconfigured`] when it went unanswered because the
    /// server refused the relay's setup: a permissions violation for `subject`, or an
    /// authorization violation, within the last two publish timeouts. The server tells that
    /// apart from a slow stream only in an error of its own, not in the publish's answer.
    fn refused_or(&self, error: PublishError, subject: &str) -> PublishError {
        if !matches!(
            error.kind(),
            PublishErrorKind::Timeout | PublishErrorKind::Transient | PublishErrorKind::Unavailable
        ) {
            return error;
        }
        let refusal = self
            .refusals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some((at, message)) = refusal else {
            return error;
        };
        let recent = at.elapsed() <= 2 * self.config.publish_timeout;
        let ours =
            message.contains(&format!("\"{subject}\"")) || message == "authorization violation";
        if recent && ours {
            PublishError::new(
                PublishErrorKind::Misconfigured,
                format!("the nats server refused the relay's user: {message} ({error})"),
            )
        } else {
            error
        }
    }
}

pub(crate) fn publish_error(
    error: NatsPublishError,
    subject: &str,
    connected: bool,
) -> PublishError {
    let api_code = std::error::Error::source(&error)
        .and_then(|source| source.downcast_ref::<jetstream::Error>())
        .map(jetstream::Error::error_code);
    let mut kind = classify(&error.kind(), api_code);
    // Whatever the client reports, a publish that failed while disconnected failed because the
    // broker is away, not because of the event.
    if !connected
        && matches!(
            kind,
            PublishErrorKind::Timeout | PublishErrorKind::Transient
        )
    {
        kind = PublishErrorKind::Unavailable;
    }
    PublishError::with_source(
        kind,
        PublishFailure {
            subject: subject.to_owned(),
            source: error,
        },
    )
}

/// Sorts async-nats's publish errors (and, for JetStream API errors, their code) into the
/// relay's kinds.
pub(crate) fn classify(
    kind: &NatsPublishErrorKind,
    api_code: Option<ErrorCode>,
) -> PublishErrorKind {
    match kind {
        // The ack did not come in time: the stream may hold the event.
        NatsPublishErrorKind::TimedOut => PublishErrorKind::Timeout,
        // "No responders": no stream captures the subject, or JetStream (or the stream's
        // leader) is not there. Not the event's fault.
        NatsPublishErrorKind::StreamNotFound => PublishErrorKind::Unavailable,
        // The client dropped the request: its connection closed.
        NatsPublishErrorKind::BrokenPipe => PublishErrorKind::Unavailable,
        // Too many acks in flight in the client; only without backpressure, which we keep on.
        NatsPublishErrorKind::MaxAckPending => PublishErrorKind::Transient,
        // Larger than the server's max_payload: it will always be.
        NatsPublishErrorKind::MaxPayloadExceeded => PublishErrorKind::Rejected,
        // handoff sends no expected-last headers (and handoff-core reserves the `Nats-` prefix
        // for caller headers), so these would repeat on every attempt.
        NatsPublishErrorKind::WrongLastMessageId | NatsPublishErrorKind::WrongLastSequence => {
            PublishErrorKind::Rejected
        }
        NatsPublishErrorKind::Other => match api_code {
            Some(code) => classify_api_error(code),
            // Not a JetStream answer: a malformed ack, a closed command channel, an invalid
            // subject (checked before publishing). Worth retrying.
            None => PublishErrorKind::Transient,
        },
    }
}

fn classify_api_error(code: ErrorCode) -> PublishErrorKind {
    match code {
        // The stream's own size limits (max_msg_size, header size): this event never fits.
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM => {
            PublishErrorKind::Rejected
        }
        ErrorCode::JETSTREAM_NOT_ENABLED
        | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT
        | ErrorCode::CLUSTER_NOT_AVAILABLE
        | ErrorCode::STREAM_OFFLINE => PublishErrorKind::Unavailable,
        // Full stream with discard=new, storage or account limits, no leader, sealed stream:
        // about the stream, and may pass once an operator or retention frees room.
        _ => PublishErrorKind::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_core::contract::format_time;
    use std::time::SystemTime;

    fn event() -> OutboxEvent {
        OutboxEvent {
            event_id: "0192f3a4-7c1e-7d2a-8b3c-4d5e6f708192".parse().unwrap(),
            aggregate_type: "order".into(),
            aggregate_id: "eu.west 42".into(),
            aggregate_sequence: 7,
            global_sequence: None,
            event_type: "OrderPlaced".into(),
            schema_version: 3,
            payload: r#"{"total":10}"#.into(),
            headers: vec![
                ("traceparent".into(), "00-abc-def-01".into()),
                ("tracestate".into(), "k=v".into()),
            ],
            // 2026-12-02T19:16:34.123456789Z
            occurred_at: SystemTime::UNIX_EPOCH + Duration::new(1_796_238_994, 123_456_789),
            attempt_count: 0,
        }
    }

    fn get<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
        headers.get(name).map(HeaderValue::as_str)
    }

    #[test]
    fn a_global_event_goes_to_the_one_global_subject_with_its_number() {
        let mut global = event();
        global.global_sequence = Some(9);
        assert_eq!(subject_for("outbox", &global), "outbox.global");
        let headers = build_headers("handoff", &global).unwrap();
        assert_eq!(
            headers
                .get(header::GLOBAL_SEQUENCE)
                .map(|v| v.as_str().to_owned()),
            Some("9".to_owned())
        );
        assert_eq!(
            headers
                .get(header::NATS_MSG_ID)
                .map(|v| v.as_str().to_owned()),
            Some(global.event_id.hyphenated().to_string())
        );
        assert_ne!(subject_for("outbox", &event()), "outbox.global");
    }

    #[test]
    fn subject_encodes_the_aggregate_id_as_one_token() {
        assert_eq!(
            subject_for("outbox", &event()),
            "outbox.order.eu%2Ewest%2042"
        );
        assert_eq!(subject_for("a.b", &event()), "a.b.order.eu%2Ewest%2042");
    }

    #[test]
    fn headers_carry_the_contract() {
        let headers = build_headers("svc", &event()).unwrap();
        let id = "0192f3a4-7c1e-7d2a-8b3c-4d5e6f708192";
        assert_eq!(get(&headers, "Nats-Msg-Id"), Some(id));
        assert_eq!(get(&headers, "ce-specversion"), Some("1.0"));
        assert_eq!(get(&headers, "ce-id"), Some(id));
        assert_eq!(get(&headers, "ce-type"), Some("OrderPlaced"));
        assert_eq!(get(&headers, "ce-source"), Some("svc"));
        assert_eq!(
            get(&headers, "ce-time"),
            Some("2026-12-02T19:16:34.123456Z")
        );
        assert_eq!(get(&headers, "Content-Type"), Some("application/json"));
        assert_eq!(get(&headers, "Handoff-Aggregate-Type"), Some("order"));
        assert_eq!(
            get(&headers, "Handoff-Aggregate-Id"),
            Some("eu%2Ewest%2042")
        );
        assert_eq!(get(&headers, "Handoff-Sequence"), Some("7"));
        assert_eq!(get(&headers, "Handoff-Schema-Version"), Some("3"));
        assert_eq!(get(&headers, "traceparent"), Some("00-abc-def-01"));
        assert_eq!(get(&headers, "tracestate"), Some("k=v"));
        assert_eq!(headers.len(), 13);
    }

    #[test]
    fn ce_time_keeps_six_digits_even_on_a_whole_second() {
        assert_eq!(
            format_time(SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_238_994)),
            "2026-12-02T19:16:34.000000Z"
        );
    }

    #[test]
    fn unsendable_caller_headers_are_rejected_not_panicking() {
        for (name, value) in [
            ("x-a", "line\nbreak"),
            ("bad:name", "v"),
            ("content-type", "text/plain"),
            ("NATS-MSG-ID", "other"),
        ] {
            let mut event = event();
            event.headers = vec![(name.into(), value.into())];
            let error = build_headers("svc", &event).unwrap_err();
            assert_eq!(error.kind(), PublishErrorKind::Rejected, "{name:?}");
        }
    }

    #[test]
    fn aggregate_types_must_be_one_token() {
        assert!(check_subject_token("order_line-2").is_ok());
        for bad in ["", "a.b", "*", ">", "a b"] {
            assert_eq!(
                check_subject_token(bad).unwrap_err().kind(),
                PublishErrorKind::Rejected
            );
        }
    }

    #[test]
    fn stream_subjects_cover_the_prefix() {
        for (pattern, prefix) in [
            ("outbox.>", "outbox"),
            (">", "outbox"),
            ("*.>", "outbox"),
            ("a.b.>", "a.b"),
            ("a.*.>", "a.b"),
            ("a.>", "a.b"),
        ] {
            assert!(subject_covers_prefix(pattern, prefix), "{pattern} {prefix}");
        }
        for (pattern, prefix) in [
            ("outbox.*", "outbox"),
            ("outbox", "outbox"),
            ("outbox.order.>", "outbox"),
            ("other.>", "outbox"),
            ("outboxx.>", "outbox"),
            ("a.b.c.>", "a.b"),
            ("*.*", "a"),
        ] {
            assert!(
                !subject_covers_prefix(pattern, prefix),
                "{pattern} {prefix}"
            );
        }
    }

    #[test]
    fn client_error_kinds_map_explicitly() {
        use NatsPublishErrorKind as N;
        let cases = [
            (N::TimedOut, PublishErrorKind::Timeout),
            (N::StreamNotFound, PublishErrorKind::Unavailable),
            (N::BrokenPipe, PublishErrorKind::Unavailable),
            (N::MaxAckPending, PublishErrorKind::Transient),
            (N::MaxPayloadExceeded, PublishErrorKind::Rejected),
            (N::WrongLastMessageId, PublishErrorKind::Rejected),
            (N::WrongLastSequence, PublishErrorKind::Rejected),
            (N::Other, PublishErrorKind::Transient),
        ];
        for (nats, ours) in cases {
            assert_eq!(classify(&nats, None), ours, "{nats:?}");
        }
    }

    fn api_error(code: u64) -> NatsPublishError {
        let json = format!(r#"{{"code":400,"err_code":{code},"description":"test"}}"#);
        let api: jetstream::Error = serde_json::from_str(&json).unwrap();
        NatsPublishError::with_source(NatsPublishErrorKind::Other, api)
    }

    #[test]
    fn jetstream_api_errors_map_by_code() {
        let cases = [
            (10054, PublishErrorKind::Rejected), // message exceeds the stream's max_msg_size
            (10097, PublishErrorKind::Rejected), // headers exceed the maximum
            (10076, PublishErrorKind::Unavailable), // jetstream not enabled
            (10077, PublishErrorKind::Transient), // store failed (stream full, discard new)
            (10047, PublishErrorKind::Transient), // storage resources exceeded
            (10109, PublishErrorKind::Transient), // stream sealed
        ];
        for (code, ours) in cases {
            let error = publish_error(api_error(code), "s.t.x", true);
            assert_eq!(error.kind(), ours, "{code}");
            assert!(
                error.to_string().contains("publish to s.t.x failed"),
                "{error}"
            );
        }
    }

    #[test]
    fn failures_while_disconnected_are_unavailable() {
        let timed_out = NatsPublishError::new(NatsPublishErrorKind::TimedOut);
        assert_eq!(
            publish_error(timed_out, "s", false).kind(),
            PublishErrorKind::Unavailable
        );
        let too_big = NatsPublishError::new(NatsPublishErrorKind::MaxPayloadExceeded);
        assert_eq!(
            publish_error(too_big, "s", false).kind(),
            PublishErrorKind::Rejected
        );
    }
}
