//! The transport conformance suite (`handoff_test::conformance`) on an HTTP endpoint: a
//! receiver on loopback that records every request it accepts and answers `200` with a body
//! naming it (`accepted <n>`), reached through a fault proxy so the case can take it down (the
//! proxy dropped: the port refuses connections) or make it silent (the proxy's black hole).
//!
//! The receiver refuses bodies over 64 KiB with `413 Payload Too Large`, as a real endpoint's
//! limit would. It does not keep `Idempotency-Key`s: a republish is a second request with the
//! same key and `ce-id` (an endpoint that deduplicates does so by that key; the destination
//! itself does not).

use std::sync::{Arc, Mutex};

use crate::common::{Endpoint, Reply};
use axum::http::HeaderMap;
use handoff_http::{HttpConfig, HttpTransport, RecordedResponse};
use handoff_test::conformance::{
    Case, Dedup, Destination, Link, Received, CE_SOURCE, PUBLISH_TIMEOUT,
};
use sha2::Digest as _;

/// The receiver's body limit.
const MAX_BODY: usize = 64 * 1024;

struct Receiver {
    transport: HttpTransport,
    /// What the receiver accepted, in arrival order. std Mutex: never held across `.await`.
    accepted: Arc<Mutex<Vec<Received>>>,
    link: Link,
    _endpoint: Endpoint,
}

impl Destination for Receiver {
    type Transport = HttpTransport;
    const NAME: &'static str = "http";
    const DEDUP: Dedup = Dedup::None;

    async fn start(_case: Case) -> Self {
        let accepted = Arc::new(Mutex::new(Vec::<Received>::new()));
        let record = Arc::clone(&accepted);
        let endpoint = Endpoint::with(move |seen| {
            if seen.body.len() > MAX_BODY {
                return Reply::status(413);
            }
            // Recorded before the answer: once the publish returns, the request is here.
            let mut accepted = record.lock().unwrap();
            let position = format!("accepted {}", accepted.len() + 1);
            accepted.push(Received {
                position: position.clone(),
                headers: headers(&seen.headers),
                body: seen.body.to_vec(),
            });
            Reply::Status(200, Vec::new(), position)
        })
        .await;
        let link = Link::to(&endpoint.url).await;
        let transport = HttpTransport::new(HttpConfig {
            endpoint: link.url().to_owned(),
            request_timeout: PUBLISH_TIMEOUT,
            ce_source: CE_SOURCE.to_owned(),
            ..HttpConfig::default()
        })
        .expect("a valid http config");
        Receiver {
            transport,
            accepted,
            link,
            _endpoint: endpoint,
        }
    }

    fn link(&mut self) -> Option<&mut Link> {
        Some(&mut self.link)
    }

    fn transport(&self) -> &HttpTransport {
        &self.transport
    }

    async fn received(&self, at_least: usize) -> Vec<Received> {
        let accepted = self.accepted.lock().unwrap().clone();
        assert!(accepted.len() >= at_least, "{accepted:?}");
        accepted
    }

    /// The transport's recorded answer: `200`, the content type axum gives a text body, and
    /// the body naming the request, with its length and digest.
    fn expected_receipt(&self, message: &Received) -> Option<String> {
        let body = &message.position;
        let sha256: String = sha2::Sha256::digest(body.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let answer = serde_json::json!({
            "status": 200,
            "headers": {"content-type": "text/plain; charset=utf-8"},
            "body": body,
            "body_truncated": false,
            "body_bytes": body.len(),
            "sha256": sha256,
        });
        let answer = RecordedResponse::parse(&answer.to_string()).expect("a recorded response");
        Some(answer.to_receipt())
    }

    fn oversize(&self) -> Option<usize> {
        Some(MAX_BODY)
    }
}

/// The request's headers as `(name, value)`, names lowercase as HTTP gives them.
fn headers(map: &HeaderMap) -> Vec<(String, String)> {
    map.iter()
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect()
}

handoff_test::conformance_suite!(Receiver);
