//! The HTTP API. Errors are `{"error": "<code>"}` with a stable code; no database text reaches
//! a client.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::faults::{Fault, FaultInjector, FaultMode, FaultPatch, FaultSettings};
use super::idempotency::IdempotencyKey;
use super::store::{ChargeError, ChargeRequest, ChargeStore, Outcome};

/// The header clients put their idempotency key in.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set to `true` on a response replayed from an earlier request with the same key.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The in-memory counters of `GET /stats`, since the provider started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// `POST /charges` requests received, refused ones included.
    pub requests: u64,
    /// Charges created.
    pub charges_created: u64,
    /// Requests answered (or meant to be answered) with a stored response.
    pub replayed: u64,
    /// Requests that committed, then held their response and answered `504`.
    pub injected_timeouts: u64,
    /// Requests that committed, then answered `500 injected_failure`.
    pub injected_errors: u64,
}

#[derive(Debug, Default)]
struct Stats {
    requests: AtomicU64,
    charges_created: AtomicU64,
    replayed: AtomicU64,
    injected_timeouts: AtomicU64,
    injected_errors: AtomicU64,
}

impl Stats {
    fn bump(counter: &AtomicU64) {
        // Relaxed: independent counters, read for reporting only.
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            charges_created: self.charges_created.load(Ordering::Relaxed),
            replayed: self.replayed.load(Ordering::Relaxed),
            injected_timeouts: self.injected_timeouts.load(Ordering::Relaxed),
            injected_errors: self.injected_errors.load(Ordering::Relaxed),
        }
    }
}

/// The payment provider: its charges, its fault injection and its counters, served by
/// [`router`](Self::router). Cheap to clone; clones share everything.
#[derive(Debug, Clone)]
pub struct Provider {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: ChargeStore,
    faults: FaultInjector,
    stats: Stats,
    /// Becomes `true` at shutdown, which ends injected hangs at once: a graceful shutdown waits
    /// for every request, and a 30 s hang would hold the process that long.
    shutting_down: watch::Sender<bool>,
}

impl Provider {
    /// A provider over `store` (whose tables exist), failing requests as `faults` says.
    pub fn new(store: ChargeStore, faults: FaultInjector) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                faults,
                stats: Stats::default(),
                shutting_down: watch::Sender::new(false),
            }),
        }
    }

    /// The routes:
    ///
    /// - `POST /charges` (header `Idempotency-Key`, body `{"order_id", "amount_cents"}`): `201`
    ///   and the charge; a retry with the same key and body gets the same answer with
    ///   `Idempotent-Replayed: true`; the same key with another body gets
    ///   `422 idempotency_key_reused`. Subject to fault injection once committed.
    /// - `GET /charges`: every charge in creation order.
    /// - `GET /faults`, `PUT /faults` (body `{"fail_after_apply", "mode", "hang_ms"}`, all
    ///   optional): the fault settings.
    /// - `GET /stats`: [`StatsSnapshot`].
    /// - `GET /healthz`: `200`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/charges", post(create_charge).get(list_charges))
            .route("/faults", get(get_faults).put(put_faults))
            .route("/stats", get(stats))
            .route("/healthz", get(|| async { "ok" }))
            .with_state(self.clone())
    }

    /// The counters so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.inner.stats.snapshot()
    }

    /// The fault injection, to read or change.
    pub fn faults(&self) -> &FaultInjector {
        &self.inner.faults
    }

    /// Ends the injected hangs in progress (they answer `504` now) and any started later: call
    /// it when a graceful shutdown begins, so it does not wait for them.
    pub fn shut_down(&self) {
        self.inner.shutting_down.send_replace(true);
    }

    /// Holds the response of a request chosen for a timeout, for `hang` or until shutdown.
    async fn hang(&self, hang: Duration) {
        let mut shutting_down = self.inner.shutting_down.subscribe();
        tokio::select! {
            () = tokio::time::sleep(hang) => {}
            // The sender lives as long as `self`: this only returns at shutdown.
            _ = shutting_down.wait_for(|down| *down) => {}
        }
    }
}

async fn create_charge(
    State(provider): State<Provider>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let stats = &provider.inner.stats;
    Stats::bump(&stats.requests);
    let key = idempotency_key(&headers)?;
    let request: ChargeRequest = parse_body(&body)?;
    let outcome = provider.inner.store.create_charge(&key, &request).await?;
    Stats::bump(if outcome.is_replayed() {
        &stats.replayed
    } else {
        &stats.charges_created
    });
    // After the commit, whether this request created or replayed: a real provider can fail to
    // answer any request, and the client cannot tell whether the charge happened.
    match provider.inner.faults.draw() {
        None => Ok(respond(&outcome)),
        Some(Fault::Error) => {
            Stats::bump(&stats.injected_errors);
            tracing::warn!(key = key.as_str(), "injected an error after apply");
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "injected_failure",
            ))
        }
        Some(Fault::Timeout(hang)) => {
            Stats::bump(&stats.injected_timeouts);
            tracing::warn!(key = key.as_str(), ?hang, "injected a timeout after apply");
            provider.hang(hang).await;
            Err(ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "injected_timeout",
            ))
        }
    }
}

async fn list_charges(State(provider): State<Provider>) -> Result<Response, ApiError> {
    match provider.inner.store.list_charges().await {
        Ok(charges) => Ok(Json(charges).into_response()),
        Err(error) => {
            tracing::error!(error = %error, "GET /charges failed");
            Err(ApiError::internal())
        }
    }
}

/// The JSON form of [`FaultSettings`].
#[derive(Debug, Serialize)]
struct FaultsBody {
    fail_after_apply: f64,
    mode: FaultMode,
    hang_ms: u64,
}

impl From<FaultSettings> for FaultsBody {
    fn from(settings: FaultSettings) -> Self {
        Self {
            fail_after_apply: settings.fail_after_apply,
            mode: settings.mode,
            hang_ms: u64::try_from(settings.hang.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

/// The body of `PUT /faults`. Unknown fields are refused: a misspelt field must not silently
/// leave faults on.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultsPatchBody {
    fail_after_apply: Option<f64>,
    mode: Option<FaultMode>,
    hang_ms: Option<u64>,
}

async fn get_faults(State(provider): State<Provider>) -> Json<FaultsBody> {
    Json(provider.inner.faults.settings().into())
}

async fn put_faults(
    State(provider): State<Provider>,
    body: Bytes,
) -> Result<Json<FaultsBody>, ApiError> {
    let patch: FaultsPatchBody = parse_body(&body)?;
    let patch = FaultPatch {
        fail_after_apply: patch.fail_after_apply,
        mode: patch.mode,
        hang: patch.hang_ms.map(Duration::from_millis),
    };
    match provider.inner.faults.update(patch) {
        Ok(settings) => {
            tracing::info!(?settings, "fault settings changed");
            Ok(Json(settings.into()))
        }
        Err(_) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_fault_settings",
        )),
    }
}

async fn stats(State(provider): State<Provider>) -> Json<StatsSnapshot> {
    Json(provider.stats())
}

fn respond(outcome: &Outcome) -> Response {
    let stored = outcome.response();
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    // The stored bytes as they are, so a replay is byte for byte the first answer.
    let mut response = (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        stored.body.clone(),
    )
        .into_response();
    if outcome.is_replayed() {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

fn idempotency_key(headers: &HeaderMap) -> Result<IdempotencyKey, ApiError> {
    let value = headers
        .get(IDEMPOTENCY_KEY)
        .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "missing_idempotency_key"))?;
    IdempotencyKey::parse(value.as_bytes())
        .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "invalid_idempotency_key"))
}

fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|error| {
        tracing::debug!(%error, "refused a request body");
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_body")
    })
}

/// An error response: `{"error": "<code>"}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    code: &'static str,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str) -> Self {
        Self { status, code }
    }

    fn internal() -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal")
    }
}

impl From<ChargeError> for ApiError {
    fn from(error: ChargeError) -> Self {
        use StatusCode as S;
        match error {
            ChargeError::InvalidAmount(_) => Self::new(S::UNPROCESSABLE_ENTITY, "invalid_amount"),
            ChargeError::KeyReused => Self::new(S::UNPROCESSABLE_ENTITY, "idempotency_key_reused"),
            ChargeError::KeyInFlight => Self::new(S::CONFLICT, "idempotency_key_in_flight"),
            // Everything else is the provider's fault; the details go to the log only.
            error => {
                tracing::error!(error = %error, "POST /charges failed");
                Self::internal()
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(serde_json::json!({"error": self.code}))).into_response()
    }
}
