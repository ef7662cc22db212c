//! The HTML pages: overview, held events, one event with its actions, sign-in. Every value
//! goes through `maud`'s escaping: payloads, headers, reasons and errors are hostile input and
//! are shown as text, never as markup.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Form, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Extension;
use handoff_postgres::{CursorSeen, EventDetail, Quarantine, QuarantinedEvent, RelaySeen};
use maud::{html, Markup, DOCTYPE};
use serde::Deserialize;
use uuid::Uuid;

use crate::auth::{self, Credential, Identity, SESSION_COOKIE};
use crate::format::{age, since};
use crate::{actions, chart, AppState, ConsoleError, StatusDocument};

mod consumers;
mod repair;
mod sagas;

pub(crate) use consumers::{consumer_row, consumer_row_retry, consumer_row_skip, consumers};
pub(crate) use repair::repair;
pub(crate) use sagas::{saga, saga_resolve, saga_resume, sagas, DEFAULT_RESUME_REASON};

/// Most held events on the overview; the held page lists up to [`HELD_LIMIT`].
const OVERVIEW_HELD: i64 = 20;
/// Most held events on the held page.
const HELD_LIMIT: i64 = 500;

fn layout(title: &str, identity: Option<(&Identity, &str)>, refresh: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · handoff console" }
                link rel="stylesheet" href="/assets/console.css";
                script src="/assets/console.js" defer {}
            }
            body {
                header {
                    strong { "handoff console" }
                    @if identity.is_some() {
                        a href="/" { "Overview" }
                        a href="/held" { "Held events" }
                        a href="/consumers" { "Consumers" }
                        a href="/sagas" { "Sagas" }
                        a href="/api/v1/openapi.json" { "API" }
                    }
                    @if let Some((identity, csrf)) = identity {
                        span class="who" {
                            "signed in as " strong { (identity.actor) }
                            @if let Credential::Session(_) = identity.credential {
                                " "
                                form method="post" action="/logout" {
                                    input type="hidden" name="csrf" value=(csrf);
                                    button type="submit" { "Sign out" }
                                }
                            }
                        }
                    }
                }
                main data-refresh=[refresh.then_some("15")] { (body) }
            }
        }
    }
}

/// A page for a signed-in identity.
fn page(state: &AppState, identity: &Identity, title: &str, refresh: bool, body: Markup) -> Markup {
    let csrf = state.csrf.token(identity);
    layout(title, Some((identity, &csrf)), refresh, body)
}

/// An error as a page, with its status. Database failures are logged, not shown.
fn error_page(state: &AppState, identity: &Identity, error: &ConsoleError) -> Response {
    if error.kind() == crate::ConsoleErrorKind::Database {
        tracing::error!(error = %error, "console: page failed");
    }
    let body = html! {
        h1 { "Not done" }
        p class="error" id="error" { (error.public_message()) }
        p { a href="/" { "Overview" } " · " a href="/held" { "Held events" } }
    };
    (error.status(), page(state, identity, "Error", false, body)).into_response()
}

/// The sign-in page, with `message` and `status` (401 when a page was refused).
pub(crate) fn login_page(message: Option<&str>, status: StatusCode) -> Response {
    let body = html! {
        h1 { "Sign in" }
        @if let Some(message) = message { p class="error" id="error" { (message) } }
        form method="post" action="/login" {
            label { "Token " input type="password" name="token" id="token" autocomplete="off"; }
            " "
            button type="submit" id="sign-in" { "Sign in" }
        }
    };
    (status, layout("Sign in", None, false, body)).into_response()
}

pub(crate) async fn login_form() -> Response {
    login_page(None, StatusCode::OK)
}

#[derive(Deserialize)]
pub(crate) struct LoginForm {
    #[serde(default)]
    token: String,
}

/// Trades a token for a session cookie: HttpOnly (no script reads it), SameSite=Strict (no
/// other site's request carries it), Secure behind TLS.
pub(crate) async fn login(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    let Some(actor) = state.config.tokens.actor(form.token.trim()) else {
        tracing::warn!(%peer, "console: sign-in refused");
        return login_page(Some("that token is not valid"), StatusCode::UNAUTHORIZED);
    };
    let id = state.sessions.open(actor);
    tracing::info!(%actor, "console: signed in");
    let forwarded_tls = auth::from_trusted_proxy(&state.config, peer)
        && headers
            .get("x-forwarded-proto")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let secure = if state.config.secure_cookies || forwarded_tls {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!("{SESSION_COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict{secure}");
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}

#[derive(Deserialize)]
pub(crate) struct ActionForm {
    csrf: Option<String>,
    reason: Option<String>,
}

/// Refuses a form post without this identity's anti-forgery token. A bearer token in the
/// `Authorization` header is never sent by a browser on its own, so it needs none.
fn check_csrf(
    state: &AppState,
    identity: &Identity,
    token: Option<&str>,
) -> Result<(), ConsoleError> {
    if identity.credential == Credential::Bearer || state.csrf.verify(identity, token) {
        Ok(())
    } else {
        tracing::warn!(actor = %identity.actor, "console: form post without its anti-forgery token");
        Err(ConsoleError::Csrf)
    }
}

pub(crate) async fn logout(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(error) = check_csrf(&state, &identity, form.csrf.as_deref()) {
        return error_page(&state, &identity, &error);
    }
    if let Credential::Session(id) = &identity.credential {
        state.sessions.close(id);
    }
    let cookie = format!("{SESSION_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
    ([(header::SET_COOKIE, cookie)], Redirect::to("/login")).into_response()
}

pub(crate) async fn overview(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
) -> Response {
    let read = async {
        let reading = state.status().await?;
        let mut conn = state.pool.acquire().await?;
        let held = Quarantine::new(&state.config.schema)
            .list(&mut conn, OVERVIEW_HELD)
            .await?;
        Ok::<_, ConsoleError>((reading, held))
    };
    let (reading, held) = match read.await {
        Ok(read) => read,
        Err(error) => return error_page(&state, &identity, &error),
    };
    let status: &StatusDocument = &reading.document;
    let report = &status.report;
    let samples = state.history.samples();
    let body = html! {
        h1 { "Overview" }
        p class="as-of" id="as-of" { "Figures as of " (reading.at.to_rfc3339()) " (" (since(reading.at))
            "; read in " (format!("{:.1}", reading.took.as_secs_f64())) " s). Relays and held events are current." }
        @if status.healthy { p class="ok" id="healthy" { "Healthy: no alert condition holds." } }
        @for alert in &status.alerts {
            p class="error alert" data-alert=(alert.name) { strong { (alert.name) } ": " (alert.message) }
        }
        div class="cards" {
            (card("pending", "Pending events", report.pending.to_string()))
            (card("oldest", "Oldest pending", age(report.oldest_pending_age_seconds)))
            (card("held", "Held events", report.quarantined.to_string()))
            (card("stuck", "Stuck aggregates", report.stuck_aggregate_count.to_string()))
            (card("holes", "Holes", report.holes.to_string()))
            (card("expired", "Expired leases", report.expired_leases.to_string()))
        }
        h2 { "Held events, longest blocking first" }
        (held_table(&held))
        @if report.quarantined > OVERVIEW_HELD { p { a href="/held" { "All held events" } } }
        h2 { "Relays" }
        (relays_table(&report.relays))
        @if !report.cursors.is_empty() {
            h2 { "Cursors" }
            (cursors_table(&report.cursors))
        }
        h2 { "The last hour" }
        (chart::line("Pending events", &samples, |s| s.pending as f64))
        (chart::line("Oldest pending age (s)", &samples, |s| s.oldest_pending_age_seconds))
        (chart::line("Events published per second", &samples, |s| s.published_per_second))
        h2 { "Stuck aggregates" }
        @if report.stuck_aggregates.is_empty() { p { "None." } } @else {
            table id="stuck" {
                thead { tr { th { "Aggregate" } th { "Waiting" } th { "Pending" } th { "Head" } th { "State" } th { "Last error" } } }
                tbody {
                    @for stuck in &report.stuck_aggregates {
                        tr {
                            td { (stuck.aggregate_type) "/" (stuck.aggregate_id) }
                            td { (age(stuck.oldest_pending_age_seconds)) }
                            td { (stuck.pending) }
                            td { a href={"/events/" (stuck.head_event_id)} { "#" (stuck.head_sequence) " " (stuck.head_event_type) } }
                            td { (stuck.head_state) }
                            td { (stuck.head_last_error.as_deref().unwrap_or("-")) }
                        }
                    }
                }
            }
        }
    };
    page(&state, &identity, "Overview", true, body).into_response()
}

fn card(id: &str, label: &str, value: String) -> Markup {
    html! { div class="card" id={"card-" (id)} { div { (label) } div class="n" { (value) } } }
}

/// The log source's cursors (`handoff relay --source log --cursor NAME`): per cursor, what it
/// has not passed yet and who reads it.
fn cursors_table(cursors: &[CursorSeen]) -> Markup {
    html! {
        table id="cursors" {
            thead { tr { th { "Cursor" } th { "Behind" } th { "Oldest behind" } th { "Lane aggregates" } th { "Reader" } th { "Moved" } } }
            tbody {
                @for cursor in cursors {
                    tr data-cursor=(cursor.cursor) {
                        td { (cursor.cursor) }
                        td class="lag-events" { (cursor.lag_events) }
                        td { (age(cursor.lag_seconds)) }
                        td { (cursor.lane_aggregates) }
                        td {
                            (cursor.owner_relay.as_deref().unwrap_or("-"))
                            @if !cursor.held { " (lease ended)" }
                        }
                        td { (since(cursor.advanced_at)) }
                    }
                }
            }
        }
    }
}

fn relays_table(relays: &[RelaySeen]) -> Markup {
    html! {
        @if relays.is_empty() { p id="no-relays" { "No relay has run on this outbox." } } @else {
            table id="relays" {
                thead { tr { th { "Relay" } th { "State" } th { "Host" } th { "Version" } th { "Last heartbeat" } th { "Last claim" } th { "Last mark" } th { "Published" } th { "Started" } } }
                tbody {
                    @for relay in relays {
                        tr data-relay-id=(relay.relay_id) data-alive=(relay.alive) {
                            td { (relay.relay_id) }
                            td {
                                @if relay.alive {
                                    span class="alive" { "alive" }
                                    @if let Some(reason) = &relay.paused_reason {
                                        " (destination paused: " (reason) ": " (relay.paused_cause.as_deref().unwrap_or("")) ")"
                                    }
                                } @else { span class="stopped" { "stopped" } }
                            }
                            td { (relay.host.as_deref().unwrap_or("-")) " pid " (relay.pid.map_or_else(|| "-".to_owned(), |p| p.to_string())) }
                            td { (relay.version.as_deref().unwrap_or("-")) }
                            td { (since(relay.last_seen)) }
                            td { (relay.last_claim_at.map_or_else(|| "-".to_owned(), since)) }
                            td { (relay.last_mark_at.map_or_else(|| "-".to_owned(), since)) }
                            td class="published" { (relay.published) }
                            td { (since(relay.started_at)) }
                        }
                    }
                }
            }
        }
    }
}

fn held_table(held: &[QuarantinedEvent]) -> Markup {
    html! {
        @if held.is_empty() { p id="no-held" { "No event is held." } } @else {
            table id="held" {
                thead { tr { th { "Event" } th { "Aggregate" } th { "Type" } th { "Held for" } th { "Reason" } th { "Attempts" } th { "Blocks" } th { "Last error" } } }
                tbody {
                    @for event in held {
                        tr data-event-id=(event.event_id) {
                            td { a href={"/events/" (event.event_id)} { (event.event_id) } }
                            td { (event.aggregate_type) "/" (event.aggregate_id) " #" (event.aggregate_sequence) }
                            td { (event.event_type) " v" (event.schema_version) }
                            td { (event.quarantined_at.map_or_else(|| "?".to_owned(), since)) }
                            td class="hold-reason" { (event.hold_reason.as_deref().unwrap_or("-")) }
                            td { (event.attempts) }
                            td { (event.held_behind) " later" }
                            td { (event.reason.as_deref().unwrap_or("-")) }
                        }
                    }
                }
            }
        }
    }
}

pub(crate) async fn held(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
) -> Response {
    let read = async {
        let mut conn = state.pool.acquire().await?;
        Ok::<_, ConsoleError>(
            Quarantine::new(&state.config.schema)
                .list(&mut conn, HELD_LIMIT)
                .await?,
        )
    };
    match read.await {
        Ok(held) => {
            let body = html! { h1 { "Held events, longest blocking first" } (held_table(&held)) };
            page(&state, &identity, "Held events", true, body).into_response()
        }
        Err(error) => error_page(&state, &identity, &error),
    }
}

#[derive(Deserialize)]
pub(crate) struct EventQuery {
    done: Option<String>,
}

async fn show(state: &AppState, id: Uuid) -> Result<EventDetail, ConsoleError> {
    let mut conn = state.pool.acquire().await?;
    Ok(Quarantine::new(&state.config.schema)
        .show(&mut conn, id)
        .await?)
}

/// `value` pretty-printed, cut to `max` bytes (at a character boundary); whether it was cut.
fn pretty(value: &serde_json::Value, max: usize) -> (String, bool) {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    if text.len() <= max {
        return (text, false);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    (text, true)
}

pub(crate) async fn event(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Query(query): Query<EventQuery>,
) -> Response {
    let detail = match show(&state, id).await {
        Ok(detail) => detail,
        Err(error) => return error_page(&state, &identity, &error),
    };
    let csrf = state.csrf.token(&identity);
    let held = detail.state == handoff_postgres::EventState::Quarantined;
    let body = html! {
        h1 { "Event " (id) }
        @if let Some(done) = &query.done { p class="flash" id="flash" { "Done: " (done) "." } }
        table id="event" {
            tr { th { "State" } td id="state" { (detail.state.as_str()) } }
            @if let Some(event) = &detail.event {
                tr { th { "Aggregate" } td { (event.aggregate_type) "/" (event.aggregate_id) " #" (event.aggregate_sequence) } }
                tr { th { "Type" } td { (event.event_type) " v" (event.schema_version) } }
                tr { th { "Occurred" } td { (event.occurred_at.to_rfc3339()) " (" (since(event.occurred_at)) ")" } }
                @if let Some(at) = event.quarantined_at {
                    tr { th { "Held since" } td { (at.to_rfc3339()) " (" (since(at)) ")" } }
                }
                tr { th { "Held by" } td id="hold-reason" { (event.hold_reason.as_deref().unwrap_or("-")) } }
                tr { th { "Attempts" } td id="attempts" { (event.attempts) } }
                tr { th { "Last error" } td id="last-error" { (event.reason.as_deref().unwrap_or("-")) } }
                tr { th { "Blocks" } td { (event.held_behind) " later event(s) of its aggregate" } }
            }
            @if let Some(at) = detail.published_at { tr { th { "Published" } td { (at.to_rfc3339()) } } }
            @if let Some(receipt) = &detail.delivery_receipt { tr { th { "Receipt" } td { (receipt) } } }
            @if let Some(reason) = &detail.skip_reason { tr { th { "Skipped" } td { (reason) } } }
        }
        @if held && !state.config.read_only {
            h2 { "Actions" }
            div class="actions" {
                form method="post" action={"/events/" (id) "/retry"} {
                    input type="hidden" name="csrf" value=(csrf);
                    button type="submit" id="retry" { "Retry" }
                }
                form method="post" action={"/events/" (id) "/skip"} {
                    input type="hidden" name="csrf" value=(csrf);
                    label { "Reason " input type="text" name="reason" id="skip-reason" maxlength="500"; }
                    " "
                    button type="submit" id="skip" { "Skip" }
                }
            }
            @if let Some(payload) = &detail.payload {
                (repair::form(id, &csrf, &pretty(payload, usize::MAX).0))
            }
        }
        @if let Some(headers) = &detail.headers {
            h2 { "Headers" }
            pre id="headers" { (pretty(headers, state.config.max_payload_shown).0) }
        }
        @if let Some(payload) = &detail.payload {
            @let (text, cut) = pretty(payload, state.config.max_payload_shown);
            h2 { "Payload" }
            @if cut {
                p id="payload-cut" { "Cut to its first " (state.config.max_payload_shown) " bytes: "
                    a href={"/events/" (id) "/payload"} download { "download the whole payload" } }
            }
            pre id="payload" { (text) }
        }
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
    page(&state, &identity, "Event", false, body).into_response()
}

/// The whole payload as a JSON file.
pub(crate) async fn payload_download(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
) -> Response {
    match show(&state, id).await {
        Ok(detail) => {
            let text = detail
                .payload
                .map(|p| serde_json::to_string_pretty(&p).unwrap_or_else(|_| p.to_string()))
                .unwrap_or_else(|| "null".to_owned());
            (
                [
                    (header::CONTENT_TYPE, "application/json".to_owned()),
                    (
                        header::CONTENT_DISPOSITION,
                        format!("attachment; filename=\"{id}.json\""),
                    ),
                ],
                text,
            )
                .into_response()
        }
        Err(error) => error_page(&state, &identity, &error),
    }
}

pub(crate) async fn retry(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Form(form): Form<ActionForm>,
) -> Response {
    let result = async {
        check_csrf(&state, &identity, form.csrf.as_deref())?;
        actions::retry(&state, &identity, id).await
    };
    match result.await {
        Ok(_) => Redirect::to(&format!("/events/{id}?done=retried")).into_response(),
        Err(error) => error_page(&state, &identity, &error),
    }
}

pub(crate) async fn skip(
    State(state): State<Arc<AppState>>,
    Extension(identity): Extension<Identity>,
    Path(id): Path<Uuid>,
    Form(form): Form<ActionForm>,
) -> Response {
    let result = async {
        check_csrf(&state, &identity, form.csrf.as_deref())?;
        actions::skip(&state, &identity, id, form.reason.as_deref().unwrap_or("")).await
    };
    match result.await {
        Ok(_) => Redirect::to(&format!("/events/{id}?done=skipped")).into_response(),
        Err(error) => error_page(&state, &identity, &error),
    }
}
