//! Commit-to-ack latency: a paced writer commits events one per transaction while one relay
//! runs, and each event's latency is the time from its writer's `COMMIT` returning to the
//! relay's publish of it returning acknowledged (both `Instant`s of this process).
//!
//! The writer is open loop: event `k` is due at `start + k / rate`, whatever happened to the
//! events before it, spread over a few connections that each take every n-th event.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use handoff_core::{EventCatalog, EventId, NewEvent};
use handoff_postgres::{Outbox, OutboxConfig, WAKE_CHANNEL};
use hdrhistogram::Histogram;
use serde::Serialize;
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection};
use tokio::sync::watch;

use super::cpu::{self, CpuShare};
use super::drain::ReportSummary;
use super::live::LiveRelay;
use super::probe::{histogram, quantile_ms, ProbeTransport, SourceStats, TransportStats};
use super::Bench;

/// Aggregates the writer cycles through: each gets its next event `AGGREGATES / rate` seconds
/// after the previous one, long after that one was published, so the claim's ordering rule
/// never holds an event back here.
const AGGREGATES: usize = 1_000;

/// How long the relay runs on an empty outbox before the writer starts, so that it is asleep
/// (registered for notifications, or between polls) as between bursts in production.
pub const SETTLE: Duration = Duration::from_millis(1_500);

/// How the relay learns of new events.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    /// The name in tables and JSON.
    pub name: &'static str,
    /// Whether the source listens for the writers' notifications.
    pub listen: bool,
    /// The relay's poll interval.
    pub poll_interval: Duration,
}

/// The scenarios measured: LISTEN/NOTIFY with the default poll, and polling alone at the
/// default interval and at 100 ms.
pub const SCENARIOS: [Scenario; 3] = [
    Scenario {
        name: "notify",
        listen: true,
        poll_interval: Duration::from_secs(1),
    },
    Scenario {
        name: "poll_1s",
        listen: false,
        poll_interval: Duration::from_secs(1),
    },
    Scenario {
        name: "poll_100ms",
        listen: false,
        poll_interval: Duration::from_millis(100),
    },
];

/// One scenario at one rate.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyRun {
    /// The scenario's name.
    pub scenario: &'static str,
    /// Whether the relay listened.
    pub listen: bool,
    /// The relay's poll interval, in ms.
    pub poll_interval_ms: u64,
    /// Events per second the writer was paced at.
    pub target_rate: u32,
    /// Events per second it committed (committed / time from first due to last commit).
    pub achieved_rate: f64,
    /// Events committed.
    pub committed: usize,
    /// Committed events never acknowledged by the end of the wait.
    pub missing: usize,
    /// Median commit-to-ack, in ms.
    pub p50_ms: f64,
    /// 90th percentile commit-to-ack, in ms.
    pub p90_ms: f64,
    /// 99th percentile commit-to-ack, in ms.
    pub p99_ms: f64,
    /// Longest commit-to-ack, in ms.
    pub max_ms: f64,
    /// Acks that returned before the writer's COMMIT did (counted as 0 ms).
    pub acked_before_commit_returned: usize,
    /// The writer's transactions (BEGIN, enqueue, COMMIT): median, in ms.
    pub writer_tx_p50_ms: f64,
    /// The writer's transactions: 99th percentile, in ms.
    pub writer_tx_p99_ms: f64,
    /// How late the writer started its latest event against its schedule, in ms.
    pub writer_max_behind_ms: f64,
    /// Notifications on the wake-up channel while the writer ran, counted by a listener of the
    /// bench's own: one per writer transaction that notified (NOTIFY is per transaction).
    pub notifications: u64,
    /// When the wait for acks ended with events unacknowledged: where they were.
    pub stuck: Option<Stuck>,
    /// Only when events were left unacknowledged, every claim: (start in ms from the relay's
    /// start, duration in ms, events claimed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim_log: Option<Vec<(f64, f64, usize)>>,
    /// The relay's claims and marks.
    pub source: SourceStats,
    /// The relay's publishes.
    pub transport: TransportStats,
    /// What the relay reported.
    pub report: ReportSummary,
    /// CPU while the writer ran (and until the last ack).
    pub cpu: CpuShare,
}

/// Runs `scenario` with the writer at `rate` events/s for `duration`, over `writers`
/// connections.
pub async fn run(
    bench: &Bench,
    admin: &mut PgConnection,
    scenario: Scenario,
    rate: u32,
    duration: Duration,
    writers: usize,
) -> Result<LatencyRun> {
    let transport = bench.transport().await?;
    bench.reset(admin, &transport, false).await?;
    let mut conns = Vec::with_capacity(writers);
    for _ in 0..writers {
        conns.push(PgConnection::connect_with(&bench.options).await?);
    }

    let origin = Instant::now();
    let mut relay = LiveRelay::start(bench, "bench-latency", scenario, transport, origin).await?;
    let (source, transport) = (relay.source.clone(), relay.transport.clone());
    tokio::time::sleep(SETTLE).await;

    // Counts the writers' notifications: whether they notify is the relay's registration.
    let mut listener = PgListener::connect_with(&bench.pool().await?).await?;
    listener.listen(WAKE_CHANNEL).await?;
    let (count_stop_tx, mut count_stop_rx) = watch::channel(false);
    let counter = tokio::spawn(async move {
        let mut count = 0u64;
        loop {
            tokio::select! {
                _ = count_stop_rx.wait_for(|stop| *stop) => return count,
                notification = listener.recv() => match notification {
                    Ok(_) => count += 1,
                    Err(_) => return count,
                },
            }
        }
    });

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let paced = write_paced(conns, rate, duration).await?;

    // Every committed event is published within a poll interval, plus publishing time.
    let deadline = Instant::now() + scenario.poll_interval + Duration::from_secs(5);
    wait_acked(&transport, &paced.commits, deadline).await;
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    let pending = super::workload::unpublished(admin).await?;
    let stuck = if pending > 0 {
        Some(stuck(admin).await?)
    } else {
        None
    };
    count_stop_tx.send_replace(true);
    let notifications = counter.await?;
    let report = relay.stop().await?;

    let acks = commit_to_ack(&transport, &paced.commits);
    let (latency, missing) = (&acks.latency, acks.missing);
    Ok(LatencyRun {
        scenario: scenario.name,
        listen: scenario.listen,
        poll_interval_ms: scenario.poll_interval.as_millis() as u64,
        target_rate: rate,
        achieved_rate: paced.achieved_rate,
        committed: paced.commits.len(),
        missing,
        p50_ms: quantile_ms(latency, 0.5),
        p90_ms: quantile_ms(latency, 0.9),
        p99_ms: quantile_ms(latency, 0.99),
        max_ms: latency.max() as f64 / 1000.0,
        acked_before_commit_returned: acks.early,
        writer_tx_p50_ms: quantile_ms(&paced.tx_times, 0.5),
        writer_tx_p99_ms: quantile_ms(&paced.tx_times, 0.99),
        writer_max_behind_ms: paced.behind.as_secs_f64() * 1000.0,
        notifications,
        stuck,
        claim_log: (missing > 0).then(|| source.claim_log()),
        source: source.stats(),
        transport: transport.stats(),
        report,
        cpu,
    })
}

/// What a paced writer committed.
pub struct Paced {
    /// Every event with the instant its writer's `COMMIT` returned.
    pub commits: Vec<(EventId, Instant)>,
    /// The writers' transactions (BEGIN, enqueue, COMMIT), in µs.
    pub tx_times: Histogram<u64>,
    /// How late a writer started its latest event against its schedule.
    pub behind: Duration,
    /// Events per second committed (committed / time from first due to last commit).
    pub achieved_rate: f64,
}

/// The open-loop writer: `rate * duration` events, one per transaction (`Outbox::enqueue`),
/// event `k` due at `start + k / rate`, connection `i` taking every n-th event from `i`.
pub async fn write_paced(conns: Vec<PgConnection>, rate: u32, duration: Duration) -> Result<Paced> {
    let writers = conns.len();
    anyhow::ensure!(writers > 0, "the paced writer needs a connection");
    let total = (f64::from(rate) * duration.as_secs_f64()).round() as usize;
    let outbox = Arc::new(Outbox::new(
        OutboxConfig::default(),
        EventCatalog::new().declare("order", "OrderCreated", 1),
    )?);
    let start = Instant::now() + Duration::from_millis(20);
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(first, mut conn)| {
            let outbox = outbox.clone();
            tokio::spawn(async move {
                let mut commits: Vec<(EventId, Instant)> = Vec::new();
                let mut tx_times = histogram();
                let mut behind = Duration::ZERO;
                for k in (first..total).step_by(writers) {
                    let due = start + Duration::from_secs_f64(k as f64 / f64::from(rate));
                    tokio::time::sleep_until(due.into()).await;
                    behind = behind.max(due.elapsed());
                    let event = writer_event(k);
                    let event_id = event.event_id();
                    let began = Instant::now();
                    let mut tx = conn.begin().await?;
                    outbox.enqueue(&mut tx, &[event]).await?;
                    tx.commit().await?;
                    let committed = Instant::now();
                    tx_times.saturating_record(committed.duration_since(began).as_micros() as u64);
                    commits.push((event_id, committed));
                }
                Ok::<_, anyhow::Error>((commits, tx_times, behind))
            })
        })
        .collect();
    let mut commits = Vec::with_capacity(total);
    let mut tx_times = histogram();
    let mut behind = Duration::ZERO;
    for task in tasks {
        let (c, t, b) = task.await??;
        commits.extend(c);
        tx_times.add(t)?;
        behind = behind.max(b);
    }
    let last_commit = commits.iter().map(|(_, at)| *at).max().unwrap_or(start);
    let achieved_rate = commits.len() as f64 / last_commit.duration_since(start).as_secs_f64();
    Ok(Paced {
        commits,
        tx_times,
        behind,
        achieved_rate,
    })
}

/// Waits until `transport` saw an ack for every commit, or until `deadline`.
pub async fn wait_acked<T>(
    transport: &ProbeTransport<T>,
    commits: &[(EventId, Instant)],
    deadline: Instant,
) {
    loop {
        let unacked = commits
            .iter()
            .filter(|(id, _)| transport.acked_at(id).is_none())
            .count();
        if unacked == 0 || Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Commit-to-ack of a paced writer's events.
pub struct Acks {
    /// Commit (writer's `COMMIT` returned) to first ack (the relay's publish returned), in µs.
    pub latency: Histogram<u64>,
    /// Committed events never acknowledged.
    pub missing: usize,
    /// Acks that returned before the writer's COMMIT did (recorded as 0).
    pub early: usize,
}

/// The commit-to-ack histogram: both instants are this process's clock.
pub fn commit_to_ack<T>(transport: &ProbeTransport<T>, commits: &[(EventId, Instant)]) -> Acks {
    let mut latency: Histogram<u64> = histogram();
    let mut missing = 0;
    let mut early = 0;
    for (id, committed) in commits {
        match transport.acked_at(id) {
            Some(acked) => {
                if acked < *committed {
                    early += 1;
                }
                latency.saturating_record(
                    acked.saturating_duration_since(*committed).as_micros() as u64
                );
            }
            None => missing += 1,
        }
    }
    Acks {
        latency,
        missing,
        early,
    }
}

/// The unpublished events when a scenario ended with events unacknowledged.
#[derive(Debug, Clone, Serialize)]
pub struct Stuck {
    /// Unpublished events.
    pub pending: i64,
    /// Of them, leased to a relay.
    pub leased: i64,
    /// Of them, with `available_at` in the future (leased or backing off).
    pub not_available: i64,
    /// Of them, whose predecessor in their aggregate is unpublished too.
    pub behind_unpublished: i64,
    /// The oldest few, with their predecessor's state.
    pub oldest: Vec<String>,
}

async fn stuck(admin: &mut PgConnection) -> Result<Stuck> {
    let (pending, leased, not_available, behind_unpublished): (i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT count(*),
                    count(*) FILTER (WHERE o.claimed_by IS NOT NULL),
                    count(*) FILTER (WHERE o.available_at > now()),
                    count(*) FILTER (WHERE p.event_id IS NOT NULL AND p.published_at IS NULL)
             FROM outbox o
             LEFT JOIN outbox p
               ON p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
              AND p.aggregate_sequence = o.aggregate_sequence - 1
             WHERE o.published_at IS NULL",
        )
        .fetch_one(&mut *admin)
        .await?;
    let oldest: Vec<String> = sqlx::query_scalar(
        "SELECT format('%s #%s available in %s claimed_by %s attempts %s; predecessor: \
                        published %s, claimed_by %s, available in %s',
                       o.aggregate_id, o.aggregate_sequence, o.available_at - now(),
                       o.claimed_by, o.attempt_count, p.published_at - now(), p.claimed_by,
                       p.available_at - now())
         FROM outbox o
         LEFT JOIN outbox p
           ON p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
          AND p.aggregate_sequence = o.aggregate_sequence - 1
         WHERE o.published_at IS NULL
         ORDER BY o.available_at, o.occurred_at
         LIMIT 5",
    )
    .fetch_all(&mut *admin)
    .await?;
    Ok(Stuck {
        pending,
        leased,
        not_available,
        behind_unpublished,
        oldest,
    })
}

/// The writer's `k`-th event: an `OrderCreated` of about the backlog's size, with a
/// `traceparent` header.
fn writer_event(k: usize) -> NewEvent {
    let aggregate = k % AGGREGATES;
    let order_id = format!("o-lat-{aggregate:04}");
    let payload = serde_json::json!({
        "order_id": order_id,
        "customer_id": format!("c-{:06}", aggregate * 7919 % 100_000),
        "lines": [
            {"sku": format!("sku-{:04}", aggregate % 500), "quantity": 2, "unit_price_cents": 500},
            {"sku": format!("sku-{:04}", aggregate * 31 % 500), "quantity": 1,
             "unit_price_cents": 1250},
        ],
        "total_cents": 2250,
        "placed_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
    });
    NewEvent::new("order", order_id, "OrderCreated", 1, payload.to_string())
        .with_header("traceparent", format!("00-{k:032x}-{aggregate:016x}-01"))
}
