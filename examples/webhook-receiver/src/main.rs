//! `webhook-receiver`: the reference HTTP receiver of handoff events (brief F1, C2).
//!
//! `POST` (any path but `/received`) applies the event's effect once per `Idempotency-Key`, in
//! sequence order per aggregate; `GET /received` lists the applied effects. It reads both
//! CloudEvents modes of `handoff-http` and checks Standard Webhooks signatures when
//! `HANDOFF_WEBHOOK_SECRET` is set. With `--ambiguous-ratio` it applies some first-time requests
//! and then never answers in time (or breaks the connection): the timeout-after-apply that makes
//! a sender's retry ambiguous. State is in memory: a restart forgets everything.
//!
//! Answers:
//! - 200 `{"applied": {...}}`: applied now, or a repeat of an applied key (same body, so the
//!   sender's receipt digest is the same);
//! - 400: no `Idempotency-Key`, or the request does not describe an event (permanent);
//! - 401: the signature is missing or wrong (permanent for the sender);
//! - 409: the aggregate's previous event has not been applied yet (retryable);
//! - 422: that sequence of the aggregate was already applied under another key (permanent).

mod ledger;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use clap::Parser;
use handoff_http::{signature, SigningSecret};
use ledger::{Answer, Incoming, Ledger, Outcome};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Parser)]
#[command(
    name = "webhook-receiver",
    version,
    about = "Reference receiver of handoff HTTP events: each Idempotency-Key applied once, in order"
)]
struct Args {
    /// Address to listen on; port 0 picks a free one. The bound address is printed on stdout
    /// as `listening on ADDR`.
    #[arg(long, default_value = "127.0.0.1:8095")]
    listen: SocketAddr,
    /// Share (0.0 to 1.0) of first-time requests that are applied and then not answered in time
    /// (held for --ambiguous-hold, or the connection broken).
    #[arg(long, value_name = "R", default_value_t = 0.0)]
    ambiguous_ratio: f64,
    /// How long a held request waits before answering (longer than the sender's timeout).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    ambiguous_hold: Duration,
    /// Seed of the generator picking the ambiguous requests.
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
}

struct Receiver {
    /// std Mutex: never held across `.await`.
    ledger: Mutex<Ledger>,
    rng: Mutex<StdRng>,
    secret: Option<SigningSecret>,
    ambiguous_ratio: f64,
    ambiguous_hold: Duration,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(error) if !error.use_stderr() => {
            let _ = error.print();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("error: {}", error.to_string().trim());
            return ExitCode::FAILURE;
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    if !(0.0..=1.0).contains(&args.ambiguous_ratio) {
        anyhow::bail!("--ambiguous-ratio must be between 0 and 1");
    }
    let secret = match std::env::var("HANDOFF_WEBHOOK_SECRET") {
        Ok(text) => Some(SigningSecret::parse(&text).context("HANDOFF_WEBHOOK_SECRET")?),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(_)) => {
            anyhow::bail!("HANDOFF_WEBHOOK_SECRET is not UTF-8")
        }
    };
    let receiver = Arc::new(Receiver {
        ledger: Mutex::new(Ledger::default()),
        rng: Mutex::new(StdRng::seed_from_u64(args.seed)),
        secret,
        ambiguous_ratio: args.ambiguous_ratio,
        ambiguous_hold: args.ambiguous_hold,
    });
    let app = Router::new()
        .route("/received", get(received))
        .fallback(deliver)
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("while binding {}", args.listen))?;
    let address = listener.local_addr()?;
    // Tests read this line to find a port-0 listener.
    println!("listening on {address}");
    tracing::info!(%address, signed = receiver.secret.is_some(),
        ambiguous_ratio = args.ambiguous_ratio, seed = args.seed, "webhook-receiver started");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("while serving")
}

async fn received(State(receiver): State<Arc<Receiver>>) -> Json<Vec<ledger::Applied>> {
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
    (
        status,
        [("content-type", "application/json")],
        answer.body,
    )
        .into_response()
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

/// The event a request describes: the `ce-id` and `Handoff-*` headers in binary mode, the
/// `id` and `handoff*` attributes of an `application/cloudevents+json` body in structured mode.
fn read_event(headers: &HeaderMap, body: &[u8]) -> Result<Incoming, String> {
    let structured = header(headers, "content-type")
        .is_some_and(|t| t.starts_with(handoff_http::CLOUDEVENTS_JSON));
    let (id, aggregate_type, aggregate_id, sequence) = if structured {
        let envelope: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        let get = |name: &str| {
            envelope
                .get(name)
                .and_then(|v| v.as_str())
                .map(str::to_owned)
                .ok_or_else(|| format!("no string attribute {name:?}"))
        };
        (
            get("id")?,
            get("handoffaggregatetype")?,
            get("handoffaggregateid")?,
            get("handoffsequence")?,
        )
    } else {
        let get = |name: &str| {
            header(headers, name)
                .map(str::to_owned)
                .ok_or_else(|| format!("no {name} header"))
        };
        (
            get("ce-id")?,
            get("handoff-aggregate-type")?,
            get("handoff-aggregate-id")?,
            get("handoff-sequence")?,
        )
    };
    let aggregate_id = handoff_core::subject::decode_token(&aggregate_id)
        .map_err(|e| e.to_string())?
        .into_owned();
    let sequence = sequence
        .parse::<i64>()
        .map_err(|_| format!("sequence {sequence:?} is not an integer"))?;
    Ok(Incoming {
        event_id: id,
        aggregate_type,
        aggregate_id,
        sequence,
    })
}
