//! `--destination http`: one POST per event to an endpoint (a webhook), with Idempotency-Key.
//! It cannot be read back (the receiver keeps what it was sent, not handoff).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_core::delivery::Transport;
use handoff_http::{HttpConfig, HttpMode, HttpTransport, SigningSecret};
use serde::Deserialize;
use tracing::info;

use super::{Common, Destination, DestinationKind, Unreadable};

/// The HTTP flags (and config-file keys). The signing secret comes from HANDOFF_HTTP_SECRET
/// only, so it stays out of process listings, config files and logs.
#[derive(clap::Args, Deserialize, Default, Clone)]
#[command(next_help_heading = "HTTP")]
pub struct HttpFlags {
    /// URL every event is POSTed to (required with http).
    ///
    /// With --destination http; redirects are not followed. The signing secret comes from
    /// HANDOFF_HTTP_SECRET only.
    #[arg(
        long,
        env = "HANDOFF_ENDPOINT",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub endpoint: Option<String>,
    /// CloudEvents mode: binary or structured [default: binary].
    ///
    /// With --destination http: `binary` (payload as body, attributes as headers) or
    /// `structured` (application/cloudevents+json).
    #[arg(long, env = "HANDOFF_HTTP_MODE", value_name = "MODE")]
    pub http_mode: Option<HttpMode>,
    /// Longest a POST may take [default: --publish-timeout].
    ///
    /// With --destination http: longest a publish may take, slot wait and response body
    /// included [default: the --publish-timeout, 5s].
    #[arg(long, env = "HANDOFF_HTTP_TIMEOUT", value_parser = humantime::parse_duration,
        value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub http_timeout: Option<Duration>,
    /// Most requests in flight at once [default: 64].
    ///
    /// With --destination http: over all aggregates.
    #[arg(long, env = "HANDOFF_HTTP_CONCURRENCY", value_name = "N")]
    pub http_concurrency: Option<usize>,
}

impl Destination for HttpFlags {
    const KIND: DestinationKind = DestinationKind::Http;
    type Config = HttpConfig;
    type Transport = HttpTransport;
    type Store = Unreadable;

    fn resolve(&self, common: &Common) -> Result<HttpConfig> {
        let Some(endpoint) = self.endpoint.clone() else {
            bail!(
                "--destination http needs --endpoint, HANDOFF_ENDPOINT or endpoint in the config"
            );
        };
        let defaults = HttpConfig::default();
        let config = HttpConfig {
            endpoint,
            mode: self.http_mode.unwrap_or_default(),
            request_timeout: common.publish_timeout,
            concurrency: self.http_concurrency.unwrap_or(defaults.concurrency),
            ce_source: common.ce_source.clone().unwrap_or(defaults.ce_source),
            signing_secret: http_secret()?,
        };
        config.validate()?;
        Ok(config)
    }

    fn publish_timeout(&self, general: Duration) -> Duration {
        self.http_timeout.unwrap_or(general)
    }

    async fn connect(config: HttpConfig) -> Result<HttpTransport> {
        let transport = HttpTransport::new(config.clone())?;
        let ready = transport.wait_until_ready(Duration::from_secs(1)).await;
        info!(
            endpoint = transport.endpoint(),
            mode = config.mode.as_str(),
            signed = config.signing_secret.is_some(),
            reachable = ready,
            "destination ready"
        );
        Ok(transport)
    }
}

/// The signing secret of the http destination: environment only, so it stays out of process
/// listings, config files and logs.
fn http_secret() -> Result<Option<SigningSecret>> {
    match std::env::var("HANDOFF_HTTP_SECRET") {
        Ok(text) if text.is_empty() => Ok(None),
        Ok(text) => Ok(Some(
            SigningSecret::parse(&text).context("in HANDOFF_HTTP_SECRET")?,
        )),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => bail!("HANDOFF_HTTP_SECRET is not UTF-8"),
    }
}
