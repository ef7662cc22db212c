//! The consumer's Prometheus metrics, registered once per consumer through the `metrics` facade.
//!
//! Every series carries the label `consumer`:
//!
//! | name | type | what |
//! |---|---|---|
//! | `handoff_consumer_applied_total` | counter | events whose effect was committed |
//! | `handoff_consumer_duplicates_total` | counter | deliveries of an already applied event, acknowledged without applying |
//! | `handoff_consumer_gaps_total` | counter | deliveries ahead of their aggregate (sequence > last + 1) |
//! | `handoff_consumer_stale_total` | counter | new event ids at an already applied place (sequence <= last) |
//! | `handoff_consumer_skipped_total` | counter | events recorded as processed without applying (stale, a reconcile skip, or an operator's skip marker) |
//! | `handoff_consumer_skipped_ahead_total` | counter | sequences a reconcile hook's `Skip` of an event ahead of its aggregate moved the aggregate past (the skipped event included) |
//! | `handoff_consumer_retries_total` | counter | deliveries handed back for a later redelivery |
//! | `handoff_consumer_abandoned_total` | counter | deliveries abandoned after the apply timeout (left for a redelivery) |
//! | `handoff_consumer_handler_errors_total{kind}` | counter | handler failures, `retryable` or `permanent` |
//! | `handoff_consumer_quarantined_total{reason}` | counter | events put in the consumer quarantine |
//! | `handoff_consumer_buffered_events` | gauge | events held by the buffer gap policy |
//! | `handoff_consumer_in_flight_bytes` | gauge | bytes of deliveries taken and not yet settled (bounded by `max_in_flight_bytes`) |
//! | `handoff_consumer_apply_seconds` | histogram | from taking a delivery to its acknowledgement |
//! | `handoff_consumer_batch_events` | histogram | batch mode: events per committed batch (applied and duplicates) |
//! | `handoff_consumer_batch_fallbacks_total` | counter | batch mode: batches rolled back whose events were then applied one per transaction |

use handoff_postgres::QuarantineKind;
use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};

use crate::HandlerErrorKind;

pub(crate) struct ConsumerMetrics {
    name: String,
    pub(crate) applied: Counter,
    pub(crate) duplicates: Counter,
    pub(crate) gaps: Counter,
    pub(crate) stale: Counter,
    pub(crate) skipped: Counter,
    pub(crate) skipped_ahead: Counter,
    pub(crate) retries: Counter,
    pub(crate) abandoned: Counter,
    pub(crate) buffered: Gauge,
    pub(crate) in_flight_bytes: Gauge,
    pub(crate) apply_seconds: Histogram,
    pub(crate) batch_events: Histogram,
    pub(crate) batch_fallbacks: Counter,
}

impl ConsumerMetrics {
    pub(crate) fn new(name: &str) -> Self {
        let label = ("consumer", name.to_owned());
        Self {
            name: name.to_owned(),
            applied: counter!(
                "handoff_consumer_applied_total",
                std::slice::from_ref(&label)
            ),
            duplicates: counter!(
                "handoff_consumer_duplicates_total",
                std::slice::from_ref(&label)
            ),
            gaps: counter!("handoff_consumer_gaps_total", std::slice::from_ref(&label)),
            stale: counter!("handoff_consumer_stale_total", std::slice::from_ref(&label)),
            skipped: counter!(
                "handoff_consumer_skipped_total",
                std::slice::from_ref(&label)
            ),
            skipped_ahead: counter!(
                "handoff_consumer_skipped_ahead_total",
                std::slice::from_ref(&label)
            ),
            retries: counter!(
                "handoff_consumer_retries_total",
                std::slice::from_ref(&label)
            ),
            abandoned: counter!(
                "handoff_consumer_abandoned_total",
                std::slice::from_ref(&label)
            ),
            buffered: gauge!(
                "handoff_consumer_buffered_events",
                std::slice::from_ref(&label)
            ),
            in_flight_bytes: gauge!(
                "handoff_consumer_in_flight_bytes",
                std::slice::from_ref(&label)
            ),
            apply_seconds: histogram!(
                "handoff_consumer_apply_seconds",
                std::slice::from_ref(&label)
            ),
            batch_events: histogram!(
                "handoff_consumer_batch_events",
                std::slice::from_ref(&label)
            ),
            batch_fallbacks: counter!("handoff_consumer_batch_fallbacks_total", &[label]),
        }
    }

    pub(crate) fn handler_error(&self, kind: HandlerErrorKind) {
        counter!("handoff_consumer_handler_errors_total",
            "consumer" => self.name.clone(), "kind" => kind.as_str())
        .increment(1);
    }

    pub(crate) fn quarantined(&self, kind: QuarantineKind) {
        counter!("handoff_consumer_quarantined_total",
            "consumer" => self.name.clone(), "reason" => kind.as_str())
        .increment(1);
    }
}
