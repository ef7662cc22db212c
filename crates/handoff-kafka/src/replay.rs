//! Replayed copies: [`KafkaTransport::send_replay`], for `handoff replay` and `handoff reconcile
//! --republish`.
//!
//! A replayed copy is the relay's record (same topic, key, value and contract headers, `ce-id`
//! still the event id) with the header `Handoff-Replay: <marker>` added. Kafka has no
//! broker-side deduplication, so the copy needs no id of its own; consumers deduplicate it by
//! `ce-id` in their inbox, as any redelivery.

use handoff_core::contract::header::REPLAY;
use handoff_core::delivery::{OutboxEvent, PublishError, PublishErrorKind};
use rdkafka::producer::{DeliveryFuture, FutureProducer};

use crate::transport::KafkaContext;
use crate::{Delivered, KafkaTransport, TopicError};

/// The delivery report of one replayed copy, to be awaited with [`wait`](Self::wait).
///
/// Keeping several outstanding lets a replay pipeline its copies while it still learns about
/// every one of them.
#[must_use = "a replay is only done once its delivery report has been awaited"]
pub struct KafkaReplayAck<'a> {
    transport: &'a KafkaTransport,
    producer: FutureProducer<KafkaContext>,
    delivery: DeliveryFuture,
}

impl std::fmt::Debug for KafkaReplayAck<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaReplayAck")
            .field("topic", &self.transport.config().topic)
            .finish_non_exhaustive()
    }
}

impl KafkaReplayAck<'_> {
    /// Waits for the copy's delivery report (at most the publish timeout and a second).
    ///
    /// # Errors
    ///
    /// [`PublishError`] as from [`KafkaTransport::send`]; a
    /// [`Timeout`](PublishErrorKind::Timeout) leaves the copy in doubt.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops waiting; the producer may still deliver the copy.
    pub async fn wait(self) -> Result<Delivered, PublishError> {
        self.transport
            .delivered(&self.producer, self.delivery)
            .await
    }
}

impl KafkaTransport {
    /// The topic's partition count, or `None` when the cluster does not know the topic: a
    /// replay checks the topic is there before it sends anything (creating it would only hide
    /// a wrong `--topic`).
    ///
    /// # Errors
    ///
    /// [`TopicError`] when the cluster does not answer in time.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe; the metadata request runs on a blocking thread and finishes by itself.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn example(t: &handoff_kafka::KafkaTransport) -> Result<(), handoff_kafka::TopicError> {
    /// if t.topic_partitions().await?.is_none() {
    ///     eprintln!("topic {} does not exist", t.config().topic);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn topic_partitions(&self) -> Result<Option<i32>, TopicError> {
        self.partition_count().await
    }

    /// The headers a replayed copy of `event` is produced with: the relay's
    /// [`headers`](Self::headers) and `Handoff-Replay: <marker>`.
    ///
    /// # Errors
    ///
    /// As [`headers`](Self::headers), and [`PublishErrorKind::Rejected`] for a marker holding
    /// CR or LF.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::{OutboxEvent, PublishError};
    /// # fn example(t: &handoff_kafka::KafkaTransport, e: &OutboxEvent) -> Result<(), PublishError> {
    /// let headers = t.replay_headers(e, "r-1")?;
    /// assert!(headers.contains(&("Handoff-Replay".to_owned(), "r-1".to_owned())));
    /// # Ok(())
    /// # }
    /// ```
    pub fn replay_headers(
        &self,
        event: &OutboxEvent,
        marker: &str,
    ) -> Result<Vec<(String, String)>, PublishError> {
        if marker.contains(['\r', '\n']) {
            return Err(PublishError::new(
                PublishErrorKind::Rejected,
                format!("replay marker {marker:?} holds CR or LF"),
            ));
        }
        let mut headers = self.headers(event)?;
        headers.push((REPLAY.to_owned(), marker.to_owned()));
        Ok(headers)
    }

    /// Hands a replayed copy of `event` to the producer and returns its pending delivery
    /// report.
    ///
    /// Copies handed over one after another reach their partition in that order (the producer
    /// is idempotent), so a caller that sends an aggregate's events in sequence order may keep
    /// several reports outstanding; it must stop at the first failure to keep that order.
    ///
    /// # Errors
    ///
    /// [`PublishError`]: a header clash or a bad marker
    /// ([`Rejected`](PublishErrorKind::Rejected)), or a producer that refuses the record (its
    /// queue full, the record too large).
    ///
    /// # Cancel safety
    ///
    /// The record is handed over before the first await: dropping the future is harmless.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::delivery::{OutboxEvent, PublishError};
    /// # async fn example(t: &handoff_kafka::KafkaTransport, e: &OutboxEvent) -> Result<(), PublishError> {
    /// let ack = t.send_replay(e, "reconcile-0193a0c4").await?;
    /// let delivered = ack.wait().await?;
    /// println!("copy at {}", delivered.receipt_detail());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn send_replay(
        &self,
        event: &OutboxEvent,
        marker: &str,
    ) -> Result<KafkaReplayAck<'_>, PublishError> {
        let (producer, delivery) = self.enqueue(event, self.replay_headers(event, marker)?)?;
        Ok(KafkaReplayAck {
            transport: self,
            producer,
            delivery,
        })
    }
}
