//! The destinations handoff delivers to, by name.
//!
//! One list for every program that lets its user choose a destination: the `handoff` commands'
//! `--destination`, the reference consumers' `--broker`, the chaos run and the demo. Each
//! destination's code lives in its own crate (`handoff-nats`, `handoff-kafka`, ...); this enum
//! only names them. With the `clap` feature it is a `clap::ValueEnum`, so a flag takes it
//! directly; a program that supports only some destinations refuses the others itself.
//!
//! # Examples
//!
//! ```
//! use handoff_core::destination::DestinationKind;
//!
//! let kind: DestinationKind = "redis".parse()?;
//! assert_eq!(kind, DestinationKind::Redis);
//! assert_eq!(kind.to_string(), "redis");
//! assert!(kind.can_read_back());
//! assert!(!DestinationKind::Http.can_read_back());
//! # Ok::<(), handoff_core::destination::UnknownDestination>(())
//! ```

use std::fmt;
use std::str::FromStr;

/// A destination handoff delivers to; spelled in lower case on command lines and in config
/// files (`nats`, `kafka`, `amqp`, `http`, `redis`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum DestinationKind {
    /// NATS JetStream: a stream, deduplicated by event id (`Nats-Msg-Id`).
    #[default]
    Nats,
    /// Kafka: a topic, keyed by aggregate id, through an idempotent producer.
    Kafka,
    /// RabbitMQ (AMQP 0-9-1): an exchange, with publisher confirms.
    Amqp,
    /// An HTTP endpoint (webhook): one POST per event, with `Idempotency-Key`.
    Http,
    /// Redis Streams: one stream key, deduplicated by event id inside a window.
    Redis,
}

impl DestinationKind {
    /// Every destination, in the order above.
    pub const ALL: [DestinationKind; 5] = [
        DestinationKind::Nats,
        DestinationKind::Kafka,
        DestinationKind::Amqp,
        DestinationKind::Http,
        DestinationKind::Redis,
    ];

    /// The name on command lines and in config files: `nats`, `kafka`, `amqp`, `http`, `redis`.
    pub const fn as_str(self) -> &'static str {
        self.facts().name
    }

    /// The broker's name for people: `NATS JetStream`, `Kafka`, `RabbitMQ`, `HTTP endpoint`,
    /// `Redis Streams`.
    pub const fn title(self) -> &'static str {
        self.facts().title
    }

    /// Whether what it stores can be read back (see [`readback`](crate::readback)): a stream
    /// or a topic can; a queue others consume and an HTTP endpoint cannot. `handoff replay`
    /// and `handoff reconcile` refuse a destination that cannot, by this answer.
    pub const fn can_read_back(self) -> bool {
        self.facts().can_read_back
    }

    /// Every fact of one destination, in one row per destination.
    const fn facts(self) -> Facts {
        match self {
            DestinationKind::Nats => Facts {
                name: "nats",
                title: "NATS JetStream",
                can_read_back: true,
            },
            DestinationKind::Kafka => Facts {
                name: "kafka",
                title: "Kafka",
                can_read_back: true,
            },
            DestinationKind::Amqp => Facts {
                name: "amqp",
                title: "RabbitMQ",
                can_read_back: false,
            },
            DestinationKind::Http => Facts {
                name: "http",
                title: "HTTP endpoint",
                can_read_back: false,
            },
            DestinationKind::Redis => Facts {
                name: "redis",
                title: "Redis Streams",
                can_read_back: true,
            },
        }
    }
}

/// What [`DestinationKind`]'s methods answer, for one destination.
struct Facts {
    /// [`DestinationKind::as_str`].
    name: &'static str,
    /// [`DestinationKind::title`].
    title: &'static str,
    /// [`DestinationKind::can_read_back`].
    can_read_back: bool,
}

impl fmt::Display for DestinationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not one of [`DestinationKind`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown destination {0:?} (expected nats, kafka, amqp, http or redis)")]
pub struct UnknownDestination(pub String);

impl FromStr for DestinationKind {
    type Err = UnknownDestination;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        DestinationKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == name)
            .ok_or_else(|| UnknownDestination(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_text_and_serde() {
        for kind in DestinationKind::ALL {
            assert_eq!(kind.as_str().parse::<DestinationKind>(), Ok(kind));
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{kind}\""));
            assert_eq!(
                serde_json::from_str::<DestinationKind>(&json).unwrap(),
                kind
            );
        }
        assert!("NATS".parse::<DestinationKind>().is_err());
    }
}
