//! One relay running in this process beside a writer, as `handoff relay` runs it (its
//! defaults, except the wake-up of a scenario), with probes that keep every event's first ack
//! instant: the latency scenarios, the held-xmin run and the writers bench all start it here.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use handoff_nats::JetStreamTransport;
use handoff_postgres::PollingSource;
use handoff_relay::{Relay, RelayConfig, RelayReport};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::drain::{polling_config, ReportSummary};
use super::latency::Scenario;
use super::probe::{Marked, ProbeSource, ProbeTransport};
use super::Bench;

/// A running relay with its probes; [`LiveRelay::stop`] ends it.
pub struct LiveRelay {
    /// Its source: claims and marks timed.
    pub source: Arc<ProbeSource<PollingSource>>,
    /// Its transport: every event's first ack instant kept.
    pub transport: Arc<ProbeTransport<JetStreamTransport>>,
    stop: watch::Sender<bool>,
    task: JoinHandle<RelayReport>,
}

impl LiveRelay {
    /// Starts relay `relay_id` on the bench's database with its own pool, publishing through
    /// `transport`; call times are measured from `origin`.
    pub async fn start(
        bench: &Bench,
        relay_id: &str,
        scenario: Scenario,
        transport: JetStreamTransport,
        origin: Instant,
    ) -> Result<Self> {
        let polling = PollingSource::new(
            bench.pool().await?,
            polling_config(relay_id, scenario.listen),
        )?;
        let source = Arc::new(ProbeSource::new(
            Arc::new(polling),
            origin,
            Marked::new(origin, None),
        ));
        let transport = Arc::new(ProbeTransport::new(transport, true));
        let config = RelayConfig {
            poll_interval: scenario.poll_interval,
            ..RelayConfig::default()
        };
        let relay = Relay::from_shared(source.clone(), transport.clone(), config)?;
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(relay.run(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        }));
        Ok(LiveRelay {
            source,
            transport,
            stop,
            task,
        })
    }

    /// Stops the relay, waits for it and unregisters its wake-up; what it reported. The
    /// probes stay readable afterwards.
    pub async fn stop(&mut self) -> Result<ReportSummary> {
        self.stop.send_replace(true);
        let report = ReportSummary::from((&mut self.task).await?);
        self.source.inner().unregister().await?;
        Ok(report)
    }
}
