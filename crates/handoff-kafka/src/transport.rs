//! [`KafkaTransport`]: the relay's [`Transport`] onto one Kafka topic.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use handoff_core::contract;
use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind, Receipt, Transport};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;

use crate::config::millis;
use crate::{ConnectError, KafkaConfig, TopicError};

/// How long [`KafkaTransport::connect`] waits for a broker's first metadata answer.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long [`KafkaTransport::ensure_topic`] waits for the cluster's answers.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// What the client tells its owner outside of individual calls.
#[derive(Debug, Default)]
pub(crate) struct ClientState {
    /// librdkafka reported that every broker is down, and no delivery or metadata answer has
    /// come since: failures now are the destination's, not the event's.
    pub(crate) brokers_down: AtomicBool,
    /// The last TLS or authentication failure librdkafka reported (a wrong CA, a wrong SASL
    /// password, a TLS client on a plaintext listener): what a connect that got no answer
    /// says instead of "unreachable". std Mutex: never held across `.await`.
    pub(crate) refused: Mutex<Option<String>>,
}

impl ClientState {
    /// The TLS or authentication failure reported so far, if any.
    pub(crate) fn refusal(&self) -> Option<String> {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Whether librdkafka's `code` says the brokers answered but refused this client (TLS or
/// SASL), which waiting cannot fix.
pub(crate) fn is_refusal(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::Authentication
            | RDKafkaErrorCode::SSL
            | RDKafkaErrorCode::SaslAuthenticationFailed
            | RDKafkaErrorCode::UnsupportedSASLMechanism
            | RDKafkaErrorCode::IllegalSASLState
    )
}

/// The client context: librdkafka's global errors set [`ClientState`], and are logged.
#[derive(Debug, Clone, Default)]
pub(crate) struct KafkaContext {
    pub(crate) state: Arc<ClientState>,
}

impl ClientContext for KafkaContext {
    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::AllBrokersDown) => {
                self.state.brokers_down.store(true, Ordering::Relaxed);
            }
            // librdkafka's reasons name the broker and the mechanism, never a password. A TLS
            // client on a plaintext listener is disconnected mid-handshake, which librdkafka
            // reports as a transport failure ("SSL handshake failed: ... connecting to a
            // PLAINTEXT broker listener?"); at connect time that is a refusal too.
            Some(code)
                if is_refusal(code)
                    || (code == RDKafkaErrorCode::BrokerTransportFailure
                        && reason.contains("SSL handshake failed")) =>
            {
                *self.state.refused.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(reason.to_owned());
            }
            _ => {}
        }
        // librdkafka retries by itself; these are worth a warning, not an error.
        tracing::warn!(%error, reason, "kafka client error");
    }
}

/// Where a published event landed: its partition and offset.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivered {
    /// The topic.
    pub topic: String,
    /// The partition the key hashed to.
    pub partition: i32,
    /// The event's offset in the partition.
    pub offset: i64,
}

impl Delivered {
    /// The receipt kept with the event in `outbox.delivery_receipt`:
    /// `kafka <topic>/<partition>@<offset>`.
    ///
    /// # Examples
    ///
    /// ```
    /// # use handoff_kafka::Delivered;
    /// # fn example(delivered: Delivered) {
    /// // kafka outbox/3@1207
    /// assert!(delivered.receipt_detail().starts_with("kafka "));
    /// # }
    /// ```
    pub fn receipt_detail(&self) -> String {
        format!("kafka {}/{}@{}", self.topic, self.partition, self.offset)
    }
}

/// The topic [`KafkaTransport::ensure_topic`] found or created.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicSummary {
    /// The topic's name.
    pub name: String,
    /// How many partitions it has (which may differ from the configured count for an existing
    /// topic).
    pub partitions: i32,
    /// Whether this call created it.
    pub created: bool,
}

/// Publishes outbox events to one Kafka topic and waits for each delivery report.
///
/// The producer is idempotent (`enable.idempotence=true`, `acks=all`): librdkafka's own retries
/// never duplicate or reorder a message within a partition. Each event goes to
/// [`KafkaConfig::topic`] with the aggregate id as its key (so one aggregate's events share a
/// partition, in order; partitioned by `murmur2_random`, the Java client's hash, so other
/// producers agree on the partition of a key; an event of the global lane has the key `global`,
/// so the whole lane shares one partition, in global order), the payload's JSON text as its
/// value, and the
/// message contract's headers (see [`headers`](Self::headers)). A publish completes only with
/// the delivery report, which tells the partition and offset ([`Delivered`]).
///
/// A republish of an event (after a relay crash between the delivery report and marking the
/// row) is a second message with the same `ce-id`: Kafka has no deduplication by id across
/// producer sessions, so consumers deduplicate by `ce-id` in their inbox.
///
/// # Examples
///
/// ```no_run
/// use handoff_core::delivery::Transport;
/// use handoff_kafka::{KafkaConfig, KafkaTransport};
///
/// # use handoff_core::delivery::OutboxEvent;
/// # async fn example(event: OutboxEvent) -> Result<(), Box<dyn std::error::Error>> {
/// let config = KafkaConfig { brokers: "127.0.0.1:9092".into(), ..KafkaConfig::default() };
/// let transport = KafkaTransport::connect(config).await?;
/// transport.ensure_topic().await?;
/// let delivered = transport.send(&event).await?;
/// println!("{}", delivered.receipt_detail());
/// # Ok(())
/// # }
/// ```
pub struct KafkaTransport {
    /// Replaced (under the write lock) when librdkafka reports a fatal error, after which an
    /// idempotent producer refuses every message. std lock: only held to clone the handle.
    producer: RwLock<FutureProducer<KafkaContext>>,
    admin: AdminClient<DefaultClientContext>,
    client_config: ClientConfig,
    state: Arc<ClientState>,
    config: KafkaConfig,
}

impl std::fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KafkaTransport {
    /// Validates `config`, creates the idempotent producer and waits until a broker answers a
    /// metadata request (at most 5 seconds).
    ///
    /// The first contact is tried once, so a caller that waits for the brokers retries with its
    /// own backoff. Once connected, librdkafka reconnects by itself after every disconnection.
    ///
    /// # Errors
    ///
    /// [`ConnectError`], whose [`kind`](ConnectError::kind) tells an invalid configuration
    /// (permanent) from unreachable brokers (retry).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt; the client is closed once the metadata request
    /// running on a blocking thread returns.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_kafka::{ConnectErrorKind, KafkaConfig, KafkaTransport};
    ///
    /// # async fn example() {
    /// match KafkaTransport::connect(KafkaConfig::default()).await {
    ///     Ok(_transport) => {}
    ///     Err(e) if e.kind() == ConnectErrorKind::Unreachable => { /* retry later */ }
    ///     Err(e) => panic!("{e}"),
    /// }
    /// # }
    /// ```
    pub async fn connect(config: KafkaConfig) -> Result<Self, ConnectError> {
        config.validate()?;
        let client_config = producer_config(&config);
        let state = Arc::new(ClientState::default());
        let producer: FutureProducer<KafkaContext> = client_config
            .create_with_context(KafkaContext {
                state: Arc::clone(&state),
            })
            .map_err(client_error)?;
        let admin: AdminClient<DefaultClientContext> =
            admin_config(&config).create().map_err(client_error)?;
        let probe = producer.clone();
        let topic = config.topic.clone();
        tokio::task::spawn_blocking(move || {
            probe
                .client()
                .fetch_metadata(Some(&topic), CONNECT_TIMEOUT)
                .map(|_| ())
        })
        .await
        .unwrap_or(Err(KafkaError::MetadataFetch(RDKafkaErrorCode::Fail)))
        .map_err(|source| match state.refusal() {
            Some(reason) => ConnectError::Refused {
                brokers: config.brokers.clone(),
                reason,
            },
            None => ConnectError::Unreachable {
                brokers: config.brokers.clone(),
                source,
            },
        })?;
        Ok(Self {
            producer: RwLock::new(producer),
            admin,
            client_config,
            state,
            config,
        })
    }

    /// Makes sure the topic exists.
    ///
    /// A missing topic is created with [`KafkaConfig::partitions`] partitions and replication
    /// factor 1. An existing topic is never changed: a partition count other than the
    /// configured one is logged and kept, since it is the operator's topic.
    ///
    /// Safe to call from several relays at once: when another one creates the topic first, its
    /// topic is used like any existing one.
    ///
    /// # Errors
    ///
    /// [`TopicError`]: the metadata could not be read, or the cluster refused the creation.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the topic created; a later call finds it.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_kafka::{KafkaTransport, TopicError};
    /// # async fn example(transport: KafkaTransport) -> Result<(), TopicError> {
    /// let topic = transport.ensure_topic().await?;
    /// println!("topic {} has {} partitions", topic.name, topic.partitions);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn ensure_topic(&self) -> Result<TopicSummary, TopicError> {
        let name = self.config.topic.clone();
        if let Some(partitions) = self.partition_count().await? {
            return Ok(self.existing(partitions));
        }
        let new_topic = NewTopic::new(&name, self.config.partitions, TopicReplication::Fixed(1));
        let options = AdminOptions::new()
            .operation_timeout(Some(ADMIN_TIMEOUT))
            .request_timeout(Some(ADMIN_TIMEOUT));
        let create_error = |source| TopicError::Create {
            topic: name.clone(),
            source,
        };
        let results = self
            .admin
            .create_topics([&new_topic], &options)
            .await
            .map_err(create_error)?;
        for result in results {
            match result {
                Ok(_) => {}
                // Another relay created it between our lookup and our create.
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {
                    let partitions = self.partition_count().await?.unwrap_or(0);
                    return Ok(self.existing(partitions));
                }
                Err((_, code)) => return Err(create_error(KafkaError::AdminOp(code))),
            }
        }
        tracing::info!(topic = %name, partitions = self.config.partitions, "created topic");
        Ok(TopicSummary {
            name,
            partitions: self.config.partitions,
            created: true,
        })
    }

    fn existing(&self, partitions: i32) -> TopicSummary {
        if partitions != self.config.partitions {
            tracing::info!(topic = %self.config.topic, partitions,
                configured = self.config.partitions,
                "the topic exists with another partition count; leaving it as it is");
        }
        TopicSummary {
            name: self.config.topic.clone(),
            partitions,
            created: false,
        }
    }

    /// The topic's partition count, or `None` when the cluster does not know the topic.
    pub(crate) async fn partition_count(&self) -> Result<Option<i32>, TopicError> {
        let producer = self.producer();
        let topic = self.config.topic.clone();
        let metadata_error = |source| TopicError::Metadata {
            topic: self.config.topic.clone(),
            source,
        };
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&topic), ADMIN_TIMEOUT)
        })
        .await
        .map_err(|_| metadata_error(KafkaError::MetadataFetch(RDKafkaErrorCode::Fail)))?
        .map_err(metadata_error)?;
        let Some(topic) = metadata
            .topics()
            .iter()
            .find(|t| t.name() == self.config.topic)
        else {
            return Ok(None);
        };
        match topic.error().map(RDKafkaErrorCode::from) {
            None => Ok(Some(
                i32::try_from(topic.partitions().len()).unwrap_or(i32::MAX),
            )),
            Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
                Ok(None)
            }
            Some(code) => Err(metadata_error(KafkaError::MetadataFetch(code))),
        }
    }

    /// The headers `event` is published with: the message contract
    /// ([`handoff_core::contract::headers`]): CloudEvents binary mode (`ce-specversion`, `ce-id`
    /// = the event id, `ce-type`, `ce-source` = [`KafkaConfig::ce_source`], `ce-time`),
    /// `Content-Type: application/json`, `Handoff-Aggregate-Type`, `Handoff-Aggregate-Id`,
    /// `Handoff-Sequence`, `Handoff-Schema-Version`, and the writer's own headers.
    ///
    /// # Errors
    ///
    /// [`PublishErrorKind::Rejected`] when a writer's header clashes with the contract's.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::{OutboxEvent, PublishError};
    /// # fn example(transport: &handoff_kafka::KafkaTransport, event: &OutboxEvent)
    /// #     -> Result<(), PublishError> {
    /// let headers = transport.headers(event)?;
    /// assert!(headers.iter().any(|(name, _)| name == "ce-id"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn headers(&self, event: &OutboxEvent) -> Result<Vec<(String, String)>, PublishError> {
        contract::headers(event, &self.config.ce_source)
    }

    /// The configuration the transport was connected with.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(transport: &handoff_kafka::KafkaTransport) {
    /// println!("publishing to {}", transport.config().topic);
    /// # }
    /// ```
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// Publishes `event` and waits for its delivery report: the same as
    /// [`Transport::publish`], with the partition and offset.
    ///
    /// # Errors
    ///
    /// [`PublishError`]: a message too large or invalid is
    /// [`Rejected`](PublishErrorKind::Rejected); no delivery report within
    /// [`KafkaConfig::publish_timeout`] is a [`Timeout`](PublishErrorKind::Timeout) (the
    /// brokers may hold it), or [`Unavailable`](PublishErrorKind::Unavailable) while every
    /// broker is down; anything else is [`Transient`](PublishErrorKind::Transient).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the message queued in the producer, which may still deliver
    /// it: the relay republishes the event under the same `ce-id`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::{OutboxEvent, PublishError};
    /// # async fn example(transport: &handoff_kafka::KafkaTransport, event: &OutboxEvent)
    /// #     -> Result<(), PublishError> {
    /// let delivered = transport.send(event).await?;
    /// assert!(delivered.offset >= 0);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn send(&self, event: &OutboxEvent) -> Result<Delivered, PublishError> {
        let (producer, delivery) = self.enqueue(event, self.headers(event)?)?;
        self.delivered(&producer, delivery).await
    }

    /// Hands `event` with `headers` to the producer: the first half of [`send`](Self::send),
    /// whose second is [`delivered`](Self::delivered). Records enqueued one after another on
    /// one partition are stored in that order (the producer is idempotent).
    pub(crate) fn enqueue(
        &self,
        event: &OutboxEvent,
        headers: Vec<(String, String)>,
    ) -> Result<(FutureProducer<KafkaContext>, DeliveryFuture), PublishError> {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: &name,
                value: Some(value.as_bytes()),
            });
        }
        let record = FutureRecord::to(&self.config.topic)
            .key(kafka_key(event))
            .payload(event.payload.as_bytes())
            .headers(owned);
        let producer = self.producer();
        match producer.send_result(record) {
            Ok(delivery) => Ok((producer, delivery)),
            Err((error, _record)) => Err(self.publish_error(&producer, error)),
        }
    }

    /// Waits for the delivery report of a record [`enqueue`](Self::enqueue) handed to
    /// `producer`.
    pub(crate) async fn delivered(
        &self,
        producer: &FutureProducer<KafkaContext>,
        delivery: DeliveryFuture,
    ) -> Result<Delivered, PublishError> {
        // librdkafka reports within message.timeout.ms (the publish timeout); the margin only
        // guards against a report that never comes.
        let wait = self.config.publish_timeout + Duration::from_secs(1);
        match tokio::time::timeout(wait, delivery).await {
            Ok(Ok(Ok(delivered))) => {
                self.state.brokers_down.store(false, Ordering::Relaxed);
                Ok(Delivered {
                    topic: self.config.topic.clone(),
                    partition: delivered.partition,
                    offset: delivered.offset,
                })
            }
            Ok(Ok(Err((error, _message)))) => Err(self.publish_error(producer, error)),
            // The producer was closed under the future (only when it is being replaced).
            Ok(Err(_canceled)) => Err(PublishError::new(
                PublishErrorKind::Transient,
                "the producer was closed before the delivery report",
            )),
            Err(_elapsed) => Err(PublishError::new(
                self.timeout_kind(),
                format!(
                    "no delivery report from topic {} within {wait:?}",
                    self.config.topic
                ),
            )),
        }
    }

    fn producer(&self) -> FutureProducer<KafkaContext> {
        self.producer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn timeout_kind(&self) -> PublishErrorKind {
        if self.state.brokers_down.load(Ordering::Relaxed) {
            PublishErrorKind::Unavailable
        } else {
            PublishErrorKind::Timeout
        }
    }

    /// Sorts a producer error into the relay's kinds, and replaces a producer that librdkafka
    /// declared fatally failed (an idempotent producer refuses everything after that).
    fn publish_error(
        &self,
        used: &FutureProducer<KafkaContext>,
        error: KafkaError,
    ) -> PublishError {
        if let Some((code, reason)) = used.client().fatal_error() {
            self.replace_producer(used, code, &reason);
            return PublishError::with_source(PublishErrorKind::Transient, error);
        }
        let kind = classify(error.rdkafka_error_code(), self.timeout_kind());
        PublishError::with_source(kind, error)
    }

    fn replace_producer(
        &self,
        used: &FutureProducer<KafkaContext>,
        code: RDKafkaErrorCode,
        reason: &str,
    ) {
        let mut current = self.producer.write().unwrap_or_else(|e| e.into_inner());
        // Another publish may have replaced it already.
        if current.client().native_ptr() != used.client().native_ptr() {
            return;
        }
        match self.client_config.create_with_context(KafkaContext {
            state: Arc::clone(&self.state),
        }) {
            Ok(fresh) => {
                tracing::warn!(
                    ?code,
                    reason,
                    "the kafka producer failed fatally; replaced it"
                );
                *current = fresh;
            }
            Err(error) => {
                tracing::error!(%error, "the kafka producer failed fatally and could not be replaced")
            }
        }
    }
}

impl Transport for KafkaTransport {
    /// Publishes `event` with [`send`](KafkaTransport::send); the receipt is
    /// `kafka <topic>/<partition>@<offset>` ([`Delivered::receipt_detail`]).
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        self.send(event)
            .await
            .map(|delivered| Receipt::new(delivered.receipt_detail()))
    }

    /// Returns `true` once a broker answers a metadata request for the topic, within `at_most`.
    async fn wait_until_ready(&self, at_most: Duration) -> bool {
        let producer = self.producer();
        let topic = self.config.topic.clone();
        let answer = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&topic), at_most)
                .is_ok()
        })
        .await
        .unwrap_or(false);
        if answer {
            self.state.brokers_down.store(false, Ordering::Relaxed);
        }
        answer
    }
}

/// The producer's librdkafka settings.
fn producer_config(config: &KafkaConfig) -> ClientConfig {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &config.brokers)
        .set("client.id", &config.client_id)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set(
            "message.timeout.ms",
            millis(config.publish_timeout).unwrap_or(5_000).to_string(),
        )
        // Topics are created by ensure_topic with the configured partitions, never by a
        // metadata request with the broker's defaults.
        .set("allow.auto.create.topics", "false")
        // The Java client's key hash: other producers put a key in the same partition.
        .set("partitioner", "murmur2_random");
    config.options.apply(&mut client);
    client
}

fn admin_config(config: &KafkaConfig) -> ClientConfig {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &config.brokers)
        .set("client.id", &config.client_id);
    config.options.apply(&mut client);
    client
}

/// librdkafka's refusal to create a client, without the option value rdkafka's own
/// configuration errors quote.
pub(crate) fn client_error(source: KafkaError) -> ConnectError {
    match source {
        KafkaError::ClientConfig(..) => ConnectError::InvalidConfig(
            crate::ConfigError::InvalidOption(crate::options::refused_option(source)),
        ),
        source => ConnectError::Client { source },
    }
}

/// Sorts librdkafka's codes into the relay's kinds; `timeout` is the kind a timeout gets (the
/// caller knows whether the brokers are down).
pub(crate) fn classify(
    code: Option<RDKafkaErrorCode>,
    timeout: PublishErrorKind,
) -> PublishErrorKind {
    use RDKafkaErrorCode as C;
    let Some(code) = code else {
        return PublishErrorKind::Transient;
    };
    match code {
        // This message never fits or never parses: retrying cannot help.
        C::MessageSizeTooLarge
        | C::InvalidMessageSize
        | C::InvalidMessage
        | C::InvalidRecord
        | C::MessageBatchTooLarge
        | C::BadMessage
        | C::InvalidTimestamp => PublishErrorKind::Rejected,
        // No report in time: the broker may hold it.
        C::MessageTimedOut | C::RequestTimedOut | C::TimedOutQueue | C::OperationTimedOut => {
            timeout
        }
        // The cluster, or the topic's leader, is not there: not the event's fault.
        C::AllBrokersDown
        | C::BrokerTransportFailure
        | C::Resolve
        | C::BrokerNotAvailable
        | C::LeaderNotAvailable
        | C::NotLeaderForPartition
        | C::UnknownTopicOrPartition
        | C::UnknownTopic
        | C::UnknownPartition => PublishErrorKind::Unavailable,
        // The relay's principal may not write the topic, or its login is refused: no event
        // gets through until an operator fixes the setup.
        C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed
        | C::SaslAuthenticationFailed
        | C::Authentication => PublishErrorKind::Misconfigured,
        _ => PublishErrorKind::Transient,
    }
}

/// The record key: the aggregate id, or `global` for an event of the global lane (one key, so
/// one partition holds the whole lane in order).
fn kafka_key(event: &OutboxEvent) -> &[u8] {
    if event.global_sequence.is_some() {
        b"global"
    } else {
        event.aggregate_id.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RDKafkaErrorCode as C;

    #[test]
    fn codes_map_to_the_relay_kinds() {
        let timeout = PublishErrorKind::Timeout;
        for (code, kind) in [
            (C::MessageSizeTooLarge, PublishErrorKind::Rejected),
            (C::InvalidRecord, PublishErrorKind::Rejected),
            (C::MessageTimedOut, PublishErrorKind::Timeout),
            (C::AllBrokersDown, PublishErrorKind::Unavailable),
            (C::UnknownTopicOrPartition, PublishErrorKind::Unavailable),
            (C::TopicAuthorizationFailed, PublishErrorKind::Misconfigured),
            (C::SaslAuthenticationFailed, PublishErrorKind::Misconfigured),
            (C::QueueFull, PublishErrorKind::Transient),
            (C::NotEnoughReplicas, PublishErrorKind::Transient),
            (C::OutOfOrderSequenceNumber, PublishErrorKind::Transient),
        ] {
            assert_eq!(classify(Some(code), timeout), kind, "{code:?}");
        }
        assert_eq!(classify(None, timeout), PublishErrorKind::Transient);
        assert_eq!(
            classify(Some(C::MessageTimedOut), PublishErrorKind::Unavailable),
            PublishErrorKind::Unavailable
        );
    }

    #[test]
    fn a_global_event_is_keyed_global_so_the_lane_keeps_one_partition() {
        let mut event = OutboxEvent {
            event_id: uuid::Uuid::nil(),
            aggregate_type: "order".into(),
            aggregate_id: "o-7".into(),
            aggregate_sequence: 1,
            global_sequence: None,
            event_type: "OrderPlaced".into(),
            schema_version: 1,
            payload: "{}".into(),
            headers: Vec::new(),
            occurred_at: std::time::SystemTime::UNIX_EPOCH,
            attempt_count: 0,
        };
        assert_eq!(kafka_key(&event), b"o-7");
        event.global_sequence = Some(3);
        assert_eq!(kafka_key(&event), b"global");
    }

    #[test]
    fn receipts_name_topic_partition_and_offset() {
        let delivered = Delivered {
            topic: "outbox".into(),
            partition: 3,
            offset: 1207,
        };
        assert_eq!(delivered.receipt_detail(), "kafka outbox/3@1207");
    }
}
