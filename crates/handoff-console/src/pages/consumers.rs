//! The consumers' quarantines (`--consumer NAME=URL`): each consumer's open rows, one row in
//! full with its stored message and audit, and the two actions `handoff consumer quarantine`
//! has: retry (the running consumer applies it again through its inbox) and skip (reason
//! required; past a gap only when asked). The stored message is hostile input, shown as text.

use std::sync::Arc;

use axum::extract::{Form, Path, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Extension;
use handoff_postgres::{ConsumerQuarantined, QuarantineRef};
use maud::html;
use serde::Deserialize;

use super::{check_csrf, error_page, page, pretty, EventQuery};
use crate::auth::Identity;
use crate::format::since;
use crate::{actions, AppState, ConsoleError};

/// Most rows listed per consumer.
const ROWS_LIMIT: i64 = 200;

/// `type/id #seq`, or `-` for a malformed message.
fn place(row: &ConsumerQuarantined) -> String {
    match (
        &row.aggregate_type,
        &row.aggregate_id,
        row.aggregate_sequence,
    ) {
        (Some(kind), Some(id), Some(sequence)) => format!("{kind}/{id} #{sequence}"),
        _ => "-".to_owned(),
    }
}

fn parse_row(text: &str) -> Result<QuarantineRef, ConsoleError> {
    text.parse()
        .map_err(|e: handoff_postgres::QuarantineRefError| ConsoleError::BadRequest(e.to_string()))
}

/// `GET /consumers`: every configured consumer's open rows, the oldest first.
pub(crate) async fn consumers(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
) -> Response {
    let mut listed = Vec::new();
    for database in &state.config.consumers {
        let read = async {
            let (database, quarantine) = actions::consumer(&state, &database.name)?;
            let mut conn = database.pool.acquire().await?;
            Ok::<_, ConsoleError>(quarantine.list(&mut conn, ROWS_LIMIT, false).await?)
        };
        // One consumer's database being down must not hide the others.
        let rows = read.await.map_err(|error| {
            tracing::warn!(consumer = %database.name, %error, "console: consumer quarantine read failed");
            error.public_message()
        });
        listed.push((database.name.as_str(), rows));
    }
    let body = html! {
        h1 { "Consumers' quarantines" }
        @if listed.is_empty() {
            p id="no-consumers" { "No consumer is configured: start the console with "
                code { "--consumer NAME=URL" } " (repeatable) to see and act on consumers' quarantines." }
        }
        @for (name, rows) in &listed {
            section class="consumer" data-consumer=(name) {
                h2 { "Consumer " (name) }
                @match rows {
                    Err(message) => { p class="error" { (message) } }
                    Ok(rows) if rows.is_empty() => { p { "No open row." } }
                    Ok(rows) => {
                        table class="consumer-rows" {
                            thead { tr { th { "Row" } th { "Event" } th { "Aggregate" } th { "Kind" } th { "Status" } th { "Deliveries" } th { "Since" } th { "Reason" } } }
                            tbody {
                                @for row in rows {
                                    tr data-row=(row.quarantine_id) {
                                        td { a href={"/consumers/" (name) "/rows/" (row.quarantine_id)} { "#" (row.quarantine_id) } }
                                        td { (row.event_id.map_or_else(|| "-".to_owned(), |id| id.to_string())) }
                                        td { (place(row)) }
                                        td { (row.reason_kind) }
                                        td class="status" { (row.status) }
                                        td { (row.deliveries) }
                                        td { (since(row.quarantined_at)) }
                                        td { (row.reason) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    page(&state, &identity, "Consumers", true, body).into_response()
}

/// `GET /consumers/{name}/rows/{row}`: one row in full, with its actions while it is open.
pub(crate) async fn consumer_row(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path((name, row)): Path<(String, String)>,
    Query(query): Query<EventQuery>,
) -> Response {
    let read = async {
        let which = parse_row(&row)?;
        let (database, quarantine) = actions::consumer(&state, &name)?;
        let mut conn = database.pool.acquire().await?;
        Ok::<_, ConsoleError>(quarantine.show(&mut conn, which).await?)
    };
    let detail = match read.await {
        Ok(detail) => detail,
        Err(error) => return error_page(&state, &identity, &error),
    };
    let csrf = state.csrf.token(&identity);
    let r = &detail.row;
    let base = format!("/consumers/{name}/rows/{}", r.quarantine_id);
    let body = html! {
        h1 { "Consumer " (name) ", row #" (r.quarantine_id) }
        @if let Some(done) = &query.done { p class="flash" id="flash" { "Done: " (done) "." } }
        table id="consumer-row" {
            tr { th { "Status" } td id="status" { (r.status) @if let Some(res) = &r.resolution { " (" (res) ")" } } }
            tr { th { "Event" } td { (r.event_id.map_or_else(|| "-".to_owned(), |id| id.to_string())) } }
            tr { th { "Aggregate" } td { (place(r)) } }
            tr { th { "Type" } td { (r.event_type.as_deref().unwrap_or("-")) } }
            tr { th { "Kind" } td id="reason-kind" { (r.reason_kind) } }
            tr { th { "Reason" } td id="reason" { (r.reason) } }
            tr { th { "Deliveries" } td { (r.deliveries) } }
            tr { th { "Quarantined" } td { (r.quarantined_at.to_rfc3339()) " (" (since(r.quarantined_at)) ")" } }
            tr { th { "Aggregate's last applied" } td { (r.last_sequence.map_or_else(|| "-".to_owned(), |s| s.to_string())) } }
        }
        @if r.status != "resolved" && !state.config.read_only {
            h2 { "Actions" }
            div class="actions" {
                @if r.status == "quarantined" {
                    form method="post" action={(base) "/retry"} {
                        input type="hidden" name="csrf" value=(csrf);
                        button type="submit" id="consumer-retry" { "Retry" }
                    }
                }
                form method="post" action={(base) "/skip"} {
                    input type="hidden" name="csrf" value=(csrf);
                    label { "Reason " input type="text" name="reason" id="consumer-skip-reason" maxlength="500"; }
                    " "
                    label { input type="checkbox" name="past_gap" value="1" id="consumer-skip-past-gap"; " past a gap" }
                    " "
                    button type="submit" id="consumer-skip" { "Skip" }
                }
            }
        }
        h2 { "Headers" }
        pre id="headers" { (pretty(&detail.headers, state.config.max_payload_shown).0) }
        h2 { "Message body" }
        @let cut = detail.payload.len() > state.config.max_payload_shown;
        @if cut { p { "Cut to its first " (state.config.max_payload_shown) " bytes." } }
        pre id="payload" { (truncate(&detail.payload, state.config.max_payload_shown)) }
        h2 { "Audit trail" }
        @if detail.actions.is_empty() { p { "No action taken." } } @else {
            table id="audit" {
                thead { tr { th { "#" } th { "Action" } th { "Actor" } th { "When" } th { "Reason" } } }
                tbody {
                    @for action in &detail.actions {
                        tr {
                            td { (action.action_id) }
                            td class="action" { (action.action) }
                            td class="actor" { (action.actor) }
                            td { (action.acted_at.to_rfc3339()) }
                            td { (action.reason.as_deref().unwrap_or("-")) }
                        }
                    }
                }
            }
        }
    };
    page(&state, &identity, "Consumer row", false, body).into_response()
}

/// `text` cut to at most `max` bytes at a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[derive(Deserialize)]
pub(crate) struct ConsumerForm {
    csrf: Option<String>,
    reason: Option<String>,
    past_gap: Option<String>,
}

/// `POST /consumers/{name}/rows/{row}/retry`.
pub(crate) async fn consumer_row_retry(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path((name, row)): Path<(String, String)>,
    Form(form): Form<ConsumerForm>,
) -> Response {
    let result = async {
        check_csrf(&state, &identity, form.csrf.as_deref())?;
        let which = parse_row(&row)?;
        actions::consumer_retry(&state, &identity, &name, which).await
    };
    match result.await {
        Ok(_) => Redirect::to(&format!(
            "/consumers/{name}/rows/{row}?done=retry+requested"
        ))
        .into_response(),
        Err(error) => error_page(&state, &identity, &error),
    }
}

/// `POST /consumers/{name}/rows/{row}/skip`.
pub(crate) async fn consumer_row_skip(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path((name, row)): Path<(String, String)>,
    Form(form): Form<ConsumerForm>,
) -> Response {
    let result = async {
        check_csrf(&state, &identity, form.csrf.as_deref())?;
        let which = parse_row(&row)?;
        actions::consumer_skip(
            &state,
            &identity,
            &name,
            which,
            form.reason.as_deref().unwrap_or(""),
            form.past_gap.is_some(),
        )
        .await
    };
    match result.await {
        Ok(_) => {
            Redirect::to(&format!("/consumers/{name}/rows/{row}?done=skipped")).into_response()
        }
        Err(error) => error_page(&state, &identity, &error),
    }
}
