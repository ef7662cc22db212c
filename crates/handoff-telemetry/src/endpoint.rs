//! The HTTP endpoint every long-running handoff binary serves on its metrics address
//! (`--metrics-addr`, `HANDOFF_METRICS_ADDR`): `handoff relay` and the reference consumers.
//!
//! - `GET /metrics`: the Prometheus text exposition of the process's `metrics` recorder, as
//!   metrics-exporter-prometheus's own listener served it (same names, same `text/plain`).
//! - `GET /healthz`: liveness. `200 {"alive":true}` whenever the process answers HTTP at all;
//!   it checks nothing else, so an orchestrator restarts the process only when it is wedged,
//!   never because a database it cannot fix is down.
//! - `GET /readyz`: readiness. Runs the checks the binary supplied (database reachable,
//!   broker reachable, schema current, ...) concurrently, each bounded by a timeout, and
//!   answers `200 {"ready":true,...}` when all pass, otherwise `503` with the first failure's
//!   reason: `{"ready":false,"reason":"database unreachable: ...","checks":{...}}`.
//!
//! Why one server of our own rather than the exporter's `http-listener`: that listener serves
//! the exposition on every path and nothing else, and an orchestrator's probes need their own
//! answers on the same port (one port per container to expose and secure).
//!
//! Readiness stays cheap however often it is probed: one run of the checks is shared by every
//! probe that arrives while it runs, and its result is reused for [`Endpoint::cache_for`]
//! (1 s by default). Reasons are shown to whoever can reach the port, so they must never hold
//! a secret; URLs' user information is removed from them here as a second line of defence.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

/// A readiness check's verdict when it fails: why, in one line an operator can act on, such
/// as `database unreachable: connection refused`. Never a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotReady(pub String);

impl NotReady {
    /// A failed check's reason.
    pub fn new(reason: impl Into<String>) -> NotReady {
        NotReady(reason.into())
    }
}

type CheckFuture = Pin<Box<dyn Future<Output = Result<(), NotReady>> + Send>>;
type CheckFn = Arc<dyn Fn() -> CheckFuture + Send + Sync>;

/// One named readiness check.
#[derive(Clone)]
struct Check {
    name: &'static str,
    run: CheckFn,
}

/// Why the endpoint could not be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// The address could not be bound (in use, not local, no permission).
    #[error("while binding {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

/// The metrics-and-probes endpoint, built with the checks `/readyz` runs.
///
/// # Examples
///
/// ```no_run
/// use handoff_telemetry::endpoint::{Endpoint, NotReady};
/// use metrics_exporter_prometheus::PrometheusBuilder;
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let handle = PrometheusBuilder::new().install_recorder()?;
/// let serving = Endpoint::new(handle)
///     .check("database", || async { Err(NotReady::new("database unreachable: refused")) })
///     .serve("127.0.0.1:9090".parse()?)
///     .await?;
/// println!("probes at http://{}/readyz", serving.addr());
/// // Keep `serving` for as long as the process runs: dropping it stops the server.
/// # Ok(())
/// # }
/// ```
pub struct Endpoint {
    handle: PrometheusHandle,
    checks: Vec<Check>,
    timeout: Duration,
    cache_for: Duration,
}

impl Endpoint {
    /// An endpoint serving `handle`'s metrics, with no readiness check yet (`/readyz` is then
    /// always 200).
    pub fn new(handle: PrometheusHandle) -> Endpoint {
        Endpoint {
            handle,
            checks: Vec::new(),
            timeout: Duration::from_secs(2),
            cache_for: Duration::from_secs(1),
        }
    }

    /// Adds a readiness check called `name` (the key in `/readyz`'s `checks`). `check` is
    /// called once per readiness run; it should answer within [`timeout`](Self::timeout),
    /// past which it counts as failed with reason `<name> check timed out after ...`.
    pub fn check<F, Fut>(mut self, name: &'static str, check: F) -> Endpoint
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), NotReady>> + Send + 'static,
    {
        self.checks.push(Check {
            name,
            run: Arc::new(move || Box::pin(check()) as CheckFuture),
        });
        self
    }

    /// The longest one check may run [default: 2 s]. Probes of orchestrators time out too
    /// (Kubernetes: 1 s by default; set `timeoutSeconds` above this).
    pub fn timeout(mut self, timeout: Duration) -> Endpoint {
        self.timeout = timeout;
        self
    }

    /// How long a readiness result is reused [default: 1 s], so a burst of probes (several
    /// orchestrators, a load balancer) costs one run of the checks.
    pub fn cache_for(mut self, cache_for: Duration) -> Endpoint {
        self.cache_for = cache_for;
        self
    }

    /// Binds `addr` and serves the endpoint on a task of the current tokio runtime, with the
    /// recorder's periodic upkeep (which its own listener used to run).
    ///
    /// # Errors
    ///
    /// [`EndpointError::Bind`] when `addr` cannot be bound.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is served until it returns.
    pub async fn serve(self, addr: SocketAddr) -> Result<Serving, EndpointError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| EndpointError::Bind { addr, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| EndpointError::Bind { addr, source })?;
        let upkeep_handle = self.handle.clone();
        let upkeep = tokio::spawn(async move {
            // The interval the exporter's own listener used: drains histogram samples so they
            // do not pile up between scrapes.
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                upkeep_handle.run_upkeep();
            }
        });
        let state = Arc::new(Shared {
            handle: self.handle,
            checks: self.checks,
            timeout: self.timeout,
            cache_for: self.cache_for,
            last: tokio::sync::Mutex::new(None),
        });
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(state);
        let server = tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                tracing::error!(%error, "the metrics endpoint stopped");
            }
        });
        Ok(Serving {
            addr: bound,
            tasks: [server, upkeep],
        })
    }
}

/// A running endpoint. Dropping it stops the server (and the recorder's upkeep).
#[derive(Debug)]
pub struct Serving {
    addr: SocketAddr,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl Serving {
    /// The bound address (the real port when port 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// What every request shares.
struct Shared {
    handle: PrometheusHandle,
    checks: Vec<Check>,
    timeout: Duration,
    cache_for: Duration,
    /// The last readiness result and when it was taken. A tokio mutex, held across the
    /// checks on purpose: probes that arrive during a run wait for it instead of starting
    /// their own.
    last: tokio::sync::Mutex<Option<(Instant, Readiness)>>,
}

/// One readiness run: each check's outcome, in the order they were added.
#[derive(Clone)]
struct Readiness {
    outcomes: Vec<(&'static str, Result<(), NotReady>)>,
}

impl Readiness {
    fn first_failure(&self) -> Option<&NotReady> {
        self.outcomes.iter().find_map(|(_, o)| o.as_ref().err())
    }

    fn body(&self) -> ReadyBody {
        let checks = self
            .outcomes
            .iter()
            .map(|(name, outcome)| {
                let shown = match outcome {
                    Ok(()) => "ok".to_owned(),
                    Err(NotReady(reason)) => scrub(reason),
                };
                (*name, shown)
            })
            .collect();
        let reason = self.first_failure().map(|NotReady(reason)| scrub(reason));
        ReadyBody {
            ready: reason.is_none(),
            reason,
            checks,
        }
    }
}

/// `/readyz`'s body, its fields in this order: `{"ready":false,"reason":"...","checks":{...}}`.
#[derive(serde::Serialize)]
struct ReadyBody {
    ready: bool,
    /// The first failed check's reason; absent when ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    /// Every check's outcome by name: `ok`, or its reason.
    checks: std::collections::BTreeMap<&'static str, String>,
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain")],
        shared.handle.render(),
    )
        .into_response()
}

async fn healthz() -> Response {
    axum::Json(serde_json::json!({ "alive": true })).into_response()
}

async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let readiness = {
        let mut last = shared.last.lock().await;
        match &*last {
            Some((at, readiness)) if at.elapsed() < shared.cache_for => readiness.clone(),
            _ => {
                let readiness = run_checks(&shared).await;
                *last = Some((Instant::now(), readiness.clone()));
                readiness
            }
        }
    };
    let status = if readiness.first_failure().is_some() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, axum::Json(readiness.body())).into_response()
}

async fn run_checks(shared: &Shared) -> Readiness {
    let timeout = shared.timeout;
    // Concurrently, so the run takes as long as the slowest check, not their sum.
    let runs: Vec<_> = shared
        .checks
        .iter()
        .map(|check| {
            let run = (check.run)();
            (check.name, tokio::spawn(tokio::time::timeout(timeout, run)))
        })
        .collect();
    let mut outcomes = Vec::with_capacity(runs.len());
    for (name, run) in runs {
        let outcome = match run.await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_elapsed)) => Err(NotReady(format!(
                "{name} check timed out after {timeout:?}"
            ))),
            Err(panicked) => Err(NotReady(format!("{name} check failed: {panicked}"))),
        };
        outcomes.push((name, outcome));
    }
    Readiness { outcomes }
}

/// `text` with the user information (`user:password@`) of every URL in it replaced by `***`.
fn scrub(text: &str) -> String {
    let mut shown = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        shown.push_str(before);
        // The authority ends at the first character that cannot be in it.
        let end = after
            .find(|c: char| "/?#,\"'".contains(c) || c.is_whitespace())
            .unwrap_or(after.len());
        match after[..end].rfind('@') {
            Some(userinfo_end) => {
                shown.push_str("***");
                shown.push_str(&after[userinfo_end..end]);
            }
            None => shown.push_str(&after[..end]),
        }
        rest = &after[end..];
    }
    shown.push_str(rest);
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_information_is_scrubbed_from_reasons() {
        assert_eq!(
            scrub("database unreachable: postgres://app:s3cret@db:5432/app refused"),
            "database unreachable: postgres://***@db:5432/app refused"
        );
        assert_eq!(
            scrub("nats://tok@a:4222,nats://u:p@b:4222 down"),
            "nats://***@a:4222,nats://***@b:4222 down"
        );
        assert_eq!(scrub("no url here"), "no url here");
        assert_eq!(scrub("http://host:80/x@y"), "http://host:80/x@y");
    }
}
