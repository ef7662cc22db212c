//! The reference HTTP receiver of handoff events (design F1, C2), as a library so tests can run it
//! in-process; the `webhook-receiver` binary is a thin command line around [`serve`].
//!
//! `POST` (any path but `/received`) applies the event's effect once per `Idempotency-Key`, in
//! sequence order per aggregate; `GET /received` lists the applied effects. It reads both
//! CloudEvents modes of `handoff-http` and checks Standard Webhooks signatures when given a
//! secret. With an ambiguous ratio it applies some first-time requests and then never answers
//! in time (or breaks the response off): the timeout-after-apply that makes a sender's retry
//! ambiguous. State is in memory: a restart forgets everything.
//!
//! Answers:
//! - 200 `{"applied": {...}}`: applied now, or a repeat of an applied key (same body, so the
//!   sender's receipt digest is the same);
//! - 400: no `Idempotency-Key`, or the request does not describe an event (permanent);
//! - 401: the signature is missing or wrong (permanent for the sender);
//! - 409: the aggregate's previous event has not been applied yet (retryable);
//! - 422: that sequence of the aggregate was already applied under another key (permanent).
//!
//! # Examples
//!
//! ```no_run
//! # async fn example() -> std::io::Result<()> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let options = webhook_receiver::Options { ambiguous_ratio: 0.3, ..Default::default() };
//! tokio::spawn(webhook_receiver::serve(listener, options, std::future::pending()));
//! # Ok(())
//! # }
//! ```

mod ledger;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use handoff_core::contract;
use handoff_http::{signature, SigningSecret};
use ledger::{Answer, Incoming, Ledger, Outcome};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use ledger::Applied;

/// How the receiver behaves.
#[derive(Debug, Clone)]
pub struct Options {
    /// Share (0.0 to 1.0) of first-time requests that are applied and then answered
    /// ambiguously: half held for [`ambiguous_hold`](Self::ambiguous_hold), half given a 200
    /// status line whose body breaks off. Default: 0.
    pub ambiguous_ratio: f64,
    /// How long a held request waits before answering (longer than the sender's timeout).
    /// Default: 30 seconds.
    pub ambiguous_hold: Duration,
    /// Seed of the generator picking the ambiguous requests. Default: 0.
    pub seed: u64,
    /// When set, requests without a valid Standard Webhooks signature get 401. Default: none.
    pub secret: Option<SigningSecret>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ambiguous_ratio: 0.0,
            ambiguous_hold: Duration::from_secs(30),
            seed: 0,
            secret: None,
        }
    }
}

/// The receiver's routes over fresh in-memory state.
pub fn router(options: Options) -> Router {
    let receiver = Arc::new(Receiver {
        ledger: Mutex::new(Ledger::default()),
        rng: Mutex::new(StdRng::seed_from_u64(options.seed)),
        secret: options.secret,
        ambiguous_ratio: options.ambiguous_ratio.clamp(0.0, 1.0),
        ambiguous_hold: options.ambiguous_hold,
    });
    Router::new()
        .route("/received", get(received))
        .fallback(deliver)
        .with_state(receiver)
}

/// Serves [`router`] on `listener` until `shutdown` completes.
///
/// # Errors
///
/// The listener failed.
///
/// # Cancel safety
///
/// Dropping the future stops serving; the state is lost.
pub async fn serve(
    listener: tokio::net::TcpListener,
    options: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(options))
        .with_graceful_shutdown(shutdown)
        .await
}

struct Receiver {
    /// std Mutex: never held across `.await`.
    ledger: Mutex<Ledger>,
    rng: Mutex<StdRng>,
    secret: Option<SigningSecret>,
    ambiguous_ratio: f64,
    ambiguous_hold: Duration,
}

async fn received(State(receiver): State<Arc<Receiver>>) -> Json<Vec<Applied>> {
    let ledger = receiver.ledger.lock().unwrap_or_else(|p| p.into_inner());
    Json(ledger.applied().to_vec())
}

async fn deliver(
    State(receiver): State<Arc<Receiver>>,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if method != Method::POST {
        return refuse(StatusCode::METHOD_NOT_ALLOWED, "POST events here".into());
    }
    let Some(key) = header(&headers, "idempotency-key").filter(|k| !k.is_empty()) else {
        return refuse(StatusCode::BAD_REQUEST, "no Idempotency-Key".into());
    };
    if let Some(secret) = &receiver.secret {
        if let Err(error) = check_signature(secret, &headers, &body) {
            return refuse(StatusCode::UNAUTHORIZED, error);
        }
    }
    let event = match read_event(&headers, &body) {
        Ok(event) => event,
        Err(error) => return refuse(StatusCode::BAD_REQUEST, error),
    };
    let outcome = receiver
        .ledger
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .offer(key, event);
    match outcome {
        Outcome::Applied(answer) => {
            let roll: f64 = receiver
                .rng
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .random();
            if roll < receiver.ambiguous_ratio {
                tracing::debug!(key, "applied; answering ambiguously");
                // Half hold the answer past the sender's timeout, half break the connection
                // after the status line: both leave the sender not knowing.
                if roll < receiver.ambiguous_ratio / 2.0 {
                    tokio::time::sleep(receiver.ambiguous_hold).await;
                    return respond(answer);
                }
                let broken = futures::stream::once(async {
                    Err::<Bytes, std::io::Error>(std::io::Error::other("injected reset"))
                });
                return (StatusCode::OK, Body::from_stream(broken)).into_response();
            }
            respond(answer)
        }
        Outcome::Repeat(answer) => respond(answer),
        Outcome::Refused(answer) => respond(answer),
    }
}

fn respond(answer: Answer) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [("content-type", "application/json")], answer.body).into_response()
}

fn refuse(status: StatusCode, error: String) -> Response {
    respond(Answer {
        status: status.as_u16(),
        body: serde_json::json!({ "error": error }).to_string(),
    })
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn check_signature(secret: &SigningSecret, headers: &HeaderMap, body: &[u8]) -> Result<(), String> {
    let get = |name| header(headers, name).ok_or_else(|| format!("no {name} header"));
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    signature::verify(
        secret,
        get(signature::WEBHOOK_ID)?,
        get(signature::WEBHOOK_TIMESTAMP)?,
        get(signature::WEBHOOK_SIGNATURE)?,
        body,
        now,
    )
    .map_err(|e| e.to_string())
}

/// The event a request describes, read by the message contract
/// ([`handoff_core::contract::read_event`]): from the headers in binary mode; in structured mode
/// (`application/cloudevents+json`) from the body's attributes, mapped back to the contract's
/// header names, with `data` as the payload.
fn read_event(headers: &HeaderMap, body: &[u8]) -> Result<Incoming, String> {
    let structured = header(headers, "content-type")
        .is_some_and(|t| t.starts_with(handoff_http::CLOUDEVENTS_JSON));
    let read = if structured {
        #[derive(serde::Deserialize)]
        struct Envelope<'a> {
            #[serde(borrow)]
            data: Option<&'a serde_json::value::RawValue>,
            #[serde(flatten)]
            attributes: std::collections::HashMap<String, serde_json::Value>,
        }
        let envelope: Envelope = serde_json::from_slice(body)
            .map_err(|e| format!("the body is not a JSON object: {e}"))?;
        let pairs = [
            ("id", contract::header::CE_ID),
            ("type", contract::header::CE_TYPE),
            ("source", contract::header::CE_SOURCE),
            ("handoffaggregatetype", contract::header::AGGREGATE_TYPE),
            ("handoffaggregateid", contract::header::AGGREGATE_ID),
            ("handoffsequence", contract::header::SEQUENCE),
            ("handoffschemaversion", contract::header::SCHEMA_VERSION),
        ];
        let headers = pairs
            .iter()
            .filter_map(|(attribute, name)| {
                let value = envelope.attributes.get(*attribute)?.as_str()?;
                Some(((*name).to_owned(), value.to_owned()))
            })
            .collect();
        let data = envelope.data.map_or("null", |d| d.get());
        contract::read_event(headers, data.as_bytes(), "structured request")
    } else {
        let headers = headers
            .iter()
            .filter_map(|(n, v)| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned())))
            .collect();
        contract::read_event(headers, body, "binary request")
    };
    let read = read.map_err(|malformed| malformed.reason)?;
    Ok(Incoming {
        event_id: read.event_id.to_string(),
        aggregate_type: read.aggregate_type,
        aggregate_id: read.aggregate_id,
        sequence: read.sequence,
    })
}
