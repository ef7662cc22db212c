//! One relay running in this process beside a writer, as `handoff relay` runs it (its
//! defaults, except the wake-up of a scenario), with probes that keep every event's first ack
//! instant: the latency scenarios, the held-xmin run and the writers bench all start it here.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use handoff_core::delivery::{Claim, Failure, Published, Released, Settled, Source, SourceError};
use handoff_nats::JetStreamTransport;
use handoff_postgres::{LogConfig, LogSource, PollingSource};
use handoff_relay::{Relay, RelayConfig, RelayReport};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::drain::{polling_config, ReportSummary};
use super::latency::Scenario;
use super::probe::{Marked, ProbeSource, ProbeTransport};
use super::Bench;

/// Which source a live relay runs (`--source` of `writers` and `held-xmin`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// `handoff relay`'s default: leases and marks in the rows.
    #[default]
    Polling,
    /// `--source log`: the outbox read through the default cursor.
    Log,
}

/// The source of a live relay, either kind (boxed: the log source is the larger by far).
pub enum RelaySource {
    Polling(Box<PollingSource>),
    Log(Box<LogSource>),
}

impl RelaySource {
    /// Stops the writers' notifications on the relay's account.
    pub async fn unregister(&self) -> Result<(), SourceError> {
        match self {
            RelaySource::Polling(s) => s.unregister().await,
            RelaySource::Log(s) => s.unregister().await,
        }
    }
}

impl Source for RelaySource {
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        match self {
            RelaySource::Polling(s) => s.claim(max, max_bytes).await,
            RelaySource::Log(s) => s.claim(max, max_bytes).await,
        }
    }

    async fn mark_published(&self, published: &[Published]) -> Result<(), SourceError> {
        match self {
            RelaySource::Polling(s) => s.mark_published(published).await,
            RelaySource::Log(s) => s.mark_published(published).await,
        }
    }

    async fn record_failures(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        match self {
            RelaySource::Polling(s) => s.record_failures(failures).await,
            RelaySource::Log(s) => s.record_failures(failures).await,
        }
    }

    async fn release(&self, released: &[Released]) -> Result<Settled, SourceError> {
        match self {
            RelaySource::Polling(s) => s.release(released).await,
            RelaySource::Log(s) => s.release(released).await,
        }
    }

    async fn wait_for_work(&self, at_most: std::time::Duration) -> Result<(), SourceError> {
        match self {
            RelaySource::Polling(s) => s.wait_for_work(at_most).await,
            RelaySource::Log(s) => s.wait_for_work(at_most).await,
        }
    }
}

/// A running relay with its probes; [`LiveRelay::stop`] ends it.
pub struct LiveRelay {
    /// Its source: claims and marks timed.
    pub source: Arc<ProbeSource<RelaySource>>,
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
        let pool = bench.pool().await?;
        let polling = polling_config(relay_id, scenario.listen);
        let inner = match bench.source {
            SourceKind::Polling => {
                RelaySource::Polling(Box::new(PollingSource::new(pool, polling)?))
            }
            SourceKind::Log => RelaySource::Log(Box::new(LogSource::new(
                pool,
                LogConfig {
                    polling,
                    ..LogConfig::default()
                },
            )?)),
        };
        let source = Arc::new(ProbeSource::new(
            Arc::new(inner),
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
