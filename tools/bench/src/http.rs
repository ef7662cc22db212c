//! `handoff-bench http`: the relay draining into an HTTP endpoint (the reference
//! `webhook-receiver`), against that endpoint's raw bound, in the same run.
//!
//! - **raw**: the backlog's events POSTed straight to a fresh receiver through
//!   [`HttpTransport`], `--concurrency` aggregates at a time, each aggregate's events one after
//!   the other in sequence order (the order rule the relay keeps): no database, no relay. This is
//!   what the endpoint and the client take at that concurrency.
//! - **drain**: the same backlog committed in the outbox (the `relay` bench's rows), one relay
//!   (polling source, LISTEN/NOTIFY on, defaults) with the same transport into another fresh
//!   receiver; timed until every row is marked published.
//!
//! Both receivers' `GET /received` are then checked: every event applied once, in order per
//! aggregate.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use handoff_core::delivery::{OutboxEvent, Transport};
use handoff_http::{HttpConfig, HttpMode, HttpTransport};
use handoff_postgres::PollingSource;
use handoff_relay::{Relay, RelayConfig};
use serde::{Deserialize, Serialize};
use sqlx::{Connection, PgConnection};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::harness::{ReportArgs, ScratchArgs, ScratchDatabase};
use crate::relay::drain::polling_config;
use crate::relay::workload::{self, Backlog, Workload};

/// Flags of `handoff-bench http`.
#[derive(clap::Args)]
pub struct HttpArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    /// The `webhook-receiver` binary; by default the one next to this binary (build both:
    /// `cargo build --release -p handoff-bench -p webhook-receiver`).
    #[arg(long)]
    receiver: Option<PathBuf>,
    /// Events in the backlog.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Aggregates the backlog is spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 2_000)]
    aggregates: usize,
    /// Requests in flight at once, in both phases (`HttpConfig::concurrency`).
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// CloudEvents mode of the requests: binary or structured.
    #[arg(long, default_value = "binary")]
    mode: HttpMode,
    /// A phase that takes longer than this fails the run.
    #[arg(long, default_value_t = 300)]
    timeout_seconds: u64,
    #[command(flatten)]
    report: ReportArgs,
}

/// One phase's figures.
#[derive(Debug, Serialize)]
struct Phase {
    events: usize,
    seconds: f64,
    events_per_second: f64,
    /// Effects the receiver applied (must equal `events`).
    applied: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    events: usize,
    aggregates: usize,
    concurrency: usize,
    mode: &'static str,
    payload_bytes: usize,
    cores: usize,
    raw: Phase,
    drain: Phase,
    /// drain / raw.
    drain_to_raw: f64,
}

/// Runs `handoff-bench http`.
pub async fn http(args: HttpArgs) -> Result<()> {
    let workload = Workload::new(args.events, args.aggregates)?;
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        run(&args, workload, scratch).await
    })
    .await
}

async fn run(args: &HttpArgs, workload: Workload, scratch: &ScratchDatabase) -> Result<()> {
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    let Backlog {
        events,
        payload_bytes,
    } = workload::preload(&mut admin, workload).await?;
    let receiver_path = match &args.receiver {
        Some(path) => path.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("this binary has no directory")?
            .join("webhook-receiver"),
    };
    let limit = Duration::from_secs(args.timeout_seconds);
    println!(
        "http: {} events over {} aggregates (~{payload_bytes} B payloads), concurrency {}, {} mode",
        workload.events,
        workload.aggregates,
        args.concurrency,
        args.mode.as_str()
    );

    let receiver = Receiver::start(&receiver_path).await?;
    let transport = Arc::new(HttpTransport::new(http_config(args, &receiver))?);
    let started = Instant::now();
    tokio::time::timeout(limit, post_raw(transport, &events, args.concurrency))
        .await
        .context("the raw phase ran out of time")??;
    let raw = phase(&events, started.elapsed(), &receiver).await?;
    println!(
        "raw:   {:>9.0} events/s ({:.2} s)",
        raw.events_per_second, raw.seconds
    );
    drop(receiver);

    let receiver = Receiver::start(&receiver_path).await?;
    let transport = HttpTransport::new(http_config(args, &receiver))?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(scratch.options.clone())
        .await?;
    let source = PollingSource::new(pool, polling_config("bench-http", true))?;
    let relay = Relay::new(source, transport, RelayConfig::default())?;
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let run = tokio::spawn(relay.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    let drained = tokio::time::timeout(limit, async {
        loop {
            if workload::unpublished(&mut admin).await? == 0 {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let elapsed = started.elapsed();
    let _ = stop.send(true);
    run.await?;
    drained.context("the drain ran out of time")??;
    let drain = phase(&events, elapsed, &receiver).await?;
    println!(
        "drain: {:>9.0} events/s ({:.2} s), {:.2} of raw",
        drain.events_per_second,
        drain.seconds,
        drain.events_per_second / raw.events_per_second
    );
    let report = Report {
        bench: "http",
        events: workload.events,
        aggregates: workload.aggregates,
        concurrency: args.concurrency,
        mode: args.mode.as_str(),
        payload_bytes,
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        drain_to_raw: drain.events_per_second / raw.events_per_second,
        raw,
        drain,
    };
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    args.report.write(&report)?;
    Ok(())
}

fn http_config(args: &HttpArgs, receiver: &Receiver) -> HttpConfig {
    HttpConfig {
        endpoint: format!("{}/events", receiver.base),
        mode: args.mode,
        concurrency: args.concurrency,
        ..HttpConfig::default()
    }
}

/// POSTs every event, `concurrency` aggregates at a time, each aggregate's in sequence order.
async fn post_raw(
    transport: Arc<HttpTransport>,
    events: &[OutboxEvent],
    concurrency: usize,
) -> Result<()> {
    let mut by_aggregate: HashMap<&str, Vec<OutboxEvent>> = HashMap::new();
    for event in events {
        by_aggregate
            .entry(&event.aggregate_id)
            .or_default()
            .push(event.clone());
    }
    let mut lanes: Vec<Vec<OutboxEvent>> = by_aggregate.into_values().collect();
    for lane in &mut lanes {
        lane.sort_by_key(|e| e.aggregate_sequence);
    }
    // std Mutex: never held across `.await`.
    let queue = Arc::new(Mutex::new(VecDeque::from(lanes)));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let queue = queue.clone();
        let transport = transport.clone();
        workers.push(tokio::spawn(async move {
            loop {
                let Some(lane) = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front() else {
                    return anyhow::Ok(());
                };
                for event in &lane {
                    transport
                        .publish(event)
                        .await
                        .with_context(|| format!("raw POST of {}", event.event_id))?;
                }
            }
        }));
    }
    for worker in workers {
        worker.await??;
    }
    Ok(())
}

/// The phase's figures, after checking the receiver applied every event once, in order per
/// aggregate.
async fn phase(events: &[OutboxEvent], elapsed: Duration, receiver: &Receiver) -> Result<Phase> {
    let received = receiver.received().await?;
    let ids: HashSet<&str> = received.iter().map(|a| a.event_id.as_str()).collect();
    anyhow::ensure!(ids.len() == received.len(), "an event was applied twice");
    anyhow::ensure!(
        received.len() == events.len(),
        "{} of {} events applied",
        received.len(),
        events.len()
    );
    let mut next: HashMap<&str, i64> = HashMap::new();
    for applied in &received {
        let expected = next.entry(&applied.aggregate_id).or_insert(1);
        anyhow::ensure!(
            applied.sequence == *expected,
            "{applied:?} applied out of order"
        );
        *expected += 1;
    }
    let seconds = elapsed.as_secs_f64();
    Ok(Phase {
        events: events.len(),
        seconds,
        events_per_second: events.len() as f64 / seconds,
        applied: received.len(),
    })
}

#[derive(Debug, Deserialize)]
struct Applied {
    event_id: String,
    aggregate_id: String,
    sequence: i64,
}

/// A `webhook-receiver` process on a free port, killed when dropped.
struct Receiver {
    _child: Child,
    base: String,
}

impl Receiver {
    async fn start(path: &PathBuf) -> Result<Receiver> {
        let mut child = Command::new(path)
            .args(["--listen", "127.0.0.1:0"])
            .env_remove("HANDOFF_WEBHOOK_SECRET")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("while starting {path:?} (see --receiver)"))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut line = String::new();
        tokio::time::timeout(
            Duration::from_secs(10),
            BufReader::new(stdout).read_line(&mut line),
        )
        .await
        .context("the receiver did not print its address")??;
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .with_context(|| format!("unexpected first line {line:?}"))?;
        Ok(Receiver {
            base: format!("http://{address}"),
            _child: child,
        })
    }

    async fn received(&self) -> Result<Vec<Applied>> {
        let text = reqwest_get(&format!("{}/received", self.base)).await?;
        Ok(serde_json::from_str(&text)?)
    }
}

/// A GET with a plain client (the bench has no other use for one).
async fn reqwest_get(url: &str) -> Result<String> {
    Ok(reqwest::get(url).await?.error_for_status()?.text().await?)
}
