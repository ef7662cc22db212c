//! The HTTP transport against real loopback servers: the request it sends in each mode, how
//! each kind of answer (or of silence) counts, and its signatures.

use std::time::Duration;

use crate::common::{Endpoint, Reply};
use handoff_core::delivery::{PublishErrorKind, Transport};
use handoff_http::{
    signature, HttpConfig, HttpMode, HttpTransport, RecordedResponse, SigningSecret,
    RECORDED_BODY_BYTES,
};
use handoff_test::factory;
use tokio::io::AsyncReadExt;

fn transport(url: &str, configure: impl FnOnce(&mut HttpConfig)) -> HttpTransport {
    let mut config = HttpConfig {
        endpoint: url.to_owned(),
        request_timeout: Duration::from_secs(2),
        ..HttpConfig::default()
    };
    configure(&mut config);
    HttpTransport::new(config).unwrap()
}

#[tokio::test]
async fn binary_mode_posts_the_payload_with_the_contract_headers_and_the_event_id_as_key() {
    let mut endpoint = Endpoint::start(vec![], Reply::status(200)).await;
    let transport = transport(&endpoint.url, |_| {});
    let mut event = factory::outbox_event("eu.42", 7);
    event.headers = vec![("traceparent".into(), "00-abc-def-01".into())];
    let receipt = transport.publish(&event).await.unwrap();
    let recorded = recorded(&receipt);
    assert_eq!(recorded.status, 200);
    assert_eq!(
        (recorded.body.as_deref(), recorded.body_bytes),
        (Some(""), 0)
    );
    // SHA-256 of the empty body.
    assert_eq!(
        recorded.sha256,
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );

    let seen = endpoint.next().await;
    let id = event.event_id.hyphenated().to_string();
    assert_eq!(seen.body, event.payload.as_bytes());
    assert_eq!(seen.header("idempotency-key"), Some(id.as_str()));
    assert_eq!(seen.header("ce-id"), Some(id.as_str()));
    assert_eq!(seen.header("ce-specversion"), Some("1.0"));
    assert_eq!(seen.header("ce-type"), Some(factory::EVENT_TYPE));
    assert_eq!(seen.header("ce-source"), Some("handoff"));
    assert_eq!(seen.header("content-type"), Some("application/json"));
    assert_eq!(
        seen.header("handoff-aggregate-type"),
        Some(factory::AGGREGATE_TYPE)
    );
    assert_eq!(seen.header("handoff-aggregate-id"), Some("eu%2E42"));
    assert_eq!(seen.header("handoff-sequence"), Some("7"));
    assert_eq!(seen.header("handoff-schema-version"), Some("1"));
    assert_eq!(seen.header("traceparent"), Some("00-abc-def-01"));
    // Unsigned without a secret.
    assert_eq!(seen.header("webhook-signature"), None);
}

#[tokio::test]
async fn structured_mode_posts_a_cloudevents_envelope_around_the_payload() {
    let mut endpoint = Endpoint::start(vec![], Reply::status(204)).await;
    let transport = transport(&endpoint.url, |c| {
        c.mode = HttpMode::Structured;
        c.ce_source = "orders".into();
    });
    let mut event = factory::outbox_event("a/1", 3);
    event.payload = r#"{"total": 12.50, "items": [1, 2]}"#.into();
    let receipt = transport.publish(&event).await.unwrap();
    assert_eq!(recorded(&receipt).status, 204);

    let seen = endpoint.next().await;
    let id = event.event_id.hyphenated().to_string();
    assert_eq!(
        seen.header("content-type"),
        Some("application/cloudevents+json")
    );
    assert_eq!(seen.header("idempotency-key"), Some(id.as_str()));
    assert_eq!(seen.header("ce-id"), None, "attributes are in the body");
    let body: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(body["specversion"], "1.0");
    assert_eq!(body["id"], id.as_str());
    assert_eq!(body["type"], factory::EVENT_TYPE);
    assert_eq!(body["source"], "orders");
    assert_eq!(body["datacontenttype"], "application/json");
    assert_eq!(body["handoffaggregatetype"], factory::AGGREGATE_TYPE);
    assert_eq!(body["handoffaggregateid"], "a%2F1");
    assert_eq!(body["handoffsequence"], "3");
    assert_eq!(body["handoffschemaversion"], "1");
    assert!(body["time"].as_str().unwrap().ends_with('Z'));
    // `data` is the payload byte for byte, not re-encoded.
    let text = std::str::from_utf8(&seen.body).unwrap();
    assert!(
        text.contains(r#""data":{"total": 12.50, "items": [1, 2]}"#),
        "{text}"
    );
}

#[tokio::test]
async fn answers_sort_into_retry_quarantine_and_pause() {
    let replies = vec![
        Reply::Status(400, vec![], "missing field \"sku\"\nat line 1".into()),
        Reply::status(404),
        Reply::status(408),
        Reply::status(409),
        Reply::Status(429, vec![("retry-after", "3".into())], String::new()),
        Reply::status(500),
        Reply::Status(
            503,
            vec![("retry-after", httpdate::fmt_http_date(in_a_minute()))],
            String::new(),
        ),
        Reply::Status(
            308,
            vec![("location", "http://elsewhere/hook".into())],
            String::new(),
        ),
    ];
    // 429 and 503 may refuse one tenant or everyone: the relay tells which from the other
    // events. 404 is no such endpoint, whatever the event: the relay's setup.
    let expected = [
        PublishErrorKind::Rejected,
        PublishErrorKind::Misconfigured,
        PublishErrorKind::Transient,
        PublishErrorKind::Transient,
        PublishErrorKind::Transient,
        PublishErrorKind::Transient,
        PublishErrorKind::Transient,
        PublishErrorKind::Unavailable,
    ];
    let mut endpoint = Endpoint::start(replies, Reply::status(200)).await;
    let transport = transport(&endpoint.url, |_| {});
    let event = factory::outbox_event("a", 1);
    let mut errors = Vec::new();
    let mut waits = Vec::new();
    for kind in expected {
        let error = transport.publish(&event).await.unwrap_err();
        assert_eq!(error.kind(), kind, "{error}");
        errors.push(error.to_string());
        waits.push(error.retry_after());
    }
    // Retry-After counts on 429 and 503 only, as seconds or as a date.
    assert_eq!(waits[4], Some(Duration::from_secs(3)));
    let wait = waits[6].expect("503's Retry-After");
    assert!(
        wait > Duration::from_secs(50) && wait <= Duration::from_secs(60),
        "{wait:?}"
    );
    assert!(waits
        .iter()
        .enumerate()
        .all(|(n, w)| w.is_none() || n == 4 || n == 6));
    // The body excerpt, on one line, says why the event was refused.
    assert!(
        errors[0].contains("400 Bad Request: missing field \"sku\" at line 1"),
        "{}",
        errors[0]
    );
    assert!(errors[7].contains("http://elsewhere/hook"), "{}", errors[7]);
    assert!(
        errors[7].contains("redirects are not followed"),
        "{}",
        errors[7]
    );
    let receipt = transport.publish(&event).await.unwrap();
    assert_eq!(recorded(&receipt).status, 200);
    // The redirect was not followed: every attempt reached the endpoint, nothing else.
    for _ in 0..9 {
        endpoint.next().await;
    }
    assert!(endpoint.requests.try_recv().is_err());
}

fn in_a_minute() -> std::time::SystemTime {
    std::time::SystemTime::now() + Duration::from_secs(60)
}

#[tokio::test]
async fn the_receipt_digests_the_whole_response_body() {
    let body = "x".repeat(100_000);
    let endpoint = Endpoint::start(vec![], Reply::Status(201, vec![], body.clone())).await;
    let transport = transport(&endpoint.url, |_| {});
    let receipt = transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .unwrap();
    use sha2::Digest as _;
    let digest: String = sha2::Sha256::digest(body.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let recorded = recorded(&receipt);
    assert_eq!(recorded.status, 201);
    assert_eq!(recorded.sha256, digest);
    assert_eq!(recorded.body_bytes, 100_000);
}

/// The receipt's detail, read back as the recorded response.
fn recorded(receipt: &handoff_core::delivery::Receipt) -> RecordedResponse {
    let detail = receipt.detail().expect("a receipt detail");
    RecordedResponse::parse(detail).unwrap_or_else(|| panic!("not a recorded response: {detail}"))
}

#[tokio::test]
async fn the_receipt_records_status_allowed_headers_and_the_bounded_body() {
    // 5000 bytes: a multi-byte character straddles the 4 KiB bound.
    let body = format!(
        "{}é{}",
        "a".repeat(RECORDED_BODY_BYTES - 1),
        "b".repeat(903)
    );
    assert_eq!(body.len(), 5000);
    let headers = vec![
        ("content-type", "application/json".to_owned()),
        ("location", "/payments/pay_1".to_owned()),
        ("etag", "\"v1\"".to_owned()),
        ("x-request-id", "req-42".to_owned()),
        ("authorization", "Bearer auth-s3cret".to_owned()),
        ("set-cookie", "session=cookie-s3cret; HttpOnly".to_owned()),
        ("www-authenticate", "Basic realm=\"www-s3cret\"".to_owned()),
        ("x-internal-token", "token-s3cret".to_owned()),
    ];
    let endpoint = Endpoint::start(vec![], Reply::Status(201, headers, body.clone())).await;
    let transport = transport(&endpoint.url, |_| {});
    let receipt = transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .unwrap();
    let detail = receipt.detail().unwrap();
    assert!(!detail.contains('\n'), "one line: {detail}");
    assert!(!detail.contains("s3cret"), "{detail}");

    let recorded = recorded(&receipt);
    assert_eq!(recorded.status, 201);
    let headers: Vec<(&str, &str)> = recorded
        .headers
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .collect();
    assert_eq!(
        headers,
        [
            ("content-type", "application/json"),
            ("etag", "\"v1\""),
            ("location", "/payments/pay_1"),
            ("x-request-id", "req-42"),
        ]
    );
    assert!(recorded.body_truncated);
    assert_eq!(recorded.body_bytes, 5000);
    // Cut before the 'é' that would end past 4096 bytes.
    assert_eq!(
        recorded.body.as_deref(),
        Some(&body[..RECORDED_BODY_BYTES - 1])
    );
    use sha2::Digest as _;
    let digest: String = sha2::Sha256::digest(body.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(recorded.sha256, digest);
}

#[tokio::test]
async fn a_refused_connection_is_unavailable_and_not_ready() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    drop(listener);
    let transport = transport(&url, |_| {});
    let error = transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Unavailable, "{error}");
    assert!(!transport.wait_until_ready(Duration::from_millis(300)).await);
}

#[tokio::test]
async fn ready_once_the_endpoint_listens() {
    let endpoint = Endpoint::start(vec![], Reply::status(200)).await;
    let transport = transport(&endpoint.url, |_| {});
    assert!(transport.wait_until_ready(Duration::from_secs(5)).await);
}

#[tokio::test]
async fn no_answer_in_time_is_an_ambiguous_timeout() {
    let mut endpoint = Endpoint::start(vec![Reply::Hang], Reply::status(200)).await;
    let transport = transport(&endpoint.url, |c| {
        c.request_timeout = Duration::from_millis(300)
    });
    let event = factory::outbox_event("a", 1);
    let error = transport.publish(&event).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Timeout, "{error}");
    transport.publish(&event).await.unwrap();
    let first = endpoint.next().await;
    let second = endpoint.next().await;
    assert_eq!(
        first.header("idempotency-key"),
        second.header("idempotency-key")
    );
}

#[tokio::test]
async fn a_connection_closed_after_the_request_is_an_ambiguous_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let event = factory::outbox_event("a", 1);
    let payload = event.payload.clone();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut request = Vec::new();
        let mut buffer = [0u8; 4096];
        // Read the whole request (it ends with the payload), then hang up without answering.
        while !String::from_utf8_lossy(&request).ends_with(&payload) {
            let n = socket.read(&mut buffer).await.unwrap();
            assert!(n > 0, "the client closed first");
            request.extend_from_slice(&buffer[..n]);
        }
        drop(socket);
    });
    let transport = transport(&url, |_| {});
    let error = transport.publish(&event).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Timeout, "{error}");
    server.await.unwrap();
}

#[tokio::test]
async fn signed_requests_verify_under_the_standard_webhooks_scheme() {
    let text = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let mut endpoint = Endpoint::start(vec![], Reply::status(200)).await;
    for mode in [HttpMode::Binary, HttpMode::Structured] {
        let transport = transport(&endpoint.url, |c| {
            c.mode = mode;
            c.signing_secret = Some(SigningSecret::parse(text).unwrap());
        });
        let event = factory::outbox_event("a", 1);
        transport.publish(&event).await.unwrap();
        let seen = endpoint.next().await;
        let id = seen.header("webhook-id").unwrap();
        assert_eq!(id, event.event_id.hyphenated().to_string());
        let timestamp = seen.header("webhook-timestamp").unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let secret = SigningSecret::parse(text).unwrap();
        let signatures = seen.header("webhook-signature").unwrap();
        assert_eq!(
            signature::verify(&secret, id, timestamp, signatures, &seen.body, now),
            Ok(())
        );
        // Another secret does not verify it.
        let other = SigningSecret::parse(&format!("whsec_{}", "A".repeat(32))).unwrap();
        assert!(signature::verify(&other, id, timestamp, signatures, &seen.body, now).is_err());
    }
}

#[tokio::test]
async fn caller_headers_cannot_override_the_key_or_the_signature() {
    let endpoint = Endpoint::start(vec![], Reply::status(200)).await;
    let transport = transport(&endpoint.url, |_| {});
    for name in ["Idempotency-Key", "webhook-signature", "ce-id"] {
        let mut event = factory::outbox_event("a", 1);
        event.headers = vec![(name.into(), "x".into())];
        let error = transport.publish(&event).await.unwrap_err();
        assert_eq!(error.kind(), PublishErrorKind::Rejected, "{name}: {error}");
    }
}

#[tokio::test]
async fn a_slot_busy_for_half_the_timeout_is_unavailable_and_sends_nothing() {
    let mut endpoint = Endpoint::start(vec![Reply::Hang], Reply::status(200)).await;
    let transport = transport(&endpoint.url, |c| {
        c.concurrency = 1;
        c.request_timeout = Duration::from_millis(300);
    });
    let (first, second) = (factory::outbox_event("a", 1), factory::outbox_event("b", 1));
    let (first, second) = tokio::join!(transport.publish(&first), async {
        // Starts once the first request holds the only slot.
        let _ = endpoint.next().await;
        transport.publish(&second).await
    });
    assert_eq!(first.unwrap_err().kind(), PublishErrorKind::Timeout);
    let second = second.unwrap_err();
    assert_eq!(second.kind(), PublishErrorKind::Unavailable, "{second}");
    assert!(
        endpoint.requests.try_recv().is_err(),
        "the second event was never sent"
    );
}
