//! What a running consumer shows: `/metrics`, `/healthz` and `/readyz`, with the database's
//! and the broker's readiness checks.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use handoff_postgres::{Migrator, ReadyProbe};
use handoff_telemetry::endpoint::{Endpoint, NotReady, Serving};
use sqlx::postgres::PgConnectOptions;
use tracing::info;

use super::logging::redact;
use super::RunError;

/// Buckets of `handoff_consumer_apply_seconds`, in seconds.
const APPLY_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// A readiness check of the broker: `Err` with the reason when it is not reachable.
type BrokerProbe =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), NotReady>> + Send>> + Send + Sync>;

/// The broker's readiness check, set once the consumer has subscribed (`/readyz` says the
/// consumer is still connecting until then). A process runs one consumer, so one slot.
static BROKER_PROBE: OnceLock<BrokerProbe> = OnceLock::new();

/// How long `/readyz` waits for the database or the broker before it calls them
/// unreachable; below the endpoint's own per-check timeout (2 s), so the reason is theirs.
pub(super) const READY_TIMEOUT: Duration = Duration::from_millis(1500);

/// Offers `probe` to `/readyz` as the broker's readiness check.
pub(super) fn offer_broker_probe<F, Fut>(probe: F)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), NotReady>> + Send + 'static,
{
    let probe: BrokerProbe = Arc::new(move || Box::pin(probe()));
    let _ = BROKER_PROBE.set(probe);
}

/// Serves `/metrics` (names unchanged), `/healthz` and `/readyz` on `addr`. Ready means:
/// PostgreSQL answers on a connection of the probe's own, the consumer's migrations (handoff's
/// and its own) are current, and the broker is reachable.
pub(super) async fn install_metrics(
    addr: SocketAddr,
    options: &PgConnectOptions,
    migrators: [Migrator; 2],
) -> Result<Serving, RunError> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let error = |source| RunError::Metrics { addr, source };
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("handoff_consumer_apply_seconds".to_owned()),
            APPLY_BUCKETS,
        )
        .map_err(error)?
        .install_recorder()
        .map_err(error)?;
    // A connection of its own (see ReadyProbe): a probe must neither wait behind the
    // consumer's busy pool nor take a connection an event needs.
    let probe = Arc::new(ReadyProbe::new(options.clone(), migrators.to_vec()));
    let serving = Endpoint::new(handle)
        .check("database", move || {
            let probe = probe.clone();
            async move {
                probe
                    .check(READY_TIMEOUT)
                    .await
                    .map_err(|e| NotReady::new(redact(&e.to_string())))
            }
        })
        .check("broker", || async {
            match BROKER_PROBE.get() {
                Some(probe) => probe().await,
                None => Err(NotReady::new(
                    "broker not connected yet: the consumer is still starting",
                )),
            }
        })
        .serve(addr)
        .await
        .map_err(|source| RunError::Endpoint { addr, source })?;
    info!(
        addr = %serving.addr(),
        "metrics at http://{addr}/metrics, probes at /healthz and /readyz",
        addr = serving.addr()
    );
    Ok(serving)
}
