//! `--destination redis`: a Redis stream, each event appended once per dedup window.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_core::delivery::{OutboxEvent, PublishError};
use handoff_core::readback::{ReadBack, ReadBackErrorKind, ReadFrom};
use handoff_redis::{RedisConfig, RedisTransport};
use serde::Deserialize;
use serde_json::json;
use tracing::info;

use super::{connect_with_retry, Common, Destination, DestinationKind, ReplayAck, Store};

/// The Redis flags (and config-file keys `redis_url`, `redis_stream`, `redis_dedup_window`).
#[derive(clap::Args, Deserialize, Default, Clone)]
#[command(next_help_heading = "Redis")]
pub struct RedisFlags {
    /// Redis URL [default: redis://127.0.0.1:6379].
    ///
    /// redis://[[user]:password@]host[:port][/db], for `--destination redis`. The password,
    /// if any, is never logged.
    #[arg(
        long,
        env = "HANDOFF_REDIS_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub redis_url: Option<String>,
    /// Redis stream key [default: handoff:outbox].
    ///
    /// The relay's Redis stream; the relay's first append creates it (replay and reconcile
    /// never do).
    #[arg(long, env = "HANDOFF_REDIS_STREAM", value_name = "KEY")]
    pub redis_stream: Option<String>,
    /// How long an event id is remembered [default: 2m].
    ///
    /// How long `--destination redis` remembers an event id: a republish inside this window
    /// appends nothing. Longer than the lease.
    #[arg(long, env = "HANDOFF_REDIS_DEDUP_WINDOW", value_parser = humantime::parse_duration,
        value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub redis_dedup_window: Option<Duration>,
}

impl Destination for RedisFlags {
    const KIND: DestinationKind = DestinationKind::Redis;
    /// Its `Debug` hides the URL's password.
    type Config = RedisConfig;
    type Transport = RedisTransport;
    type Store = RedisTransport;

    fn resolve(&self, common: &Common) -> Result<RedisConfig> {
        let defaults = RedisConfig::default();
        let config = RedisConfig {
            url: self.redis_url.clone().unwrap_or(defaults.url),
            stream: self.redis_stream.clone().unwrap_or(defaults.stream),
            dedup_window: self.redis_dedup_window.unwrap_or(defaults.dedup_window),
            publish_timeout: common.publish_timeout,
            ce_source: common.ce_source.clone().unwrap_or(defaults.ce_source),
            ..defaults
        };
        config.validate()?;
        common.check_dedup_window("redis dedup window", config.dedup_window)?;
        Ok(config)
    }

    // --redis-url and --redis-stream are not refused with another destination: other tools of a
    // deployment read the same variables.
    fn stray(&self) -> Option<&'static str> {
        self.redis_dedup_window
            .is_some()
            .then_some("--redis-dedup-window needs --destination redis")
    }

    async fn connect(config: RedisConfig) -> Result<RedisTransport> {
        let transport = connect_with_retry(
            "Redis",
            || RedisTransport::connect(config.clone()),
            |e: &handoff_redis::ConnectError| {
                e.kind() == handoff_redis::ConnectErrorKind::Unreachable
            },
        )
        .await?;
        info!(stream = %config.stream, "destination ready");
        Ok(transport)
    }

    fn names(config: &RedisConfig) -> serde_json::Map<String, serde_json::Value> {
        let names = json!({ "stream": config.stream });
        names.as_object().cloned().unwrap_or_default()
    }

    fn place(config: &RedisConfig) -> String {
        format!("stream {}", config.stream)
    }

    /// Connects and checks that the relay's stream is there.
    async fn open_store(config: RedisConfig) -> Result<RedisTransport> {
        let stream = config.stream.clone();
        let transport = RedisTransport::connect(config)
            .await
            .context("while connecting to Redis (check --redis-url / HANDOFF_REDIS_URL)")?;
        match transport.read_back(ReadFrom::Start).await {
            Ok(_) => Ok(transport),
            Err(error) if error.kind() == ReadBackErrorKind::NotFound => {
                bail!("stream {stream:?} does not exist (check --redis-stream)")
            }
            Err(error) => Err(error).context(format!("stream {stream:?}")),
        }
    }
}

impl Store for RedisTransport {
    fn location(&self, _event: &OutboxEvent) -> String {
        self.config().stream.clone()
    }

    /// The copy is deduplicated under a key of its own
    /// ([`handoff_redis::replay_dedup_id`]), so the event's dedup window does not drop it; it
    /// is stored when this returns.
    async fn send_replay(
        &self,
        event: &OutboxEvent,
        marker: &str,
    ) -> Result<ReplayAck<'_>, PublishError> {
        self.publish_replay(event, marker).await?;
        Ok(Box::pin(std::future::ready(Ok(()))))
    }
}
