//! The relay's metric names (Prometheus format through the `metrics` facade; the binary
//! installs the exporter).

pub(crate) const CLAIMS: &str = "handoff_relay_claims_total";
pub(crate) const CLAIMED: &str = "handoff_relay_claimed_events_total";
pub(crate) const CLAIM_SECONDS: &str = "handoff_relay_claim_seconds";
pub(crate) const PUBLISHED: &str = "handoff_events_published_total";
pub(crate) const PUBLISH_FAILURES: &str = "handoff_relay_publish_failures_total";
pub(crate) const TAKEN_OVER: &str = "handoff_relay_leases_taken_over_total";
pub(crate) const HELD: &str = "handoff_relay_held_events_total";
pub(crate) const ACK_SECONDS: &str = "handoff_relay_ack_seconds";
pub(crate) const COMMIT_TO_ACK_SECONDS: &str = "handoff_relay_commit_to_ack_seconds";
pub(crate) const IN_FLIGHT: &str = "handoff_relay_in_flight_events";
pub(crate) const IN_FLIGHT_BYTES: &str = "handoff_relay_in_flight_bytes";
pub(crate) const BROKER_UP: &str = "handoff_relay_broker_up";
pub(crate) const SOURCE_ERRORS: &str = "handoff_relay_source_errors_total";
pub(crate) const DESTINATION_PAUSED: &str = "handoff_destination_paused";
pub(crate) const DESTINATION_PAUSES: &str = "handoff_destination_pauses_total";
pub(crate) const STALE_WRITES: &str = "handoff_relay_stale_writes_total";

/// The histograms, for exporters that need bucket settings per metric.
pub const HISTOGRAMS: &[&str] = &[CLAIM_SECONDS, ACK_SECONDS, COMMIT_TO_ACK_SECONDS];

pub(crate) fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(CLAIMS, "Claim statements run");
    describe_counter!(CLAIMED, "Events leased by claims");
    describe_histogram!(
        CLAIM_SECONDS,
        Unit::Seconds,
        "Duration of one claim statement"
    );
    describe_counter!(
        TAKEN_OVER,
        "Events claimed from a lease that ran out unsettled"
    );
    describe_counter!(PUBLISHED, "Events the broker acknowledged");
    describe_counter!(PUBLISH_FAILURES, "Publishes that failed, by error kind");
    describe_counter!(
        HELD,
        "Events held for an operator (attempt cap or permanent refusal)"
    );
    describe_histogram!(
        ACK_SECONDS,
        Unit::Seconds,
        "Publish to broker acknowledgement"
    );
    describe_histogram!(
        COMMIT_TO_ACK_SECONDS,
        Unit::Seconds,
        "Event occurred_at (writer's commit) to broker acknowledgement"
    );
    describe_gauge!(IN_FLIGHT, "Events leased by this relay and not yet settled");
    describe_gauge!(
        IN_FLIGHT_BYTES,
        "Bytes of payload and headers of the events this relay holds: claimed, not yet published or given back"
    );
    describe_gauge!(
        BROKER_UP,
        "1 while the broker answers, 0 while claims are paused"
    );
    describe_counter!(SOURCE_ERRORS, "Failed source operations, by operation");
    describe_counter!(
        STALE_WRITES,
        "Failures and releases that changed nothing because the event was no longer held under \
         the lease it was claimed under (the lease ran out and a claim took the event again \
         before the write landed), by operation (record_failures, release)"
    );
    describe_gauge!(
        DESTINATION_PAUSED,
        "1 for the reason of the pause in force (the destination is down, throttling, failing \
         for different events, or refusing the relay's setup; no attempts are charged \
         meanwhile), else 0"
    );
    describe_counter!(
        DESTINATION_PAUSES,
        "Pauses of the destination, by reason (unavailable, throttled, failing, misconfigured)"
    );
}
