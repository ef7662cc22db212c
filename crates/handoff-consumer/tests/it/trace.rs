//! One trace from the order service through the relay to a consumer (feature `otel`), over the
//! real PostgreSQL outbox, the polling source, the JetStream transport and intake, with the
//! spans read back from the OpenTelemetry SDK's in-memory exporter.
//!
//! The order service's span is the parent of both the relay's publish span and the consumer's
//! handler span: the event carries the context it was written in (its creation context, as
//! OpenTelemetry's messaging conventions have it), and each hop continues it.

use std::time::Duration;

use crate::common::Setup;
use handoff_consumer::{Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_postgres::{Outbox, OutboxConfig, PollingConfig, PollingSource};
use handoff_relay::{Relay, RelayConfig};
use handoff_test::nats::shared_url;
use handoff_test::{factory, inbox};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry::Value;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sqlx::PgConnection;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

/// A context a caller propagates itself (the W3C specification's example).
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// Records the event and does its work in a span of its own, as a real handler's code would.
struct Traced;

impl Handler for Traced {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        inbox::record(tx, event)
            .instrument(tracing::info_span!("test.reserve_stock"))
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_the_order_service_the_relay_and_the_consumer() {
    // Global, so the relay's and the consumer's tasks on every worker thread see it.
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("trace-test")));
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let setup = Setup::new("consumer_trace").await;
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let traced = factory::event("o-traced", 1);
    let caller_set = factory::event("o-caller", 1)
        .with_header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"));
    // The order service's step: its command writes the events inside its request span.
    let request = tracing::info_span!("order_service.create_order");
    async {
        let mut tx = setup.db.pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, &[traced.clone(), caller_set.clone()])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    .instrument(request)
    .await;

    // What enqueue stored: the request's context, and the caller's own one untouched.
    let stored: Vec<(String, serde_json::Value)> =
        sqlx::query_as("SELECT aggregate_id, headers FROM outbox ORDER BY aggregate_id")
            .fetch_all(&setup.db.pool)
            .await
            .unwrap();
    let finished = exporter.get_finished_spans().unwrap();
    let request = one(&finished, |s| s.name == "order_service.create_order");
    let trace_id = request.span_context.trace_id();
    let request_span = request.span_context.span_id();
    assert_eq!(stored[0].0, "o-caller");
    assert_eq!(
        stored[0].1,
        serde_json::json!({"traceparent": format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01")})
    );
    assert_eq!(stored[1].0, "o-traced");
    assert_eq!(
        stored[1].1,
        serde_json::json!({"traceparent": format!("00-{trace_id}-{request_span}-01")}),
        "enqueue captures the current span's context (and no empty tracestate)"
    );

    // The relay (polling source, JetStream transport) and the consumer (JetStream intake).
    let transport = JetStreamTransport::connect(
        &shared_url(),
        JetStreamConfig {
            stream: setup.stream.clone(),
            subject_prefix: setup.stream.clone(),
            ..JetStreamConfig::default()
        },
    )
    .await
    .unwrap();
    let source = PollingSource::new(setup.db.pool.clone(), PollingConfig::default()).unwrap();
    let relay = Relay::new(
        source,
        transport,
        RelayConfig {
            poll_interval: Duration::from_millis(50),
            ..RelayConfig::default()
        },
    )
    .unwrap();
    let (stop_relay, mut stopped) = tokio::sync::watch::channel(false);
    let relay = tokio::spawn(relay.run(async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    }));
    let consumer = setup.start(setup.config("trace"), Traced).await;
    setup.wait_count("SELECT count(*) FROM applied", 2).await;
    stop_relay.send(true).unwrap();
    relay.await.unwrap();
    consumer.stop().await;
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();

    // Order service -> relay: the publish span continues the request's trace.
    let publish = one(&spans, |s| {
        s.name == "handoff.relay.publish" && message_id(s) == traced.event_id().to_string()
    });
    assert_eq!(publish.span_context.trace_id(), trace_id);
    assert_eq!(publish.parent_span_id, request_span);
    assert!(
        publish.parent_span_is_remote,
        "the parent came from the headers"
    );

    // Order service -> consumer: the handler span continues it too, from the message headers.
    let handle = one(&spans, |s| {
        s.name == "handoff.consumer.handle" && message_id(s) == traced.event_id().to_string()
    });
    assert_eq!(handle.span_context.trace_id(), trace_id);
    assert_eq!(handle.parent_span_id, request_span);
    assert!(handle.parent_span_is_remote);
    // ... and the handler's own work is inside it.
    let work = spans
        .iter()
        .find(|s| s.name == "test.reserve_stock" && s.span_context.trace_id() == trace_id)
        .expect("the handler's own span is in the trace");
    assert_eq!(work.parent_span_id, handle.span_context.span_id());

    // A caller's own context wins over the current span, through every hop.
    let caller_trace = TraceId::from_hex(CALLER_TRACE).unwrap();
    let caller_span = SpanId::from_hex(CALLER_SPAN).unwrap();
    for name in ["handoff.relay.publish", "handoff.consumer.handle"] {
        let span = one(&spans, |s| {
            s.name == name && message_id(s) == caller_set.event_id().to_string()
        });
        assert_eq!(span.span_context.trace_id(), caller_trace, "{name}");
        assert_eq!(span.parent_span_id, caller_span, "{name}");
    }
    // One trace each: nothing else was exported in the request's trace but these four.
    let in_trace: Vec<_> = spans
        .iter()
        .filter(|s| s.span_context.trace_id() == trace_id)
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(
        in_trace.len(),
        4,
        "request, publish, handle, handler work: {in_trace:?}"
    );
}

/// The one span matching `matches`.
fn one(spans: &[SpanData], matches: impl Fn(&SpanData) -> bool) -> &SpanData {
    let found: Vec<_> = spans.iter().filter(|s| matches(s)).collect();
    assert_eq!(
        found.len(),
        1,
        "spans: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    found[0]
}

/// The span's `messaging.message.id` attribute (the event id), or "".
fn message_id(span: &SpanData) -> String {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == "messaging.message.id")
        .map(|kv| match &kv.value {
            Value::String(s) => s.to_string(),
            other => other.to_string(),
        })
        .unwrap_or_default()
}
