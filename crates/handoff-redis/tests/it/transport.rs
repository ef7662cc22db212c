//! The Redis Streams transport against the local Redis: the entry's fields, the dedup window,
//! replayed copies, refusals, error kinds with the server gone or silent, and the read-back.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use crate::common::{connection, read_all, Scratch};
use handoff_core::contract;
use handoff_core::delivery::{PublishErrorKind, Transport};
use handoff_core::readback::{MessageScan, ReadBack, ReadBackErrorKind, ReadFrom};
use handoff_redis::redis;
use handoff_redis::{ConnectErrorKind, RedisConfig, RedisTransport};
use handoff_test::factory::outbox_event;
use handoff_test::proxy::FaultProxy;

#[tokio::test]
async fn an_event_is_one_entry_with_event_id_payload_and_the_contract_fields() {
    let scratch = Scratch::new("contract");
    let transport = RedisTransport::connect(scratch.config()).await.unwrap();
    let mut event = outbox_event("eu.west 42", 3);
    event
        .headers
        .push(("traceparent".into(), "00-abc-def-01".into()));

    let receipt = transport.publish(&event).await.unwrap();

    let messages = read_all(&transport).await;
    assert_eq!(messages.len(), 1);
    let message = &messages[0];
    assert_eq!(
        receipt.detail(),
        Some(format!("redis {} {}", scratch.key(), message.position).as_str())
    );
    assert_eq!(message.subject, scratch.key());
    assert_eq!(message.event_id, Some(event.event_id));
    assert_eq!(message.replay, None);
    assert_eq!(message.payload.as_deref(), Some(event.payload.as_bytes()));
    let names: Vec<&str> = message.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "ce-specversion",
            "ce-id",
            "ce-type",
            "ce-source",
            "ce-time",
            "Content-Type",
            "Handoff-Aggregate-Type",
            "Handoff-Aggregate-Id",
            "Handoff-Sequence",
            "Handoff-Schema-Version",
            "traceparent",
        ]
    );
    assert_eq!(message.header("ce-source"), Some("handoff"));
    assert_eq!(message.header("Handoff-Sequence"), Some("3"));
    // The same reading every intake does.
    let read = contract::read_event(
        message.headers.clone(),
        message.payload.as_deref().unwrap(),
        "test",
    )
    .unwrap();
    assert_eq!(read.event_id, event.event_id);
    assert_eq!(read.aggregate_id, "eu.west 42");
    assert_eq!(read.sequence, 3);

    // The raw entry: `event_id` and `payload` lead.
    let raw: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(scratch.key())
        .arg("-")
        .arg("+")
        .query(&mut connection())
        .unwrap();
    assert_eq!(raw[0].1[0], ("event_id".into(), event.event_id.to_string()));
    assert_eq!(raw[0].1[1], ("payload".into(), event.payload.clone()));
}

#[tokio::test]
async fn a_republish_inside_the_window_appends_nothing_but_a_replay_gets_through_once() {
    let scratch = Scratch::new("dedup");
    let transport = RedisTransport::connect(scratch.config()).await.unwrap();
    let event = outbox_event("o-1", 1);

    let first = transport.publish(&event).await.unwrap();
    let again = transport.publish(&event).await.unwrap();
    assert_eq!(scratch.len(), 1);
    assert_eq!(
        again.detail().unwrap(),
        format!("{} (duplicate)", first.detail().unwrap())
    );
    // The event id is remembered for the window, no longer.
    let ttl: i64 = redis::cmd("PTTL")
        .arg(transport.dedup_key(&event.event_id.to_string()))
        .query(&mut connection())
        .unwrap();
    assert!(ttl > 0 && ttl <= 120_000, "{ttl}");

    transport.publish_replay(&event, "run-1").await.unwrap();
    transport.publish_replay(&event, "run-1").await.unwrap();
    assert_eq!(scratch.len(), 2, "one copy per replay run");
    transport.publish_replay(&event, "run-2").await.unwrap();
    let messages = read_all(&transport).await;
    let replays: Vec<Option<&str>> = messages.iter().map(|m| m.replay.as_deref()).collect();
    assert_eq!(replays, [None, Some("run-1"), Some("run-2")]);
    assert!(messages.iter().all(|m| m.event_id == Some(event.event_id)));
}

#[tokio::test]
async fn an_oversize_event_or_a_clashing_header_is_rejected_without_being_sent() {
    let scratch = Scratch::new("oversize");
    let transport = RedisTransport::connect(RedisConfig {
        max_event_bytes: 1024,
        ..scratch.config()
    })
    .await
    .unwrap();
    let mut big = outbox_event("o-1", 1);
    big.payload = format!(r#"{{"pad":"{}"}}"#, "x".repeat(2000));
    let error = transport.publish(&big).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Rejected, "{error}");

    let mut clash = outbox_event("o-1", 1);
    clash.headers.push(("Payload".into(), "mine".into()));
    let error = transport.publish(&clash).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Rejected, "{error}");
    assert_eq!(scratch.len(), 0);

    // A small one still goes through.
    transport.publish(&outbox_event("o-1", 1)).await.unwrap();
    assert_eq!(scratch.len(), 1);
}

#[tokio::test]
async fn connecting_to_a_closed_port_or_a_key_of_another_type_fails_with_its_kind() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = listener.local_addr().unwrap();
    drop(listener);
    let config = RedisConfig {
        url: format!("redis://{closed}"),
        ..RedisConfig::default()
    };
    let error = RedisTransport::connect(config).await.unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unreachable, "{error}");

    let scratch = Scratch::new("wrongtype");
    let _: () = redis::cmd("SET")
        .arg(scratch.key())
        .arg("a string")
        .query(&mut connection())
        .unwrap();
    let error = RedisTransport::connect(scratch.config()).await.unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Topology, "{error}");
}

#[tokio::test]
async fn a_server_gone_is_unavailable_a_silent_one_times_out_and_both_recover() {
    let scratch = Scratch::new("faults");
    let upstream: SocketAddr = "127.0.0.1:6379".parse().unwrap();
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let transport = RedisTransport::connect(RedisConfig {
        url: format!("redis://{}", proxy.addr()),
        publish_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_millis(500),
        ..scratch.config()
    })
    .await
    .unwrap();
    transport.publish(&outbox_event("o-1", 1)).await.unwrap();

    proxy.refuse();
    proxy.cut();
    let error = transport
        .publish(&outbox_event("o-1", 2))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Unavailable, "{error}");
    assert!(!transport.wait_until_ready(Duration::from_millis(300)).await);

    proxy.heal();
    assert!(transport.wait_until_ready(Duration::from_secs(5)).await);
    transport.publish(&outbox_event("o-1", 2)).await.unwrap();

    proxy.black_hole();
    let silent = outbox_event("o-1", 3);
    let error = transport.publish(&silent).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Timeout, "{error}");

    proxy.heal();
    assert!(transport.wait_until_ready(Duration::from_secs(5)).await);
    transport.publish(&silent).await.unwrap();
    transport.publish(&silent).await.unwrap();
    let sequences: Vec<String> = read_all(&transport)
        .await
        .iter()
        .map(|m| m.header("Handoff-Sequence").unwrap().to_owned())
        .collect();
    assert_eq!(sequences, ["1", "2", "3"]);
}

#[tokio::test]
async fn read_back_returns_entries_in_order_from_the_start_a_position_or_a_time() {
    let scratch = Scratch::new("readback");
    let transport = RedisTransport::connect(scratch.config()).await.unwrap();
    let missing = transport.read_back(ReadFrom::Start).await.unwrap_err();
    assert_eq!(missing.kind(), ReadBackErrorKind::NotFound);

    // More than two pages, three aggregates interleaved.
    let before = SystemTime::now() - Duration::from_secs(1);
    let mut ids = Vec::new();
    for n in 1..=400 {
        for aggregate in ["a", "b", "c"] {
            let event = outbox_event(aggregate, n);
            ids.push(event.event_id);
            transport.publish(&event).await.unwrap();
        }
    }
    let messages = read_all(&transport).await;
    let read: Vec<_> = messages.iter().map(|m| m.event_id.unwrap()).collect();
    assert_eq!(read, ids, "every entry once, in append order");

    let from = messages[700].position.clone();
    let mut scan = transport
        .read_back(ReadFrom::Position(from.clone()))
        .await
        .unwrap();
    let first = scan.next().await.unwrap().unwrap();
    assert_eq!(first.position, from);
    let mut rest = 1;
    while scan.next().await.unwrap().is_some() {
        rest += 1;
    }
    assert_eq!(rest, 1200 - 700);

    let mut since = transport.read_back(ReadFrom::Time(before)).await.unwrap();
    assert_eq!(since.next().await.unwrap().unwrap().event_id, Some(ids[0]));
    let later = SystemTime::now() + Duration::from_secs(3600);
    let mut none = transport.read_back(ReadFrom::Time(later)).await.unwrap();
    assert!(none.next().await.unwrap().is_none());

    let invalid = transport
        .read_back(ReadFrom::Position("seven".into()))
        .await
        .unwrap_err();
    assert_eq!(invalid.kind(), ReadBackErrorKind::Invalid);
}
