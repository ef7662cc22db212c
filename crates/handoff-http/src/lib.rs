//! `handoff-http`: the HTTP endpoint (webhook) transport of the handoff relay (design F1).
//!
//! This is the only handoff crate with an HTTP client. [`HttpTransport`] implements
//! [`handoff_core::delivery::Transport`]: `handoff-relay` hands it committed outbox events and it
//! POSTs each one to the configured endpoint, finished only by a 2xx answer, which is recorded
//! in the event's delivery receipt ([`RecordedResponse`]: status, a few headers, the start of
//! the body and the whole body's digest).
//!
//! - [`HttpConfig`]: the endpoint, the CloudEvents mode ([`HttpMode`]), the request timeout, the
//!   concurrency limit and the optional [`SigningSecret`];
//! - [`HttpTransport::new`]: validate and build;
//! - [`signature`]: Standard Webhooks signing and verification.
//!
//! Delivery is at least once: the event id travels as `Idempotency-Key`, and every retry of an
//! event (after a timeout, a reset connection or a relay crash) carries the same key. An
//! endpoint that applies each key once gives exactly-once effect; `examples/webhook-receiver`
//! is a reference receiver that does.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_core::delivery::Transport;
//! use handoff_http::{HttpConfig, HttpTransport};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let config = HttpConfig { endpoint: "http://127.0.0.1:8080/".into(), ..HttpConfig::default() };
//! let transport = HttpTransport::new(config)?;
//! assert!(transport.wait_until_ready(std::time::Duration::from_secs(1)).await);
//! # Ok(())
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod config;
mod receipt;
pub mod signature;
mod transport;

pub use config::{ConfigError, HttpConfig, HttpMode, SigningSecret};
pub use receipt::{RecordedResponse, RECORDED_BODY_BYTES, RECORDED_HEADERS};
pub use transport::{
    BuildError, HttpTransport, CLOUDEVENTS_JSON, IDEMPOTENCY_KEY, MAX_RETRY_AFTER,
};
