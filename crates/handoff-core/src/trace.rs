//! W3C trace context between `tracing` spans and event headers (feature `otel`).
//!
//! The one place where handoff reads and writes `traceparent` / `tracestate`:
//!
//! - at enqueue, `handoff-postgres` calls [`headers_json_with_current_context`] so that an event
//!   written inside a traced request carries that request's trace;
//! - the relay's publish span and the consumer's handler span call [`continue_trace`] with the
//!   event's headers, so each continues the trace the event was written in.
//!
//! Both sides go through the `tracing` span's OpenTelemetry context, which exists only when the
//! process installed a `tracing-opentelemetry` layer (the binaries do when given
//! `--otlp-endpoint`). Without one nothing is captured, nothing is continued and every call here
//! is a cheap no-op; headers the writer set itself travel unchanged either way.

use std::collections::BTreeMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{Limits, NewEvent};

/// The W3C header naming the trace and the parent span: `00-<trace id>-<span id>-<flags>`.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor-specific trace state along with [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// Adds the current `tracing` span's trace context to `headers` as `traceparent` (and
/// `tracestate` when the trace has one).
///
/// Headers the caller set win: when `headers` already has a `traceparent` or a `tracestate`
/// (in any ASCII case) nothing is added, so a caller who propagates a context of its own keeps
/// it whole. Returns whether headers were added; `false` also when there is no current span
/// with a valid OpenTelemetry context (no layer installed, or no span entered).
///
/// # Examples
///
/// ```
/// use std::collections::BTreeMap;
///
/// let mut headers = BTreeMap::new();
/// headers.insert("traceparent".to_owned(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned());
/// // The caller's context is kept.
/// assert!(!handoff_core::trace::inject_current_context(&mut headers));
/// assert_eq!(headers.len(), 1);
/// ```
pub fn inject_current_context(headers: &mut BTreeMap<String, String>) -> bool {
    if headers
        .keys()
        .any(|name| name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE))
    {
        return false;
    }
    let context = tracing::Span::current().context();
    if !context.span().span_context().is_valid() {
        return false;
    }
    TraceContextPropagator::new().inject_context(&context, &mut MapInjector(headers));
    // The propagator writes `tracestate` even when the trace has none: no empty header.
    if headers.get(TRACESTATE).is_some_and(String::is_empty) {
        headers.remove(TRACESTATE);
    }
    headers.contains_key(TRACEPARENT)
}

/// The headers of `event` as the outbox stores them (a JSON object, as
/// [`NewEvent::headers_json`]), with the current trace context added by
/// [`inject_current_context`].
///
/// The event was validated against `limits` without the added headers; when adding them would
/// break a limit (the caller's headers already fill the 4 KiB), the event is stored as the
/// caller wrote it, untraced, rather than refused.
pub fn headers_json_with_current_context(event: &NewEvent, limits: &Limits) -> String {
    let mut headers = event.headers().clone();
    if !inject_current_context(&mut headers) {
        return event.headers_json();
    }
    if let Err(error) = limits.check_headers(&headers) {
        tracing::debug!(
            event_id = %event.event_id(),
            %error,
            "trace context left out: the event's headers are at their limit"
        );
        return event.headers_json();
    }
    // A map of strings to strings always serialises.
    serde_json::to_string(&headers).unwrap_or_else(|_| event.headers_json())
}

/// Makes `span` continue the trace carried by `headers` (`traceparent`, `tracestate`, names
/// compared without regard to ASCII case), as the remote parent of `span`.
///
/// Call it on a span that was just created, before it is entered. Returns whether a parent was
/// set: `false` when the headers carry no valid context, when `span` is disabled, or when no
/// OpenTelemetry layer is installed; `span` then keeps the parent it had.
///
/// # Examples
///
/// ```
/// let span = tracing::info_span!("handle");
/// let headers = [("traceparent".to_owned(), "not a trace".to_owned())];
/// assert!(!handoff_core::trace::continue_trace(&span, &headers));
/// ```
pub fn continue_trace(span: &tracing::Span, headers: &[(String, String)]) -> bool {
    // No layer wants the span (no exporter, logs filtered): nothing to parse.
    if span.is_disabled() {
        return false;
    }
    let parent = TraceContextPropagator::new().extract(&PairsExtractor(headers));
    if !parent.span().span_context().is_valid() {
        return false;
    }
    span.set_parent(parent).is_ok()
}

/// Writes propagated fields into a header map.
struct MapInjector<'a>(&'a mut BTreeMap<String, String>);

impl Injector for MapInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

/// Reads propagated fields from headers as a broker gives them: a list of pairs.
struct PairsExtractor<'a>(&'a [(String, String)]);

impl Extractor for PairsExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(key))
            .map(|(_, value)| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_added_without_a_current_span() {
        let mut headers = BTreeMap::new();
        assert!(!inject_current_context(&mut headers));
        assert!(headers.is_empty());
    }

    #[test]
    fn a_caller_set_tracestate_alone_also_keeps_the_context_out() {
        let mut headers = BTreeMap::from([("TraceState".to_owned(), "k=v".to_owned())]);
        assert!(!inject_current_context(&mut headers));
        assert_eq!(headers.len(), 1);
    }

    #[test]
    fn extraction_finds_headers_in_any_case() {
        let headers = [(
            "TraceParent".to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        )];
        let context = TraceContextPropagator::new().extract(&PairsExtractor(&headers));
        assert_eq!(
            context.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }
}
