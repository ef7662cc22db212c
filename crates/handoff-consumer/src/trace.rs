//! The span a handler runs in (feature `otel`).
//!
//! With `otel`, the handler runs in a `handoff.consumer.handle` span (OpenTelemetry kind
//! `consumer`) whose parent is the trace context the event carries (its `traceparent` /
//! `tracestate` headers, see `handoff_core::trace`): the trace of the request that wrote the
//! event goes on into the consumer, and events the handler enqueues in its transaction carry
//! it further. Without `otel` there is no span at all.

use handoff_core::intake::ReceivedEvent;
use tracing::Span;

/// The span to run the handler for `event` in (a disabled span without `otel`); `consumer` is
/// the consumer's name.
pub(crate) fn handler_span(consumer: &str, event: &ReceivedEvent) -> Span {
    #[cfg(feature = "otel")]
    {
        // No contextual parent: the handler belongs to the event's trace, not to the
        // consumer loop's span.
        let span = tracing::info_span!(
            parent: None,
            "handoff.consumer.handle",
            otel.kind = "consumer",
            messaging.message.id = %event.event_id,
            messaging.consumer.group.name = consumer,
            handoff.aggregate_type = %event.aggregate_type,
            handoff.aggregate_id = %event.aggregate_id,
            handoff.sequence = event.sequence,
            handoff.event_type = %event.event_type,
            handoff.replayed = event.replayed,
        );
        handoff_core::trace::continue_trace(&span, &event.headers);
        span
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (consumer, event);
        Span::none()
    }
}
