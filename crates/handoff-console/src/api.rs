//! `/api/v1/`: the console's reads and actions as JSON, for scripts. `status` answers what
//! `handoff status --json` prints and `quarantine` what `handoff quarantine list --json`
//! prints; actions answer `{"action_id", "acted_at"}`; errors `{"error", "kind"}` with the
//! status [`ConsoleError::status`] gives.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use handoff_postgres::{ActionRecord, Quarantine, QuarantineRef};
use handoff_saga::{SagaAdmin, SagaDetail, SagaRecord, SagaState};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use crate::auth::Identity;
use crate::{actions, AppState, ConsoleError, StatusDocument};

/// The OpenAPI document, kept beside the code it describes.
const OPENAPI: &str = include_str!("openapi.json");

/// A failed request's answer.
pub(crate) fn error_response(error: &ConsoleError) -> Response {
    if error.kind() == crate::ConsoleErrorKind::Database {
        tracing::error!(error = %error, "console: request failed");
    }
    (
        error.status(),
        Json(json!({ "error": error.public_message(), "kind": error.kind_name() })),
    )
        .into_response()
}

/// A handler's result: JSON, or the error's answer.
pub(crate) struct ApiResult<T>(Result<T, ConsoleError>);

impl<T: Serialize> IntoResponse for ApiResult<T> {
    fn into_response(self) -> Response {
        match self.0 {
            Ok(value) => Json(value).into_response(),
            Err(error) => error_response(&error),
        }
    }
}

impl<T> From<Result<T, ConsoleError>> for ApiResult<T> {
    fn from(result: Result<T, ConsoleError>) -> Self {
        Self(result)
    }
}

/// What an action recorded.
#[derive(Serialize)]
pub(crate) struct Acted {
    action_id: i64,
    acted_at: DateTime<Utc>,
}

impl From<ActionRecord> for Acted {
    fn from(record: ActionRecord) -> Self {
        Self {
            action_id: record.action_id,
            acted_at: record.acted_at,
        }
    }
}

/// The console's latest status reading (at most about one sample interval old, see
/// `readings`); `X-Handoff-Read-At` says when it was read.
pub(crate) async fn status(State(state): State<Arc<AppState>>) -> Response {
    match state.status().await {
        Ok(reading) => (
            [("x-handoff-read-at", reading.at.to_rfc3339())],
            Json::<&StatusDocument>(&reading.document),
        )
            .into_response(),
        Err(error) => error_response(&error),
    }
}

#[derive(Deserialize)]
pub(crate) struct ListQuery {
    /// Most events listed, as `handoff quarantine list --limit`.
    limit: Option<i64>,
}

pub(crate) async fn quarantine_list(
    State(state): State<Arc<AppState>>,
    Query(query): Query<ListQuery>,
) -> ApiResult<Vec<handoff_postgres::QuarantinedEvent>> {
    async {
        let mut conn = state.pool.acquire().await?;
        Ok(Quarantine::new(&state.config.schema)
            .list(&mut conn, query.limit.unwrap_or(100))
            .await?)
    }
    .await
    .into()
}

pub(crate) async fn samples(State(state): State<Arc<AppState>>) -> Json<Vec<crate::Sample>> {
    Json(state.history.samples())
}

pub(crate) async fn event(
    State(state): State<Arc<AppState>>,
    Path(id): Path<Uuid>,
) -> ApiResult<serde_json::Value> {
    async {
        let mut conn = state.pool.acquire().await?;
        let detail = Quarantine::new(&state.config.schema)
            .show(&mut conn, id)
            .await?;
        crate::event_json(&detail).map_err(|e| ConsoleError::BadRequest(e.to_string()))
    }
    .await
    .into()
}

pub(crate) async fn retry(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
) -> ApiResult<Acted> {
    actions::retry(&state, &identity, id)
        .await
        .map(Acted::from)
        .into()
}

#[derive(Deserialize)]
pub(crate) struct SkipBody {
    /// Why; required.
    #[serde(default)]
    reason: String,
}

/// The body is JSON only: a cross-site form cannot send `application/json` without a CORS
/// preflight the console never grants.
pub(crate) async fn skip(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Json(body): Json<SkipBody>,
) -> ApiResult<Acted> {
    actions::skip(&state, &identity, id, &body.reason)
        .await
        .map(Acted::from)
        .into()
}

#[derive(Deserialize)]
pub(crate) struct RepairBody {
    /// The corrected payload.
    payload: serde_json::Value,
}

pub(crate) async fn repair(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Json(body): Json<RepairBody>,
) -> ApiResult<Acted> {
    actions::repair(&state, &identity, id, &body.payload.to_string())
        .await
        .map(Acted::from)
        .into()
}

pub(crate) async fn openapi() -> Response {
    (
        StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
        .into_response()
}

/// One configured consumer and its open rows.
#[derive(Serialize)]
pub(crate) struct ConsumerSummary {
    name: String,
    /// Rows waiting for an operator.
    quarantined: usize,
    /// Rows waiting for the consumer's retry.
    retry_requested: usize,
}

/// `GET /api/v1/consumers`: the consumers given with `--consumer`, with their open rows.
pub(crate) async fn consumers(
    State(state): State<Arc<AppState>>,
) -> ApiResult<Vec<ConsumerSummary>> {
    async {
        let mut out = Vec::new();
        for database in &state.config.consumers {
            let (database, quarantine) = actions::consumer(&state, &database.name)?;
            let mut conn = database.pool.acquire().await?;
            let rows = quarantine.list(&mut conn, i64::MAX, false).await?;
            out.push(ConsumerSummary {
                name: database.name.clone(),
                quarantined: rows.iter().filter(|r| r.status == "quarantined").count(),
                retry_requested: rows
                    .iter()
                    .filter(|r| r.status == "retry_requested")
                    .count(),
            });
        }
        Ok(out)
    }
    .await
    .into()
}

#[derive(Deserialize)]
pub(crate) struct ConsumerListQuery {
    /// Most rows, as `handoff consumer quarantine list --limit`.
    limit: Option<i64>,
    /// Resolved rows too, as `--all`.
    #[serde(default)]
    all: bool,
}

/// `GET /api/v1/consumers/{name}/quarantine`: `handoff consumer quarantine list --json`.
pub(crate) async fn consumer_list(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    Query(query): Query<ConsumerListQuery>,
) -> ApiResult<Vec<handoff_postgres::ConsumerQuarantined>> {
    async {
        let (database, quarantine) = actions::consumer(&state, &name)?;
        let mut conn = database.pool.acquire().await?;
        Ok(quarantine
            .list(&mut conn, query.limit.unwrap_or(100), query.all)
            .await?)
    }
    .await
    .into()
}

fn parse_row(text: &str) -> Result<QuarantineRef, ConsoleError> {
    text.parse()
        .map_err(|e: handoff_postgres::QuarantineRefError| ConsoleError::BadRequest(e.to_string()))
}

/// `GET /api/v1/consumers/{name}/quarantine/{row}`: `handoff consumer quarantine show --json`.
pub(crate) async fn consumer_show(
    State(state): State<Arc<AppState>>,
    Path((name, row)): Path<(String, String)>,
) -> ApiResult<handoff_postgres::ConsumerQuarantineDetail> {
    async {
        let which = parse_row(&row)?;
        let (database, quarantine) = actions::consumer(&state, &name)?;
        let mut conn = database.pool.acquire().await?;
        Ok(quarantine.show(&mut conn, which).await?)
    }
    .await
    .into()
}

/// `POST /api/v1/consumers/{name}/quarantine/{row}/retry`.
pub(crate) async fn consumer_retry(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path((name, row)): Path<(String, String)>,
) -> ApiResult<Acted> {
    async {
        let which = parse_row(&row)?;
        actions::consumer_retry(&state, &identity, &name, which).await
    }
    .await
    .map(Acted::from)
    .into()
}

#[derive(Deserialize)]
pub(crate) struct ConsumerSkipBody {
    /// Why; required.
    #[serde(default)]
    reason: String,
    /// As `--past-gap`.
    #[serde(default)]
    past_gap: bool,
}

/// What a consumer skip recorded.
#[derive(Serialize)]
pub(crate) struct ConsumerSkipped {
    action_id: i64,
    acted_at: DateTime<Utc>,
    /// The aggregate's last applied sequence before the skip.
    last_sequence: Option<i64>,
    /// Whether the aggregate's sequence moved to the skipped event's.
    advanced: bool,
}

/// `POST /api/v1/consumers/{name}/quarantine/{row}/skip`.
pub(crate) async fn consumer_skip(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path((name, row)): Path<(String, String)>,
    Json(body): Json<ConsumerSkipBody>,
) -> ApiResult<ConsumerSkipped> {
    async {
        let which = parse_row(&row)?;
        let record =
            actions::consumer_skip(&state, &identity, &name, which, &body.reason, body.past_gap)
                .await?;
        Ok(ConsumerSkipped {
            action_id: record.action.action_id,
            acted_at: record.action.acted_at,
            last_sequence: record.last_sequence,
            advanced: record.advanced,
        })
    }
    .await
    .into()
}

#[derive(Deserialize)]
pub(crate) struct SagaListQuery {
    /// Only sagas in this state, as `handoff saga list --state`.
    state: Option<String>,
    /// Most sagas, as `--limit`.
    limit: Option<i64>,
}

/// `GET /api/v1/sagas`: `handoff saga list --json`.
pub(crate) async fn sagas(
    State(state): State<Arc<AppState>>,
    Query(query): Query<SagaListQuery>,
) -> ApiResult<Vec<SagaRecord>> {
    async {
        let filter =
            match query.state.as_deref() {
                None => None,
                Some(text) => Some(text.parse::<SagaState>().map_err(|_| {
                    ConsoleError::BadRequest(format!("unknown saga state {text:?}"))
                })?),
            };
        Ok(SagaAdmin::new(&state.config.schema)
            .list(&state.pool, filter, query.limit.unwrap_or(100))
            .await?)
    }
    .await
    .into()
}

/// `GET /api/v1/sagas/{id}`: `handoff saga show --json`.
pub(crate) async fn saga(
    State(state): State<Arc<AppState>>,
    Path(id): Path<Uuid>,
) -> ApiResult<SagaDetail> {
    async {
        SagaAdmin::new(&state.config.schema)
            .show(&state.pool, id)
            .await?
            .ok_or(ConsoleError::Saga(handoff_saga::SagaError::NotFound(id)))
    }
    .await
    .into()
}

#[derive(Deserialize)]
pub(crate) struct SagaBody {
    /// Why; required to resolve, `resumed by an operator` when a resume gives none.
    #[serde(default)]
    reason: Option<String>,
}

/// `POST /api/v1/sagas/{id}/resume`: the saga afterwards, as `handoff saga resume --json`.
pub(crate) async fn saga_resume(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    body: axum::body::Bytes,
) -> ApiResult<SagaRecord> {
    async {
        // The body is optional here: none, or `{}`, resumes with the CLI's default reason.
        let body: SagaBody = if body.is_empty() {
            SagaBody { reason: None }
        } else {
            serde_json::from_slice(&body)
                .map_err(|e| ConsoleError::BadRequest(format!("invalid JSON body: {e}")))?
        };
        let reason = body
            .reason
            .filter(|r| !r.trim().is_empty())
            .unwrap_or_else(|| crate::pages::DEFAULT_RESUME_REASON.to_owned());
        actions::saga_resume(&state, &identity, id, &reason).await
    }
    .await
    .into()
}

/// `POST /api/v1/sagas/{id}/resolve`: the saga afterwards, as `handoff saga resolve --json`.
pub(crate) async fn saga_resolve(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Json(body): Json<SagaBody>,
) -> ApiResult<SagaRecord> {
    actions::saga_resolve(&state, &identity, id, body.reason.as_deref().unwrap_or(""))
        .await
        .into()
}
