//! [`KafkaIntake`]: a consumer's [`Intake`] from a Kafka consumer group, committing offsets only
//! up to what is settled.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use handoff_core::contract;
use handoff_core::intake::{Delivery, Intake, IntakeError, MalformedEvent, ReceivedEvent, Settle};
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::config::{check_brokers, check_topic};
use crate::{ConfigError, ConnectError, KafkaConfig, KafkaOptions, KafkaTransport, TopicError};

/// Where and how a [`KafkaIntake`] consumes.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use handoff_kafka::IntakeConfig;
///
/// let config = IntakeConfig {
///     brokers: "127.0.0.1:9092".into(),
///     group_id: "inventory".into(),
///     redeliver_after: Duration::from_secs(10),
///     ..IntakeConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntakeConfig {
    /// The bootstrap brokers, as [`KafkaConfig::brokers`]. Default `"127.0.0.1:9092"`.
    pub brokers: String,
    /// The topic the relay produces to; created (as the relay would, with
    /// [`KafkaConfig::partitions`]' default) when missing, so a consumer may start first.
    /// Default `"outbox"`.
    pub topic: String,
    /// The consumer group: every instance of one consumer shares it (and its committed
    /// offsets). Use the consumer's name. Required.
    pub group_id: String,
    /// The client id the brokers see. Default `"handoff"`.
    pub client_id: String,
    /// Most deliveries handed out and not yet acknowledged or terminated (naked ones count):
    /// the bound on what the consumer holds. Default 1000.
    pub max_unsettled: usize,
    /// How long after a delivery was dropped without being settled (an abandoned apply) it is
    /// delivered again, as a JetStream ack wait would. Default 30 s.
    pub redeliver_after: Duration,
    /// How long the group coordinator waits for a silent member before it hands that member's
    /// partitions to the others (`session.timeout.ms`; heartbeats go every third of it).
    /// Default 10 s, not librdkafka's 45 s: a consumer instance that crashed holds its
    /// partitions, and every rebalance meanwhile, until this passes, and an outbox consumer
    /// would rather fail over quickly. The brokers bound it (`group.min.session.timeout.ms`,
    /// 6 s by default).
    pub session_timeout: Duration,
    /// librdkafka settings for TLS, SASL and tuning, as [`KafkaConfig::options`]; applied to
    /// the consumer and to the client that makes sure the topic exists. Default: none.
    pub options: KafkaOptions,
}

impl Default for IntakeConfig {
    fn default() -> Self {
        Self {
            brokers: "127.0.0.1:9092".to_owned(),
            topic: "outbox".to_owned(),
            group_id: String::new(),
            client_id: "handoff".to_owned(),
            max_unsettled: 1000,
            redeliver_after: Duration::from_secs(30),
            session_timeout: Duration::from_secs(10),
            options: KafkaOptions::default(),
        }
    }
}

impl IntakeConfig {
    /// Checks every field against the rules in its documentation.
    ///
    /// # Errors
    ///
    /// The first rule broken, as an [`IntakeConfigError`].
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_kafka::IntakeConfig;
    ///
    /// assert!(IntakeConfig::default().validate().is_err(), "a group id is required");
    /// ```
    pub fn validate(&self) -> Result<(), IntakeConfigError> {
        check_brokers(&self.brokers)?;
        check_topic(&self.topic)?;
        if self.group_id.is_empty() || !self.group_id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(IntakeConfigError::Invalid(
                "group_id must be non-empty printable ASCII",
            ));
        }
        if self.max_unsettled == 0 {
            return Err(IntakeConfigError::Invalid(
                "max_unsettled must be at least 1",
            ));
        }
        if self.redeliver_after.is_zero() {
            return Err(IntakeConfigError::Invalid(
                "redeliver_after must be greater than zero",
            ));
        }
        if self.client_id.is_empty() || !self.client_id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::InvalidClientId(self.client_id.clone()).into());
        }
        if self.session_timeout < Duration::from_secs(1) || self.session_timeout > MAX_SESSION {
            return Err(IntakeConfigError::Invalid(
                "session_timeout must be from 1 s to 1 hour",
            ));
        }
        self.options.validate().map_err(ConfigError::from)?;
        Ok(())
    }
}

/// The longest [`IntakeConfig::session_timeout`]: librdkafka's own bound.
const MAX_SESSION: Duration = Duration::from_secs(3600);

/// Why an [`IntakeConfig`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IntakeConfigError {
    /// A setting shared with [`KafkaConfig`] breaks its rule.
    #[error(transparent)]
    Kafka(#[from] ConfigError),
    /// An intake setting breaks its rule.
    #[error("{0}")]
    Invalid(&'static str),
}

/// Why [`KafkaIntake::connect`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IntakeConnectError {
    /// The brokers could not be reached, or the configuration is unusable.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The topic could not be found or created.
    #[error(transparent)]
    Topic(#[from] TopicError),
    /// The configuration is unusable.
    #[error("invalid intake configuration: {0}")]
    InvalidConfig(#[from] IntakeConfigError),
    /// The consumer could not be created or subscribed.
    #[error("while subscribing group {group} to topic {topic}: {source}")]
    Subscribe {
        /// The consumer group.
        group: String,
        /// The topic.
        topic: String,
        /// librdkafka's error.
        #[source]
        source: KafkaError,
    },
}

/// The messages of one partition handed out in this assignment, by offset, and whether each is
/// settled. The committed position is the first unsettled offset (or one past the last
/// settled): the contiguous settled prefix.
#[derive(Debug)]
struct Track {
    generation: u64,
    delivered: BTreeMap<i64, bool>,
    committed: i64,
}

impl Track {
    fn new(generation: u64) -> Self {
        Self {
            generation,
            delivered: BTreeMap::new(),
            committed: -1,
        }
    }

    /// Marks `offset` settled and returns the new commit position when the settled prefix grew.
    fn settle(&mut self, offset: i64) -> Option<i64> {
        if let Some(settled) = self.delivered.get_mut(&offset) {
            *settled = true;
        }
        let mut next = None;
        while let Some((&first, &true)) = self.delivered.first_key_value() {
            self.delivered.pop_first();
            next = Some(first + 1);
        }
        let next = next.filter(|n| *n > self.committed)?;
        self.committed = next;
        Some(next)
    }
}

/// The partitions this member owns, one [`Track`] each; replaced at every rebalance, so a
/// settle of a delivery from an earlier assignment finds another generation and is ignored.
#[derive(Debug, Default)]
struct Tracks {
    map: Mutex<HashMap<i32, Track>>,
    generations: AtomicU64,
}

impl Tracks {
    fn lock(&self) -> MutexGuard<'_, HashMap<i32, Track>> {
        // std Mutex: held for map operations only, never across an await.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn next_generation(&self) -> u64 {
        self.generations.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Records a delivery from the broker and returns its partition's generation.
    fn delivered(&self, partition: i32, offset: i64) -> u64 {
        let mut map = self.lock();
        let track = map
            .entry(partition)
            .or_insert_with(|| Track::new(self.next_generation()));
        track.delivered.entry(offset).or_insert(false);
        track.generation
    }

    fn is_current(&self, partition: i32, generation: u64) -> bool {
        self.lock()
            .get(&partition)
            .is_some_and(|t| t.generation == generation)
    }

    /// Settles `offset` and, when the partition's settled prefix grew, hands the new commit
    /// position to `commit` *while still holding the lock*; returns that position.
    ///
    /// Commits are therefore issued in the order their positions were computed, which is
    /// increasing per partition ([`Track::settle`] never returns a position at or below one it
    /// returned before): two settles racing on different threads cannot issue 13 after 15 and
    /// move the group's committed offset backwards. A revoke takes the same lock, so it cannot
    /// slip between computing a position and committing it either: no commit of a partition
    /// goes out after this member gave the partition up. `commit` must not block (an async
    /// commit only queues the request).
    fn settle<E>(
        &self,
        partition: i32,
        generation: u64,
        offset: i64,
        commit: impl FnOnce(i64) -> Result<(), E>,
    ) -> Result<Option<i64>, E> {
        let mut map = self.lock();
        let Some(track) = map.get_mut(&partition) else {
            return Ok(None);
        };
        if track.generation != generation {
            return Ok(None);
        }
        let Some(next) = track.settle(offset) else {
            return Ok(None);
        };
        // A failed commit is not undone: the next settle commits a later position, and until
        // then a restart redelivers a little more, which the inbox absorbs.
        commit(next)?;
        Ok(Some(next))
    }
}

/// The consumer's context: rebalances renew the partitions' tracks; commit failures are logged.
struct IntakeContext {
    tracks: Arc<Tracks>,
    topic: String,
}

impl ClientContext for IntakeContext {}

impl ConsumerContext for IntakeContext {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            // Every advance of a settled prefix was committed when it happened; what is still
            // unsettled is delivered again by the partition's next owner.
            let mut map = self.tracks.lock();
            for element in list.elements_for_topic(&self.topic) {
                map.remove(&element.partition());
            }
            tracing::info!(topic = %self.topic, revoked = list.count(), "partitions revoked");
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let mut map = self.tracks.lock();
            for element in list.elements_for_topic(&self.topic) {
                map.insert(
                    element.partition(),
                    Track::new(self.tracks.next_generation()),
                );
            }
            tracing::info!(topic = %self.topic, assigned = list.count(), "partitions assigned");
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(error) = result {
            // The next settle commits a later position; until then a restart redelivers a
            // little more, which the inbox absorbs.
            tracing::warn!(%error, ?offsets, "committing offsets failed");
        }
    }
}

struct Inner {
    consumer: StreamConsumer<IntakeContext>,
    tracks: Arc<Tracks>,
    topic: String,
    redeliver: mpsc::UnboundedSender<Redelivery>,
    redeliver_after: Duration,
}

impl Inner {
    /// Settles one delivery and commits the partition's settled prefix when it grew.
    fn settle(&self, partition: i32, generation: u64, offset: i64) -> Result<(), IntakeError> {
        self.tracks
            .settle(partition, generation, offset, |next| {
                let mut list = TopicPartitionList::new();
                list.add_partition_offset(&self.topic, partition, Offset::Offset(next))?;
                // Under the tracks' lock (see `Tracks::settle`), so commits leave in increasing
                // order; async, so this only queues the request and the lock is held briefly.
                // librdkafka sends queued commits in order on one connection to the group's
                // coordinator, which applies them in order.
                self.consumer.commit(&list, CommitMode::Async)
            })
            .map(drop)
            .map_err(|e| IntakeError::new("while committing", e))
    }
}

/// A delivery handed back by `nak` (or dropped unsettled), waiting to be delivered again.
struct Redelivery {
    partition: i32,
    offset: i64,
    generation: u64,
    held: Held,
}

/// What a delivery needs to be delivered again.
struct Held {
    event: Result<ReceivedEvent, MalformedEvent>,
    delivery_count: u64,
    /// Released (to the intake's bound) when the delivery is settled.
    _permit: OwnedSemaphorePermit,
}

/// Deliveries from a Kafka consumer group, with offsets committed only up to the settled prefix
/// of each partition.
///
/// The consumer subscribes to the topic in `group_id` with auto-commit off, starting a new
/// group from the earliest offset. `handoff-consumer` applies events of different aggregates in
/// parallel and so settles out of offset order; the intake tracks each partition's handed-out
/// offsets and commits the first one not yet settled, so a restart or a rebalance delivers
/// again exactly what was not settled, plus at most what was settled after it (which the inbox
/// absorbs).
///
/// - `ack` and `term` settle the message;
/// - `nak(delay)` delivers the message again from memory after `delay`, with its delivery
///   count one higher; the partition's commit point stays behind it meanwhile;
/// - `in_progress` does nothing (Kafka has no per-message deadline);
/// - a delivery dropped without being settled is delivered again after
///   [`redeliver_after`](IntakeConfig::redeliver_after).
///
/// Kafka keeps no delivery count: a message read from the broker counts as delivery 1, also
/// after a restart. There is no broker-side delivery limit either (no
/// [`set_delivery_backstop`](Intake::set_delivery_backstop)): the consumer's delivery cap,
/// counted here in process, is the bound, and the commit point never passes a message that was
/// not settled, so the log keeps one whose quarantine write keeps failing. The group's coordinator takes the partitions away from a member that asks
/// for no delivery for longer than librdkafka's `max.poll.interval.ms` (5 minutes), as when
/// [`max_unsettled`](IntakeConfig::max_unsettled) deliveries stay unsettled that long. Messages are read back from the relay's contract (`ce-id`,
/// `Handoff-Sequence`, ...); one without it is handed over as a [`MalformedEvent`].
///
/// # Examples
///
/// ```no_run
/// use handoff_core::intake::Intake;
/// use handoff_kafka::{IntakeConfig, KafkaIntake};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let config = IntakeConfig { group_id: "audit".into(), ..IntakeConfig::default() };
/// let mut intake = KafkaIntake::connect(config).await?;
/// let delivery = intake.next().await?;
/// println!("delivery {} of {:?}", delivery.delivery_count, delivery.event.map(|e| e.event_id));
/// # Ok(())
/// # }
/// ```
pub struct KafkaIntake {
    inner: Arc<Inner>,
    permits: Arc<Semaphore>,
    redeliveries: mpsc::UnboundedReceiver<Redelivery>,
}

impl KafkaIntake {
    /// Checks `config`, makes sure the topic exists (creating it as
    /// [`KafkaTransport::ensure_topic`] would), and subscribes the group to it.
    ///
    /// # Errors
    ///
    /// [`IntakeConnectError`]: an invalid configuration, unreachable brokers, a topic that
    /// could not be created, or a refused subscription.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the topic created; a later call uses it.
    pub async fn connect(config: IntakeConfig) -> Result<Self, IntakeConnectError> {
        config.validate()?;
        let transport = KafkaTransport::connect(KafkaConfig {
            brokers: config.brokers.clone(),
            topic: config.topic.clone(),
            client_id: config.client_id.clone(),
            options: config.options.clone(),
            ..KafkaConfig::default()
        })
        .await?;
        transport.ensure_topic().await?;
        drop(transport);
        let subscribe_error = |source| IntakeConnectError::Subscribe {
            group: config.group_id.clone(),
            topic: config.topic.clone(),
            source,
        };
        let tracks = Arc::new(Tracks::default());
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", &config.brokers)
            .set("group.id", &config.group_id)
            .set("client.id", &config.client_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // A new group reads the topic from its start, as a new durable JetStream consumer.
            .set("auto.offset.reset", "earliest")
            .set("allow.auto.create.topics", "false")
            .set(
                "session.timeout.ms",
                config.session_timeout.as_millis().to_string(),
            )
            .set(
                "heartbeat.interval.ms",
                (config.session_timeout.as_millis() / 3).to_string(),
            );
        config.options.apply(&mut client);
        let consumer: StreamConsumer<IntakeContext> = client
            .create_with_context(IntakeContext {
                tracks: Arc::clone(&tracks),
                topic: config.topic.clone(),
            })
            .map_err(subscribe_error)?;
        consumer
            .subscribe(&[&config.topic])
            .map_err(subscribe_error)?;
        let (redeliver, redeliveries) = mpsc::unbounded_channel();
        Ok(Self {
            inner: Arc::new(Inner {
                consumer,
                tracks,
                topic: config.topic.clone(),
                redeliver,
                redeliver_after: config.redeliver_after,
            }),
            permits: Arc::new(Semaphore::new(config.max_unsettled)),
            redeliveries,
        })
    }

    /// A delivery handed back earlier, if its partition is still this member's.
    fn redelivery(&self, redelivery: Redelivery) -> Option<Delivery<KafkaSettle>> {
        if !self
            .inner
            .tracks
            .is_current(redelivery.partition, redelivery.generation)
        {
            // Revoked meanwhile: the partition's new owner reads it from the commit point.
            return None;
        }
        let Redelivery {
            partition,
            offset,
            generation,
            held,
        } = redelivery;
        Some(self.delivery(partition, offset, generation, held))
    }

    fn broker_delivery(
        &self,
        message: &BorrowedMessage<'_>,
        permit: OwnedSemaphorePermit,
    ) -> Delivery<KafkaSettle> {
        let (partition, offset) = (message.partition(), message.offset());
        let headers = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|h| {
                        let value = h.value.map(String::from_utf8_lossy).unwrap_or_default();
                        (h.key.to_owned(), value.into_owned())
                    })
                    .collect()
            })
            .unwrap_or_default();
        let location = format!("{}/{partition}@{offset}", self.inner.topic);
        let event = contract::read_event(headers, message.payload().unwrap_or_default(), &location);
        let generation = self.inner.tracks.delivered(partition, offset);
        let held = Held {
            event,
            delivery_count: 1,
            _permit: permit,
        };
        self.delivery(partition, offset, generation, held)
    }

    fn delivery(
        &self,
        partition: i32,
        offset: i64,
        generation: u64,
        held: Held,
    ) -> Delivery<KafkaSettle> {
        Delivery {
            event: held.event.clone(),
            delivery_count: held.delivery_count,
            settle: KafkaSettle {
                inner: Arc::clone(&self.inner),
                partition,
                offset,
                generation,
                held: Mutex::new(Some(held)),
            },
        }
    }
}

impl Intake for KafkaIntake {
    type Settle = KafkaSettle;

    async fn next(&mut self) -> Result<Delivery<KafkaSettle>, IntakeError> {
        loop {
            // Redeliveries carry their permit; new messages wait for one.
            let permit = tokio::select! {
                biased;
                Some(redelivery) = self.redeliveries.recv() => {
                    match self.redelivery(redelivery) {
                        Some(delivery) => return Ok(delivery),
                        None => continue,
                    }
                }
                permit = Arc::clone(&self.permits).acquire_owned() => permit
                    .map_err(|_| IntakeError::message("the intake is closed"))?,
            };
            tokio::select! {
                biased;
                Some(redelivery) = self.redeliveries.recv() => {
                    drop(permit);
                    if let Some(delivery) = self.redelivery(redelivery) {
                        return Ok(delivery);
                    }
                }
                message = self.inner.consumer.recv() => {
                    let message = message
                        .map_err(|e| IntakeError::new("while reading from kafka", e))?;
                    return Ok(self.broker_delivery(&message, permit));
                }
            }
        }
    }
}

/// Settles one Kafka delivery: marks its offset settled (committing the partition's settled
/// prefix) or delivers it again later.
pub struct KafkaSettle {
    inner: Arc<Inner>,
    partition: i32,
    offset: i64,
    generation: u64,
    /// The delivery's content and permit until it is settled or handed back.
    held: Mutex<Option<Held>>,
}

impl KafkaSettle {
    fn take(&self) -> Option<Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Hands the delivery back, to be delivered again after `delay`.
    fn hand_back(&self, held: Held, delay: Duration) {
        let redelivery = Redelivery {
            partition: self.partition,
            offset: self.offset,
            generation: self.generation,
            held: Held {
                delivery_count: held.delivery_count + 1,
                ..held
            },
        };
        let sender = self.inner.redeliver.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime (dropped outside one): left unsettled, so the partition's next owner
            // reads it again from the commit point.
            return;
        };
        runtime.spawn(async move {
            tokio::time::sleep(delay).await;
            // The intake may be gone; then so is the partition.
            let _ = sender.send(redelivery);
        });
    }
}

impl Settle for KafkaSettle {
    async fn ack(&self) -> Result<(), IntakeError> {
        drop(self.take());
        self.inner
            .settle(self.partition, self.generation, self.offset)
    }

    async fn nak(&self, delay: Duration) -> Result<(), IntakeError> {
        if let Some(held) = self.take() {
            self.hand_back(held, delay);
        }
        Ok(())
    }

    async fn term(&self) -> Result<(), IntakeError> {
        // Quarantined by the consumer: as settled as an applied event.
        self.ack().await
    }

    async fn in_progress(&self) -> Result<(), IntakeError> {
        Ok(())
    }
}

impl Drop for KafkaSettle {
    fn drop(&mut self) {
        if let Some(held) = self.take() {
            self.hand_back(held, self.inner.redeliver_after);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commit_point_is_the_settled_prefix() {
        let mut track = Track::new(1);
        for offset in [10, 11, 12, 14] {
            track.delivered.insert(offset, false);
        }
        assert_eq!(track.settle(11), None, "10 is still unsettled");
        assert_eq!(track.settle(12), None);
        assert_eq!(track.settle(10), Some(13), "10..=12 settled: commit 13");
        assert_eq!(track.settle(14), Some(15), "a gap in offsets is no hole");
        assert_eq!(track.settle(14), None, "settling twice commits nothing new");
        assert!(track.delivered.is_empty());
    }

    #[test]
    fn settles_of_an_earlier_assignment_are_ignored() {
        let tracks = Tracks::default();
        let old = tracks.delivered(0, 5);
        tracks
            .lock()
            .insert(0, Track::new(tracks.next_generation()));
        assert!(!tracks.is_current(0, old));
        assert_eq!(tracks.settle(0, old, 5, no_commit()), Ok(None));
        let new = tracks.delivered(0, 5);
        assert_eq!(tracks.settle(0, new, 5, no_commit()), Ok(Some(6)));
    }

    fn no_commit() -> impl FnOnce(i64) -> Result<(), ()> {
        |_| Ok(())
    }

    /// Many threads settle one partition's offsets in an interleaved order, as
    /// handoff-consumer's parallel applies do; every commit they issue is recorded in issue
    /// order. Issued after the lock was released (as before), a thread that computed 13 could
    /// issue it after another thread issued 15.
    #[test]
    fn concurrent_settles_issue_commits_in_increasing_order() {
        const OFFSETS: i64 = 20_000;
        const THREADS: i64 = 8;
        for round in 0..5 {
            let tracks = Tracks::default();
            let mut generation = 0;
            for offset in 0..OFFSETS {
                generation = tracks.delivered(3, offset);
            }
            let issued = Mutex::new(Vec::new());
            std::thread::scope(|scope| {
                for thread in 0..THREADS {
                    let (tracks, issued) = (&tracks, &issued);
                    scope.spawn(move || {
                        // Thread t settles t, t + THREADS, ...: the prefix grows in small
                        // steps, each step computed by whichever thread filled the gap.
                        let mut offset = (thread + round) % THREADS;
                        while offset < OFFSETS {
                            tracks
                                .settle(3, generation, offset, |next| {
                                    // Widens the window between computing a position and
                                    // issuing it, where another thread could overtake.
                                    std::thread::yield_now();
                                    issued.lock().unwrap().push(next);
                                    Ok::<_, ()>(())
                                })
                                .unwrap();
                            offset += THREADS;
                        }
                    });
                }
            });
            let issued = issued.into_inner().unwrap();
            assert!(
                issued.windows(2).all(|pair| pair[0] < pair[1]),
                "round {round}: a commit went backwards: {:?}",
                issued
                    .windows(2)
                    .find(|pair| pair[0] >= pair[1])
                    .unwrap_or_default()
            );
            assert_eq!(issued.last(), Some(&OFFSETS), "round {round}: all settled");
        }
    }

    #[test]
    fn the_commit_is_issued_while_the_tracks_are_locked() {
        let tracks = Tracks::default();
        let generation = tracks.delivered(0, 9);
        let mut locked = None;
        let committed = tracks.settle(0, generation, 9, |next| {
            // Held (by this thread): no other settle, and no revoke, can run meanwhile.
            locked = Some(tracks.map.try_lock().is_err());
            assert_eq!(next, 10);
            Ok::<_, ()>(())
        });
        assert_eq!(committed, Ok(Some(10)));
        assert_eq!(locked, Some(true));
    }

    #[test]
    fn a_failed_commit_is_reported_and_a_later_settle_commits_further() {
        let tracks = Tracks::default();
        let generation = tracks.delivered(0, 1);
        tracks.delivered(0, 2);
        assert_eq!(
            tracks.settle(0, generation, 1, |_| Err("down")),
            Err("down")
        );
        let mut issued = None;
        let committed = tracks.settle(0, generation, 2, |next| {
            issued = Some(next);
            Ok::<_, &str>(())
        });
        assert_eq!(committed, Ok(Some(3)));
        assert_eq!(issued, Some(3));
        // Nothing lower is ever issued again, even for an offset settled twice.
        assert_eq!(tracks.settle(0, generation, 1, |_| Err("never")), Ok(None));
    }

    #[test]
    fn a_revoked_partition_issues_no_commit() {
        let tracks = Tracks::default();
        let generation = tracks.delivered(7, 40);
        tracks.lock().remove(&7);
        let committed = tracks.settle(7, generation, 40, |_| Err("committed after revoke"));
        assert_eq!(committed, Ok(None));
    }
}
