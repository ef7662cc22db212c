//! `--destination amqp`: a RabbitMQ (AMQP 0-9-1) exchange, with publisher confirms. It cannot
//! be read back (the exchange keeps nothing; its queues belong to their consumers).

use std::path::PathBuf;

use anyhow::Result;
use handoff_amqp::{AmqpConfig, AmqpTransport};
use serde::Deserialize;
use tracing::info;

use super::{connect_with_retry, Common, Destination, DestinationKind, Unreadable};

/// The AMQP flags (and config-file keys).
#[derive(clap::Args, Deserialize, Default, Clone)]
#[command(next_help_heading = "AMQP")]
pub struct AmqpFlags {
    /// AMQP broker URL [default: amqp://127.0.0.1:5672/%2f].
    ///
    /// amqp[s]://user:password@host:port/vhost, for `--destination amqp`. The password, if
    /// any, is never logged.
    #[arg(
        long,
        alias = "url",
        env = "HANDOFF_AMQP_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    #[serde(alias = "url")]
    pub amqp_url: Option<String>,
    /// AMQP exchange [default: outbox].
    ///
    /// Exchange of `--destination amqp`; declared as a durable topic exchange when missing.
    /// Routing key: <aggregate_type>.<aggregate_id>.
    #[arg(long, env = "HANDOFF_EXCHANGE")]
    pub exchange: Option<String>,
    /// CA certificate (PEM) for an amqps:// URL.
    ///
    /// With an amqps:// --amqp-url: a CA certificate file (PEM) trusted besides the public
    /// roots, for a broker whose certificate a private CA signed.
    #[arg(long, env = "HANDOFF_AMQP_TLS_CA", value_name = "FILE")]
    pub amqp_tls_ca: Option<PathBuf>,
}

impl Destination for AmqpFlags {
    const KIND: DestinationKind = DestinationKind::Amqp;
    /// Its `Debug` hides the URL's password.
    type Config = AmqpConfig;
    type Transport = AmqpTransport;
    type Store = Unreadable;

    fn resolve(&self, common: &Common) -> Result<AmqpConfig> {
        let defaults = AmqpConfig::default();
        let config = AmqpConfig {
            url: self.amqp_url.clone().unwrap_or(defaults.url),
            exchange: self.exchange.clone().unwrap_or(defaults.exchange),
            publish_timeout: common.publish_timeout,
            ce_source: common.ce_source.clone().unwrap_or(defaults.ce_source),
            connection_name: common.connection_name.clone(),
            tls_ca: self.amqp_tls_ca.clone(),
            ..defaults
        };
        config.validate()?;
        Ok(config)
    }

    fn stray(&self) -> Option<&'static str> {
        self.amqp_tls_ca
            .is_some()
            .then_some("--amqp-tls-ca needs --destination amqp")
    }

    async fn connect(config: AmqpConfig) -> Result<AmqpTransport> {
        let transport = connect_with_retry(
            "RabbitMQ",
            || AmqpTransport::connect(config.clone()),
            |e: &handoff_amqp::ConnectError| {
                e.kind() == handoff_amqp::ConnectErrorKind::Unreachable
            },
        )
        .await?;
        info!(server = transport.server(), exchange = %config.exchange, "destination ready");
        Ok(transport)
    }
}
