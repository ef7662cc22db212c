//! `handoff relay --destination http` as real processes, SIGKILLed and restarted while writers
//! commit, into the reference receiver (`webhook_receiver`, in this process) that leaves 30% of
//! first requests unanswered after applying them: every committed event applied exactly once,
//! none rolled back, in order per aggregate.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use crate::common::{handoff, logs, migrated, stdout_json, wait_drained, RelayProcess, Writers};

/// The relay's flags for the receiver at `endpoint`: short HTTP timeouts so that the held
/// (ambiguous) requests time out quickly, and 16 aggregates in flight.
fn http_flags(endpoint: &str) -> [&str; 8] {
    [
        "--destination",
        "http",
        "--endpoint",
        endpoint,
        "--http-timeout",
        "500ms",
        "--http-concurrency",
        "16",
    ]
}

/// The reference receiver on a free port, in this process.
async fn receiver(options: webhook_receiver::Options) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(webhook_receiver::serve(
        listener,
        options,
        std::future::pending(),
    ));
    base
}

async fn received(base: &str) -> Vec<webhook_receiver::Applied> {
    reqwest::get(format!("{base}/received"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_http_relays_deliver_every_committed_event_once_in_order() {
    let (db, outbox) = migrated("destination_http_kills").await;
    let base = receiver(webhook_receiver::Options {
        ambiguous_ratio: 0.3,
        ambiguous_hold: Duration::from_secs(3),
        seed: 11,
        secret: None,
    })
    .await;
    let endpoint = format!("{base}/events");
    let url = db.url();
    let flags = http_flags(&endpoint);
    // The signing secret of the test's own environment would not match the receiver's.
    let env = [("HANDOFF_HTTP_SECRET", "")];
    let mut relays: Vec<RelayProcess> = ["http-a", "http-b"]
        .iter()
        .map(|id| RelayProcess::spawn(&url, id, &flags, &env))
        .collect();
    let writers = Writers {
        connections: 4,
        transactions: 400,
        aggregates: 30,
        rollback_every: 10,
    }
    .spawn(&db.pool, &outbox);

    // Meanwhile http-a is SIGKILLed and restarted, at seeded random moments.
    let mut rng = fastrand::Rng::with_seed(3);
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(rng.u64(300..900))).await;
        relays[0].kill();
        relays[0] = RelayProcess::spawn(&url, "http-a", &flags, &env);
    }
    let rolled_back = writers.await.unwrap();
    wait_drained(&db.pool, Duration::from_secs(60), || logs(&relays)).await;
    for relay in &mut relays {
        assert!(
            relay.terminate().success(),
            "{} exits 0:\n{}",
            relay.id,
            relay.log()
        );
    }

    let committed: Vec<(uuid::Uuid, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT event_id, aggregate_id, aggregate_sequence, delivery_receipt FROM outbox",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(committed.len() >= 360, "{} committed", committed.len());
    assert!(!rolled_back.is_empty());
    let applied = received(&base).await;
    let ids: HashSet<String> = applied.iter().map(|a| a.event_id.clone()).collect();
    assert_eq!(ids.len(), applied.len(), "an effect was applied twice");
    let expected: HashSet<String> = committed.iter().map(|c| c.0.to_string()).collect();
    assert_eq!(ids, expected, "applied effects = committed events");
    assert!(rolled_back.iter().all(|id| !ids.contains(&id.to_string())));
    let mut next: HashMap<&str, i64> = HashMap::new();
    for effect in &applied {
        let want = next.entry(&effect.aggregate_id).or_insert(1);
        assert_eq!(effect.sequence, *want, "{effect:?} applied out of order");
        *want += 1;
    }
    for (id, _, _, receipt) in &committed {
        let receipt = receipt.as_deref().unwrap_or("");
        let recorded = handoff_http::RecordedResponse::parse(receipt);
        assert_eq!(recorded.map(|r| r.status), Some(200), "{id}: {receipt:?}");
    }

    // `quarantine show` prints the recorded answer: parsed in JSON, line by line in text.
    let id = committed[0].0.to_string();
    let shown = handoff(&db, &["quarantine", "show", &id, "--json"]);
    assert!(shown.status.success(), "{shown:?}");
    let shown = stdout_json(&shown);
    assert_eq!(shown["state"], "published");
    assert!(shown["delivery_receipt"].is_string());
    let response = &shown["delivery_response"];
    assert_eq!(response["status"], 200, "{shown}");
    assert!(
        response["body"].as_str().unwrap_or("").contains(&id),
        "the receiver's answer names the event: {shown}"
    );
    let text = handoff(&db, &["quarantine", "show", &id]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("receipt      http 200 ("), "{text}");
    assert!(text.contains("content-type: application/json"), "{text}");
    assert!(text.contains(&format!("\"event_id\":\"{id}\"")), "{text}");
}
