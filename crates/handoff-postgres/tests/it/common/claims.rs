//! What a relay does with a claim, for the tests of claim order (`parking`, `order_holes`):
//! settle it, or have the destination refuse an event for good.

use handoff_core::delivery::{Claim, Failure, Published, Receipt, Source};
use handoff_core::EventId;
use handoff_postgres::PollingSource;

/// `(aggregate_id, aggregate_sequence)` of a claim's events, in claim order.
pub fn claimed(claim: &Claim) -> Vec<(String, i64)> {
    claim
        .events
        .iter()
        .map(|e| (e.aggregate_id.clone(), e.aggregate_sequence))
        .collect()
}

/// Marks every event of `claim` published, as the relay does once the broker acked them.
pub async fn mark_published(source: &PollingSource, claim: &Claim) {
    let acks: Vec<Published> = claim
        .events
        .iter()
        .map(|e| Published {
            event_id: e.event_id,
            receipt: Receipt::new("test ack"),
            lease: claim.lease,
        })
        .collect();
    source.mark_published(&acks).await.unwrap();
}

/// Holds `event_id` of `claim` for an operator: the destination refused it for good.
pub async fn hold(source: &PollingSource, claim: &Claim, event_id: EventId) {
    source
        .record_failures(&[Failure {
            event_id,
            error: "refused".into(),
            retry_after: None,
            counts_as_attempt: true,
            hold_reason: Some("rejected"),
            lease: claim.lease,
        }])
        .await
        .unwrap();
}
