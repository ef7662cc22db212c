//! The relay (polling source over the real PostgreSQL) delivering into a real `webhook-receiver`
//! process that applies and then leaves 30% of first requests unanswered: every committed event
//! applied exactly once, in order per aggregate. Also the receiver's own contract: signatures,
//! structured mode, repeats.

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use handoff_core::delivery::{PublishErrorKind, Transport};
use handoff_http::{HttpConfig, HttpMode, HttpTransport, SigningSecret};
use handoff_postgres::{Migrator, Outbox, OutboxConfig, PollingConfig, PollingSource, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig};
use handoff_test::{eventually, factory, TestDb};
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

#[derive(Debug, Deserialize, PartialEq, Eq, Hash, Clone)]
struct Applied {
    event_id: String,
    aggregate_id: String,
    sequence: i64,
}

/// A `webhook-receiver` process on a free port; killed when dropped.
struct Receiver {
    _child: Child,
    base: String,
}

impl Receiver {
    async fn start(args: &[&str], secret: Option<&str>) -> Receiver {
        let mut command = Command::new(env!("CARGO_BIN_EXE_webhook-receiver"));
        command
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("HANDOFF_WEBHOOK_SECRET")
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if let Some(secret) = secret {
            command.env("HANDOFF_WEBHOOK_SECRET", secret);
        }
        let mut child = command.spawn().expect("start webhook-receiver");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        tokio::time::timeout(
            Duration::from_secs(10),
            BufReader::new(stdout).read_line(&mut line),
        )
        .await
        .expect("the receiver prints its address")
        .unwrap();
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        Receiver {
            _child: child,
            base: format!("http://{address}"),
        }
    }

    fn endpoint(&self) -> String {
        format!("{}/events", self.base)
    }

    async fn received(&self) -> Vec<Applied> {
        reqwest::get(format!("{}/received", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

fn http_config(endpoint: String) -> HttpConfig {
    HttpConfig {
        endpoint,
        request_timeout: Duration::from_millis(500),
        concurrency: 16,
        ..HttpConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committed_event_is_applied_once_in_order_through_ambiguous_timeouts() {
    let db = TestDb::new("webhook_relay_ambiguous").await;
    Migrator::handoff(Schema::default())
        .run(&mut db.pool.acquire().await.unwrap())
        .await
        .unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    let (aggregates, per_aggregate) = (40, 8u64);
    for n in 1..=per_aggregate {
        let mut tx = db.pool.begin().await.unwrap();
        for aggregate in 0..aggregates {
            let event = factory::event(&format!("agg-{aggregate}"), n);
            outbox.enqueue(&mut tx, &[event]).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    // A rolled-back transaction leaves nothing to deliver.
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("rolled-back", 1)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let receiver = Receiver::start(
        &[
            "--ambiguous-ratio",
            "0.3",
            "--ambiguous-hold",
            "5s",
            "--seed",
            "9",
        ],
        None,
    )
    .await;
    let relay_config = RelayConfig {
        batch_size: 50,
        max_in_flight: 200,
        retry_backoff: Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        },
        outage_backoff: Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        },
        poll_interval: Duration::from_millis(50),
        max_attempts: 1_000,
        ..RelayConfig::default()
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut runs = Vec::new();
    for id in ["relay-a", "relay-b"] {
        let transport = HttpTransport::new(http_config(receiver.endpoint())).unwrap();
        let polling = PollingConfig {
            relay_id: id.into(),
            ..PollingConfig::default()
        };
        let source = PollingSource::new(db.pool.clone(), polling).unwrap();
        let relay = Relay::from_shared(Arc::new(source), Arc::new(transport), relay_config.clone())
            .unwrap();
        let mut stop = stop_rx.clone();
        runs.push(tokio::spawn(relay.run(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
    }

    // The last state a timeout shows: the first rows still pending, and their errors.
    eventually("no pending rows", Duration::from_secs(50), async || {
        if db.pending_rows().await == 0 {
            return Ok(());
        }
        let errors: Vec<(String, i64, Option<String>)> = sqlx::query_as(
            "SELECT aggregate_id, aggregate_sequence, last_error FROM outbox \
             WHERE published_at IS NULL ORDER BY aggregate_id, aggregate_sequence LIMIT 5",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        Err(errors)
    })
    .await;
    stop_tx.send(true).unwrap();
    let mut retried = 0;
    for run in runs {
        retried += run.await.unwrap().retried;
    }
    assert!(retried > 0, "ambiguous answers were retried");

    let committed: Vec<(uuid::Uuid, String, i64)> = sqlx::query_as(
        "SELECT event_id, aggregate_id, aggregate_sequence FROM outbox ORDER BY event_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(committed.len(), aggregates * per_aggregate as usize);
    let received = receiver.received().await;
    // Exactly once: as many effects as committed events, no id twice, the same ids.
    let ids: HashSet<_> = received.iter().map(|a| a.event_id.clone()).collect();
    assert_eq!(ids.len(), received.len(), "an effect was applied twice");
    let committed_ids: HashSet<_> = committed.iter().map(|c| c.0.to_string()).collect();
    assert_eq!(ids, committed_ids);
    // In order per aggregate.
    let mut next: HashMap<&str, i64> = HashMap::new();
    for applied in &received {
        let expected = next.entry(&applied.aggregate_id).or_insert(1);
        assert_eq!(applied.sequence, *expected, "{applied:?} out of order");
        *expected += 1;
    }
    assert!(!received.iter().any(|a| a.aggregate_id == "rolled-back"));

    // Each row's receipt records the receiver's answer for that event (and its digest), which
    // a repeat of the key gets again byte for byte.
    let receipts: Vec<(uuid::Uuid, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT event_id, aggregate_id, aggregate_sequence, delivery_receipt FROM outbox",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for (event_id, aggregate_id, sequence, receipt) in receipts {
        let answer = serde_json::json!({ "applied": {
            "event_id": event_id.to_string(),
            "aggregate_id": aggregate_id,
            "sequence": sequence,
        }})
        .to_string();
        use sha2::Digest as _;
        let digest: String = sha2::Sha256::digest(answer.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let receipt = receipt.unwrap_or_default();
        let recorded = handoff_http::RecordedResponse::parse(&receipt)
            .unwrap_or_else(|| panic!("{event_id}: not a recorded answer: {receipt}"));
        assert_eq!(recorded.status, 200, "{event_id}");
        assert_eq!(recorded.sha256, digest, "{event_id}");
        assert_eq!(
            recorded.body.as_deref(),
            Some(answer.as_str()),
            "{event_id}"
        );
    }
}

#[tokio::test]
async fn the_receiver_verifies_signatures_and_reads_both_modes() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let receiver = Receiver::start(&[], Some(secret)).await;
    let mut events = Vec::new();
    for (n, mode) in [HttpMode::Binary, HttpMode::Structured]
        .into_iter()
        .enumerate()
    {
        let transport = HttpTransport::new(HttpConfig {
            mode,
            signing_secret: Some(SigningSecret::parse(secret).unwrap()),
            ..http_config(receiver.endpoint())
        })
        .unwrap();
        let event = factory::outbox_event("a.b c", n as u64 + 1);
        transport.publish(&event).await.unwrap();
        // A repeat is answered the same and applies nothing.
        transport.publish(&event).await.unwrap();
        events.push(event);
    }
    // Unsigned, or signed with another secret: 401, the relay's setup and not the event's (the
    // relay pauses until the secret is fixed, holding nothing).
    for other in [None, Some(format!("whsec_{}", "A".repeat(32)))] {
        let transport = HttpTransport::new(HttpConfig {
            signing_secret: other.map(|s| SigningSecret::parse(&s).unwrap()),
            ..http_config(receiver.endpoint())
        })
        .unwrap();
        let error = transport
            .publish(&factory::outbox_event("a.b c", 3))
            .await
            .unwrap_err();
        assert_eq!(error.kind(), PublishErrorKind::Misconfigured, "{error}");
        assert!(error.to_string().contains("401"), "{error}");
    }
    let received = receiver.received().await;
    let expected: Vec<_> = events
        .iter()
        .map(|e| Applied {
            event_id: e.event_id.to_string(),
            aggregate_id: "a.b c".into(),
            sequence: e.aggregate_sequence,
        })
        .collect();
    assert_eq!(received, expected);
}

#[tokio::test]
async fn the_receiver_holds_back_gaps_and_refuses_a_filled_position() {
    let receiver = Receiver::start(&[], None).await;
    let transport = HttpTransport::new(http_config(receiver.endpoint())).unwrap();
    let second = factory::outbox_event("a", 2);
    let error = transport.publish(&second).await.unwrap_err();
    assert_eq!(
        error.kind(),
        PublishErrorKind::Transient,
        "409 is retried: {error}"
    );
    transport
        .publish(&factory::outbox_event("a", 1))
        .await
        .unwrap();
    transport.publish(&second).await.unwrap();
    // Sequence 2 again, under another key.
    let error = transport
        .publish(&factory::outbox_event("a", 2))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Rejected, "{error}");
    assert_eq!(receiver.received().await.len(), 2);
}
