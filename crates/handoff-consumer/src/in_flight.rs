//! The bytes of deliveries the consumer holds: taken from the intake, not yet settled
//! ([`ConsumerConfig::max_in_flight_bytes`](crate::ConsumerConfig::max_in_flight_bytes)).
//!
//! Why bytes and not a count: the intake's own bounds count messages (JetStream's
//! `max_ack_pending`, AMQP's prefetch), and a consumer of large events (documents, snapshots of
//! a few hundred KB up to the broker's limit) at a thousand unacknowledged messages holds a
//! gigabyte: in a small container, an OOM kill and a redelivery loop. The consumer stops asking
//! the intake for more while what it holds is at the bound, whatever the count.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use handoff_core::intake::{MalformedEvent, ReceivedEvent};
use metrics::Gauge;
use tokio::sync::Notify;

/// Counts the bytes held and wakes the intake loop when some are given back.
pub(crate) struct InFlightBytes {
    limit: usize,
    held: AtomicUsize,
    freed: Notify,
    gauge: Gauge,
}

impl InFlightBytes {
    pub(crate) fn new(limit: usize, gauge: Gauge) -> Arc<Self> {
        Arc::new(Self {
            limit,
            held: AtomicUsize::new(0),
            freed: Notify::new(),
            gauge,
        })
    }

    /// Waits until the consumer holds less than its bound. One delivery is always let in below
    /// the bound, so an event larger than the bound still flows, alone.
    pub(crate) async fn room(&self) {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the check: a release between the check and the await wakes it.
            freed.as_mut().enable();
            if self.held.load(Ordering::Acquire) < self.limit {
                return;
            }
            freed.await;
        }
    }

    /// Counts `bytes` as held until the returned guard is dropped (the delivery settled, handed
    /// back or abandoned).
    pub(crate) fn hold(self: &Arc<Self>, bytes: usize) -> HeldBytes {
        let now = self.held.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.gauge.set(now as f64);
        HeldBytes {
            owner: self.clone(),
            bytes,
        }
    }

    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// Bytes of one delivery, given back when dropped.
pub(crate) struct HeldBytes {
    owner: Arc<InFlightBytes>,
    bytes: usize,
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        let now = self.owner.held.fetch_sub(self.bytes, Ordering::AcqRel) - self.bytes;
        self.owner.gauge.set(now as f64);
        self.owner.freed.notify_waiters();
    }
}

/// What a delivered event costs the consumer in memory, about: its payload, headers and ids.
pub(crate) fn event_bytes(event: &ReceivedEvent) -> usize {
    event.payload.len()
        + headers_bytes(&event.headers)
        + event.aggregate_type.len()
        + event.aggregate_id.len()
        + event.event_type.len()
}

/// As [`event_bytes`], for a message that is not an event.
pub(crate) fn malformed_bytes(malformed: &MalformedEvent) -> usize {
    malformed.payload.len()
        + headers_bytes(&malformed.headers)
        + malformed.reason.len()
        + malformed.location.len()
}

fn headers_bytes(headers: &[(String, String)]) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn room_waits_at_the_bound_and_opens_when_bytes_come_back() {
        let in_flight = InFlightBytes::new(100, Gauge::noop());
        in_flight.room().await;
        // One delivery over the bound is let in (an event larger than the bound flows alone)...
        let big = in_flight.hold(150);
        assert_eq!(in_flight.held(), 150);
        // ... and then nothing until it is settled.
        let waited = tokio::time::timeout(Duration::from_millis(50), in_flight.room()).await;
        assert!(waited.is_err(), "room at 150 of 100 bytes");
        let waiting = tokio::spawn({
            let in_flight = in_flight.clone();
            async move { in_flight.room().await }
        });
        drop(big);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("room once the bytes came back")
            .unwrap();
        assert_eq!(in_flight.held(), 0);
    }
}
