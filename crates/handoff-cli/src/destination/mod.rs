//! Where events go: `--destination` and one file per destination.
//!
//! `handoff relay`, `handoff replay` and `handoff reconcile` take the same [`DestinationArgs`]:
//! the `--destination` choice and every destination's flags, each flag written once in its
//! destination's file, in a struct that derives both the clap arguments and the serde settings
//! of the relay's config file (a flag or its variable wins over the file's key). The relay
//! connects the chosen destination through [`DestinationArgs::dispatch`] and runs over its
//! transport; `replay` and `reconcile` open its [`Store`] (read-back and replayed copies), and
//! refuse, on one line, a destination that cannot be read back.
//!
//! # Adding a destination
//!
//! A destination is its own crate, `crates/handoff-<name>/` (transport, intake, read-back, and
//! its `tests/it/conformance.rs` running `handoff_test::conformance_suite!`), plus these files and
//! no others. New files:
//!
//! - `crates/handoff-cli/src/destination/<name>.rs`, shaped like [`kafka`]: a `<Name>Flags`
//!   struct deriving `clap::Args`, `serde::Deserialize`, `Default` and `Clone`, every field an
//!   `Option` (the default is applied in `resolve` and named in the flag's doc as
//!   `[default: ...]`), flag names that say whose they are (`--redis-url`, not `--url`: every
//!   destination's flags share one command line and one config file), durations with
//!   `value_parser = humantime::parse_duration` and `#[serde(default, with =
//!   "humantime_serde")]`. Then `impl Destination for <Name>Flags`: [`Destination::KIND`],
//!   [`Destination::resolve`] (flags and [`Common`] into the library's config, checked),
//!   [`Destination::connect`] (the relay's transport, retried while the broker is unreachable,
//!   with [`connect_with_retry`]) and, when [`DestinationKind::can_read_back`],
//!   [`Destination::open_store`] with a [`Store`] (its crate's `ReadBack` plus
//!   [`Store::location`] and [`Store::send_replay`]; see `nats.rs`, where the transport is
//!   the store, and `kafka.rs`, where a transport and a reader make one) and
//!   [`Destination::names`] / [`Destination::place`] for the commands' output; otherwise
//!   `type Store = Unreadable;` (a test here checks that the two agree).
//! - `crates/handoff-cli/tests/it/destination_<name>.rs` (and its `mod` line in
//!   `tests/it/main.rs`): relays killed under concurrent writers
//!   leave every committed event once, in order per aggregate; `replay` and `reconcile` when
//!   it can be read back.
//! - `tools/test/src/<name>.rs`: the test support (its server, a scratch stream or topic of
//!   the test's own, reading it back).
//! - `examples/consumers/tests/it/<name>.rs` (and its `mod` line), when it has an intake.
//!
//! Existing files, one place in each unless said:
//!
//! 1. `Cargo.toml`: the workspace member and its dependency line.
//! 2. `crates/handoff-core/src/destination.rs`: a [`DestinationKind`] variant (its doc line is
//!    the value's help; the serde name is the lowercase variant), its place in
//!    [`DestinationKind::ALL`], and its row of facts (name, title, whether it can be read
//!    back). The reference consumers, the chaos run and the demo share this one list.
//! 3. `crates/handoff-cli/Cargo.toml`: the crate.
//! 4. This file: `pub mod <name>;`, a `#[command(flatten)] #[serde(flatten)]` field of
//!    [`DestinationArgs`] with the destination in its `--destination` doc line, and one arm
//!    in `DestinationArgs::visit`, the only match over every destination here.
//! 5. `crates/handoff/Cargo.toml` and 6. `crates/handoff/src/lib.rs`: the facade's feature
//!    and re-export.
//! 7. `examples/consumers/Cargo.toml` and 8. `examples/consumers/src/common/broker.rs`: the
//!    reference consumers' flags and arm, when it has an intake.
//! 9. `tools/test/Cargo.toml` and 10. `tools/test/src/lib.rs`: the test support module.
//! 11. `.ci/run`: starting its server.
//! 12. `README.md`, 13. `docs/destinations.md`, 14. `docs/operations.md` and, when it can be
//!     read back, 15. `docs/ops/replay-and-reconcile.md`.
//!
//! Nothing else changes: `relay/`, `replay.rs` and `reconcile.rs` only see [`Visit`]. The
//! config file takes every new flag under its name with `_` for `-` by itself (its known keys
//! are the relay's clap argument ids); a flag whose TOML form differs (such as Kafka's
//! `--kafka-option` and `[kafka]` table) gives the flag the key's id (`#[arg(id = "kafka")]`)
//! and the file-only field `#[arg(skip)]`.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use anyhow::{bail, Result};
use handoff_core::delivery::{OutboxEvent, PublishError, Transport};
use handoff_core::readback::{MessageScan, ReadBack, ReadBackError, ReadFrom, StoredMessage};
use handoff_relay::Backoff;
use serde::Deserialize;
use tracing::warn;

pub mod amqp;
pub mod http;
pub mod kafka;
pub mod nats;
pub mod redis;

pub use handoff_core::destination::DestinationKind;

/// `--destination` and every destination's flags: flattened into a command's arguments and
/// into the relay's config file.
#[derive(clap::Args, Deserialize, Default, Clone)]
#[command(next_help_heading = "Destination")]
pub struct DestinationArgs {
    /// nats, kafka, amqp, http or redis [default: nats].
    ///
    /// `nats` (JetStream; --nats-url, --stream, --subject-prefix), `kafka` (--kafka-brokers,
    /// --topic), `amqp` (RabbitMQ; --amqp-url, --exchange), `http` (POST to --endpoint) or
    /// `redis` (Redis Streams; --redis-url, --redis-stream).
    #[arg(
        long,
        env = "HANDOFF_DESTINATION",
        value_enum,
        hide_possible_values = true,
        help_heading = "Destination"
    )]
    pub destination: Option<DestinationKind>,
    #[command(flatten)]
    #[serde(flatten)]
    pub nats: nats::NatsFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub kafka: kafka::KafkaFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub amqp: amqp::AmqpFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub http: http::HttpFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub redis: redis::RedisFlags,
}

impl DestinationArgs {
    /// The chosen destination.
    pub fn kind(&self) -> DestinationKind {
        self.destination.unwrap_or_default()
    }

    /// Runs `visit` with the chosen destination's flags, after refusing flags only another
    /// destination takes.
    pub async fn dispatch<V: Visit>(&self, visit: V) -> Result<V::Output> {
        self.refuse_strays().await?;
        self.visit(self.kind(), visit).await
    }

    /// Runs `visit` with `kind`'s flags: the one match over every destination.
    async fn visit<V: Visit>(&self, kind: DestinationKind, visit: V) -> Result<V::Output> {
        match kind {
            DestinationKind::Nats => visit.visit(&self.nats).await,
            DestinationKind::Kafka => visit.visit(&self.kafka).await,
            DestinationKind::Amqp => visit.visit(&self.amqp).await,
            DestinationKind::Http => visit.visit(&self.http).await,
            DestinationKind::Redis => visit.visit(&self.redis).await,
        }
    }

    /// A flag only one destination takes, given with another, is a mistake, not a no-op.
    async fn refuse_strays(&self) -> Result<()> {
        /// The message naming a flag of a destination that was given.
        struct Stray;

        impl Visit for Stray {
            type Output = Option<&'static str>;

            async fn visit<D: Destination>(self, destination: &D) -> Result<Self::Output> {
                Ok(destination.stray())
            }
        }

        let chosen = self.kind();
        for other in DestinationKind::ALL.into_iter().filter(|&k| k != chosen) {
            if let Some(stray) = self.visit(other, Stray).await? {
                bail!("{stray}");
            }
        }
        Ok(())
    }
}

/// What a command does with the chosen destination, for any destination.
pub trait Visit {
    /// What the command returns.
    type Output;

    /// Runs the command with the chosen destination's flags.
    async fn visit<D: Destination>(self, destination: &D) -> Result<Self::Output>;
}

/// What a destination's flags need from the command around them.
#[derive(Debug, Clone)]
pub struct Common {
    /// The client id where the broker keeps one (Kafka): `handoff-relay`, `handoff-replay`.
    pub client_id: String,
    /// The connection's name where the broker shows one (RabbitMQ's `rabbitmqctl
    /// list_connections`): which relay holds it.
    pub connection_name: String,
    /// Longest wait for the destination's acknowledgement.
    pub publish_timeout: Duration,
    /// CloudEvents `ce-source` of the published events [default: each library's, `handoff`].
    pub ce_source: Option<String>,
    /// The relay's lease, when a relay runs: a deduplication window must outlast it.
    pub lease: Option<Duration>,
}

impl Common {
    /// Refuses a deduplication window (`what`, such as `duplicate window`) that does not
    /// outlast the relay's lease: a republish after a lease expiry would not be deduplicated.
    /// Without a lease (replay, reconcile) any window does.
    pub fn check_dedup_window(&self, what: &str, window: Duration) -> Result<()> {
        if let Some(lease) = self.lease {
            if window <= lease {
                bail!(
                    "{what} of {} must be longer than the lease of {}: a republish after a \
                     lease expiry would not be deduplicated",
                    humantime::format_duration(window),
                    humantime::format_duration(lease)
                );
            }
        }
        Ok(())
    }

    /// What `replay` and `reconcile` (`application`, such as `handoff-replay`) connect with:
    /// the relay's default publish timeout, no lease.
    pub fn operator(application: &str) -> Common {
        Common {
            client_id: application.to_owned(),
            connection_name: application.replace('-', " "),
            publish_timeout: handoff_nats::JetStreamConfig::default().publish_timeout,
            ce_source: None,
            lease: None,
        }
    }
}

/// One destination: its flags, resolved into its library's settings, connected.
pub trait Destination {
    /// Which destination it is. Its name, its title and whether it can be read back are
    /// [`DestinationKind`]'s, not restated here: `replay` and `reconcile` refuse a destination
    /// whose [`DestinationKind::can_read_back`] is false before they open its store.
    const KIND: DestinationKind;
    /// Its library's settings, checked; their `Debug` shows no password.
    type Config: std::fmt::Debug + Send;
    /// What the relay publishes through.
    type Transport: Transport;
    /// What `replay` and `reconcile` read and republish through: [`Unreadable`] exactly when
    /// [`DestinationKind::can_read_back`] says it cannot be read back (a test checks that
    /// they agree).
    type Store: Store;

    /// The settings these flags and `common` give, checked.
    fn resolve(&self, common: &Common) -> Result<Self::Config>;

    /// The time to wait for an acknowledgement, when this destination has a flag of its own
    /// for it.
    fn publish_timeout(&self, general: Duration) -> Duration {
        general
    }

    /// A message naming a flag of this destination that was given, for when another
    /// destination is chosen: a flag no other destination reads is refused then.
    fn stray(&self) -> Option<&'static str> {
        None
    }

    /// The relay's transport: connected (retrying, and saying so, while the broker cannot be
    /// reached), its stream or topic ensured, ready logged.
    async fn connect(config: Self::Config) -> Result<Self::Transport>;

    /// The destination's names for a command's JSON summary (`stream`, `topic`, ...).
    fn names(config: &Self::Config) -> serde_json::Map<String, serde_json::Value> {
        let _ = config;
        serde_json::Map::new()
    }

    /// Where the messages are, for a person: `stream OUTBOX`, `topic outbox`.
    fn place(config: &Self::Config) -> String {
        let _ = config;
        format!("the {} destination", Self::KIND)
    }

    /// The store `replay` and `reconcile` work on, connected once (no retry: an operator is
    /// waiting) and checked to exist.
    async fn open_store(config: Self::Config) -> Result<Self::Store> {
        let _ = config;
        Err(cannot_read_back(Self::KIND.as_str()))
    }
}

/// The pending acknowledgement of one replayed copy.
pub type ReplayAck<'a> = Pin<Box<dyn Future<Output = Result<(), PublishError>> + Send + 'a>>;

/// A destination as `replay` and `reconcile` see it: read back through the read-back seam, and
/// sent replayed copies (the relay's message plus `Handoff-Replay: <marker>`).
pub trait Store: ReadBack {
    /// Where the relay stores `event`, as [`StoredMessage::subject`] reports it.
    fn location(&self, event: &OutboxEvent) -> String;

    /// Sends a replayed copy of `event`; the returned acknowledgement resolves once the
    /// destination stored it. Copies sent one after another are stored in that order.
    async fn send_replay(
        &self,
        event: &OutboxEvent,
        marker: &str,
    ) -> Result<ReplayAck<'_>, PublishError>;
}

/// The store of a destination that cannot be read back: it has no values.
pub enum Unreadable {}

impl ReadBack for Unreadable {
    type Scan = Unreadable;

    async fn read_back(&self, _from: ReadFrom) -> Result<Unreadable, ReadBackError> {
        match *self {}
    }
}

impl MessageScan for Unreadable {
    async fn next(&mut self) -> Result<Option<StoredMessage>, ReadBackError> {
        match *self {}
    }
}

impl Store for Unreadable {
    fn location(&self, _event: &OutboxEvent) -> String {
        match *self {}
    }

    async fn send_replay(
        &self,
        _event: &OutboxEvent,
        _marker: &str,
    ) -> Result<ReplayAck<'_>, PublishError> {
        match *self {}
    }
}

/// The refusal of `replay` and `reconcile` for a destination that keeps no copy of what it
/// was sent.
pub fn cannot_read_back(name: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "--destination {name} cannot be read back: it keeps no copy of what it was sent, so \
         there is nothing to compare or replay into; use the relay's delivery receipts instead \
         (docs/operations.md, \"Destinations that cannot be read back\")"
    )
}

/// Connects with `connect`, retrying with backoff (and saying what it waits for) while
/// `unreachable` says the broker cannot be reached yet; any other error (a malformed URL, a bad
/// configuration, refused credentials) ends the command at once.
pub async fn connect_with_retry<T, E, F, Fut>(
    broker: &str,
    mut connect: F,
    unreachable: impl Fn(&E) -> bool,
) -> Result<T>
where
    E: std::error::Error + Send + Sync + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let backoff = Backoff {
        initial: Duration::from_millis(200),
        max: Duration::from_secs(10),
    };
    for attempt in 1u32.. {
        match connect().await {
            Ok(transport) => return Ok(transport),
            Err(error) if unreachable(&error) => {
                let delay = backoff.delay(attempt);
                warn!(error = %error, retry_in = ?delay, "waiting for {broker}");
                tokio::time::sleep(delay).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
    unreachable!("the retry loop only ends by returning")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a destination's code says of itself: its kind, and whether its store can be read.
    struct Facts;

    impl Visit for Facts {
        type Output = (DestinationKind, bool);

        async fn visit<D: Destination>(self, _destination: &D) -> Result<Self::Output> {
            let readable = std::any::type_name::<D::Store>() != std::any::type_name::<Unreadable>();
            Ok((D::KIND, readable))
        }
    }

    #[tokio::test]
    async fn every_destination_agrees_with_its_kind() {
        for kind in DestinationKind::ALL {
            let args = DestinationArgs {
                destination: Some(kind),
                ..DestinationArgs::default()
            };
            let (said, readable) = args.dispatch(Facts).await.unwrap();
            assert_eq!(said, kind, "--destination {kind} dispatches to {said}");
            assert_eq!(
                readable,
                kind.can_read_back(),
                "{kind}: a Store of its own exactly when DestinationKind::can_read_back"
            );
        }
    }
}
