//! The `inventory` binary on Redis Streams (`--broker redis`) against the real PostgreSQL and
//! Redis: every order event changes the reserved stock exactly once while the consumer is
//! SIGKILLed and restarted between batches, with entries delivered and not acknowledged.

use crate::common::{orders, processed, stock, wait_for, Process, INVENTORY};
use handoff_core::delivery::{OutboxEvent, Transport};
use handoff_redis::RedisTransport;
use handoff_test::redis::ScratchStream;
use handoff_test::TestDb;

/// A stream of the test's own, fed by the relay's transport; deleted (with its dedup keys and
/// groups) on drop.
struct Stream {
    scratch: ScratchStream,
    transport: RedisTransport,
}

impl Stream {
    async fn new(test: &str) -> Stream {
        let scratch = ScratchStream::new(test);
        let transport = RedisTransport::connect(scratch.config())
            .await
            .expect("connect the transport");
        Stream { scratch, transport }
    }

    fn args(&self) -> Vec<String> {
        let url = handoff_test::redis::url();
        [
            "--broker",
            "redis",
            "--redis-url",
            &url,
            "--redis-stream",
            self.scratch.key(),
        ]
        .map(str::to_owned)
        .to_vec()
    }

    async fn publish(&self, event: &OutboxEvent) {
        self.transport
            .publish(event)
            .await
            .unwrap_or_else(|e| panic!("publish {}: {e}", event.event_id));
    }
}

async fn start(db: &TestDb, stream: &Stream) -> Process {
    let mut args = stream.args();
    // The shortest ack wait the consumer takes: a restarted consumer reads its own unsettled
    // entries at once anyway; this bounds how long another one would wait.
    args.extend(["--ack-wait", "1s"].map(str::to_owned));
    Process::start(INVENTORY, &args, &[("DATABASE_URL", db.url())], "consuming").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_is_applied_once_through_consumer_kills() {
    let db = TestDb::new("inventory_redis_kills").await;
    let stream = Stream::new("inventory-redis-kills").await;
    // Three batches of 80 orders.
    let (orders, expected) = orders(240);
    let batches: Vec<Vec<OutboxEvent>> = orders.chunks(80).map(|c| c.concat()).collect();
    let total: usize = batches.iter().map(Vec::len).sum();

    let mut consumer = start(&db, &stream).await;
    assert_eq!(
        consumer.ready_line(),
        format!("consuming {} as inventory", stream.scratch.key())
    );
    let mut kills = 0;
    let mut left_unacknowledged = 0;
    let mut published = 0;
    for batch in &batches {
        let before = processed(&db.pool).await.len();
        for event in batch {
            stream.publish(event).await;
        }
        published += batch.len();
        // Killed once it is busy with this batch: some of it applied, the rest delivered,
        // in flight or not read yet.
        wait_for("some of the batch applied", || async {
            let n = processed(&db.pool).await.len();
            (n > before).then_some(()).ok_or(format!("{n} processed"))
        })
        .await;
        consumer.kill().await;
        kills += 1;
        // Delivered to the dead consumer and never acknowledged: the restarted one gets them
        // again, some already applied (the inbox absorbs those).
        left_unacknowledged += stream.scratch.pending("inventory");
        consumer = start(&db, &stream).await;
    }
    assert_eq!(published, total);
    wait_for("every event applied", || async {
        let n = processed(&db.pool).await.len();
        (n == total)
            .then_some(())
            .ok_or(format!("{n} of {total} processed"))
    })
    .await;
    wait_for("every entry acknowledged", || async {
        let n = stream.scratch.pending("inventory");
        (n == 0).then_some(()).ok_or(format!("{n} pending"))
    })
    .await;
    assert_eq!(kills, 3);
    eprintln!("{left_unacknowledged} entries pending at the kills (summed over the three)");
    assert!(
        left_unacknowledged > 0,
        "the kills left nothing to deliver again"
    );
    assert_eq!(stock(&db.pool).await, expected, "each event applied once");
    let quarantined: i64 = sqlx::query_scalar("SELECT count(*) FROM consumer_quarantine")
        .fetch_one(&db.pool)
        .await
        .expect("count the quarantine");
    assert_eq!(quarantined, 0);
    let status = consumer.terminate().await;
    assert!(status.success(), "exit after SIGTERM: {status}");
}
