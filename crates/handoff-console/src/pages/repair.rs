//! Repairing a held event's payload from its page, in two steps: the operator edits the
//! payload and asks for a review; the console checks it exactly as the repair will (the event
//! is held, the payload passes every enqueue's checks) and shows the old payload against the
//! new, line by line, writing nothing; a save then repairs and releases the event, audited
//! under the operator's name. A refused payload comes back in the form with the reason.
//!
//! The review carries a fingerprint of the payload it was made against: a save after someone
//! else changed the event is refused instead of overwriting a change nobody reviewed.

use std::sync::Arc;

use axum::extract::{Form, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use axum::Extension;
use base64::Engine;
use handoff_postgres::EventDetail;
use maud::{html, Markup};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::{check_csrf, error_page, page, pretty};
use crate::auth::Identity;
use crate::diff::{self, Line, Shown};
use crate::{actions, AppState, ConsoleError, ConsoleErrorKind};

/// The repair form on a held event's page, holding `text`.
pub(super) fn form(id: Uuid, csrf: &str, text: &str) -> Markup {
    html! {
        h2 { "Repair the payload" }
        p { "Edit the payload below. It is checked as every enqueue checks it, and the change is \
             shown to you before anything is saved." }
        form method="post" action={"/events/" (id) "/repair"} id="repair-form" {
            input type="hidden" name="csrf" value=(csrf);
            textarea name="payload" id="repair-payload" rows="16" spellcheck="false" { (text) }
            p { button type="submit" id="repair-review" { "Review the change" } }
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct RepairForm {
    csrf: Option<String>,
    /// The new payload, as typed.
    #[serde(default)]
    payload: String,
    /// The fingerprint of the payload the review was made against (the save step only).
    base: Option<String>,
    /// Present on the save step.
    confirm: Option<String>,
}

/// A fingerprint of an event's current payload.
fn fingerprint(detail: &EventDetail) -> String {
    let text = detail
        .payload
        .as_ref()
        .map(serde_json::Value::to_string)
        .unwrap_or_default();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(text.as_bytes()))
}

/// `POST /events/{id}/repair`: the review step, or with `confirm` the save.
pub(crate) async fn repair(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Form(form): Form<RepairForm>,
) -> Response {
    if let Err(error) = check_csrf(&state, &identity, form.csrf.as_deref()) {
        return error_page(&state, &identity, &error);
    }
    if form.confirm.is_some() {
        let saved = async {
            let detail = actions::check_repair(&state, id, &form.payload).await?;
            if form.base.as_deref() != Some(fingerprint(&detail).as_str()) {
                return Err(ConsoleError::Stale);
            }
            actions::repair(&state, &identity, id, &form.payload).await
        };
        return match saved.await {
            Ok(_) => Redirect::to(&format!("/events/{id}?done=repaired")).into_response(),
            Err(error) => refused(&state, &identity, id, &form.payload, &error),
        };
    }
    match actions::check_repair(&state, id, &form.payload).await {
        Ok(detail) => review(&state, &identity, id, &form.payload, &detail),
        Err(error) => refused(&state, &identity, id, &form.payload, &error),
    }
}

/// A refused repair: a refused payload comes back in the form with the reason (nothing was
/// written); anything else is an error page.
fn refused(
    state: &AppState,
    identity: &Identity,
    id: Uuid,
    text: &str,
    error: &ConsoleError,
) -> Response {
    let payload_problem =
        matches!(error, ConsoleError::Stale) || error.kind() == ConsoleErrorKind::BadRequest;
    if !payload_problem {
        return error_page(state, identity, error);
    }
    let csrf = state.csrf.token(identity);
    let body = html! {
        h1 { "Repair event " (id) }
        p class="error" id="error" { (error.public_message()) }
        p { "Nothing was written. " a href={"/events/" (id)} { "Back to the event" } }
        (form(id, &csrf, text))
    };
    (error.status(), page(state, identity, "Repair", false, body)).into_response()
}

/// The review: the old payload against the new, and the save button.
fn review(
    state: &AppState,
    identity: &Identity,
    id: Uuid,
    text: &str,
    detail: &EventDetail,
) -> Response {
    let old = detail
        .payload
        .as_ref()
        .map(|p| pretty(p, usize::MAX).0)
        .unwrap_or_default();
    // The check passed, so the text parses; what is stored is the parsed value.
    let new = serde_json::from_str::<serde_json::Value>(text)
        .map(|v| pretty(&v, usize::MAX).0)
        .unwrap_or_else(|_| text.to_owned());
    let lines = diff::lines(&old, &new);
    let changed = lines.iter().any(|l| !matches!(l, Line::Same(_)));
    let csrf = state.csrf.token(identity);
    let body = html! {
        h1 { "Repair event " (id) ": review" }
        p { "The payload as it is (" span class="del" { "−" } ") and as it will be saved ("
            span class="ins" { "+" } "). Nothing is written until you save; saving releases the \
            event for publishing, recorded under your name." }
        @if !changed {
            p class="flash" id="repair-same" { "The new payload is the same as the old: saving \
                publishes the event as it is." }
        }
        pre id="repair-diff" class="diff" {
            @for shown in diff::shown(&lines) {
                @match shown {
                    Shown::Line(Line::Same(l)) => { span class="same" { "  " (l) } "\n" }
                    Shown::Line(Line::Removed(l)) => { span class="del" { "- " (l) } "\n" }
                    Shown::Line(Line::Added(l)) => { span class="ins" { "+ " (l) } "\n" }
                    Shown::Skipped(n) => { span class="skipped" { "  … " (n) " unchanged line(s)" } "\n" }
                }
            }
        }
        form method="post" action={"/events/" (id) "/repair"} {
            input type="hidden" name="csrf" value=(csrf);
            input type="hidden" name="payload" value=(text);
            input type="hidden" name="base" value=(fingerprint(detail));
            input type="hidden" name="confirm" value="1";
            button type="submit" id="repair-save" { "Save and publish" }
            " "
            a href={"/events/" (id)} id="repair-cancel" { "Cancel" }
        }
        (form(id, &csrf, text))
    };
    (StatusCode::OK, page(state, identity, "Repair", false, body)).into_response()
}
