//! The HTTP API. Errors are JSON with a stable `code`; no database text reaches a client.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::json;
use uuid::Uuid;

use crate::idempotency::{Fingerprint, IdempotencyKey};
use crate::model::{CancelOrder, CreateOrder, Line};
use crate::store::{CommandError, Outcome, Store};

/// The header clients put their idempotency key in.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set to `true` on a response replayed from an earlier request with the same key.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The service's routes over `store`.
pub fn router(store: Store) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .route("/orders/{id}/lines", post(add_line))
        .route("/orders/{id}/cancel", post(cancel_order))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(store)
        .layer(axum::middleware::from_fn(traced))
}

/// Runs each request in an `order_service.request` span. The span continues the caller's W3C
/// trace context (its `traceparent` / `tracestate` headers) and the events the command
/// enqueues carry it on, through the relay to the consumers (docs/tracing.md); without an
/// OpenTelemetry layer installed (no `--otlp-endpoint`) it is only a log span.
async fn traced(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let span = tracing::info_span!(
        "order_service.request",
        otel.kind = "server",
        http.request.method = %request.method(),
        url.path = %request.uri().path(),
    );
    let context: Vec<(String, String)> = ["traceparent", "tracestate"]
        .into_iter()
        .filter_map(|name| {
            let value = request.headers().get(name)?.to_str().ok()?;
            Some((name.to_owned(), value.to_owned()))
        })
        .collect();
    handoff::core::trace::continue_trace(&span, &context);
    tracing::Instrument::instrument(next.run(request), span).await
}

async fn create_order(
    State(store): State<Store>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let request: CreateOrder = parse_body(&body)?;
    let fingerprint = Fingerprint::of("POST", "/orders", &request);
    Ok(respond(
        store.create_order(&key, &fingerprint, &request).await?,
    ))
}

async fn add_line(
    State(store): State<Store>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order_id = order_id(&id)?;
    let key = idempotency_key(&headers)?;
    let line: Line = parse_body(&body)?;
    let fingerprint = Fingerprint::of("POST", &format!("/orders/{order_id}/lines"), &line);
    Ok(respond(
        store.add_line(&key, &fingerprint, order_id, &line).await?,
    ))
}

async fn cancel_order(
    State(store): State<Store>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order_id = order_id(&id)?;
    let key = idempotency_key(&headers)?;
    let request: CancelOrder = if body.iter().all(u8::is_ascii_whitespace) {
        CancelOrder::default()
    } else {
        parse_body(&body)?
    };
    let fingerprint = Fingerprint::of("POST", &format!("/orders/{order_id}/cancel"), &request);
    Ok(respond(
        store
            .cancel_order(&key, &fingerprint, order_id, &request)
            .await?,
    ))
}

async fn get_order(
    State(store): State<Store>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let order_id = order_id(&id)?;
    match store.get_order(order_id).await? {
        Some(order) => Ok(Json(order).into_response()),
        None => Err(CommandError::NotFound.into()),
    }
}

fn respond(outcome: Outcome) -> Response {
    let (response, replayed) = match outcome {
        Outcome::Applied(r) => (r, false),
        Outcome::Replayed(r) => (r, true),
    };
    let status = StatusCode::from_u16(response.status).unwrap_or(StatusCode::OK);
    let mut http = (status, Json(response.body)).into_response();
    if replayed {
        http.headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    http
}

fn idempotency_key(headers: &HeaderMap) -> Result<IdempotencyKey, ApiError> {
    let value = headers.get(IDEMPOTENCY_KEY).ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "missing_idempotency_key",
            "this request needs an Idempotency-Key header",
        )
    })?;
    IdempotencyKey::parse(value.as_bytes()).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
            e.to_string(),
        )
    })
}

fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            format!("invalid JSON body: {e}"),
        )
    })
}

fn order_id(raw: &str) -> Result<Uuid, ApiError> {
    // An id that is not a UUID names no order.
    Uuid::parse_str(raw).map_err(|_| CommandError::NotFound.into())
}

/// An error response: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
}

impl From<CommandError> for ApiError {
    fn from(error: CommandError) -> Self {
        use StatusCode as S;
        match &error {
            CommandError::Invalid(e) => {
                Self::new(S::UNPROCESSABLE_ENTITY, "validation_failed", e.0.clone())
            }
            CommandError::NotFound => Self::new(S::NOT_FOUND, "order_not_found", "no such order"),
            CommandError::Cancelled => {
                Self::new(S::CONFLICT, "order_cancelled", "the order is cancelled")
            }
            CommandError::KeyReused => Self::new(
                S::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                "this Idempotency-Key was used for a different request",
            ),
            CommandError::KeyInFlight => Self::new(
                S::CONFLICT,
                "idempotency_key_in_flight",
                "a request with this Idempotency-Key is being processed; retry",
            ),
            CommandError::Enqueue(e) if e.is_retryable() => {
                tracing::warn!(error = %error, "command lost a race, client may retry");
                Self::new(
                    S::SERVICE_UNAVAILABLE,
                    "retry",
                    "a concurrent change won; retry",
                )
            }
            CommandError::Database(sqlx::Error::PoolTimedOut) => {
                tracing::warn!("no database connection available in time");
                Self::new(
                    S::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "the service is overloaded; retry",
                )
            }
            // Everything else is the service's fault; the details go to the log only.
            _ => {
                tracing::error!(error = %error, "command failed");
                Self::new(S::INTERNAL_SERVER_ERROR, "internal", "internal error")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}
