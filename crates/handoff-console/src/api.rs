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
use handoff_postgres::{ActionRecord, Quarantine};
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

pub(crate) async fn status(State(state): State<Arc<AppState>>) -> ApiResult<StatusDocument> {
    async {
        let mut conn = state.pool.acquire().await?;
        StatusDocument::read(&mut conn, &state.config.schema, state.config.status).await
    }
    .await
    .into()
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
