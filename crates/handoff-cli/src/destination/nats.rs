//! `--destination nats` (the default): a NATS JetStream stream.

use std::time::Duration;

use anyhow::{Context, Result};
use handoff_core::delivery::{OutboxEvent, PublishError};
use handoff_nats::{ConnectErrorKind, JetStreamConfig, JetStreamTransport, NatsSecurityArgs};
use serde::Deserialize;
use serde_json::json;
use tracing::info;

use super::{connect_with_retry, Common, Destination, DestinationKind, ReplayAck, Store};

/// The NATS flags (and config-file keys).
#[derive(clap::Args, Deserialize, Default, Clone)]
#[command(next_help_heading = "NATS")]
pub struct NatsFlags {
    /// NATS URL [default: nats://127.0.0.1:4222].
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub nats_url: Option<String>,
    /// JetStream stream [default: OUTBOX].
    ///
    /// The relay's JetStream stream; the relay creates it when missing (replay and reconcile
    /// never do).
    #[arg(long, env = "HANDOFF_STREAM")]
    pub stream: Option<String>,
    /// First subject tokens [default: outbox].
    ///
    /// Events go to <prefix>.<aggregate_type>.<aggregate_id>.
    #[arg(long, env = "HANDOFF_SUBJECT_PREFIX", value_name = "PREFIX")]
    pub subject_prefix: Option<String>,
    /// Duplicate window of a stream it creates [default: 2m].
    ///
    /// JetStream duplicate window for a stream this relay creates; longer than the lease.
    #[arg(long, env = "HANDOFF_DUPLICATE_WINDOW", value_parser = humantime::parse_duration,
        value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub duplicate_window: Option<Duration>,
    /// How often the relay pings NATS [default: 5s].
    ///
    /// A connection without an answer to two pings in a row is dropped and reconnected, so a
    /// silent one is found within about three intervals.
    #[arg(long, env = "HANDOFF_NATS_PING_INTERVAL", value_parser = humantime::parse_duration,
        value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub nats_ping_interval: Option<Duration>,
    /// Replicas of a stream it creates [default: 1].
    ///
    /// Replicas of a JetStream stream this relay creates; at most the cluster's servers. An
    /// existing stream with fewer is kept, with a warning.
    #[arg(long, env = "HANDOFF_STREAM_REPLICAS", value_name = "N")]
    pub stream_replicas: Option<usize>,
    /// NATS credentials and TLS files (--nats-creds, --nats-nkey, --nats-tls-ca,
    /// --nats-tls-cert, --nats-tls-key; env HANDOFF_NATS_CREDS, ...; TOML nats_creds, ...).
    #[command(flatten)]
    #[serde(flatten)]
    pub nats_security: NatsSecurityArgs,
}

/// The stream's settings, checked. Its `Debug` hides the URL's password.
pub struct NatsConfig {
    /// The server's URL.
    pub url: String,
    /// The stream, prefix, windows and security.
    pub jetstream: JetStreamConfig,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nats")
            .field("url", &handoff_core::redact::url(&self.url))
            .field("config", &self.jetstream)
            .finish()
    }
}

impl Destination for NatsFlags {
    const KIND: DestinationKind = DestinationKind::Nats;
    type Config = NatsConfig;
    type Transport = JetStreamTransport;
    type Store = JetStreamTransport;

    fn resolve(&self, common: &Common) -> Result<NatsConfig> {
        let defaults = JetStreamConfig::default();
        let jetstream = JetStreamConfig {
            stream: self.stream.clone().unwrap_or(defaults.stream),
            subject_prefix: self
                .subject_prefix
                .clone()
                .unwrap_or(defaults.subject_prefix),
            duplicate_window: self.duplicate_window.unwrap_or(defaults.duplicate_window),
            publish_timeout: common.publish_timeout,
            source: common.ce_source.clone().unwrap_or(defaults.source),
            ping_interval: self.nats_ping_interval.unwrap_or(defaults.ping_interval),
            replicas: self.stream_replicas.unwrap_or(defaults.replicas),
            security: self.nats_security.security(),
        };
        jetstream.validate()?;
        common.check_dedup_window("duplicate window", jetstream.duplicate_window)?;
        Ok(NatsConfig {
            url: self
                .nats_url
                .clone()
                .unwrap_or_else(|| "nats://127.0.0.1:4222".into()),
            jetstream,
        })
    }

    async fn connect(config: NatsConfig) -> Result<JetStreamTransport> {
        let transport = connect_with_retry(
            "NATS",
            || JetStreamTransport::connect(&config.url, config.jetstream.clone()),
            |e: &handoff_nats::ConnectError| e.kind() == ConnectErrorKind::Unreachable,
        )
        .await?;
        let stream = transport
            .ensure_stream()
            .await
            .context("while ensuring the stream")?;
        info!(stream = ?stream, "destination ready");
        Ok(transport)
    }

    fn names(config: &NatsConfig) -> serde_json::Map<String, serde_json::Value> {
        let names = json!({
            "stream": config.jetstream.stream,
            "subject_prefix": config.jetstream.subject_prefix,
        });
        names.as_object().cloned().unwrap_or_default()
    }

    fn place(config: &NatsConfig) -> String {
        format!("stream {}", config.jetstream.stream)
    }

    /// Connects and checks that the relay's stream is there: a replay into a stream that does
    /// not exist would only fail event by event ("no responders").
    async fn open_store(config: NatsConfig) -> Result<JetStreamTransport> {
        let stream = config.jetstream.stream.clone();
        let transport = JetStreamTransport::connect(&config.url, config.jetstream)
            .await
            .context("while connecting to NATS (check --nats-url / NATS_URL)")?;
        handoff_nats::async_nats::jetstream::new(transport.client().clone())
            .get_stream(&stream)
            .await
            .with_context(|| format!("stream {stream:?} (check --stream)"))?;
        Ok(transport)
    }
}

impl Store for JetStreamTransport {
    fn location(&self, event: &OutboxEvent) -> String {
        self.subject(event)
    }

    /// The copy carries a `Nats-Msg-Id` of its own, so the stream's duplicate window does not
    /// drop it ([`handoff_nats::replay_msg_id`]).
    async fn send_replay(
        &self,
        event: &OutboxEvent,
        marker: &str,
    ) -> Result<ReplayAck<'_>, PublishError> {
        let ack = JetStreamTransport::send_replay(self, event, marker).await?;
        Ok(Box::pin(ack.wait()))
    }
}
