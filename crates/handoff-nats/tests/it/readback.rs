//! The read-back seam on a JetStream stream of the shared server: from the start, from a
//! position (a stream sequence) and from a time, with replayed copies marked, and the error
//! kinds of a missing stream and a malformed position.

use std::time::SystemTime;

use handoff_core::delivery::Transport;
use handoff_core::readback::{MessageScan, ReadBack, ReadBackErrorKind, ReadFrom, StoredMessage};
use handoff_nats::{JetStreamConfig, JetStreamTransport};
use handoff_test::factory;
use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use uuid::Uuid;

async fn read_all(transport: &JetStreamTransport, from: ReadFrom) -> Vec<StoredMessage> {
    let mut scan = transport.read_back(from).await.unwrap();
    let mut messages = Vec::new();
    while let Some(message) = scan.next().await.unwrap() {
        messages.push(message);
    }
    messages
}

#[tokio::test]
async fn a_stream_reads_back_from_its_start_a_sequence_or_a_time_with_copies_marked() {
    prepare_shared_server().await;
    let name = unique_name("readback");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &name);
    let config = JetStreamConfig {
        stream: name.clone(),
        subject_prefix: name.clone(),
        ..JetStreamConfig::default()
    };
    let transport = JetStreamTransport::connect(&shared_url(), config)
        .await
        .unwrap();
    transport.ensure_stream().await.unwrap();
    let events: Vec<_> = (1..=4).map(|n| factory::outbox_event("o-1", n)).collect();
    let mut between = SystemTime::now();
    for (n, event) in events.iter().enumerate() {
        transport.publish(event).await.unwrap();
        if n == 2 {
            between = SystemTime::now();
        }
    }
    transport
        .send_replay(&events[1], "r-1")
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();

    let all = read_all(&transport, ReadFrom::Start).await;
    let positions: Vec<&str> = all.iter().map(|m| m.position.as_str()).collect();
    assert_eq!(positions, ["1", "2", "3", "4", "5"]);
    let ids: Vec<Option<Uuid>> = all.iter().map(|m| m.event_id).collect();
    let wanted: Vec<Option<Uuid>> = [0, 1, 2, 3, 1]
        .iter()
        .map(|&i| Some(events[i].event_id))
        .collect();
    assert_eq!(ids, wanted);
    assert_eq!(all[4].replay.as_deref(), Some("r-1"));
    assert!(all[..4].iter().all(|m| m.replay.is_none()));
    assert_eq!(all[0].subject, transport.subject(&events[0]));

    let from_three = read_all(&transport, ReadFrom::Position("3".into())).await;
    assert_eq!(from_three, all[2..]);
    let from_time = read_all(&transport, ReadFrom::Time(between)).await;
    assert_eq!(from_time, all[3..]);
    let past_the_end = read_all(&transport, ReadFrom::Position("99".into())).await;
    assert!(past_the_end.is_empty());

    let error = transport
        .read_back(ReadFrom::Position("1:2".into()))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ReadBackErrorKind::Invalid);
}

#[tokio::test]
async fn a_missing_stream_reads_back_as_not_found() {
    prepare_shared_server().await;
    let name = unique_name("readback_missing");
    let config = JetStreamConfig {
        stream: name.clone(),
        subject_prefix: name,
        ..JetStreamConfig::default()
    };
    let transport = JetStreamTransport::connect(&shared_url(), config)
        .await
        .unwrap();
    let error = transport.read_back(ReadFrom::Start).await.unwrap_err();
    assert_eq!(error.kind(), ReadBackErrorKind::NotFound, "{error}");
}
