//! docs/quickstart.md's flow end to end: migrate, `POST /orders`, the relay publishes, the
//! consumer applies the event once and counts it in its metrics.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use handoff::nats::{JetStreamConfig, JetStreamTransport};
use handoff::postgres::{PollingConfig, PollingSource};
use handoff::relay::{Relay, RelayConfig};
use handoff_test::nats::{prepare_shared_server, read_stream, shared_url, DeleteStreamOnDrop};
use handoff_test::{eventually, unique_name, TestDb};
use quickstart::{
    migrate_consumer, migrate_service, outbox, router, run_consumer, serve_metrics, AppState, Bus,
    OrderCreated, OrderPlaced,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tower::ServiceExt;

const DEADLINE: Duration = Duration::from_secs(30);

fn post_order(body: &'static str) -> Request<Body> {
    Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap()
}

/// The Prometheus text at `http://addr/metrics`.
async fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    Ok(text)
}

#[tokio::test]
async fn an_order_placed_over_http_ships_once() {
    let service_db = TestDb::new("quickstart_service").await;
    let consumer_db = TestDb::new("quickstart_consumer").await;
    migrate_service(&service_db.pool).await.unwrap();
    migrate_consumer(&consumer_db.pool).await.unwrap();
    // Run again, as every replica does at start: nothing left to apply.
    migrate_service(&service_db.pool).await.unwrap();
    // The two sets keep apart: handoff's history and the application's.
    assert!(service_db.count("handoff_migrations").await > 0);
    assert_eq!(service_db.count("_sqlx_migrations").await, 1);
    assert!(consumer_db.count("handoff_migrations").await > 0);

    let app = router(AppState {
        pool: service_db.pool.clone(),
        outbox: outbox(),
    });
    let refused = app
        .clone()
        .oneshot(post_order(r#"{"customer_id":"c-1","total_cents":0}"#))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let created = app
        .oneshot(post_order(r#"{"customer_id":"c-1","total_cents":4200}"#))
        .await
        .unwrap();
    assert_eq!(created.status(), StatusCode::CREATED);
    let body = axum::body::to_bytes(created.into_body(), usize::MAX)
        .await
        .unwrap();
    let OrderCreated { order_id } = serde_json::from_slice(&body).unwrap();
    // The order and its event, and nothing of the refused request.
    assert_eq!(service_db.count("orders").await, 1);
    assert_eq!(service_db.pending_rows().await, 1);

    // The relay, embedded, into a stream of this test's own.
    let client = prepare_shared_server().await;
    let url = shared_url();
    let stream = unique_name("quickstart");
    let _cleanup = DeleteStreamOnDrop::new(&url, &stream);
    let bus = Bus {
        nats_url: url.clone(),
        stream: stream.clone(),
        subject_prefix: stream.clone(),
    };
    let transport = JetStreamTransport::connect(
        &url,
        JetStreamConfig {
            stream: bus.stream.clone(),
            subject_prefix: bus.subject_prefix.clone(),
            ..JetStreamConfig::default()
        },
    )
    .await
    .unwrap();
    transport.ensure_stream().await.unwrap();
    let source = PollingSource::new(service_db.pool.clone(), PollingConfig::default()).unwrap();
    let relay = Relay::new(source, transport, RelayConfig::default()).unwrap();
    let (stop_relay, relay_stop) = oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run(async move {
        let _ = relay_stop.await;
    }));
    eventually(
        "the event is published",
        DEADLINE,
        async || match service_db.pending_rows().await {
            0 => Ok(()),
            n => Err(n),
        },
    )
    .await;
    let stored = read_stream(&client, &bus.stream).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(
        stored[0].subject,
        format!("{}.order.{order_id}", bus.subject_prefix)
    );

    // The consumer, on its own database, with its metrics served.
    let metrics_addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    serve_metrics(metrics_addr).unwrap();
    let (stop_consumer, consumer_stop) = oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let pool = consumer_db.pool.clone();
        let bus = bus.clone();
        async move {
            run_consumer(pool, &bus, async move {
                let _ = consumer_stop.await;
            })
            .await
        }
    });
    eventually(
        "the shipment is written",
        DEADLINE,
        async || match consumer_db.count("shipments").await {
            0 => Err(0),
            n => Ok(n),
        },
    )
    .await;
    eventually("the metrics count the event", DEADLINE, async || {
        let text = scrape(metrics_addr).await.map_err(|e| e.to_string())?;
        let applied = r#"handoff_consumer_applied_total{consumer="shipping"} 1"#;
        if text.lines().any(|line| line == applied) {
            Ok(())
        } else {
            Err(text)
        }
    })
    .await;
    stop_consumer.send(()).unwrap();
    consumer.await.unwrap().unwrap();
    stop_relay.send(()).unwrap();
    relay.await.unwrap();

    // Once: one shipment, one inbox row, for the order placed.
    let (shipped, customer): (String, String) =
        sqlx::query_as("SELECT order_id, customer_id FROM shipments")
            .fetch_one(&consumer_db.pool)
            .await
            .unwrap();
    assert_eq!(
        (shipped.as_str(), customer.as_str()),
        (order_id.as_str(), "c-1")
    );
    assert_eq!(consumer_db.count("processed_events").await, 1);
    let payload: OrderPlaced = serde_json::from_slice(&stored[0].payload).unwrap();
    assert_eq!(payload.total_cents, 4200);
}
