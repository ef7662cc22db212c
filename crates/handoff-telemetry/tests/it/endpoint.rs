//! The metrics-and-probes endpoint over real HTTP: `/metrics` renders the recorder,
//! `/healthz` always answers, `/readyz` runs the supplied checks concurrently, bounded by the
//! timeout, reuses a result within the cache period, and never shows a URL's password.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_telemetry::endpoint::{Endpoint, NotReady, Serving};
use metrics_exporter_prometheus::PrometheusBuilder;
use serde_json::Value;

async fn get(serving: &Serving, path: &str) -> (u16, String) {
    let response = reqwest::get(format!("http://{}{path}", serving.addr()))
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

#[tokio::test]
async fn metrics_and_liveness_are_served_beside_readiness() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        metrics::counter!("handoff_test_events_total").increment(3);
    });
    let serving = Endpoint::new(handle)
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let (status, text) = get(&serving, "/metrics").await;
    assert_eq!(status, 200);
    assert!(text.contains("handoff_test_events_total 3"), "{text}");
    assert_eq!(
        get(&serving, "/healthz").await,
        (200, r#"{"alive":true}"#.into())
    );
    // No check supplied: ready.
    assert_eq!(
        get(&serving, "/readyz").await,
        (200, r#"{"ready":true,"checks":{}}"#.into())
    );
    assert_eq!(get(&serving, "/other").await.0, 404);
}

#[tokio::test]
async fn readiness_reports_the_first_failure_bounded_cached_and_scrubbed() {
    let handle = PrometheusBuilder::new().build_recorder().handle();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let serving = Endpoint::new(handle)
        .timeout(Duration::from_millis(300))
        .cache_for(Duration::from_secs(60))
        .check("database", move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async {
                Err(NotReady::new(
                    "database unreachable: postgres://app:hunter2@db:5432/app refused",
                ))
            }
        })
        .check("broker", || async {
            // Hangs: the endpoint's timeout must end it.
            std::future::pending::<()>().await;
            Ok(())
        })
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();

    let started = Instant::now();
    let (status, body) = get(&serving, "/readyz").await;
    let took = started.elapsed();
    assert_eq!(status, 503, "{body}");
    assert!(
        took < Duration::from_secs(2),
        "a hanging check held the probe {took:?}"
    );
    let json: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["ready"], false);
    assert_eq!(
        json["reason"], "database unreachable: postgres://***@db:5432/app refused",
        "{body}"
    );
    assert!(!body.contains("hunter2"), "{body}");
    assert_eq!(
        json["checks"]["broker"],
        "broker check timed out after 300ms"
    );
    assert!(
        body.starts_with(r#"{"ready":false,"reason":"#),
        "ready first, then the reason: {body}"
    );

    // Within the cache period a probe costs no new run.
    for _ in 0..5 {
        assert_eq!(get(&serving, "/readyz").await.0, 503);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
