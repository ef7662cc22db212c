//! The drain variants: the same preloaded backlog through the relay, and through each of its
//! bounds, so every rate is comparable with every other of the same run.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::stream::{FuturesUnordered, StreamExt};
use handoff_core::delivery::{OutboxEvent, Published, Source, Transport};
use handoff_core::EventId;
use handoff_nats::JetStreamTransport;
use handoff_postgres::{LogConfig, LogSource, PollingConfig, PollingSource};
use handoff_relay::{Relay, RelayConfig, RelayReport};
use serde::Serialize;
use sqlx::postgres::PgPool;
use sqlx::PgConnection;
use tokio::sync::watch;

use super::cpu::{self, CpuShare};
use super::probe::{Marked, ProbeSource, ProbeTransport, SourceStats, TransportStats};
use super::{workload, Bench};

/// Width of the windows of the drain-rate timeline.
pub const WINDOW: Duration = Duration::from_millis(250);

/// Claim size of the SQL bound: the relay's default batch.
pub(crate) const SQL_BATCH: usize = 500;

/// Which way the backlog was moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum DrainVariant {
    /// One event at a time: claim 1, publish, await the ack, mark; for a fixed time.
    #[serde(rename = "naive")]
    Naive,
    /// Claim 500, mark them published, repeat: the relay's SQL with no broker.
    #[serde(rename = "sql_bound")]
    SqlBound,
    /// The plain claim+mark loop of the shared bench specification (no ordering logic, no
    /// broker) on the same rows ([`crate::hot_path::plain`]): the baseline of every drain goal.
    #[serde(rename = "plain_bound")]
    PlainBound,
    /// The backlog's events from memory through the transport, 256 acks outstanding: no
    /// database.
    #[serde(rename = "jetstream_bound")]
    JetStreamBound,
    /// As the JetStream bound, awaiting each ack before the next publish; for a fixed time.
    #[serde(rename = "jetstream_serial")]
    JetStreamSerial,
    /// One relay with its defaults.
    #[serde(rename = "relay_1")]
    Relay1,
    /// Two relays (own pools, own NATS connections, own relay ids) on the same backlog.
    #[serde(rename = "relay_2")]
    Relay2,
    /// One relay with the log source (`--source log`): the backlog read through the default
    /// cursor, placed where it stood before the backlog was written (a relay that was down).
    #[serde(rename = "relay_log")]
    RelayLog,
    /// The peer, oxide-outbox, at its best tuning: 8 managers, batches of 1,000, one
    /// publish+ack per event ([`crate::hot_path::peer`]).
    #[serde(rename = "oxide_outbox_8x1000")]
    Peer,
    /// drain-bound's control for the lease candidates: the SQL bound's claim and mark, in the
    /// candidates' loop ([`crate::hot_path::candidates`]).
    #[serde(rename = "sql_row_lease")]
    SqlRowLease,
    /// The same statements, the claim committed with `synchronous_commit = off`.
    #[serde(rename = "sql_async_claim")]
    SqlAsyncClaim,
    /// The claim's row locks, held in its open transaction, as the lease; the mark in it.
    #[serde(rename = "sql_lock_lease")]
    SqlLockLease,
    /// `sql_row_lease` with two claim loops at once.
    #[serde(rename = "sql_row_lease_x2")]
    SqlRowLease2,
    /// `sql_lock_lease` with two claim loops at once.
    #[serde(rename = "sql_lock_lease_x2")]
    SqlLockLease2,
}

impl DrainVariant {
    /// The name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            DrainVariant::Naive => "naive",
            DrainVariant::SqlBound => "sql_bound",
            DrainVariant::PlainBound => "plain_bound",
            DrainVariant::JetStreamBound => "jetstream_bound",
            DrainVariant::JetStreamSerial => "jetstream_serial",
            DrainVariant::Relay1 => "relay_1",
            DrainVariant::Relay2 => "relay_2",
            DrainVariant::RelayLog => "relay_log",
            DrainVariant::Peer => "oxide_outbox_8x1000",
            DrainVariant::SqlRowLease => "sql_row_lease",
            DrainVariant::SqlAsyncClaim => "sql_async_claim",
            DrainVariant::SqlLockLease => "sql_lock_lease",
            DrainVariant::SqlRowLease2 => "sql_row_lease_x2",
            DrainVariant::SqlLockLease2 => "sql_lock_lease_x2",
        }
    }
}

/// One variant's run in one round.
#[derive(Debug, Clone, Serialize)]
pub struct DrainRun {
    /// The variant.
    pub variant: DrainVariant,
    /// The round, from 1.
    pub round: usize,
    /// Events moved (marked published, or acked for the JetStream variants).
    pub events: usize,
    /// From the start until the last of them was marked (or acked).
    pub seconds: f64,
    /// `events / seconds`.
    pub rows_per_second: f64,
    /// Whether the whole backlog was moved (false for the fixed-time variants).
    pub complete: bool,
    /// The stream read back after a relay drain.
    pub check: Option<StreamCheck>,
    /// Per source (one per relay), its claims and marks.
    pub sources: Vec<SourceStats>,
    /// Per transport (one per relay), its publishes.
    pub transports: Vec<TransportStats>,
    /// What each relay reported when it stopped.
    pub reports: Vec<ReportSummary>,
    /// CPU during the variant.
    pub cpu: CpuShare,
    /// Events first marked per [`WINDOW`], from the start.
    pub rate_windows: Vec<u64>,
}

/// A [`RelayReport`], serialisable.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ReportSummary {
    /// Events acknowledged.
    pub published: u64,
    /// Failed publishes scheduled for a retry.
    pub retried: u64,
    /// Events held for an operator.
    pub held: u64,
    /// Leased events given back.
    pub released: u64,
}

impl From<RelayReport> for ReportSummary {
    fn from(report: RelayReport) -> Self {
        ReportSummary {
            published: report.published,
            retried: report.retried,
            held: report.held,
            released: report.released,
        }
    }
}

/// The stream after a drain, against the backlog.
#[derive(Debug, Clone, Serialize)]
pub struct StreamCheck {
    /// Messages stored.
    pub messages: usize,
    /// Backlog events absent from the stream.
    pub missing: usize,
    /// Messages whose event id an earlier message already had.
    pub duplicates: usize,
    /// Messages of events that are not in the backlog, or without the headers to tell.
    pub unexpected: usize,
    /// Per aggregate, the first occurrences in stream order were exactly 1, 2, 3, ...
    pub order_ok: bool,
    /// First occurrences that were not their aggregate's next sequence.
    pub order_violations: usize,
    /// The first of them, for the report.
    pub first_violation: Option<String>,
    /// Time to read the stream back, in seconds.
    pub read_seconds: f64,
}

/// The claim/publish/mark loop with one event at a time, for `run_for`.
pub async fn naive(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    run_for: Duration,
) -> Result<DrainRun> {
    let transport = bench.transport().await?;
    bench.reset(admin, &transport, true).await?;
    let pool = bench.pool().await?;
    let polling = PollingSource::new(pool, polling_config("bench-naive", true))?;
    let transport = ProbeTransport::new(transport, false);

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let started = Instant::now();
    let marked = Marked::new(started, None);
    let source = ProbeSource::new(Arc::new(polling), started, marked.clone());
    let mut moved = 0;
    while started.elapsed() < run_for {
        let claim = source.claim(1, usize::MAX).await?;
        let Some(event) = claim.events.first() else {
            break;
        };
        let receipt = transport.publish(event).await.context("naive publish")?;
        source
            .mark_published(&[Published {
                event_id: event.event_id,
                receipt,
                lease: claim.lease,
            }])
            .await?;
        moved += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    Ok(DrainRun {
        variant: DrainVariant::Naive,
        round,
        events: moved,
        seconds,
        rows_per_second: moved as f64 / seconds,
        complete: moved == bench.workload.events,
        check: None,
        sources: vec![source.stats()],
        transports: vec![transport.stats()],
        reports: Vec::new(),
        cpu,
        rate_windows: marked.rate_windows(WINDOW),
    })
}

/// The relay's claim and mark statements alone: claim 500, mark them, until the backlog is gone.
pub async fn sql_bound(bench: &Bench, admin: &mut PgConnection, round: usize) -> Result<DrainRun> {
    let transport = bench.transport().await?;
    bench.reset(admin, &transport, true).await?;
    let pool = bench.pool().await?;
    let polling = PollingSource::new(pool, polling_config("bench-sql", true))?;

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let started = Instant::now();
    let marked = Marked::new(started, Some(bench.workload.events));
    let source = ProbeSource::new(Arc::new(polling), started, marked.clone());
    // A claim can lease nothing and still make progress: a front of events waiting behind
    // unpublished ones is parked, and the next claim reads past it. So an empty claim ends the
    // loop only once nothing is pending; a run of them with events pending is a stuck claim.
    let mut empty_claims = 0;
    loop {
        let claim = source.claim(SQL_BATCH, usize::MAX).await?;
        if claim.events.is_empty() {
            if workload::unpublished(admin).await? == 0 {
                break;
            }
            empty_claims += 1;
            anyhow::ensure!(
                empty_claims < 1_000,
                "the SQL bound's claims found nothing while events were pending"
            );
            continue;
        }
        empty_claims = 0;
        let acked: Vec<Published> = claim
            .events
            .iter()
            .map(|e| Published::id(e.event_id))
            .collect();
        source.mark_published(&acked).await?;
    }
    let sources = vec![source.stats()];
    sql_loop_run(
        bench,
        admin,
        DrainVariant::SqlBound,
        round,
        &cpu_start,
        &marked,
        sources,
    )
    .await
}

/// The run of an SQL loop (claims and marks, no broker: the SQL bound, the lease candidates)
/// once it stopped: fails if it left events pending, and takes its rate up to its last mark and
/// the CPU since `cpu_start`. `sources`: its claims and marks, where a probed source made them.
pub(crate) async fn sql_loop_run(
    bench: &Bench,
    admin: &mut PgConnection,
    variant: DrainVariant,
    round: usize,
    cpu_start: &cpu::Snapshot,
    marked: &Marked,
    sources: Vec<SourceStats>,
) -> Result<DrainRun> {
    let seconds = marked.seconds();
    let cpu = cpu::share(cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    let moved = marked.count();
    anyhow::ensure!(
        workload::unpublished(admin).await? == 0,
        "{} left events unpublished",
        variant.name()
    );
    Ok(DrainRun {
        variant,
        round,
        events: moved,
        seconds,
        rows_per_second: moved as f64 / seconds,
        complete: moved == bench.workload.events,
        check: None,
        sources,
        transports: Vec::new(),
        reports: Vec::new(),
        cpu,
        rate_windows: marked.rate_windows(WINDOW),
    })
}

/// The backlog's events from memory through the transport with `outstanding` acks awaited at
/// once; all of them, or as many as `run_for` allows.
pub async fn jetstream(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    outstanding: usize,
    run_for: Option<Duration>,
) -> Result<DrainRun> {
    let transport = bench.transport().await?;
    // The database plays no part, but is left as quiet as for the other variants.
    bench.reset(admin, &transport, true).await?;
    let transport = ProbeTransport::new(transport, false);

    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let started = Instant::now();
    let mut next = bench.events.iter();
    let mut pending = FuturesUnordered::new();
    let mut acked = 0;
    loop {
        while pending.len() < outstanding && run_for.is_none_or(|limit| started.elapsed() < limit) {
            let Some(event) = next.next() else { break };
            pending.push(transport.publish(event));
        }
        match pending.next().await {
            Some(result) => {
                result.context("jetstream publish")?;
                acked += 1;
            }
            None => break,
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu::share(&cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    Ok(DrainRun {
        variant: if outstanding == 1 {
            DrainVariant::JetStreamSerial
        } else {
            DrainVariant::JetStreamBound
        },
        round,
        events: acked,
        seconds,
        rows_per_second: acked as f64 / seconds,
        complete: acked == bench.events.len(),
        check: None,
        sources: Vec::new(),
        transports: vec![transport.stats()],
        reports: Vec::new(),
        cpu,
        rate_windows: Vec::new(),
    })
}

/// `count` relays with their defaults, each with its own pool and NATS connection, draining the
/// backlog; then the stream is read back and checked.
pub async fn relays(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    count: usize,
) -> Result<DrainRun> {
    let parts = relay_parts(bench, count).await?;
    bench.reset(admin, &parts[0].1, true).await?;
    relays_on_loaded(bench, admin, round, parts).await
}

/// A pool and a NATS connection for each of `count` relays.
pub async fn relay_parts(bench: &Bench, count: usize) -> Result<Vec<(PgPool, JetStreamTransport)>> {
    let mut parts = Vec::with_capacity(count);
    for _ in 0..count {
        parts.push((bench.pool().await?, bench.transport().await?));
    }
    Ok(parts)
}

/// One relay with the log source on the preloaded backlog: the default cursor is placed where
/// it stood before the backlog's transaction (as for a relay that was down while it was
/// written), then the relay drains it through the cursor.
pub async fn relay_log(bench: &Bench, admin: &mut PgConnection, round: usize) -> Result<DrainRun> {
    let parts = relay_parts(bench, 1).await?;
    bench.reset(admin, &parts[0].1, true).await?;
    relay_log_on_loaded(bench, admin, round, parts, None).await
}

/// As [`relay_log`], on an outbox the caller has loaded (and its stream reset): the default
/// cursor is placed before the oldest event's transaction; events of `refused_type`, if any,
/// are refused by the destination.
pub async fn relay_log_on_loaded(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    parts: Vec<(PgPool, JetStreamTransport)>,
    refused_type: Option<&str>,
) -> Result<DrainRun> {
    sqlx::query("TRUNCATE outbox_cursors, outbox_cursor_ranges, outbox_cursor_lanes")
        .execute(&mut *admin)
        .await?;
    sqlx::query(
        "INSERT INTO outbox_cursors (cursor_name, settled_snapshot)
         SELECT 'default', (min(txid)::text || ':' || min(txid)::text || ':')::pg_snapshot
         FROM outbox",
    )
    .execute(&mut *admin)
    .await?;
    run_relays(
        bench,
        admin,
        round,
        parts,
        DrainVariant::RelayLog,
        refused_type,
        |pool, relay_id| {
            let config = LogConfig {
                polling: polling_config(relay_id, true),
                ..LogConfig::default()
            };
            Ok(Arc::new(LogSource::new(pool, config)?))
        },
    )
    .await
}

/// A source the drain can stop listening for at its end.
pub trait Unregister {
    /// Stops the writers' notifications on the relay's account.
    fn unregister(&self) -> impl std::future::Future<Output = Result<()>> + Send;
}

impl Unregister for PollingSource {
    async fn unregister(&self) -> Result<()> {
        Ok(PollingSource::unregister(self).await?)
    }
}

impl Unregister for LogSource {
    async fn unregister(&self) -> Result<()> {
        Ok(LogSource::unregister(self).await?)
    }
}

/// As [`relays`], on an outbox and stream the caller has already prepared (the backlog and,
/// say, events that must stay unpublished): one relay per part drains the backlog, then the
/// stream is read back and checked against the backlog.
pub async fn relays_on_loaded(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    parts: Vec<(PgPool, JetStreamTransport)>,
) -> Result<DrainRun> {
    let variant = if parts.len() == 1 {
        DrainVariant::Relay1
    } else {
        DrainVariant::Relay2
    };
    run_relays(
        bench,
        admin,
        round,
        parts,
        variant,
        None,
        |pool, relay_id| {
            Ok(Arc::new(PollingSource::new(
                pool,
                polling_config(relay_id, true),
            )?))
        },
    )
    .await
}

/// One relay per part, each over the source `source` makes, drains the backlog; then the
/// stream is read back and checked against it.
async fn run_relays<S: Source + Unregister>(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    parts: Vec<(PgPool, JetStreamTransport)>,
    variant: DrainVariant,
    refused_type: Option<&str>,
    source: impl Fn(PgPool, &str) -> Result<Arc<S>>,
) -> Result<DrainRun> {
    let count = parts.len();
    let cpu_start = cpu::snapshot(admin, bench.nats_pid).await?;
    let started = Instant::now();
    let marked = Marked::new(started, Some(bench.workload.events));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut running = Vec::with_capacity(count);
    for (i, (pool, transport)) in parts.into_iter().enumerate() {
        let relay_id = format!("bench-relay-{}", i + 1);
        let source = Arc::new(ProbeSource::new(
            source(pool, &relay_id)?,
            started,
            marked.clone(),
        ));
        let transport = Arc::new(ProbeTransport::new(transport, false).refusing(refused_type));
        let relay = Relay::from_shared(source.clone(), transport.clone(), RelayConfig::default())?;
        let mut stop = stop_rx.clone();
        let handle = tokio::spawn(relay.run(async move {
            let _ = stop.wait_for(|stop| *stop).await;
        }));
        running.push((handle, source, transport));
    }

    // Before the relays stop, while their backends are still connected.
    let (complete, seconds, cpu) = drained(bench, admin, &marked, &cpu_start).await?;
    if !complete {
        eprintln!(
            "  warning: {} relay(s) marked {} of {} events within {:?}; stopping them",
            count,
            marked.count(),
            bench.workload.events,
            bench.drain_timeout
        );
    }
    stop_tx.send_replace(true);
    let mut reports = Vec::with_capacity(count);
    let mut sources = Vec::with_capacity(count);
    let mut transports = Vec::with_capacity(count);
    let mut client = None;
    for (handle, source, transport) in running {
        reports.push(ReportSummary::from(handle.await?));
        source.inner().unregister().await?;
        sources.push(source.stats());
        transports.push(transport.stats());
        client.get_or_insert_with(|| transport.inner().client().clone());
    }
    // Only the backlog's own: events the caller left blocked on purpose (another aggregate
    // type) stay unpublished. The log source writes no published_at: its view says.
    let unpublished = if variant == DrainVariant::RelayLog {
        sqlx::query_scalar(
            "SELECT count(*) FROM outbox_published
             WHERE published_at IS NULL AND aggregate_type = $1",
        )
        .bind(workload::AGGREGATE_TYPE)
        .fetch_one(&mut *admin)
        .await?
    } else {
        workload::unpublished_of(admin, workload::AGGREGATE_TYPE).await?
    };
    anyhow::ensure!(
        !complete || unpublished == 0,
        "every event was marked, yet {unpublished} are unpublished in the table"
    );
    let client = client.context("no relay ran")?;
    let check = check_stream(&client, &bench.jetstream.stream, &bench.events).await?;
    let moved = marked.count();
    Ok(DrainRun {
        variant,
        round,
        events: moved,
        seconds,
        rows_per_second: moved as f64 / seconds,
        complete,
        check: Some(check),
        sources,
        transports,
        reports,
        cpu,
        rate_windows: marked.rate_windows(WINDOW),
    })
}

/// The source's defaults, except for the relay id and whether it listens.
pub fn polling_config(relay_id: &str, listen: bool) -> PollingConfig {
    PollingConfig {
        relay_id: relay_id.to_owned(),
        listen,
        ..PollingConfig::default()
    }
}

/// Where [`check_stream_by`] takes a stored message's aggregate sequence from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sequences {
    /// handoff's sequence header, which must also agree with the backlog.
    Header,
    /// The backlog's sequence of the message's event id: for a publisher (the peer) that sends
    /// only `Nats-Msg-Id`.
    Backlog,
}

/// Reads the whole stream back and checks it against the backlog: every event present, and
/// per aggregate the first occurrences in stream order are its sequences 1, 2, 3, ... exactly.
pub async fn check_stream(
    client: &handoff_nats::async_nats::Client,
    stream: &str,
    expected: &[OutboxEvent],
) -> Result<StreamCheck> {
    check_stream_by(client, stream, expected, Sequences::Header).await
}

/// As [`check_stream`], with each message's sequence taken from `sequences`.
pub async fn check_stream_by(
    client: &handoff_nats::async_nats::Client,
    stream: &str,
    expected: &[OutboxEvent],
    sequences: Sequences,
) -> Result<StreamCheck> {
    let started = Instant::now();
    let reader = client.clone();
    let name = stream.to_owned();
    // read_stream panics on a broker error (it is made for tests); a task turns that into an
    // error of this run instead of an abort that would leave the scratch database behind.
    let messages =
        tokio::spawn(async move { handoff_test::nats::read_stream(&reader, &name).await })
            .await
            .context("while reading the stream back")?;
    let read_seconds = started.elapsed().as_secs_f64();

    let backlog: HashMap<EventId, (&str, i64)> = expected
        .iter()
        .map(|e| (e.event_id, (e.aggregate_id.as_str(), e.aggregate_sequence)))
        .collect();
    let mut seen: HashSet<EventId> = HashSet::with_capacity(backlog.len());
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut duplicates = 0;
    let mut unexpected = 0;
    let mut order_violations = 0;
    let mut first_violation = None;
    for message in &messages {
        let Some(id) = message
            .header(handoff_nats::header::NATS_MSG_ID)
            .and_then(|id| id.parse::<EventId>().ok())
        else {
            unexpected += 1;
            continue;
        };
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        // The backlog's own (aggregate, sequence) for the id: the headers are the transport's
        // encoding of the same, and a mismatch would show up as an order violation.
        let Some(&(aggregate, sequence)) = backlog.get(&id) else {
            unexpected += 1;
            continue;
        };
        let header_sequence = match sequences {
            Sequences::Header => message
                .header(handoff_nats::header::SEQUENCE)
                .and_then(|s| s.parse::<i64>().ok()),
            Sequences::Backlog => Some(sequence),
        };
        let previous = last.entry(aggregate).or_insert(0);
        if header_sequence != Some(sequence) || sequence != *previous + 1 {
            order_violations += 1;
            first_violation.get_or_insert_with(|| {
                format!(
                    "aggregate {aggregate}: sequence {sequence} (header {header_sequence:?}) \
                     after {previous}, stream sequence {}",
                    message.sequence
                )
            });
        }
        *previous = sequence;
    }
    let missing = backlog.keys().filter(|id| !seen.contains(id)).count();
    Ok(StreamCheck {
        messages: messages.len(),
        missing,
        duplicates,
        unexpected,
        order_ok: order_violations == 0,
        order_violations,
        first_violation,
        read_seconds,
    })
}

/// Waits until every event of the backlog is marked (at most the bench's drain timeout); whether
/// they all were, the seconds from `marked`'s origin to the last mark, and the CPU shares since
/// `cpu_start`. Called while the drainers still run, so their backends are counted.
pub(crate) async fn drained(
    bench: &Bench,
    admin: &mut PgConnection,
    marked: &Marked,
    cpu_start: &cpu::Snapshot,
) -> Result<(bool, f64, CpuShare)> {
    let complete = marked.wait(bench.drain_timeout).await;
    let seconds = marked.seconds();
    let cpu = cpu::share(cpu_start, &cpu::snapshot(admin, bench.nats_pid).await?);
    Ok((complete, seconds, cpu))
}
