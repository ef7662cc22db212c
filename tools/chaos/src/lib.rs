//! Proof tooling for handoff: the invariant checker behind `handoff-chaos check` (design V2).
//!
//! [`check`] reads the order service's database (orders, idempotency records, outbox), the
//! whole JetStream stream, and optionally the reference consumers' databases, and returns a
//! [`Report`] whose `violations` is empty exactly when every invariant holds:
//!
//! 1. every committed mutation (an idempotency record: the order at `version` n) has exactly
//!    one outbox event, at sequence n (`lost_intent`, `duplicate_intent`);
//! 2. every outbox event belongs to a committed mutation (`phantom_event`);
//! 3. every outbox event is in the stream, and every stream message is an outbox event
//!    (`unpublished_intent`, `phantom_message`); further copies count as duplicates absorbed;
//! 4. the first copies of an aggregate's events come in sequence order 1, 2, 3 ...
//!    (`swapped_pair`, `gap`);
//! 5. each consumer applied each event exactly once (`missing_effect`, `double_effect`,
//!    `phantom_effect`, `sequence_mismatch`).
//!
//! An event an operator skipped (`handoff quarantine skip`) is delivered as a skip marker: it is
//! in the stream and in each consumer's inbox like any event, but its business effect must be
//! absent (`skipped_applied` when it is not); [`Report::skipped`] counts them.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_chaos::{check, CheckConfig};
//!
//! # async fn example() -> Result<(), handoff_chaos::CheckError> {
//! let report = check(&CheckConfig {
//!     database_url: "postgres://postgres@127.0.0.1/orders".into(),
//!     nats_url: "nats://127.0.0.1:4222".into(),
//!     stream: "HANDOFF".into(),
//!     subject_prefix: "handoff".into(),
//!     inventory_database_url: None,
//!     payments_database_url: None,
//!     provider_url: None,
//! })
//! .await?;
//! assert!(report.holds(), "first counter-example: {:?}", report.first_violation);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod backlog;
pub mod run;
pub mod stream;

use std::collections::{BTreeMap, HashMap, HashSet};

use handoff_core::intake::ReceivedEvent;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

use crate::stream::StreamMessage;

/// The `aggregate_type` of the order service's events.
const ORDER: &str = order_service::events::AGGREGATE_TYPE;

/// Whether the outbox row `o` is not published yet, whichever source the relays use: the
/// polling source and the log source's lane write `published_at`; the log source's default
/// cursor has published every event its settled snapshot sees, except those its lane holds
/// (migration 0021; the `outbox_published` view says when, at a cost this check need not pay).
pub(crate) const UNPUBLISHED_SQL: &str = "\
o.published_at IS NULL
AND NOT coalesce((
    SELECT o.txid IS NOT NULL
           AND pg_visible_in_snapshot(o.txid, c.settled_snapshot)
           AND NOT EXISTS (
               SELECT 1
               FROM outbox_cursor_lanes l
               WHERE l.cursor_name = c.cursor_name
                 AND l.aggregate_type = o.aggregate_type
                 AND l.aggregate_id = o.aggregate_id
                 AND l.from_sequence <= o.aggregate_sequence
                 AND (l.released_through IS NULL OR l.released_through >= o.aggregate_sequence))
    FROM outbox_cursors c
    WHERE c.cursor_name = 'default'), false)";

/// What [`check`] reads.
#[derive(Debug, Clone)]
pub struct CheckConfig {
    /// The order service's database (orders, idempotency records, outbox).
    pub database_url: String,
    /// The NATS server.
    pub nats_url: String,
    /// The JetStream stream the relay publishes to.
    pub stream: String,
    /// The relay's subject prefix; only messages under it are checked.
    pub subject_prefix: String,
    /// The inventory consumer's database, when its effects are to be checked.
    pub inventory_database_url: Option<String>,
    /// The payments consumer's database, when its effects are to be checked.
    pub payments_database_url: Option<String>,
    /// The payment provider's base URL (`GET {url}/charges`), when its charges are to be checked.
    pub provider_url: Option<String>,
}

/// Why [`check`] could not run (not a violation: the system could not be read).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// A database could not be read.
    #[error("could not read a database")]
    Database(#[from] sqlx::Error),
    /// The stream could not be read.
    #[error("nats: {0}")]
    Nats(String),
    /// A Kafka topic or a RabbitMQ queue could not be read.
    #[error("{0}")]
    Broker(String),
    /// The payment provider could not be read.
    #[error("could not read the payment provider's charges")]
    Provider(#[from] reqwest::Error),
    /// A stored row does not have the shape the checker expects.
    #[error("unexpected data: {0}")]
    Data(String),
}

/// The kind of a [`Violation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// A committed mutation has no outbox event.
    LostIntent,
    /// A committed mutation has more than one outbox event.
    DuplicateIntent,
    /// An outbox event without a committed mutation (its order or its command is absent).
    PhantomEvent,
    /// An outbox event that is not in the stream.
    UnpublishedIntent,
    /// A stream message that is no outbox event.
    PhantomMessage,
    /// Two events of one aggregate came in the stream in the wrong order.
    SwappedPair,
    /// An aggregate's events in the stream skip a sequence.
    Gap,
    /// A consumer did not apply an event (or its business effect is short).
    MissingEffect,
    /// A consumer applied an event's effect more than once.
    DoubleEffect,
    /// A consumer holds an effect of an event that does not exist.
    PhantomEffect,
    /// A consumer's last applied sequence differs from the aggregate's last sequence.
    SequenceMismatch,
    /// An event an operator skipped went out with its payload, or a consumer holds its
    /// business effect: a skip must leave no effect.
    SkippedApplied,
}

/// One counter-example: what is wrong, and the ids and sequences involved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// What is wrong.
    pub kind: ViolationKind,
    /// The aggregate, when one is involved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aggregate_id: Option<String>,
    /// The events involved (outbox `event_id`, `ce-id`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub event_ids: Vec<Uuid>,
    /// Aggregate sequences involved, in the order of `event_ids` where both are given.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sequences: Vec<i64>,
    /// Stream sequences involved.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stream_sequences: Vec<u64>,
    /// The consumer, for an effect violation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    /// A sentence for people.
    pub detail: String,
}

impl Violation {
    fn new(kind: ViolationKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            aggregate_id: None,
            event_ids: Vec::new(),
            sequences: Vec::new(),
            stream_sequences: Vec::new(),
            consumer: None,
            detail: detail.into(),
        }
    }

    fn aggregate(mut self, id: &str) -> Self {
        self.aggregate_id = Some(id.to_owned());
        self
    }

    fn events(mut self, ids: &[Uuid], sequences: &[i64]) -> Self {
        self.event_ids = ids.to_vec();
        self.sequences = sequences.to_vec();
        self
    }

    fn consumer(mut self, name: &str) -> Self {
        self.consumer = Some(name.to_owned());
        self
    }
}

/// Effects counted for one consumer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerCounts {
    /// Rows in its inbox (`processed_events`) under its name.
    pub inbox: u64,
    /// Business effect rows (stock SKUs, payments).
    pub effects: u64,
    /// Inbox rows of events an operator skipped: recorded, deliberately not applied.
    pub skipped: u64,
}

/// What [`check`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Orders in the service's database.
    pub orders: u64,
    /// Committed mutations (idempotency records).
    pub mutations: u64,
    /// Outbox events, of every aggregate type, archived ones included.
    pub intents: u64,
    /// Messages in the stream under the subject prefix.
    pub stream_messages: u64,
    /// Further copies of an event already in the stream (replays, second publishes).
    pub duplicates_absorbed: u64,
    /// Outbox events an operator skipped (`handoff quarantine skip`): delivered as skip
    /// markers, their business effect expected to be absent.
    pub skipped: u64,
    /// Per consumer checked, its counts.
    pub effects: BTreeMap<String, ConsumerCounts>,
    /// Every violation found; empty when all holds.
    pub violations: Vec<Violation>,
    /// The first of `violations`, the counter-example to start from.
    pub first_violation: Option<Violation>,
    /// Only in a check of a system still catching up ([`check_catching_up`]): per part of the
    /// system (`relay`, or a consumer's name), the events it has not reached yet, which are
    /// not judged. Empty in a plain [`check`] and once everything is caught up.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub behind: BTreeMap<String, u64>,
}

impl Report {
    /// Whether every invariant holds.
    pub fn holds(&self) -> bool {
        self.violations.is_empty()
    }

    /// Whether every event was reached by every part of the system checked (always so for a
    /// plain [`check`]): `false` means the check judged only what had been reached.
    pub fn caught_up(&self) -> bool {
        self.behind.values().all(|&n| n == 0)
    }

    /// The kinds of the violations found, in order, each once.
    pub fn kinds(&self) -> Vec<ViolationKind> {
        let mut kinds: Vec<ViolationKind> = Vec::new();
        for v in &self.violations {
            if !kinds.contains(&v.kind) {
                kinds.push(v.kind);
            }
        }
        kinds
    }
}

/// An outbox row, as the checker needs it.
#[derive(Debug, Clone, sqlx::FromRow)]
struct Intent {
    event_id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    aggregate_sequence: i64,
    event_type: String,
    schema_version: i32,
    payload: serde_json::Value,
    /// Held by an operator (`handoff quarantine`): not published on purpose.
    quarantined: bool,
    /// Skipped by an operator (`handoff quarantine skip`): published as a skip marker, never
    /// to be applied.
    skipped: bool,
    /// Not yet published and not held: a relay has still to reach it.
    pending: bool,
}

/// Reads everything and checks every invariant.
///
/// # Errors
///
/// [`CheckError`] when a database, the stream or the provider cannot be read.
pub async fn check(config: &CheckConfig) -> Result<Report, CheckError> {
    // The database first: with both unreachable, the database is what the user must fix first.
    let pool = connect(&config.database_url).await?;
    let client = async_nats::connect(&config.nats_url)
        .await
        .map_err(|e| CheckError::Nats(format!("connect to {}: {e}", config.nats_url)))?;
    let messages = stream::read_stream(&client, &config.stream, &config.subject_prefix).await?;
    check_with(config, pool, &messages).await
}

/// Checks every invariant as [`check`] does, against `messages` read from another destination
/// than `config`'s stream (a Kafka topic, a RabbitMQ queue: see [`stream`]), in the order the
/// destination holds them. `config`'s NATS fields are not used.
///
/// # Errors
///
/// [`CheckError`] when a database or the provider cannot be read.
pub async fn check_messages(
    config: &CheckConfig,
    messages: &[StreamMessage],
) -> Result<Report, CheckError> {
    let pool = connect(&config.database_url).await?;
    check_with(config, pool, messages).await
}

/// How far each consumer had got on the broker, read BEFORE the consumers' databases: what
/// [`check_catching_up`] needs to tell an event a consumer has not reached yet from one it lost.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Positions {
    /// Per consumer name, its ack floor: the stream sequence at or below which the broker holds
    /// every message as acknowledged by that consumer (JetStream's `ack_floor.stream_seq`). A
    /// consumer acknowledges only after its transaction committed, so an event whose every copy
    /// is at or below the floor was applied, or lost. A consumer without a floor here is
    /// credited only with the events no relay has published yet.
    pub ack_floors: BTreeMap<String, u64>,
}

/// Reads the ack floor of each of `consumers` (durable names) on `stream`; a consumer whose info
/// cannot be read is left out, which makes the check stricter, never looser.
///
/// # Errors
///
/// [`CheckError::Nats`] when the server or the stream cannot be reached.
pub async fn ack_floors(
    nats_url: &str,
    stream: &str,
    consumers: &[&str],
) -> Result<Positions, CheckError> {
    let client = async_nats::connect(nats_url)
        .await
        .map_err(|e| CheckError::Nats(format!("connect to {nats_url}: {e}")))?;
    let stream = async_nats::jetstream::new(client)
        .get_stream(stream)
        .await
        .map_err(|e| CheckError::Nats(format!("stream {stream}: {e}")))?;
    let mut positions = Positions::default();
    for &name in consumers {
        match stream.consumer_info(name).await {
            Ok(info) => {
                positions
                    .ack_floors
                    .insert(name.to_owned(), info.ack_floor.stream_sequence);
            }
            Err(error) => tracing::warn!(%error, consumer = name, "no ack floor"),
        }
    }
    Ok(positions)
}

/// Checks a system that may still be catching up (its consumers, or its relays, behind): as
/// [`check`], except that an event a part of the system has provably not reached yet is counted
/// in [`Report::behind`] instead of judged. Everything else is judged as strictly as by
/// [`check`], so a real loss is still a violation:
///
/// - a relay has not reached an outbox event that is neither published nor held;
/// - a consumer has not reached an event above its last applied sequence for the aggregate
///   (`consumer_sequences`, advanced in the effect's transaction) that the relay has not
///   published yet, or of which a copy lies above the consumer's ack floor in `positions`.
///
/// An event at or below the consumer's last applied sequence without its inbox row, or whose
/// every copy was acknowledged, stays a `missing_effect`. The system must be still (its relays
/// and consumers stopped) while it is read, and `positions` read before it: a consumer that
/// applies events between the reads of its inbox and its effects would look inconsistent.
///
/// # Errors
///
/// [`CheckError`] when a database, the stream or the provider cannot be read.
pub async fn check_catching_up(
    config: &CheckConfig,
    positions: &Positions,
) -> Result<Report, CheckError> {
    let pool = connect(&config.database_url).await?;
    let client = async_nats::connect(&config.nats_url)
        .await
        .map_err(|e| CheckError::Nats(format!("connect to {}: {e}", config.nats_url)))?;
    let messages = stream::read_stream(&client, &config.stream, &config.subject_prefix).await?;
    check_with_positions(config, pool, &messages, Some(positions)).await
}

/// [`check_catching_up`] against `messages` read from another destination (see
/// [`check_messages`]).
///
/// # Errors
///
/// [`CheckError`] when a database or the provider cannot be read.
pub async fn check_messages_catching_up(
    config: &CheckConfig,
    messages: &[StreamMessage],
    positions: &Positions,
) -> Result<Report, CheckError> {
    let pool = connect(&config.database_url).await?;
    check_with_positions(config, pool, messages, Some(positions)).await
}

/// Checks every invariant over the order service's database behind `pool` and `messages`.
async fn check_with(
    config: &CheckConfig,
    pool: PgPool,
    messages: &[StreamMessage],
) -> Result<Report, CheckError> {
    check_with_positions(config, pool, messages, None).await
}

/// As [`check_with`]; with `positions`, what a part of the system has not reached yet is counted
/// as behind rather than judged (see [`check_catching_up`]).
async fn check_with_positions(
    config: &CheckConfig,
    pool: PgPool,
    messages: &[StreamMessage],
    positions: Option<&Positions>,
) -> Result<Report, CheckError> {
    let mut report = Report::default();
    let world = World::read(&pool).await?;
    pool.close().await;
    report.orders = world.versions.len() as u64;
    report.mutations = world.mutations.len() as u64;
    report.intents = world.all.len() as u64;
    report.skipped = world.all.iter().filter(|i| i.skipped).count() as u64;
    report.stream_messages = messages.len() as u64;
    let mut violations = Vec::new();
    world.check_intents(&mut violations);
    let catching_up = positions.is_some();
    let (duplicates, relay_behind) = world.check_stream(messages, catching_up, &mut violations);
    report.duplicates_absorbed = duplicates;
    // The last stream sequence of each event's copies: the consumer has not reached an event
    // while one of its copies lies above the consumer's ack floor.
    let mut last_copy: HashMap<Uuid, u64> = HashMap::new();
    if catching_up {
        report.behind.insert("relay".to_owned(), relay_behind);
        for message in messages {
            if let Some(id) = message.event_id {
                let last = last_copy.entry(id).or_insert(0);
                *last = (*last).max(message.stream_sequence);
            }
        }
    }
    let reach = |consumer: &str| {
        positions.map(|p| Reach {
            ack_floor: p.ack_floors.get(consumer).copied(),
            last_copy: &last_copy,
        })
    };
    if let Some(url) = &config.inventory_database_url {
        let pool = connect(url).await?;
        let (counts, behind) = world
            .check_inventory(&pool, reach(INVENTORY).as_ref(), &mut violations)
            .await?;
        report.effects.insert(INVENTORY.to_owned(), counts);
        if catching_up {
            report
                .behind
                .insert(INVENTORY.to_owned(), behind.len() as u64);
        }
        pool.close().await;
    }
    let mut payments_behind = HashSet::new();
    if let Some(url) = &config.payments_database_url {
        let pool = connect(url).await?;
        let (counts, behind) = world
            .check_payments(&pool, reach(PAYMENTS).as_ref(), &mut violations)
            .await?;
        report.effects.insert(PAYMENTS.to_owned(), counts);
        if catching_up {
            report
                .behind
                .insert(PAYMENTS.to_owned(), behind.len() as u64);
        }
        payments_behind = behind;
        pool.close().await;
    }
    if let Some(url) = &config.provider_url {
        world
            .check_provider(url, &payments_behind, &mut violations)
            .await?;
    }
    report.first_violation = violations.first().cloned();
    report.violations = violations;
    Ok(report)
}

/// What a consumer had reached on the broker: its ack floor, when known, and the last stream
/// sequence of each event's copies.
struct Reach<'a> {
    ack_floor: Option<u64>,
    last_copy: &'a HashMap<Uuid, u64>,
}

/// A small pool for `url` that gives up within seconds when the server does not answer.
async fn connect(url: &str) -> Result<PgPool, CheckError> {
    // One direct connection first: a pool retries a refused connection until its timeout and
    // then reports only the timeout, while this says what went wrong (refused, bad password).
    use sqlx::Connection;
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, sqlx::PgConnection::connect(url))
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
    probe.close().await?;
    Ok(PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect(url)
        .await?)
}

/// How long a database may take to accept the checker's connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The first copy of an event in the stream: (aggregate sequence, event id, stream sequence).
type First = (i64, Uuid, u64);

const INVENTORY: &str = reference_consumers::inventory::DEFAULT_NAME;
const PAYMENTS: &str = reference_consumers::payments::DEFAULT_NAME;

/// The order service's side, read once.
struct World {
    /// Per order, its version (the sequence of its latest event).
    versions: HashMap<String, i64>,
    /// Committed mutations: (order, version it left).
    mutations: Vec<(String, i64)>,
    /// Outbox events of orders, by aggregate then sequence.
    intents: Vec<Intent>,
    /// Every outbox event, of any aggregate type, archived ones included.
    all: Vec<Intent>,
}

impl World {
    async fn read(pool: &PgPool) -> Result<Self, CheckError> {
        let versions: Vec<(Uuid, i64)> =
            sqlx::query_as("SELECT order_id, version FROM orders ORDER BY order_id")
                .fetch_all(pool)
                .await?;
        let bodies: Vec<(String, serde_json::Value)> = sqlx::query_as(
            "SELECT idempotency_key, response_body FROM idempotency_keys
             WHERE response_status BETWEEN 200 AND 299 ORDER BY created_at, idempotency_key",
        )
        .fetch_all(pool)
        .await?;
        let mut mutations = Vec::with_capacity(bodies.len());
        for (key, body) in bodies {
            // The stored response is the order as the command left it: its version is the
            // sequence of the one event that command enqueued.
            let order_id = body.get("order_id").and_then(|v| v.as_str());
            let version = body.get("version").and_then(|v| v.as_i64());
            match (order_id, version) {
                (Some(id), Some(v)) => mutations.push((id.to_owned(), v)),
                _ => {
                    return Err(CheckError::Data(format!(
                        "idempotency record {key:?} has no order_id/version"
                    )))
                }
            }
        }
        // Archived rows (`handoff cleanup --archive`) are intents too: their events are in
        // the stream and the consumers. Rows cleanup deleted outright cannot be checked.
        let all = sqlx::query_as::<_, Intent>(&format!(
            "SELECT event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
                    schema_version, payload, quarantined_at IS NOT NULL AS quarantined,
                    skip_reason IS NOT NULL AS skipped,
                    ({UNPUBLISHED_SQL}) AND quarantined_at IS NULL AS pending
             FROM outbox o
             UNION ALL
             SELECT event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type,
                    schema_version, payload, false, skip_reason IS NOT NULL, false
             FROM outbox_archive
             ORDER BY aggregate_type, aggregate_id, aggregate_sequence"
        ))
        .fetch_all(pool)
        .await?;
        let intents = all
            .iter()
            .filter(|i| i.aggregate_type == ORDER)
            .cloned()
            .collect();
        Ok(Self {
            versions: versions
                .into_iter()
                .map(|(id, v)| (id.to_string(), v))
                .collect(),
            mutations,
            intents,
            all,
        })
    }

    /// Invariants 1 and 2: mutations against outbox events.
    fn check_intents(&self, violations: &mut Vec<Violation>) {
        let mut by_place: HashMap<(&str, i64), Vec<&Intent>> = HashMap::new();
        for intent in &self.intents {
            by_place
                .entry((intent.aggregate_id.as_str(), intent.aggregate_sequence))
                .or_default()
                .push(intent);
        }
        let mut committed: HashSet<(&str, i64)> = HashSet::new();
        for (order, version) in &self.mutations {
            committed.insert((order.as_str(), *version));
        }
        // Every sequence up to an order's version is a committed mutation, also when its
        // idempotency record is gone (records may be pruned; the order row stays).
        for (order, version) in &self.versions {
            for sequence in 1..=*version {
                committed.insert((order.as_str(), sequence));
            }
        }
        let mut committed: Vec<(&str, i64)> = committed.into_iter().collect();
        committed.sort_unstable();
        for (order, sequence) in committed {
            match by_place.get(&(order, sequence)).map(Vec::as_slice) {
                None | Some([]) => violations.push(
                    Violation::new(
                        ViolationKind::LostIntent,
                        format!("order {order} committed mutation {sequence} has no outbox event"),
                    )
                    .aggregate(order)
                    .events(&[], &[sequence]),
                ),
                Some([_]) => {}
                Some(many) => {
                    let ids: Vec<Uuid> = many.iter().map(|i| i.event_id).collect();
                    violations.push(
                        Violation::new(
                            ViolationKind::DuplicateIntent,
                            format!("order {order} mutation {sequence} has {} events", ids.len()),
                        )
                        .aggregate(order)
                        .events(&ids, &vec![sequence; ids.len()]),
                    );
                }
            }
        }
        for intent in &self.intents {
            let id = intent.aggregate_id.as_str();
            let version = self.versions.get(id).copied();
            let committed = version.is_some_and(|v| intent.aggregate_sequence <= v);
            if !committed {
                let detail = match version {
                    None => format!("outbox event for order {id}, which does not exist"),
                    Some(v) => format!(
                        "outbox event {} of order {id}, past its version {v}",
                        intent.aggregate_sequence
                    ),
                };
                violations.push(
                    Violation::new(ViolationKind::PhantomEvent, detail)
                        .aggregate(id)
                        .events(&[intent.event_id], &[intent.aggregate_sequence]),
                );
            }
        }
    }

    /// Invariants 3 and 4: the stream against the outbox. Returns the duplicates absorbed, and
    /// with `catching_up` the events no relay has reached yet (pending in the outbox, not held),
    /// which are then not reported as unpublished.
    fn check_stream(
        &self,
        messages: &[StreamMessage],
        catching_up: bool,
        violations: &mut Vec<Violation>,
    ) -> (u64, u64) {
        let mut relay_behind = 0;
        let intents: HashMap<Uuid, &Intent> = self.all.iter().map(|i| (i.event_id, i)).collect();
        let mut seen: HashSet<Uuid> = HashSet::new();
        let mut duplicates = 0;
        // Per aggregate, its first copies in stream order: (sequence, event id, stream seq).
        let mut firsts: BTreeMap<(&str, &str), Vec<First>> = BTreeMap::new();
        for message in messages {
            let intent = message.event_id.and_then(|id| intents.get(&id));
            let Some(intent) = intent else {
                let mut v = Violation::new(
                    ViolationKind::PhantomMessage,
                    format!(
                        "stream message {} on {} is no outbox event",
                        message.stream_sequence, message.subject
                    ),
                );
                v.event_ids = message.event_id.into_iter().collect();
                v.sequences = message.sequence.into_iter().collect();
                v.stream_sequences = vec![message.stream_sequence];
                violations.push(v);
                continue;
            };
            if intent.skipped && !message.skipped {
                violations.push(Violation {
                    stream_sequences: vec![message.stream_sequence],
                    ..Violation::new(
                        ViolationKind::SkippedApplied,
                        format!(
                            "event {} of {} {} was skipped by an operator, but stream message \
                             {} carries it without the skip marker",
                            intent.aggregate_sequence,
                            intent.aggregate_type,
                            intent.aggregate_id,
                            message.stream_sequence
                        ),
                    )
                    .aggregate(&intent.aggregate_id)
                    .events(&[intent.event_id], &[intent.aggregate_sequence])
                });
            }
            if !seen.insert(intent.event_id) {
                duplicates += 1;
                continue;
            }
            firsts
                .entry((intent.aggregate_type.as_str(), intent.aggregate_id.as_str()))
                .or_default()
                .push((
                    intent.aggregate_sequence,
                    intent.event_id,
                    message.stream_sequence,
                ));
        }
        for intent in &self.all {
            if !seen.contains(&intent.event_id) {
                if catching_up && intent.pending {
                    relay_behind += 1;
                    continue;
                }
                let held = if intent.quarantined {
                    " (it is quarantined)"
                } else {
                    ""
                };
                violations.push(
                    Violation::new(
                        ViolationKind::UnpublishedIntent,
                        format!(
                            "event {} of {} {} is not in the stream{held}",
                            intent.aggregate_sequence, intent.aggregate_type, intent.aggregate_id
                        ),
                    )
                    .aggregate(&intent.aggregate_id)
                    .events(&[intent.event_id], &[intent.aggregate_sequence]),
                );
            }
        }
        for ((_, aggregate), firsts) in firsts {
            let swapped = firsts.windows(2).find(|w| w[0].0 > w[1].0);
            if let Some([a, b]) = swapped {
                violations.push(Violation {
                    stream_sequences: vec![a.2, b.2],
                    ..Violation::new(
                        ViolationKind::SwappedPair,
                        format!(
                            "order {aggregate}: event {} came before event {} in the stream",
                            a.0, b.0
                        ),
                    )
                    .aggregate(aggregate)
                    .events(&[a.1, b.1], &[a.0, b.0])
                });
                continue;
            }
            // In order: a gap is an earlier sequence missing before a later one came.
            let gap = (1..)
                .zip(&firsts)
                .find(|(expected, first)| first.0 != *expected);
            if let Some((expected, (sequence, event_id, stream_sequence))) = gap {
                violations.push(Violation {
                    stream_sequences: vec![*stream_sequence],
                    ..Violation::new(
                        ViolationKind::Gap,
                        format!(
                            "order {aggregate}: event {sequence} came while {expected} was not \
                             in the stream"
                        ),
                    )
                    .aggregate(aggregate)
                    .events(&[*event_id], &[expected, *sequence])
                });
            }
        }
        (duplicates, relay_behind)
    }

    /// The inbox of `consumer`: each event once, none unknown, last sequences as the orders'.
    /// With `reach`, the events the consumer has not reached yet are returned instead of judged.
    async fn check_inbox(
        &self,
        pool: &PgPool,
        consumer: &str,
        reach: Option<&Reach<'_>>,
        violations: &mut Vec<Violation>,
    ) -> Result<(u64, u64, HashSet<Uuid>), CheckError> {
        // The last sequences first: read after the inbox, a consumer still running could have
        // moved past an event read as missing, which would then look lost.
        let lasts: Vec<(String, i64)> = sqlx::query_as(
            "SELECT aggregate_id, last_sequence FROM consumer_sequences
             WHERE consumer_name = $1 AND aggregate_type = $2",
        )
        .bind(consumer)
        .bind(ORDER)
        .fetch_all(pool)
        .await?;
        let lasts: HashMap<String, i64> = lasts.into_iter().collect();
        // Not reached: beyond the consumer's last applied sequence of its aggregate, and not
        // yet published, or with a copy the consumer has not acknowledged.
        let unreached = |intent: &Intent| {
            let Some(reach) = reach else {
                return false;
            };
            let last = lasts.get(&intent.aggregate_id).copied().unwrap_or(0);
            let unacked = reach.ack_floor.is_some_and(|floor| {
                reach
                    .last_copy
                    .get(&intent.event_id)
                    .is_some_and(|&copy| copy > floor)
            });
            intent.aggregate_sequence > last && (intent.pending || unacked)
        };
        let mut behind: HashSet<Uuid> = HashSet::new();
        let processed: Vec<Uuid> =
            sqlx::query_scalar("SELECT event_id FROM processed_events WHERE consumer_name = $1")
                .bind(consumer)
                .fetch_all(pool)
                .await?;
        let processed_set: HashSet<Uuid> = processed.iter().copied().collect();
        // Events the consumer gave up on are still missing effects, but the detail says where
        // they are, which is the first place an operator looks.
        let quarantined: HashSet<Uuid> = sqlx::query_scalar(
            "SELECT event_id FROM consumer_quarantine
             WHERE consumer_name = $1 AND event_id IS NOT NULL",
        )
        .bind(consumer)
        .fetch_all(pool)
        .await?
        .into_iter()
        .collect();
        let known: HashSet<Uuid> = self.intents.iter().map(|i| i.event_id).collect();
        for intent in &self.intents {
            if !processed_set.contains(&intent.event_id) {
                if unreached(intent) {
                    behind.insert(intent.event_id);
                    continue;
                }
                violations.push(
                    Violation::new(
                        ViolationKind::MissingEffect,
                        format!(
                            "{consumer} did not apply event {} of order {}{}",
                            intent.aggregate_sequence,
                            intent.aggregate_id,
                            if quarantined.contains(&intent.event_id) {
                                " (it is in the consumer's quarantine)"
                            } else {
                                ""
                            }
                        ),
                    )
                    .aggregate(&intent.aggregate_id)
                    .events(&[intent.event_id], &[intent.aggregate_sequence])
                    .consumer(consumer),
                );
            }
        }
        for id in &processed {
            if !known.contains(id) {
                violations.push(
                    Violation::new(
                        ViolationKind::PhantomEffect,
                        format!("{consumer} processed {id}, which is no outbox event"),
                    )
                    .events(&[*id], &[])
                    .consumer(consumer),
                );
            }
        }
        let mut heads: BTreeMap<&str, i64> = BTreeMap::new();
        // Aggregates with an event beyond the consumer's last sequence that it has reached:
        // their short sequence is not explained by lag.
        let mut unexplained: HashSet<&str> = HashSet::new();
        for intent in &self.intents {
            let head = heads.entry(intent.aggregate_id.as_str()).or_insert(0);
            *head = (*head).max(intent.aggregate_sequence);
            let last = lasts.get(&intent.aggregate_id).copied().unwrap_or(0);
            if intent.aggregate_sequence > last && !behind.contains(&intent.event_id) {
                unexplained.insert(intent.aggregate_id.as_str());
            }
        }
        for (aggregate, head) in heads {
            let last = lasts.get(aggregate).copied().unwrap_or(0);
            if last < head && !unexplained.contains(aggregate) {
                continue;
            }
            if last != head {
                violations.push(
                    Violation::new(
                        ViolationKind::SequenceMismatch,
                        format!(
                            "{consumer} is at {last} for order {aggregate}, which is at {head}"
                        ),
                    )
                    .aggregate(aggregate)
                    .events(&[], &[last, head])
                    .consumer(consumer),
                );
            }
        }
        // A skipped event is in the inbox like any other (the consumer recorded its marker);
        // only its business effect is absent, which the effect checks verify.
        let skipped = self
            .intents
            .iter()
            .filter(|i| i.skipped && processed_set.contains(&i.event_id))
            .count() as u64;
        Ok((processed.len() as u64, skipped, behind))
    }

    /// Inventory: the inbox, and `stock.reserved` per SKU equal to what the events imply (those
    /// it has reached). Returns the events it has not reached (see [`check_catching_up`]).
    async fn check_inventory(
        &self,
        pool: &PgPool,
        reach: Option<&Reach<'_>>,
        violations: &mut Vec<Violation>,
    ) -> Result<(ConsumerCounts, HashSet<Uuid>), CheckError> {
        let (inbox, skipped, behind) = self.check_inbox(pool, INVENTORY, reach, violations).await?;
        let mut expected: BTreeMap<String, i64> = BTreeMap::new();
        // A skipped event changes no stock: the consumer recorded its marker, never its lines.
        // An event not reached yet has changed none either.
        for intent in self
            .intents
            .iter()
            .filter(|i| !i.skipped && !behind.contains(&i.event_id))
        {
            let event = ReceivedEvent {
                event_id: intent.event_id,
                aggregate_type: ORDER.to_owned(),
                aggregate_id: intent.aggregate_id.clone(),
                sequence: intent.aggregate_sequence,
                event_type: intent.event_type.clone(),
                schema_version: intent.schema_version,
                payload: intent.payload.to_string(),
                headers: Vec::new(),
                replayed: false,
            };
            // An event the consumer cannot read goes to its quarantine, with no effect.
            let Ok(changes) = reference_consumers::inventory::stock_changes(&event) else {
                continue;
            };
            for (sku, change) in changes {
                *expected.entry(sku).or_insert(0) += change;
            }
        }
        let actual: Vec<(String, i64)> = sqlx::query_as("SELECT sku, reserved FROM stock")
            .fetch_all(pool)
            .await?;
        let effects = actual.len() as u64;
        let mut actual: BTreeMap<String, i64> = actual.into_iter().collect();
        for (sku, want) in &expected {
            let got = actual.remove(sku).unwrap_or(0);
            effect_amount(violations, INVENTORY, sku, got, *want);
        }
        for (sku, got) in actual {
            effect_amount(violations, INVENTORY, &sku, got, 0);
        }
        let counts = ConsumerCounts {
            inbox,
            effects,
            skipped,
        };
        Ok((counts, behind))
    }

    /// Payments: the inbox, and one payment per order that was created (none for an order
    /// whose creation it has not reached). Returns the events it has not reached.
    async fn check_payments(
        &self,
        pool: &PgPool,
        reach: Option<&Reach<'_>>,
        violations: &mut Vec<Violation>,
    ) -> Result<(ConsumerCounts, HashSet<Uuid>), CheckError> {
        let (inbox, skipped, behind) = self.check_inbox(pool, PAYMENTS, reach, violations).await?;
        let rows: Vec<(Uuid,)> = sqlx::query_as("SELECT order_id FROM payments")
            .fetch_all(pool)
            .await?;
        let ids: Vec<String> = rows.into_iter().map(|(id,)| id.to_string()).collect();
        // The payment row is written in the event's transaction: none before it is reached.
        self.one_per_created_order(PAYMENTS, "payment", &ids, &behind, 0, violations);
        let counts = ConsumerCounts {
            inbox,
            effects: ids.len() as u64,
            skipped,
        };
        Ok((counts, behind))
    }

    /// The provider: one charge per order that was created; at most one for an order whose
    /// creation the payments consumer has not reached (`payments_behind`): a charge made by a
    /// delivery whose transaction did not commit, which the next one replays.
    async fn check_provider(
        &self,
        url: &str,
        payments_behind: &HashSet<Uuid>,
        violations: &mut Vec<Violation>,
    ) -> Result<(), CheckError> {
        #[derive(Deserialize)]
        struct Charge {
            order_id: Uuid,
        }
        let url = format!("{}/charges", url.trim_end_matches('/'));
        let charges: Vec<Charge> = reqwest::get(&url).await?.error_for_status()?.json().await?;
        let ids: Vec<String> = charges.iter().map(|c| c.order_id.to_string()).collect();
        self.one_per_created_order(
            "payment-provider",
            "charge",
            &ids,
            payments_behind,
            1,
            violations,
        );
        Ok(())
    }

    /// One effect per created order; for an order whose creation is in `behind`, from 0 to
    /// `behind_at_most`.
    fn one_per_created_order(
        &self,
        consumer: &str,
        what: &str,
        order_ids: &[String],
        behind: &HashSet<Uuid>,
        behind_at_most: usize,
        violations: &mut Vec<Violation>,
    ) {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for id in order_ids {
            *counts.entry(id.as_str()).or_insert(0) += 1;
        }
        for intent in self.intents.iter().filter(|i| i.aggregate_sequence == 1) {
            let id = intent.aggregate_id.as_str();
            let n = counts.remove(id).unwrap_or(0);
            if behind.contains(&intent.event_id) && n <= behind_at_most {
                continue;
            }
            // An order whose creation an operator skipped is never charged.
            let kind = match (intent.skipped, n) {
                (true, 0) | (false, 1) => continue,
                (true, _) => ViolationKind::SkippedApplied,
                (false, 0) => ViolationKind::MissingEffect,
                (false, _) => ViolationKind::DoubleEffect,
            };
            violations.push(
                Violation::new(kind, format!("order {id} has {n} {what}(s) at {consumer}"))
                    .aggregate(id)
                    .events(&[intent.event_id], &[1])
                    .consumer(consumer),
            );
        }
        for (id, n) in counts {
            violations.push(
                Violation::new(
                    ViolationKind::PhantomEffect,
                    format!("{n} {what}(s) at {consumer} for order {id}, never created"),
                )
                .aggregate(id)
                .consumer(consumer),
            );
        }
    }
}

/// Compares a counter effect: above what the events imply is a double effect, below a missing
/// one (for a cancellation's negative change the direction says which way it went wrong, not
/// which event: the report names the SKU and both figures).
fn effect_amount(violations: &mut Vec<Violation>, consumer: &str, sku: &str, got: i64, want: i64) {
    let kind = match got.cmp(&want) {
        std::cmp::Ordering::Equal => return,
        std::cmp::Ordering::Greater => ViolationKind::DoubleEffect,
        std::cmp::Ordering::Less => ViolationKind::MissingEffect,
    };
    violations.push(
        Violation::new(
            kind,
            format!("{consumer}: stock.reserved of {sku} is {got}, the events imply {want}"),
        )
        .consumer(consumer),
    );
}
