//! The span each publish runs in (feature `otel`).
//!
//! With `otel`, a publish runs in a `handoff.relay.publish` span (OpenTelemetry kind
//! `producer`) whose parent is the trace context the event was enqueued with (its
//! `traceparent` / `tracestate` headers, see `handoff_core::trace`), so the publish shows up in
//! the trace of the request that wrote the event. An event without one gets a span of its
//! own trace. Without `otel` there is no span at all.

use handoff_core::delivery::OutboxEvent;
use tracing::Span;

/// The span to run the publish of `event` in (a disabled span without `otel`).
pub(crate) fn publish_span(event: &OutboxEvent) -> Span {
    #[cfg(feature = "otel")]
    {
        // No contextual parent: a publish belongs to the event's trace, not to whatever span
        // the relay loop happens to run in.
        let span = tracing::info_span!(
            parent: None,
            "handoff.relay.publish",
            otel.kind = "producer",
            messaging.message.id = %event.event_id,
            handoff.aggregate_type = %event.aggregate_type,
            handoff.aggregate_id = %event.aggregate_id,
            handoff.sequence = event.aggregate_sequence,
            handoff.event_type = %event.event_type,
            handoff.attempt = event.attempt_count + 1,
        );
        handoff_core::trace::continue_trace(&span, &event.headers);
        span
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = event;
        Span::none()
    }
}
