//! Sagas (design F2): the open ones by type and state, the stuck ones in full, and the two
//! actions `handoff saga` has on a stuck saga: resume (its failing step is tried again with a
//! fresh budget) and resolve (closed by hand, reason required); both audited in
//! `saga_operator_actions` under the operator's name.

use std::sync::Arc;

use axum::extract::{Form, Path, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Extension;
use handoff_saga::{SagaAdmin, SagaState};
use maud::html;
use serde::Deserialize;
use uuid::Uuid;

use super::{check_csrf, error_page, page, pretty, EventQuery};
use crate::auth::Identity;
use crate::format::since;
use crate::{actions, AppState, ConsoleError};

/// Most stuck sagas listed.
const STUCK_LIMIT: i64 = 200;

/// The resume reason when the operator gives none, as `handoff saga resume`'s default.
pub(crate) const DEFAULT_RESUME_REASON: &str = "resumed by an operator";

/// `GET /sagas`: open sagas by type and state, and the stuck ones.
pub(crate) async fn sagas(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
) -> Response {
    let read = async {
        let admin = SagaAdmin::new(&state.config.schema);
        let open = admin.open_counts(&state.pool).await?;
        let stuck = admin
            .list(&state.pool, Some(SagaState::Stuck), STUCK_LIMIT)
            .await?;
        Ok::<_, ConsoleError>((open, stuck))
    };
    let (open, stuck) = match read.await {
        Ok(read) => read,
        Err(error) => return error_page(&state, &identity, &error),
    };
    let body = html! {
        h1 { "Sagas" }
        h2 { "Open, by type and state" }
        @if open.is_empty() { p { "No saga is open." } } @else {
            table id="saga-counts" {
                thead { tr { th { "Type" } th { "State" } th { "Sagas" } } }
                tbody { @for count in &open { tr { td { (count.saga_type) } td { (count.state) } td { (count.count) } } } }
            }
        }
        h2 { "Stuck, the most recently stuck first" }
        @if stuck.is_empty() { p id="no-stuck-sagas" { "No saga is stuck." } } @else {
            table id="stuck-sagas" {
                thead { tr { th { "Saga" } th { "Type" } th { "Step" } th { "Stuck for" } th { "Why" } } }
                tbody {
                    @for saga in &stuck {
                        tr data-saga-id=(saga.saga_id) {
                            td { a href={"/sagas/" (saga.saga_id)} { (saga.saga_id) } }
                            td { (saga.saga_type) }
                            td { (saga.step) }
                            td { (since(saga.updated_at)) }
                            td { (saga.stuck_reason.as_deref().or(saga.failure.as_deref()).unwrap_or("-")) }
                        }
                    }
                }
            }
        }
    };
    page(&state, &identity, "Sagas", true, body).into_response()
}

/// `GET /sagas/{id}`: one saga with its history and audit, and its actions while stuck.
pub(crate) async fn saga(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Query(query): Query<EventQuery>,
) -> Response {
    let read = async {
        SagaAdmin::new(&state.config.schema)
            .show(&state.pool, id)
            .await?
            .ok_or(ConsoleError::Saga(handoff_saga::SagaError::NotFound(id)))
    };
    let detail = match read.await {
        Ok(detail) => detail,
        Err(error) => return error_page(&state, &identity, &error),
    };
    let saga = &detail.saga;
    let csrf = state.csrf.token(&identity);
    let body = html! {
        h1 { "Saga " (id) }
        @if let Some(done) = &query.done { p class="flash" id="flash" { "Done: " (done) "." } }
        table id="saga" {
            tr { th { "Type" } td { (saga.saga_type) } }
            tr { th { "State" } td id="saga-state" { (saga.state.as_str()) } }
            tr { th { "Step" } td { (saga.step) } }
            tr { th { "Attempt" } td { (saga.attempt) } }
            tr { th { "Stuck because" } td id="stuck-reason" { (saga.stuck_reason.as_deref().unwrap_or("-")) } }
            tr { th { "Failure" } td { (saga.failure.as_deref().unwrap_or("-")) } }
            tr { th { "Last transition error" } td { (saga.last_transition_error.as_deref().unwrap_or("-")) } }
            tr { th { "Changed" } td { (saga.updated_at.to_rfc3339()) " (" (since(saga.updated_at)) ")" } }
        }
        @if saga.state == SagaState::Stuck && !state.config.read_only {
            h2 { "Actions" }
            div class="actions" {
                form method="post" action={"/sagas/" (id) "/resume"} {
                    input type="hidden" name="csrf" value=(csrf);
                    label { "Reason " input type="text" name="reason" id="resume-reason" maxlength="500" placeholder=(DEFAULT_RESUME_REASON); }
                    " "
                    button type="submit" id="saga-resume" { "Resume" }
                }
                form method="post" action={"/sagas/" (id) "/resolve"} {
                    input type="hidden" name="csrf" value=(csrf);
                    label { "Reason " input type="text" name="reason" id="resolve-reason" maxlength="500"; }
                    " "
                    button type="submit" id="saga-resolve" { "Resolve by hand" }
                }
            }
        }
        h2 { "Data" }
        pre id="saga-data" { (pretty(&saga.data, state.config.max_payload_shown).0) }
        h2 { "History" }
        table id="saga-history" {
            thead { tr { th { "Version" } th { "What" } th { "State" } th { "Step" } th { "When" } th { "Detail" } } }
            tbody {
                @for entry in &detail.history {
                    tr { td { (entry.version) } td { (entry.kind) } td { (entry.state) } td { (entry.step) } td { (entry.at.to_rfc3339()) } td { (entry.detail.as_deref().unwrap_or("-")) } }
                }
            }
        }
        h2 { "Audit trail" }
        @if detail.actions.is_empty() { p { "No operator action taken." } } @else {
            table id="audit" {
                thead { tr { th { "#" } th { "Action" } th { "Actor" } th { "When" } th { "Reason" } } }
                tbody {
                    @for action in &detail.actions {
                        tr {
                            td { (action.action_id) }
                            td class="action" { (action.action) }
                            td class="actor" { (action.actor) }
                            td { (action.acted_at.to_rfc3339()) }
                            td { (action.reason) }
                        }
                    }
                }
            }
        }
    };
    page(&state, &identity, "Saga", false, body).into_response()
}

#[derive(Deserialize)]
pub(crate) struct SagaForm {
    csrf: Option<String>,
    reason: Option<String>,
}

/// `POST /sagas/{id}/resume`; an empty reason is the CLI's default one.
pub(crate) async fn saga_resume(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Form(form): Form<SagaForm>,
) -> Response {
    let result = async {
        check_csrf(&state, &identity, form.csrf.as_deref())?;
        let reason = form
            .reason
            .as_deref()
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .unwrap_or(DEFAULT_RESUME_REASON);
        actions::saga_resume(&state, &identity, id, reason).await
    };
    match result.await {
        Ok(_) => Redirect::to(&format!("/sagas/{id}?done=resumed")).into_response(),
        Err(error) => error_page(&state, &identity, &error),
    }
}

/// `POST /sagas/{id}/resolve`; the reason is required.
pub(crate) async fn saga_resolve(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Form(form): Form<SagaForm>,
) -> Response {
    let result = async {
        check_csrf(&state, &identity, form.csrf.as_deref())?;
        actions::saga_resolve(&state, &identity, id, form.reason.as_deref().unwrap_or("")).await
    };
    match result.await {
        Ok(_) => Redirect::to(&format!("/sagas/{id}?done=resolved")).into_response(),
        Err(error) => error_page(&state, &identity, &error),
    }
}
