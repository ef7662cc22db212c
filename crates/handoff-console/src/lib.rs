//! The handoff web console and admin HTTP API (`handoff console`): one axum [`Router`] over
//! an outbox's PostgreSQL schema.
//!
//! Its place in the workspace: a library beside `handoff-cli`, which serves it; it reads with
//! `handoff-postgres`'s [`Status`](handoff_postgres::Status) and
//! [`Quarantine`](handoff_postgres::Quarantine), and acts through the same `Quarantine` calls
//! `handoff quarantine retry|skip|repair` use, audited the same way (`outbox_quarantine_actions`).
//!
//! - Pages: the overview (backlog, relays alive and stopped, charts of the last hour), held
//!   events the longest blocking first, one event in full with its audit trail, retry and skip.
//!   Server-rendered HTML (`maud` escapes every value: payloads, headers and errors are hostile
//!   input), one small stylesheet and script embedded in the binary, a Content-Security-Policy
//!   that runs no inline script.
//! - `/api/v1/`: the same reads and actions as JSON, in `handoff status --json`'s and
//!   `handoff quarantine list --json`'s shapes; `/api/v1/openapi.json` describes it.
//! - Nothing is open: bearer tokens ([`Tokens`]), or a trusted proxy's user header. Forms carry
//!   an anti-forgery token; cookies are HttpOnly and SameSite=Strict.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_console::{Console, ConsoleConfig, Tokens};
//! use handoff_postgres::Schema;
//!
//! # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let mut config = ConsoleConfig::new(Schema::default());
//! config.tokens = Tokens::parse("alice:s3cret")?;
//! let console = Console::new(pool, config)?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8089").await?;
//! console.serve(listener, std::future::pending()).await?;
//! # Ok(())
//! # }
//! ```

mod actions;
mod api;
mod assets;
mod auth;
mod chart;
mod config;
mod csrf;
mod diff;
mod error;
mod event_json;
pub mod format;
mod pages;
mod readings;
mod sampler;
mod status;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use sqlx::PgPool;

pub use auth::Tokens;
pub use config::{ConsoleConfig, ConsumerDatabase};
pub use error::{ConsoleError, ConsoleErrorKind};
pub use event_json::event_json;
pub use sampler::{History, Sample};
pub use status::{Alert, Sagas, StatusDocument, StatusOptions};

/// What every handler shares.
pub(crate) struct AppState {
    pub pool: PgPool,
    pub config: ConsoleConfig,
    pub sessions: auth::Sessions,
    pub csrf: csrf::CsrfKey,
    pub history: History,
    pub readings: Arc<readings::Readings>,
}

impl AppState {
    /// The latest status reading, or a new one when it is stale (see [`readings`]), with the
    /// relays read now: they are cheap to read, and a relay that stopped must show as stopped
    /// within its heartbeat bound, not a reading later.
    pub(crate) async fn status(&self) -> Result<readings::Reading, ConsoleError> {
        let mut reading = self
            .readings
            .get(
                &self.pool,
                &self.config.schema,
                self.config.status,
                self.config.sample_interval,
            )
            .await?;
        let mut conn = self.pool.acquire().await?;
        let relays = handoff_postgres::Status::new(&self.config.schema)
            .relays(&mut conn)
            .await?;
        reading.document = std::sync::Arc::new(
            (*reading.document)
                .clone()
                .with_relays(relays, self.config.status),
        );
        Ok(reading)
    }
}

/// A console over one outbox: its router, and the sampler behind its charts.
pub struct Console {
    state: Arc<AppState>,
}

impl Console {
    /// A console reading and acting through `pool`.
    ///
    /// # Errors
    ///
    /// [`ConsoleError::BadRequest`] when `config` fails [`ConsoleConfig::validate`].
    pub fn new(pool: PgPool, config: ConsoleConfig) -> Result<Self, ConsoleError> {
        config.validate().map_err(ConsoleError::BadRequest)?;
        Ok(Self {
            state: Arc::new(AppState {
                pool,
                config,
                sessions: auth::Sessions::default(),
                csrf: csrf::CsrfKey::random(),
                history: History::default(),
                readings: Arc::default(),
            }),
        })
    }

    /// The backlog samples the charts draw.
    pub fn history(&self) -> History {
        self.state.history.clone()
    }

    /// The router: pages, `/api/v1/`, the embedded assets. Serve it with connect info
    /// (`into_make_service_with_connect_info::<SocketAddr>()`), as [`serve`](Self::serve)
    /// does: the trusted-proxy check needs the peer's address.
    pub fn router(&self) -> Router {
        let protected = Router::new()
            .route("/", get(pages::overview))
            .route("/held", get(pages::held))
            .route("/events/{id}", get(pages::event))
            .route("/events/{id}/payload", get(pages::payload_download))
            .route("/events/{id}/retry", post(pages::retry))
            .route("/events/{id}/skip", post(pages::skip))
            .route("/events/{id}/repair", post(pages::repair))
            .route("/consumers", get(pages::consumers))
            .route("/consumers/{name}/rows/{row}", get(pages::consumer_row))
            .route(
                "/consumers/{name}/rows/{row}/retry",
                post(pages::consumer_row_retry),
            )
            .route(
                "/consumers/{name}/rows/{row}/skip",
                post(pages::consumer_row_skip),
            )
            .route("/sagas", get(pages::sagas))
            .route("/sagas/{id}", get(pages::saga))
            .route("/sagas/{id}/resume", post(pages::saga_resume))
            .route("/sagas/{id}/resolve", post(pages::saga_resolve))
            .route("/logout", post(pages::logout))
            .route("/api/v1/status", get(api::status))
            .route("/api/v1/quarantine", get(api::quarantine_list))
            .route("/api/v1/samples", get(api::samples))
            .route("/api/v1/events/{id}", get(api::event))
            .route("/api/v1/events/{id}/retry", post(api::retry))
            .route("/api/v1/events/{id}/skip", post(api::skip))
            .route("/api/v1/events/{id}/repair", post(api::repair))
            .route("/api/v1/consumers", get(api::consumers))
            .route(
                "/api/v1/consumers/{name}/quarantine",
                get(api::consumer_list),
            )
            .route(
                "/api/v1/consumers/{name}/quarantine/{row}",
                get(api::consumer_show),
            )
            .route(
                "/api/v1/consumers/{name}/quarantine/{row}/retry",
                post(api::consumer_retry),
            )
            .route(
                "/api/v1/consumers/{name}/quarantine/{row}/skip",
                post(api::consumer_skip),
            )
            .route("/api/v1/sagas", get(api::sagas))
            .route("/api/v1/sagas/{id}", get(api::saga))
            .route("/api/v1/sagas/{id}/resume", post(api::saga_resume))
            .route("/api/v1/sagas/{id}/resolve", post(api::saga_resolve))
            .route("/api/v1/openapi.json", get(api::openapi))
            .route_layer(middleware::from_fn_with_state(
                self.state.clone(),
                require_identity,
            ));
        Router::new()
            .route("/login", get(pages::login_form).post(pages::login))
            .route("/assets/console.css", get(assets::css))
            .route("/assets/console.js", get(assets::js))
            .merge(protected)
            .layer(middleware::from_fn(security_headers))
            .with_state(self.state.clone())
    }

    /// Serves the console on `listener` until `shutdown` completes, sampling the backlog
    /// meanwhile.
    ///
    /// # Errors
    ///
    /// The listener failed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops serving and sampling.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let state = &self.state;
        let sampler = tokio::spawn(sampler::run(
            state.pool.clone(),
            state.config.schema.clone(),
            state.config.status,
            state.readings.clone(),
            state.history.clone(),
            state.config.sample_interval,
            state.config.history,
        ));
        // Aborts the sampler however serving ends, a dropped future included.
        let _sampler = AbortOnDrop(sampler);
        axum::serve(
            listener,
            self.router()
                .into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(shutdown)
        .await
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Lets through only requests that prove who sent them, with the [`auth::Identity`] in the
/// request's extensions; the others get 401 (JSON under `/api/`, the sign-in page elsewhere).
async fn require_identity(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut request: Request,
    next: Next,
) -> Response {
    match auth::identify(&state.config, &state.sessions, request.headers(), peer) {
        Ok(identity) => {
            request.extensions_mut().insert(identity);
            next.run(request).await
        }
        Err(error) if request.uri().path().starts_with("/api/") => {
            api::error_response(&error).into_response()
        }
        Err(error) => pages::login_page(Some(&error.public_message()), error.status()),
    }
}

/// What every answer carries: no inline script runs, nothing frames the console, nothing is
/// cached or sniffed, no referrer leaves.
async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// `(path, method)` of every `/api/v1/` route the router above declares, read from this
    /// file's source: the document cannot drift from the routes without this test failing.
    fn routed() -> BTreeSet<(String, String)> {
        let source = include_str!("lib.rs");
        let source = &source[..source.find("#[cfg(test)]").unwrap_or(source.len())];
        let mut routes = BTreeSet::new();
        for (at, _) in source.match_indices("\"/api/v1/") {
            let path = &source[at + 1..];
            let path = &path[..path.find('"').expect("a closed literal")];
            let rest = &source[at..];
            let method = ["get(", "post("]
                .iter()
                .filter_map(|m| rest.find(m).map(|i| (i, m.trim_end_matches('('))))
                .min()
                .expect("a method after the path")
                .1;
            routes.insert((path.to_owned(), method.to_owned()));
        }
        routes
    }

    #[test]
    fn the_openapi_document_names_every_api_route_and_no_other() {
        let document: serde_json::Value =
            serde_json::from_str(include_str!("openapi.json")).unwrap();
        let documented: BTreeSet<(String, String)> = document["paths"]
            .as_object()
            .unwrap()
            .iter()
            .flat_map(|(path, item)| {
                item.as_object()
                    .unwrap()
                    .keys()
                    .map(move |method| (path.clone(), method.clone()))
            })
            .collect();
        let routed = routed();
        assert!(routed.len() >= 17, "{routed:?}");
        assert_eq!(routed, documented);
    }
}
