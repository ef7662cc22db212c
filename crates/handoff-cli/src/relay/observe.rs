//! What the running relay shows: the `/metrics`, `/healthz` and `/readyz` endpoint (with the
//! destination's readiness probe), the backlog gauges, the other order lane's warnings and the
//! destination pause reported to `handoff status`.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use handoff_core::delivery::Transport;
use handoff_postgres::{Migrator, OrderMode, PollingSource};
use tracing::{info, warn};

use super::settings::Settings;
use crate::args::redact;

/// Warns, every 30 s at most, about what this relay's order mode leaves pending (events the
/// other mode writes, which need a relay in that mode) and about a global lane blocked by a
/// held event.
pub(super) async fn report_other_lane(source: std::sync::Arc<PollingSource>) {
    let order = source.config().order;
    if order == OrderMode::Global {
        metrics::describe_gauge!(
            "handoff_global_lane_blocked",
            "1 while the global lane waits on an event held for an operator (its front, or an \
             earlier event of the front's aggregate), else 0; read every 30 s"
        );
    }
    let mut tick = tokio::time::interval(Duration::from_secs(30));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let lane = match source.other_lane().await {
            Ok(lane) => lane,
            Err(error) => {
                warn!(error = %error, "could not read the other order mode's backlog");
                continue;
            }
        };
        if lane.pending > 0 {
            match order {
                OrderMode::Global => warn!(
                    pending = lane.pending,
                    "per-aggregate (unnumbered) events are pending; this relay runs with \
                     --order global and does not publish them: run a relay with --order \
                     aggregate too, or write them in global order mode"
                ),
                OrderMode::Aggregate => warn!(
                    pending = lane.pending,
                    "events of the global lane are pending; this relay runs with --order \
                     aggregate and leaves them alone: run a relay with --order global"
                ),
            }
        }
        if order == OrderMode::Global && lane.global_front_held {
            tracing::error!(
                global_sequence = lane.global_front,
                "the global lane is blocked by an event held for an operator: nothing after \
                 it is published until it is retried or skipped (`handoff quarantine`)"
            );
        } else if order == OrderMode::Global && lane.global_front_behind_held {
            tracing::error!(
                global_sequence = lane.global_front,
                "the global lane is blocked: its front waits behind a held event of its own \
                 aggregate, and nothing after it is published until that event is retried or \
                 skipped (`handoff quarantine list`)"
            );
        }
        if order == OrderMode::Global {
            metrics::gauge!("handoff_global_lane_blocked").set(if lane.global_lane_blocked() {
                1.0
            } else {
                0.0
            });
        }
    }
}

/// Hands the relay's destination pause to the source's heartbeat every second, for `handoff
/// status` to show beside the relay (`outbox_relays`).
pub(super) async fn report_pause(
    source: std::sync::Arc<PollingSource>,
    status: handoff_relay::RelayStatus,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let pause = status.destination_pause();
        let cause = pause.as_ref().map(|p| redact(&p.cause));
        source.report_destination_pause(
            pause
                .as_ref()
                .map(|p| (p.reason, cause.as_deref().unwrap_or(""))),
        );
    }
}

/// A readiness check of the destination: whether it answers, within a bound the check sets.
type BrokerProbe = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> + Send + Sync,
>;

/// The destination's readiness check, set once the relay is connected to it (`/readyz` says
/// the relay is still connecting until then). A process runs one relay, so one slot.
static BROKER_PROBE: std::sync::OnceLock<BrokerProbe> = std::sync::OnceLock::new();

/// The running relay's view of its destination: `/readyz` says why it paused it. A process
/// runs one relay, so one slot.
pub(super) static RELAY_STATUS: std::sync::OnceLock<handoff_relay::RelayStatus> =
    std::sync::OnceLock::new();

/// How long `/readyz` waits for the database or the destination before it calls them
/// unreachable; below the endpoint's own per-check timeout (2 s), so the reason is theirs.
const READY_TIMEOUT: Duration = Duration::from_millis(1500);

/// Offers `transport` to `/readyz`: the destination is ready when its own readiness wait (the
/// one the relay uses to end a pause) says so within [`READY_TIMEOUT`].
pub(super) fn offer_broker_probe<T: Transport>(transport: &std::sync::Arc<T>) {
    let transport = transport.clone();
    let probe: BrokerProbe = std::sync::Arc::new(move || {
        let transport = transport.clone();
        Box::pin(async move { transport.wait_until_ready(READY_TIMEOUT).await })
    });
    let _ = BROKER_PROBE.set(probe);
}

/// Serves `/metrics` (the relay's metrics, names unchanged), `/healthz` and `/readyz` on
/// `addr`. Ready means: PostgreSQL answers on a connection of the probe's own, handoff's
/// migrations are current, and the destination is connected and answers.
pub(super) async fn install_metrics(
    addr: SocketAddr,
    settings: &Settings,
) -> Result<handoff_telemetry::endpoint::Serving> {
    use handoff_telemetry::endpoint::{Endpoint, NotReady};
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let mut builder = PrometheusBuilder::new();
    let buckets = [
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
    ];
    for name in handoff_relay::metrics::HISTOGRAMS {
        builder = builder.set_buckets_for_metric(Matcher::Full((*name).to_owned()), &buckets)?;
    }
    let handle = builder
        .install_recorder()
        .with_context(|| format!("while serving metrics on {addr}"))?;
    // A connection of its own (see ReadyProbe): a probe must neither wait behind the relay's
    // busy pool nor take a connection the relay needs.
    let probe = std::sync::Arc::new(handoff_postgres::ReadyProbe::new(
        settings.database.clone(),
        vec![Migrator::handoff(settings.polling.schema.clone())],
    ));
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
            let Some(probe) = BROKER_PROBE.get() else {
                return Err(NotReady::new(
                    "broker not connected yet: the relay is still starting",
                ));
            };
            if let Some(pause) = RELAY_STATUS.get().and_then(|s| s.destination_pause()) {
                return Err(NotReady::new(format!(
                    "destination paused ({}): {}",
                    pause.reason,
                    redact(&pause.cause)
                )));
            }
            if probe().await {
                Ok(())
            } else {
                Err(NotReady::new(format!(
                    "broker unreachable: no answer within {READY_TIMEOUT:?}"
                )))
            }
        })
        .serve(addr)
        .await
        .with_context(|| format!("while serving metrics on {addr}"))?;
    info!(
        addr = %serving.addr(),
        "metrics at http://{addr}/metrics, probes at /healthz and /readyz",
        addr = serving.addr()
    );
    Ok(serving)
}

/// Backlog gauges every 5 s (design O1): one cheap query over the pending index.
/// The log source's lag, every 5 seconds: `handoff_cursor_lag_events{cursor}`,
/// `handoff_cursor_lag_seconds{cursor}` and `handoff_cursor_lane_aggregates{cursor}`.
pub(super) async fn report_cursor_lag(source: std::sync::Arc<handoff_postgres::LogSource>) {
    use metrics::{describe_gauge, gauge, Unit};
    describe_gauge!(
        "handoff_cursor_lag_events",
        "Committed events the cursor has not passed yet"
    );
    describe_gauge!(
        "handoff_cursor_lag_seconds",
        Unit::Seconds,
        "Age of the oldest committed event the cursor has not passed"
    );
    describe_gauge!(
        "handoff_cursor_lane_aggregates",
        "Aggregates in the cursor's lane (failed, held, behind a hole, or a backlog from before it)"
    );
    let cursor = source.config().cursor.clone();
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tick.tick().await;
        match source.lag().await {
            Ok(Some(lag)) => {
                let label = [("cursor", cursor.clone())];
                gauge!("handoff_cursor_lag_events", &label).set(lag.events as f64);
                gauge!("handoff_cursor_lag_seconds", &label).set(lag.seconds);
                gauge!("handoff_cursor_lane_aggregates", &label).set(lag.lane_aggregates as f64);
            }
            Ok(None) => {}
            Err(error) => tracing::debug!(error = %error, "could not read the cursor's lag"),
        }
    }
}

pub(super) async fn report_backlog(source: std::sync::Arc<PollingSource>) {
    use metrics::{describe_gauge, gauge, Unit};
    describe_gauge!("handoff_outbox_pending", "Unpublished outbox events");
    describe_gauge!(
        "handoff_quarantined_events",
        "Events held for an operator (attempt cap or permanent refusal)"
    );
    describe_gauge!(
        "handoff_outbox_expired_leases",
        "Leases that ran out unsettled"
    );
    describe_gauge!(
        "handoff_outbox_oldest_pending_age_seconds",
        Unit::Seconds,
        "Age of the oldest unpublished event"
    );
    describe_gauge!(
        "handoff_outbox_stuck_aggregates",
        "Aggregates whose oldest unpublished event is older than --stuck-after"
    );
    describe_gauge!(
        "handoff_outbox_holes",
        "Unpublished events whose predecessor sequence was never written; each holds its aggregate"
    );
    describe_gauge!(
        "handoff_outbox_table_bytes",
        Unit::Bytes,
        "Size of the outbox table with its indexes"
    );
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tick.tick().await;
        match source.backlog().await {
            Ok(backlog) => {
                gauge!("handoff_outbox_pending").set(backlog.pending as f64);
                gauge!("handoff_quarantined_events").set(backlog.held as f64);
                gauge!("handoff_outbox_expired_leases").set(backlog.expired_leases as f64);
                gauge!("handoff_outbox_oldest_pending_age_seconds")
                    .set(backlog.oldest_age.map_or(0.0, |age| age.as_secs_f64()));
                gauge!("handoff_outbox_stuck_aggregates").set(backlog.stuck_aggregates as f64);
                gauge!("handoff_outbox_holes").set(backlog.holes as f64);
                gauge!("handoff_outbox_table_bytes").set(backlog.outbox_bytes as f64);
            }
            Err(error) => warn!(error = %error, "could not read the backlog"),
        }
    }
}
