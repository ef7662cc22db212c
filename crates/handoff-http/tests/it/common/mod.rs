//! A scripted HTTP endpoint on loopback: it answers requests from a queue of replies and reports
//! every request it received.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What the endpoint does with one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Answer with this status, headers and body.
    Status(u16, Vec<(&'static str, String)>, String),
    /// Never answer (within any test's timeout).
    Hang,
}

impl Reply {
    /// A status with an empty body.
    pub fn status(code: u16) -> Reply {
        Reply::Status(code, Vec::new(), String::new())
    }
}

/// One request the endpoint received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// When it arrived.
    pub at: Instant,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Bytes,
}

impl Seen {
    /// A header's value as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

type Handler = Box<dyn Fn(&Seen) -> Reply + Send + Sync>;

struct Script {
    /// Picks the reply to each request.
    handler: Handler,
    seen: mpsc::UnboundedSender<Seen>,
}

/// The running endpoint: its URL and the requests it received.
pub struct Endpoint {
    /// `http://127.0.0.1:<port>/hook`.
    pub url: String,
    /// Every request, in arrival order.
    pub requests: mpsc::UnboundedReceiver<Seen>,
}

impl Endpoint {
    /// Starts an endpoint answering `replies` in order, then `otherwise` forever.
    pub async fn start(replies: Vec<Reply>, otherwise: Reply) -> Endpoint {
        // std Mutex: never held across `.await`.
        let replies = Mutex::new(VecDeque::from(replies));
        Endpoint::with(move |_| {
            replies
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or_else(|| otherwise.clone())
        })
        .await
    }

    /// Starts an endpoint answering each request with `handler`'s reply.
    pub async fn with(handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Endpoint {
        let (seen, requests) = mpsc::unbounded_channel();
        let script = Arc::new(Script {
            handler: Box::new(handler),
            seen,
        });
        let app = Router::new().fallback(answer).with_state(script);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Endpoint { url, requests }
    }

    /// The next request, waiting at most 30 s.
    pub async fn next(&mut self) -> Seen {
        tokio::time::timeout(Duration::from_secs(30), self.requests.recv())
            .await
            .expect("a request within 30 s")
            .expect("the endpoint is running")
    }
}

async fn answer(State(script): State<Arc<Script>>, headers: HeaderMap, body: Bytes) -> Response {
    let seen = Seen {
        at: Instant::now(),
        headers,
        body,
    };
    let reply = (script.handler)(&seen);
    let _ = script.seen.send(seen);
    match reply {
        Reply::Status(code, headers, body) => {
            let mut response = (StatusCode::from_u16(code).unwrap(), body).into_response();
            for (name, value) in headers {
                response.headers_mut().insert(name, value.parse().unwrap());
            }
            response
        }
        Reply::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            StatusCode::OK.into_response()
        }
    }
}
