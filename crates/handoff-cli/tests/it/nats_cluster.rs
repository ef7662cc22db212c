//! `handoff relay --stream-replicas 3` on a private 3-node nats-server cluster: the relay
//! creates an R3 stream, and SIGKILLing the stream's leader under load (concurrent writers,
//! relay running) loses, duplicates and reorders nothing; `handoff reconcile` reports clean.

use std::time::{Duration, Instant};

use crate::common::{check_stream, migrated, wait_drained, RelayProcess, Target, Writers};
use handoff_test::nats::{read_stream, unique_name, NatsCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_r3_stream_loses_nothing_when_its_leader_is_killed_under_load() {
    let mut cluster = NatsCluster::start(3).await.expect("a 3-node cluster");
    let client = async_nats::connect(cluster.server_addrs()).await.unwrap();
    let (db, outbox) = migrated("nats_cluster_r3").await;
    let stream = unique_name("nats_cluster_r3");
    let target = Target {
        database_url: db.url(),
        nats_url: cluster.url(),
        stream: stream.clone(),
        prefix: stream.clone(),
    };
    let relay = RelayProcess::start(&target, "r3-relay", &["--stream-replicas", "3"], &[]);
    relay
        .wait_for_log("destination ready", Duration::from_secs(30))
        .await;
    let info = async_nats::jetstream::new(client.clone())
        .get_stream(&stream)
        .await
        .unwrap()
        .cached_info()
        .clone();
    assert_eq!(
        info.config.num_replicas, 3,
        "the relay created an R3 stream"
    );

    let writers = Writers {
        connections: 4,
        transactions: 1_600,
        aggregates: 40,
        rollback_every: 10,
    }
    .spawn(&db.pool, &outbox);

    // Under load: once a few hundred events are in, SIGKILL the stream's leader.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let published: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        if published >= 300 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "nothing published:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leader = NatsCluster::stream_leader(&client, &stream).await.unwrap();
    let killed = cluster.node_named(&leader).expect("the leader is a node");
    assert!(!writers.is_finished(), "the kill comes under load");
    cluster.node_mut(killed).kill().unwrap();
    let killed_at = Instant::now();

    // A new leader takes over while the writers go on; the killed node comes back. An election
    // takes seconds, longer on a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match NatsCluster::stream_leader(&client, &stream).await {
            Ok(new) if new != leader => break,
            _ => {}
        }
        assert!(Instant::now() < deadline, "no new leader:\n{}", relay.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rolled_back = tokio::time::timeout(Duration::from_secs(60), writers)
        .await
        .expect("the writers finished")
        .unwrap();
    cluster.node_mut(killed).start_again().unwrap();
    wait_drained(&db.pool, Duration::from_secs(40), || relay.log()).await;
    eprintln!(
        "leader {leader} killed; drained {:?} later; relay warnings: {}",
        killed_at.elapsed(),
        relay.log().lines().filter(|l| l.contains("WARN")).count()
    );

    let messages = read_stream(&client, &stream).await;
    let check = check_stream(&db.pool, &messages).await;
    assert_eq!(check.duplicates, 0, "every event in the stream once");
    assert!(check.messages >= 1_600, "{check:?}");
    for message in &messages {
        let id = message.header("ce-id").unwrap().parse().unwrap();
        assert!(
            !rolled_back.contains(&id),
            "a rolled-back event was published"
        );
    }

    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["reconcile", "--since", "10m", "--json"])
        .args(["--nats-url", &target.nats_url, "--stream", &stream])
        .args(["--subject-prefix", &stream])
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "warn,handoff_nats=debug")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    eprintln!(
        "reconcile: the leader held more than the consumer counted {} times",
        stderr.matches("the stream's leader holds more").count()
    );
    assert_eq!(
        run.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let summary: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(summary["missing"], 0, "{summary}\n{stderr}");
    assert_eq!(summary["checked"], check.messages, "{summary}\n{stderr}");
}

#[tokio::test]
async fn an_existing_weaker_stream_is_kept_with_one_warning_naming_both_values() {
    use handoff_test::nats::{prepare_shared_server, shared_url, DeleteStreamOnDrop};

    let client = prepare_shared_server().await;
    let (db, _outbox) = migrated("nats_weaker_stream").await;
    let stream = unique_name("nats_weaker_stream");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    async_nats::jetstream::new(client.clone())
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{stream}.>")],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            num_replicas: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream.clone(),
    };
    let mut relay = RelayProcess::start(&target, "weak-relay", &["--stream-replicas", "3"], &[]);
    relay
        .wait_for_log("destination ready", Duration::from_secs(30))
        .await;
    assert!(relay.terminate().success(), "{}", relay.log());
    let log = relay.log();
    let replicas: Vec<_> = log
        .lines()
        .filter(|l| l.contains("fewer replicas than configured"))
        .collect();
    assert_eq!(replicas.len(), 1, "{log}");
    assert!(
        replicas[0].contains("stream_replicas=1") && replicas[0].contains("configured_replicas=3"),
        "{log}"
    );
    let storage: Vec<_> = log
        .lines()
        .filter(|l| l.contains("in memory only"))
        .collect();
    assert_eq!(storage.len(), 1, "{log}");
    assert!(storage[0].contains("stream_storage=\"memory\""), "{log}");
    let info = async_nats::jetstream::new(client)
        .get_stream(&stream)
        .await
        .unwrap()
        .cached_info()
        .clone();
    assert_eq!(
        info.config.num_replicas, 1,
        "the operator's stream is left as it is"
    );
}
