//! The trace context an enqueued event carries (feature `otel`).
//!
//! With `otel`, an event enqueued inside a `tracing` span that has an OpenTelemetry context
//! stores that context as its `traceparent` / `tracestate` headers, unless the caller set
//! either; the relay and consumers continue the trace from there. The W3C format itself lives
//! in `handoff_core::trace`.

use handoff_core::{Limits, NewEvent};

/// The headers column of `event`: its headers as a JSON object, with the current trace
/// context added under `otel` (only when it fits within `limits`).
pub(crate) fn stored_headers(event: &NewEvent, limits: &Limits) -> String {
    #[cfg(feature = "otel")]
    {
        handoff_core::trace::headers_json_with_current_context(event, limits)
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = limits;
        event.headers_json()
    }
}
