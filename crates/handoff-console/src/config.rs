//! [`ConsoleConfig`]: what the console shows and who may use it.

use std::net::IpAddr;
use std::time::Duration;

use handoff_core::Limits;
use handoff_postgres::Schema;
use sqlx::PgPool;

use crate::auth::Tokens;
use crate::StatusOptions;

/// How a console runs. Nothing is open by default: without tokens and without a trusted
/// proxy header, every request is refused.
#[derive(Debug, Clone, Default)]
pub struct ConsoleConfig {
    /// Schema of handoff's tables.
    pub schema: Schema,
    /// Bearer tokens; each token's name is the actor its actions are audited under.
    pub tokens: Tokens,
    /// A header a reverse proxy sets to the signed-in user's name (`X-Forwarded-User`),
    /// honoured only from [`trusted_proxies`](Self::trusted_proxies).
    pub trusted_user_header: Option<String>,
    /// Peer addresses whose [`trusted_user_header`](Self::trusted_user_header) and
    /// `X-Forwarded-Proto` are believed.
    pub trusted_proxies: Vec<IpAddr>,
    /// Drop every action: pages show no buttons and action requests are refused.
    pub read_only: bool,
    /// Mark cookies `Secure` always (TLS in front of the console); they are also marked so
    /// when a trusted proxy says `X-Forwarded-Proto: https`.
    pub secure_cookies: bool,
    /// The status reading's thresholds, as `handoff status` takes them.
    pub status: StatusOptions,
    /// How often the console samples the backlog for its charts.
    pub sample_interval: Duration,
    /// How long the charts reach back.
    pub history: Duration,
    /// Payloads longer than this many bytes (pretty-printed) are cut on the page, with a
    /// download link for the whole.
    pub max_payload_shown: usize,
    /// The limits a repaired payload is checked against: those of the application's outbox,
    /// as every enqueue checks them.
    pub limits: Limits,
    /// Consumers whose quarantines the console shows and acts on, each in its own database.
    pub consumers: Vec<ConsumerDatabase>,
}

/// One consumer's database, where its inbox and quarantine live (`--consumer NAME=URL`).
#[derive(Debug, Clone)]
pub struct ConsumerDatabase {
    /// The consumer's name, as its `ConsumerConfig::name`.
    pub name: String,
    /// Schema of the consumer's tables in that database.
    pub schema: Schema,
    /// Connections to it. Its URL is never shown: it may hold a password.
    pub pool: PgPool,
}

impl ConsoleConfig {
    /// The defaults with `schema`: 10 s samples over an hour, payloads cut at 64 KiB.
    pub fn new(schema: Schema) -> Self {
        Self {
            schema,
            sample_interval: Duration::from_secs(10),
            history: Duration::from_secs(3600),
            max_payload_shown: 64 * 1024,
            ..Self::default()
        }
    }

    /// Whether anybody could sign in: a console nobody can use is a configuration mistake.
    ///
    /// # Errors
    ///
    /// A message naming what is missing.
    pub fn validate(&self) -> Result<(), String> {
        if self.tokens.is_empty() && self.trusted_user_header.is_none() {
            return Err(
                "no way to sign in: give --auth-token-file or --trusted-user-header \
                        (the console is never open without either)"
                    .to_owned(),
            );
        }
        if self.trusted_user_header.is_some() && self.trusted_proxies.is_empty() {
            return Err(
                "--trusted-user-header needs --trusted-proxy: the header is honoured \
                        only from the proxy's addresses"
                    .to_owned(),
            );
        }
        for (i, consumer) in self.consumers.iter().enumerate() {
            if let Err(e) =
                handoff_postgres::ConsumerQuarantine::new(&consumer.schema, &consumer.name)
            {
                return Err(format!("--consumer: {e}"));
            }
            if self.consumers[..i].iter().any(|c| c.name == consumer.name) {
                return Err(format!("--consumer {} is given twice", consumer.name));
            }
        }
        if self.sample_interval.is_zero() {
            return Err("the sample interval must be above zero".to_owned());
        }
        Ok(())
    }
}
