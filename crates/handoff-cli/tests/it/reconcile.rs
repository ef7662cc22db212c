//! `handoff reconcile` as a real process against the real PostgreSQL and nats-server: messages
//! the broker lost after acknowledging them (deleted behind handoff's back here) are found from
//! the outbox, reported with exit status 2, and republished exactly, in per-aggregate order.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use crate::common::{enqueue_spread, migrated, wait_drained, RelayProcess};
use crate::ops::{assert_in_order_per_aggregate, handoff, is_lost, missing_ids, Broker};
use handoff_test::nats::read_stream;
use uuid::Uuid;

#[tokio::test]
async fn events_lost_by_the_broker_are_reported_then_republished_exactly_once_in_order() {
    let (db, outbox) = migrated("reconcile_loss").await;
    let broker = Broker::new(&db, "reconcile_loss").await;
    enqueue_spread(&db.pool, &outbox, 0, 24, 4).await;
    let mut relay = RelayProcess::start(&broker.target, "reconcile-relay", &[], &[]);
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    assert!(relay.terminate().success(), "{}", relay.log());

    // Nothing lost yet: exit 0.
    let run = handoff(&broker.target, "reconcile", &["--since", "10m", "--json"]).await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let summary = run.json();
    assert_eq!(
        (&summary["checked"], &summary["missing"]),
        (&24.into(), &0.into())
    );

    // The broker "loses" five acknowledged messages: sequences 2, 3 and 5 of agg-1 (so the
    // republish order within one aggregate shows), 1 of agg-2 and 4 of agg-3. None is the
    // stream's last message (an aggregate's 6th), which read_stream reads up to.
    let before = read_stream(&broker.client, &broker.target.stream).await;
    assert_eq!(before.len(), 24);
    let lost: Vec<_> = before
        .iter()
        .filter(|m| {
            is_lost(
                m.header("Handoff-Aggregate-Id").unwrap(),
                m.header("Handoff-Sequence").unwrap(),
            )
        })
        .collect();
    assert_eq!(lost.len(), 5);
    assert!(lost
        .iter()
        .all(|m| m.sequence < before.last().unwrap().sequence));
    let stream = async_nats::jetstream::new(broker.client.clone())
        .get_stream(&broker.target.stream)
        .await
        .unwrap();
    for message in &lost {
        assert!(stream.delete_message(message.sequence).await.unwrap());
    }
    let lost_ids: HashSet<Uuid> = lost
        .iter()
        .map(|m| m.header("ce-id").unwrap().parse().unwrap())
        .collect();

    // Reported, not repaired: exit 2 with exactly those events.
    let run = handoff(&broker.target, "reconcile", &["--since", "10m", "--json"]).await;
    assert_eq!(run.code, Some(2), "{run:?}");
    let summary = run.json();
    assert_eq!(summary["checked"], 24);
    assert_eq!(summary["missing"], 5);
    assert_eq!(summary["republished"], 0);
    assert_eq!(missing_ids(&summary), lost_ids);
    assert_eq!(
        read_stream(&broker.client, &broker.target.stream)
            .await
            .len(),
        19,
        "a check publishes nothing"
    );

    // Text output says the same, with the same exit status.
    let run = handoff(&broker.target, "reconcile", &["--since", "10m"]).await;
    assert_eq!(run.code, Some(2), "{run:?}");
    assert_eq!(
        run.stdout
            .lines()
            .filter(|l| l.starts_with("missing "))
            .count(),
        5
    );

    // Repaired: exactly the lost events come again, each once, in order per aggregate.
    let run = handoff(
        &broker.target,
        "reconcile",
        &["--since", "10m", "--republish", "--json"],
    )
    .await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let summary = run.json();
    assert_eq!(
        (&summary["missing"], &summary["republished"]),
        (&5.into(), &5.into())
    );
    assert_eq!(missing_ids(&summary), lost_ids);
    let marker = summary["replay_marker"].as_str().unwrap().to_owned();
    assert!(marker.starts_with("reconcile-"), "{marker}");

    let after = read_stream(&broker.client, &broker.target.stream).await;
    assert_eq!(after.len(), 24, "19 kept + 5 republished, nothing else");
    let added: Vec<_> = after
        .iter()
        .filter(|m| m.sequence > before.last().unwrap().sequence)
        .collect();
    assert_eq!(added.len(), 5);
    let added_ids: Vec<Uuid> = added
        .iter()
        .map(|m| m.header("ce-id").unwrap().parse().unwrap())
        .collect();
    assert_eq!(added_ids.iter().copied().collect::<HashSet<_>>(), lost_ids);
    for (message, id) in added.iter().zip(&added_ids) {
        assert_eq!(message.header("Handoff-Replay"), Some(marker.as_str()));
        assert_eq!(
            message.header("Nats-Msg-Id"),
            Some(format!("{id}:replay:{marker}").as_str())
        );
        let original = before
            .iter()
            .find(|m| m.header("ce-id") == message.header("ce-id"))
            .unwrap();
        assert_eq!(message.subject, original.subject);
        assert_eq!(message.payload, original.payload);
    }
    assert_in_order_per_aggregate(added.iter().map(|m| {
        (
            m.header("Handoff-Aggregate-Id").unwrap(),
            m.header("Handoff-Sequence").unwrap(),
        )
    }));

    // The copies count as present: nothing missing any more.
    let run = handoff(&broker.target, "reconcile", &["--since", "10m", "--json"]).await;
    assert_eq!(run.code, Some(0), "{run:?}");
    let summary = run.json();
    assert_eq!(
        (&summary["missing"], &summary["present_as_replayed_copy"]),
        (&0.into(), &5.into())
    );

    // Losing the stream's very last message: the scan still ends (its last sequence is never
    // delivered) and reports it.
    let newest = after.last().unwrap();
    assert!(stream.delete_message(newest.sequence).await.unwrap());
    let run = handoff(&broker.target, "reconcile", &["--since", "10m", "--json"]).await;
    assert_eq!(run.code, Some(2), "{run:?}");
    let newest_id: Uuid = newest.header("ce-id").unwrap().parse().unwrap();
    assert_eq!(missing_ids(&run.json()), HashSet::from([newest_id]));
}

#[tokio::test]
async fn reconcile_refuses_bad_arguments_and_an_unknown_stream() {
    let (db, _outbox) = migrated("reconcile_refusals").await;
    let broker = Broker::new(&db, "reconcile_refusals").await;
    // No --since, a bad time, a range that ends before it starts: nothing to check.
    for (args, why) in [
        (&[][..], "--since"),
        (
            &["--since", "last week"][..],
            "neither an RFC 3339 timestamp",
        ),
        (&["--since", "1m", "--until", "1h"][..], "after it ends"),
    ] {
        broker.ensure_stream().await;
        let run = handoff(&broker.target, "reconcile", args).await;
        assert!(
            run.code.is_some_and(|c| c != 0 && c != 2),
            "{args:?}: {run:?}"
        );
        assert!(run.stderr.contains(why), "{args:?}: {why:?} in {run:?}");
    }
    let mut elsewhere = broker.target.clone();
    elsewhere.stream = format!("{}_missing", broker.target.stream);
    let run = handoff(&elsewhere, "reconcile", &["--since", "1h"]).await;
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stderr.contains("--stream"), "{run:?}");
}

#[tokio::test]
async fn reconcile_and_replay_refuse_a_destination_that_cannot_be_read_back_on_one_line() {
    let (db, _outbox) = migrated("reconcile_unreadable").await;
    for destination in ["amqp", "http"] {
        for command in [&["reconcile", "--since", "1h"][..], &["replay", "--all"]] {
            let args = [command, &["--destination", destination]].concat();
            let run = common::handoff(&db, &args);
            let stderr = common::stderr(&run);
            common::assert_refused(&run, "cannot be read back");
            assert!(stderr.contains("delivery receipts"), "{stderr}");
            assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        }
    }
}
