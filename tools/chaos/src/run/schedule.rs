//! The fault schedule: which process (or server) is killed when, drawn from the seed.

use super::*;

/// The kind of a process the run starts, and may kill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// `order-service`.
    OrderService,
    /// `handoff relay`.
    Relay,
    /// The `inventory` consumer.
    Inventory,
    /// The `payments` consumer.
    Payments,
    /// `payment-provider`.
    PaymentProvider,
    /// The private nats-server.
    NatsServer,
    /// The private PostgreSQL server (its postmaster).
    Postgres,
}

impl Kind {
    /// Every kind, in report order.
    pub const ALL: [Kind; 7] = [
        Kind::OrderService,
        Kind::Relay,
        Kind::Inventory,
        Kind::Payments,
        Kind::PaymentProvider,
        Kind::NatsServer,
        Kind::Postgres,
    ];

    /// The kind's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::OrderService => "order-service",
            Kind::Relay => "relay",
            Kind::Inventory => "inventory",
            Kind::Payments => "payments",
            Kind::PaymentProvider => "payment-provider",
            Kind::NatsServer => "nats-server",
            Kind::Postgres => "postgres",
        }
    }

    /// How many instances of the kind run.
    pub(crate) fn instances(self) -> usize {
        match self {
            Kind::Relay => 3,
            Kind::Inventory | Kind::Payments => 2,
            _ => 1,
        }
    }

    /// How long a restart takes at most beyond its pause, as the schedule assumes: the
    /// servers recover their stores, the services reconnect.
    pub(super) fn restart_allowance(self) -> Duration {
        match self {
            Kind::Postgres | Kind::NatsServer => Duration::from_secs(3),
            _ => Duration::from_secs(1),
        }
    }
}

/// One planned kill: at `at` after the start of the load, SIGKILL `instance` of `kind`, and
/// start it again `pause` later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fault {
    /// When, from the start of the load.
    #[serde(serialize_with = "millis")]
    pub at: Duration,
    /// What is killed.
    pub kind: Kind,
    /// Which instance of it (0 for the singletons).
    pub instance: usize,
    /// How long it stays down.
    #[serde(serialize_with = "millis")]
    pub pause: Duration,
}

pub(super) fn millis<S: serde::Serializer>(
    value: &Duration,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_u64(u64::try_from(value.as_millis()).unwrap_or(u64::MAX))
}

/// The fault schedule of `seed` over `duration`: a function of both alone, so the same seed
/// gives the same kills at the same times.
///
/// Kills come every 0.4 to 2 s; each picks a kind of process (dealt from a shuffled deck of the
/// seven kinds, so each comes about once per round of seven), then one of its instances, and keeps it
/// down for 0.2 to 1.5 s. A target still down (by
/// the schedule's reckoning, pause plus a restart allowance) is not picked again, and neither
/// is the last relay, or the last instance of a consumer, still up: one of each always
/// recovers while the others are down.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_chaos::run::schedule;
///
/// let a = schedule(7, Duration::from_secs(20));
/// assert!(!a.is_empty());
/// assert_eq!(a, schedule(7, Duration::from_secs(20)));
/// ```
pub fn schedule(seed: u64, duration: Duration) -> Vec<Fault> {
    schedule_of(seed, duration, &Kind::ALL)
}

/// The fault schedule of `seed` over `duration` for a run on `destination`: [`schedule`] over
/// the destination's [`fault_targets`](Destination::fault_targets) only.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_chaos::run::{schedule, schedule_for, Destination, Kind};
///
/// let nats = schedule_for(7, Duration::from_secs(20), Destination::Nats);
/// assert_eq!(nats, schedule(7, Duration::from_secs(20)));
/// let kafka = schedule_for(7, Duration::from_secs(20), Destination::Kafka);
/// assert!(kafka.iter().all(|fault| fault.kind != Kind::NatsServer));
/// ```
pub fn schedule_for(seed: u64, duration: Duration, destination: Destination) -> Vec<Fault> {
    schedule_of(seed, duration, &destination.fault_targets())
}

/// The schedule over the process kinds `kinds`.
pub(super) fn schedule_of(seed: u64, duration: Duration, kinds: &[Kind]) -> Vec<Fault> {
    let mut rng = StdRng::seed_from_u64(seed);
    let targets: Vec<(Kind, usize)> = kinds
        .iter()
        .flat_map(|&kind| (0..kind.instances()).map(move |i| (kind, i)))
        .collect();
    let mut busy_until: BTreeMap<(Kind, usize), Duration> = BTreeMap::new();
    let mut faults = Vec::new();
    let mut deck: Vec<Kind> = Vec::new();
    let mut at = Duration::from_millis(rng.random_range(500..1500));
    // The last second is left without kills: the restarts land before the faults stop.
    let end = duration.saturating_sub(Duration::from_secs(1));
    while at < end {
        let down = |kind: Kind, instance: usize| {
            busy_until
                .get(&(kind, instance))
                .is_some_and(|&until| until > at)
        };
        let open: Vec<(Kind, usize)> = targets
            .iter()
            .copied()
            .filter(|&(kind, instance)| {
                if down(kind, instance) {
                    return false;
                }
                let others_up = (0..kind.instances())
                    .filter(|&i| i != instance && !down(kind, i))
                    .count();
                kind.instances() == 1 || others_up > 0
            })
            .collect();
        // The kind first, dealt from a shuffled deck of every kind, then the instance: each
        // kind (the two servers as much as the three relays) is hit once in every round of
        // seven kills, so even a short run kills each of them.
        if deck.is_empty() {
            deck = kinds.to_vec();
            deck.shuffle(&mut rng);
        }
        let dealt = deck
            .iter()
            .position(|kind| open.iter().any(|&(k, _)| k == *kind))
            .map(|index| deck.remove(index));
        if let Some(kind) = dealt {
            let instances: Vec<usize> = open
                .iter()
                .filter(|&&(k, _)| k == kind)
                .map(|&(_, i)| i)
                .collect();
            let instance = instances[rng.random_range(0..instances.len())];
            let pause = Duration::from_millis(rng.random_range(200..1500));
            busy_until.insert((kind, instance), at + pause + kind.restart_allowance());
            faults.push(Fault {
                at,
                kind,
                instance,
                pause,
            });
        }
        at += Duration::from_millis(rng.random_range(400..2000));
    }
    faults
}
