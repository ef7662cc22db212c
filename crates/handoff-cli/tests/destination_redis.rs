//! `handoff relay --destination redis` as real processes against the real PostgreSQL and the
//! local Redis: writers commit events over many aggregates while relays are SIGKILLed and
//! restarted; the stream then holds every committed event, nothing rolled back, per aggregate
//! in sequence order, and none twice (every republish fell inside the dedup window).

mod common;

use std::time::{Duration, Instant};

use common::{
    check_delivered, logs, migrated, pending, wait_drained, Delivered, RelayProcess, Writers,
};
use handoff_core::readback::{MessageScan, ReadBack, ReadFrom};
use handoff_redis::{redis, RedisConfig, RedisTransport};
use sqlx::PgPool;
use uuid::Uuid;

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A stream key of the test's own; deleted with its dedup keys on drop.
struct Stream(String);

impl Stream {
    fn new(test: &str) -> Stream {
        Stream(format!("handoff-test:{test}:{}", Uuid::now_v7()))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let Ok(mut connection) = redis::Client::open(redis_url()).and_then(|c| c.get_connection())
        else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.0))
            .query(&mut connection)
            .unwrap_or_default();
        for key in keys {
            let _: Result<(), _> = redis::cmd("DEL").arg(key).query(&mut connection);
        }
    }
}

/// A relay into `stream`, the URL from the environment as a deployment would set it.
fn redis_relay(database_url: &str, stream: &str, id: &str, env: &[(&str, &str)]) -> RelayProcess {
    let flags = [
        "--destination",
        "redis",
        "--redis-stream",
        stream,
        "--poll-interval",
        "100ms",
    ];
    let url = redis_url();
    let mut env = env.to_vec();
    env.push(("REDIS_URL", url.as_str()));
    RelayProcess::spawn(database_url, id, &flags, &env)
}

async fn published(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Every entry of the stream, in stream order, through the read-back seam.
async fn read_stream(stream: &str) -> Vec<Delivered> {
    let transport = RedisTransport::connect(RedisConfig {
        url: redis_url(),
        stream: stream.to_owned(),
        ..RedisConfig::default()
    })
    .await
    .unwrap();
    let mut scan = transport.read_back(ReadFrom::Start).await.unwrap();
    let mut delivered = Vec::new();
    while let Some(message) = scan.next().await.unwrap() {
        let header = |name: &str| {
            message
                .header(name)
                .unwrap_or_else(|| panic!("entry {}: no {name}", message.position))
        };
        delivered.push(Delivered {
            event_id: message.event_id.unwrap(),
            aggregate_id: handoff_core::subject::decode_token(header("Handoff-Aggregate-Id"))
                .unwrap()
                .into_owned(),
            sequence: header("Handoff-Sequence").parse().unwrap(),
            position: format!("entry {}", message.position),
        });
    }
    delivered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committed_event_reaches_redis_once_in_order_through_relay_sigkills() {
    let (db, outbox) = migrated("destination_redis").await;
    let stream = Stream::new("dest-redis");
    let url = db.url();

    let writer = Writers {
        connections: 2,
        transactions: 400,
        aggregates: 30,
        rollback_every: 50,
    }
    .spawn(&db.pool, &outbox);

    // A relay frozen right after Redis's answer (failpoint), then SIGKILLed: what it appended
    // stays unmarked until its lease runs out, and the others publish it again.
    let frozen = redis_relay(
        &url,
        &stream.0,
        "r-frozen",
        &[("FAILPOINTS", "relay.after_ack=return")],
    );
    if cfg!(feature = "failpoints") {
        frozen
            .wait_for_log("failpoint fired", Duration::from_secs(30))
            .await;
    }
    drop(frozen);

    let mut relays: Vec<RelayProcess> = (0..2)
        .map(|n| redis_relay(&url, &stream.0, &format!("r-{n}"), &[]))
        .collect();
    // Three rounds: once the relays have published more, SIGKILL one (leaving whatever it had
    // appended but not marked) and start a fresh one in its place.
    for round in 0..3usize {
        let target = 100 * (round as i64 + 1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while published(&db.pool).await < target {
            assert!(
                Instant::now() < deadline,
                "the relays did not publish {target} events:\n{}",
                logs(&relays)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let victim = round % relays.len();
        relays[victim].kill();
        let id = format!("r-{}", round + 2);
        relays[victim] = redis_relay(&url, &stream.0, &id, &[]);
    }
    let rolled_back = writer.await.unwrap();
    assert!(!rolled_back.is_empty());
    wait_drained(&db.pool, Duration::from_secs(45), || logs(&relays)).await;
    assert_eq!(pending(&db.pool).await, 0);
    let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();

    let delivered = read_stream(&stream.0).await;
    let check = check_delivered(&db.pool, &delivered).await;
    assert_eq!(
        check.duplicates, 0,
        "a republish inside the dedup window appended a second entry"
    );
    assert_eq!(check.messages as i64, committed);
    let absorbed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE delivery_receipt LIKE '%(duplicate)'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    if cfg!(feature = "failpoints") {
        assert!(
            absorbed > 0,
            "the frozen relay's events were published again and absorbed by the dedup window"
        );
    }
    eprintln!(
        "{} entries for {committed} events ({} rolled back): {absorbed} republishes absorbed by \
         the dedup window",
        check.messages,
        rolled_back.len(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_file_names_the_redis_stream() {
    let (db, outbox) = migrated("destination_redis_toml").await;
    let stream = Stream::new("dest-redis-toml");
    common::enqueue_spread(&db.pool, &outbox, 0, 5, 2).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    std::fs::write(
        &file,
        format!(
            "destination = \"redis\"\nredis_url = \"{}\"\nredis_stream = \"{}\"\n\
             redis_dedup_window = \"5m\"\n",
            redis_url(),
            stream.0
        ),
    )
    .unwrap();
    let relays = [RelayProcess::spawn(
        &db.url(),
        "r-toml",
        &["--config", file.to_str().unwrap()],
        &[],
    )];
    wait_drained(&db.pool, Duration::from_secs(30), || logs(&relays)).await;
    let check = check_delivered(&db.pool, &read_stream(&stream.0).await).await;
    assert_eq!((check.messages, check.duplicates), (5, 0));
}
