//! `handoff-bench console`: the operator console and the on-call commands on a large outbox.
//!
//! Setup, in a scratch database on the `--database-url` server (timed, and reported): the
//! outbox is built with `INSERT ... SELECT generate_series` with its indexes and constraints
//! dropped and then built again (as a bulk load would), then vacuumed, analysed and
//! checkpointed. Its shape, with the defaults: 1,000,000 aggregates of 10 events (10,000,000
//! rows), sequences 1 to 9 published over the last 30 days and sequence 10 pending (the last
//! hour); in the first 10,000 aggregates sequence 9 is held (`rejected`, as the relay holds an
//! event the broker refused) with sequence 10 parked behind it. So 1,010,000 rows are
//! unpublished: 990,000 ready, 10,000 held, 10,000 blocked.
//!
//! Then, against the real `handoff` binary (`--handoff`, a release build):
//!
//! - every console page and API read, `--requests` sequential requests each after a warm-up,
//!   with the console's own sampler running: p50 and p99 (goal: p99 ≤ 300 ms);
//! - `handoff status` and `handoff cleanup --dry-run`, `--runs` runs each, process start
//!   included (goals: ≤ 1 s and ≤ 5 s);
//! - a relay (`handoff relay` into JetStream) draining the backlog in phases of
//!   `--drain-phase`, alternately without a console and with one sampling every second while a
//!   client loads the overview and `/api/v1/status` every second (an operator watching): the
//!   figure is the drain rate with the console over the rate without, same run.
//!
//! Slow reads are explained with `EXPLAIN (ANALYZE, BUFFERS)`; `--keep` leaves the scratch
//! database for that.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use handoff_nats::async_nats::jetstream;
use handoff_postgres::{Migrator, Schema};
use serde::Serialize;
use sqlx::{Connection, Executor, PgConnection};

use crate::harness::{median, server_options, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::machine;

/// The stream the relay phases publish to: created here and deleted at the end.
const STREAM: &str = "BENCH_CONSOLE";

/// The token the benchmark signs in with.
const TOKEN: &str = "bench-token";

/// Flags of `handoff-bench console`.
#[derive(clap::Args)]
pub struct ConsoleArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    #[command(flatten)]
    report: ReportArgs,
    /// JetStream server for the relay phases.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// The `handoff` binary measured (build it with `cargo build --release -p handoff-cli`).
    #[arg(long, default_value = "target/release/handoff")]
    handoff: PathBuf,
    /// Aggregates; each gets --events-per-aggregate events, the last one pending.
    #[arg(long, default_value_t = 1_000_000)]
    aggregates: i64,
    /// Events per aggregate (at least 3).
    #[arg(long, default_value_t = 10)]
    events_per_aggregate: i64,
    /// Aggregates whose second-to-last event is held, with the last parked behind it.
    #[arg(long, default_value_t = 10_000)]
    held: i64,
    /// Requests per page and API endpoint.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Runs of `handoff status` and of `handoff cleanup --dry-run`.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Length of each relay phase.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    drain_phase: Duration,
    /// Relay rounds; each runs a phase without and one with the console, alternating order.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Leave the scratch database in place (to EXPLAIN afterwards); it is printed.
    #[arg(long)]
    keep: bool,
    /// Skip the relay phases.
    #[arg(long)]
    no_relay: bool,
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    date: String,
    machine: machine::Machine,
    shape: Shape,
    setup: Setup,
    endpoints: Vec<Latency>,
    commands: Vec<Latency>,
    relay: Option<RelayFigures>,
}

#[derive(Serialize)]
struct Shape {
    rows: i64,
    aggregates: i64,
    unpublished: i64,
    held: i64,
    blocked: i64,
    outbox_bytes: i64,
}

#[derive(Serialize)]
struct Setup {
    insert_seconds: f64,
    index_seconds: f64,
    vacuum_analyze_seconds: f64,
    total_seconds: f64,
}

#[derive(Serialize, Clone)]
struct Latency {
    name: String,
    samples: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    goal_ms: f64,
    met: bool,
}

#[derive(Serialize)]
struct RelayPhase {
    round: usize,
    with_console: bool,
    seconds: f64,
    published: i64,
    events_per_second: f64,
    console_requests: usize,
}

#[derive(Serialize)]
struct RelayFigures {
    phases: Vec<RelayPhase>,
    median_without: f64,
    median_with: f64,
    /// with / without.
    ratio: f64,
}

pub async fn console(args: ConsoleArgs) -> Result<()> {
    anyhow::ensure!(
        args.events_per_aggregate >= 3,
        "--events-per-aggregate must be at least 3"
    );
    anyhow::ensure!(
        args.held <= args.aggregates,
        "--held cannot exceed --aggregates"
    );
    anyhow::ensure!(
        args.handoff.exists(),
        "{} is missing: build it with `cargo build --release -p handoff-cli` or give --handoff",
        args.handoff.display()
    );
    let server = server_options(&args.scratch.database_url)?;
    let scratch = ScratchDatabase::create(&server).await?;
    let result = run(&args, &scratch).await;
    if args.keep {
        eprintln!("kept the scratch database {}", scratch.name());
        result
    } else {
        let dropped = scratch.drop_database().await;
        result.and(dropped)
    }
}

async fn run(args: &ConsoleArgs, scratch: &ScratchDatabase) -> Result<()> {
    let url = scratch_url(&args.scratch.database_url, scratch.name())?;
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    Migrator::handoff(Schema::default())
        .run(&mut admin)
        .await
        .context("while migrating the scratch database")?;
    let nats = handoff_nats::async_nats::connect(&args.nats_url)
        .await
        .context("while connecting to NATS (check --nats-url / HANDOFF_NATS_URL)")?;
    let machine = machine::Machine::read(&mut admin, nats.server_info().version).await?;
    eprintln!("{}", machine.summary());

    let setup = build(&mut admin, args).await?;
    let shape = shape(&mut admin).await?;
    eprintln!(
        "setup: {} rows ({:.1} GiB with indexes), {} unpublished ({} held, {} blocked) in \
         {:.0} s (insert {:.0} s, indexes {:.0} s, vacuum+analyze {:.0} s)",
        shape.rows,
        shape.outbox_bytes as f64 / f64::from(1 << 30),
        shape.unpublished,
        shape.held,
        shape.blocked,
        setup.total_seconds,
        setup.insert_seconds,
        setup.index_seconds,
        setup.vacuum_analyze_seconds
    );

    let dir = tempfile_dir()?;
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("bench:{TOKEN}\n"))?;
    let held_id: uuid::Uuid = sqlx::query_scalar(
        "SELECT event_id FROM outbox WHERE hold_reason IS NOT NULL ORDER BY quarantined_at LIMIT 1",
    )
    .fetch_one(&mut admin)
    .await?;

    // Pages and API, against a console sampling at its default interval.
    let console = ConsoleChild::start(args, &url, &tokens, "10s")?;
    let http = reqwest::Client::new();
    let mut endpoints = Vec::new();
    for path in [
        "/".to_owned(),
        "/held".to_owned(),
        format!("/events/{held_id}"),
        "/sagas".to_owned(),
        "/consumers".to_owned(),
        "/api/v1/status".to_owned(),
        "/api/v1/quarantine".to_owned(),
        format!("/api/v1/events/{held_id}"),
        "/api/v1/samples".to_owned(),
        "/api/v1/sagas?state=stuck".to_owned(),
        "/api/v1/consumers".to_owned(),
        "/api/v1/openapi.json".to_owned(),
    ] {
        let latency = endpoint(&http, &console.url, &path, args.requests).await?;
        eprintln!(
            "  GET {path}: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            latency.p50_ms, latency.p99_ms, latency.max_ms
        );
        endpoints.push(latency);
    }
    drop(console);

    let mut commands = Vec::new();
    for (name, command, goal) in [
        ("handoff status", vec!["status", "--json"], 1000.0),
        (
            "handoff cleanup --dry-run",
            vec!["cleanup", "--dry-run", "--json"],
            5000.0,
        ),
    ] {
        let latency = command_latency(args, &url, name, &command, goal)?;
        eprintln!(
            "  {name}: p50 {:.0} ms, p99 {:.0} ms (max {:.0} ms)",
            latency.p50_ms, latency.p99_ms, latency.max_ms
        );
        commands.push(latency);
    }

    let relay = if args.no_relay {
        None
    } else {
        Some(relay_phases(args, &url, &tokens, &mut admin, &nats).await?)
    };

    let report = Report {
        benchmark: "console",
        date: chrono::Utc::now().to_rfc3339(),
        machine,
        shape,
        setup,
        endpoints,
        commands,
        relay,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    args.report.write(&report)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The scratch database's URL: the server's URL with its database name replaced.
fn scratch_url(server_url: &str, name: &str) -> Result<String> {
    let mut url = url::Url::parse(server_url).context("invalid --database-url")?;
    url.set_path(&format!("/{name}"));
    Ok(url.to_string())
}

fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("handoff-bench-console-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Builds the outbox: columns first, then indexes and constraints, then vacuum and analyze.
async fn build(admin: &mut PgConnection, args: &ConsoleArgs) -> Result<Setup> {
    let began = Instant::now();
    admin
        .execute("SET maintenance_work_mem = '512MB'; SET synchronous_commit = off")
        .await?;
    // What the migrations made, to make again after the load: a bulk load into a table without
    // indexes and one sort per index is several times quicker than 10 M index insertions.
    let constraints: Vec<(String, String)> = sqlx::query_as(
        "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
         WHERE conrelid = 'outbox'::regclass AND contype IN ('p', 'u') ORDER BY conname",
    )
    .fetch_all(&mut *admin)
    .await?;
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT i.indexname::text, i.indexdef FROM pg_indexes i
         WHERE i.tablename = 'outbox' AND i.schemaname = current_schema()
           AND NOT EXISTS (SELECT 1 FROM pg_constraint c
                           WHERE c.conrelid = 'outbox'::regclass AND c.conname = i.indexname)
         ORDER BY i.indexname",
    )
    .fetch_all(&mut *admin)
    .await?;
    for (name, _) in &indexes {
        admin.execute(format!("DROP INDEX {name}").as_str()).await?;
    }
    for (name, _) in &constraints {
        admin
            .execute(format!("ALTER TABLE outbox DROP CONSTRAINT {name}").as_str())
            .await?;
    }
    let (aggregates, per, held) = (args.aggregates, args.events_per_aggregate, args.held);
    // Published sequences spread over the 30 days before the last hour; the last sequence
    // of each aggregate pending, spread over the last hour. In the first `held` aggregates
    // sequence per-1 is held and sequence per is parked behind it.
    sqlx::query(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload, occurred_at, available_at,
                             published_at, attempt_count, last_error, quarantined_at,
                             hold_reason, blocked)
         SELECT gen_random_uuid(), 'order', 'o-' || a, s, 'OrderCreated', 1,
                jsonb_build_object('order_id', 'o-' || a, 'n', s, 'total', (a * 7 + s) % 1000),
                t.at,
                CASE WHEN t.held THEN 'infinity' ELSE t.at END,
                CASE WHEN s < $2 AND NOT t.held THEN t.at + interval '1 second' END,
                CASE WHEN t.held THEN 5 WHEN s < $2 THEN 1 ELSE 0 END,
                CASE WHEN t.held THEN 'nats: maximum message payload exceeded' END,
                CASE WHEN t.held THEN t.at + interval '5 minutes' END,
                CASE WHEN t.held THEN 'rejected' END,
                a < $3 AND s = $2
         FROM generate_series(1, $2) s
         CROSS JOIN generate_series(0, $1 - 1) a
         CROSS JOIN LATERAL (
             SELECT CASE WHEN s < $2
                         THEN now() - interval '30 days 1 hour'
                              + ((s - 1) * $1 + a)::float8
                                * (interval '30 days' / (($2 - 1) * $1)::float8)
                         ELSE now() - interval '1 hour'
                              + a::float8 * (interval '1 hour' / $1::float8)
                    END AS at,
                    a < $3 AND s = $2 - 1 AS held
         ) t",
    )
    .bind(aggregates)
    .bind(per)
    .bind(held)
    .execute(&mut *admin)
    .await
    .context("while loading the outbox")?;
    sqlx::query(
        "INSERT INTO outbox_heads (aggregate_type, aggregate_id, last_sequence)
         SELECT 'order', 'o-' || a, $2 FROM generate_series(0, $1 - 1) a",
    )
    .bind(aggregates)
    .bind(per)
    .execute(&mut *admin)
    .await?;
    let inserted = began.elapsed();
    for (name, definition) in &constraints {
        admin
            .execute(format!("ALTER TABLE outbox ADD CONSTRAINT {name} {definition}").as_str())
            .await?;
    }
    for (_, definition) in &indexes {
        admin.execute(definition.as_str()).await?;
    }
    let indexed = began.elapsed();
    // One statement each: VACUUM refuses to run inside a multi-statement string.
    for statement in [
        "VACUUM (ANALYZE) outbox",
        "VACUUM (ANALYZE) outbox_heads",
        "CHECKPOINT",
    ] {
        admin.execute(statement).await?;
    }
    let total = began.elapsed();
    Ok(Setup {
        insert_seconds: inserted.as_secs_f64(),
        index_seconds: (indexed - inserted).as_secs_f64(),
        vacuum_analyze_seconds: (total - indexed).as_secs_f64(),
        total_seconds: total.as_secs_f64(),
    })
}

async fn shape(admin: &mut PgConnection) -> Result<Shape> {
    let (rows, aggregates, unpublished, held, blocked, outbox_bytes): (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox),
                (SELECT count(*) FROM outbox_heads),
                (SELECT count(*) FROM outbox WHERE published_at IS NULL),
                (SELECT count(*) FROM outbox WHERE published_at IS NULL
                                               AND available_at = 'infinity'),
                (SELECT count(*) FROM outbox WHERE published_at IS NULL AND blocked),
                pg_total_relation_size('outbox')",
    )
    .fetch_one(admin)
    .await?;
    Ok(Shape {
        rows,
        aggregates,
        unpublished,
        held,
        blocked,
        outbox_bytes,
    })
}

/// A `handoff console` child on a port of its own choosing; killed on drop.
struct ConsoleChild {
    child: Child,
    url: String,
}

impl ConsoleChild {
    fn start(args: &ConsoleArgs, url: &str, tokens: &std::path::Path, every: &str) -> Result<Self> {
        let mut child = Command::new(&args.handoff)
            .args([
                "console",
                "--listen",
                "127.0.0.1:0",
                "--sample-interval",
                every,
                "--consumer",
                &format!("bench={url}"),
            ])
            .arg("--auth-token-file")
            .arg(tokens)
            .env("HANDOFF_DATABASE_URL", url)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("while starting handoff console")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("console stdout")?).read_line(&mut line)?;
        let Some(address) = line.trim().strip_prefix("console listening on ") else {
            let _ = child.kill();
            bail!("the console did not start: {line:?}");
        };
        Ok(Self {
            url: address.to_owned(),
            child,
        })
    }
}

impl Drop for ConsoleChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percentiles of `ms` (sorted here): the nearest-rank p50 and p99, and the maximum.
fn latency(name: &str, mut ms: Vec<f64>, goal_ms: f64) -> Latency {
    ms.sort_by(f64::total_cmp);
    let rank = |p: f64| ms[((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
    let p99 = rank(0.99);
    Latency {
        name: name.to_owned(),
        samples: ms.len(),
        p50_ms: rank(0.50),
        p99_ms: p99,
        max_ms: ms[ms.len() - 1],
        goal_ms,
        met: p99 <= goal_ms,
    }
}

/// `requests` sequential GETs of `path` after three unmeasured ones.
async fn endpoint(
    http: &reqwest::Client,
    base: &str,
    path: &str,
    requests: usize,
) -> Result<Latency> {
    let mut ms = Vec::with_capacity(requests);
    for i in 0..requests + 3 {
        let began = Instant::now();
        let answer = http
            .get(format!("{base}{path}"))
            .bearer_auth(TOKEN)
            .send()
            .await?;
        let status = answer.status();
        let body = answer.bytes().await?;
        let elapsed = began.elapsed().as_secs_f64() * 1000.0;
        if !status.is_success() {
            bail!(
                "GET {path} answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        if i >= 3 {
            ms.push(elapsed);
        }
    }
    Ok(latency(&format!("GET {path}"), ms, 300.0))
}

/// `runs` runs of `handoff ARGS` on `url`, each timed from spawn to exit.
fn command_latency(
    args: &ConsoleArgs,
    url: &str,
    name: &str,
    command: &[&str],
    goal_ms: f64,
) -> Result<Latency> {
    let mut ms = Vec::with_capacity(args.runs);
    for _ in 0..args.runs {
        let began = Instant::now();
        let output = Command::new(&args.handoff)
            .args(command)
            .env("HANDOFF_DATABASE_URL", url)
            .env("RUST_LOG", "warn")
            .output()?;
        ms.push(began.elapsed().as_secs_f64() * 1000.0);
        // status exits 2 while an alert holds (it does: events are held); anything else failed.
        if !matches!(output.status.code(), Some(0 | 2)) {
            bail!("{name} failed: {}", String::from_utf8_lossy(&output.stderr));
        }
    }
    Ok(latency(name, ms, goal_ms))
}

async fn unpublished(admin: &mut PgConnection) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .fetch_one(admin)
            .await?,
    )
}

/// The relay phases: drain rate without a console and with one watched, alternating.
async fn relay_phases(
    args: &ConsoleArgs,
    url: &str,
    tokens: &std::path::Path,
    admin: &mut PgConnection,
    nats: &handoff_nats::async_nats::Client,
) -> Result<RelayFigures> {
    let js = jetstream::new(nats.clone());
    let _ = js.delete_stream(STREAM).await;
    js.create_stream(jetstream::stream::Config {
        name: STREAM.to_owned(),
        subjects: vec!["bench_console.>".to_owned()],
        ..Default::default()
    })
    .await
    .context("while creating the stream")?;
    let mut phases = Vec::new();
    for round in 0..args.rounds {
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for with_console in order {
            let phase = relay_phase(args, url, tokens, admin, round, with_console).await?;
            eprintln!(
                "  relay round {round} {}: {} events in {:.1} s = {:.0} events/s",
                if with_console {
                    "with the console"
                } else {
                    "without"
                },
                phase.published,
                phase.seconds,
                phase.events_per_second
            );
            phases.push(phase);
        }
    }
    let _ = js.delete_stream(STREAM).await;
    let median_of = |with: bool| {
        median(
            phases
                .iter()
                .filter(|p| p.with_console == with)
                .map(|p| p.events_per_second),
        )
    };
    let (median_without, median_with) = (median_of(false), median_of(true));
    Ok(RelayFigures {
        ratio: median_with / median_without,
        phases,
        median_without,
        median_with,
    })
}

async fn relay_phase(
    args: &ConsoleArgs,
    url: &str,
    tokens: &std::path::Path,
    admin: &mut PgConnection,
    round: usize,
    with_console: bool,
) -> Result<RelayPhase> {
    let console = if with_console {
        Some(ConsoleChild::start(args, url, tokens, "1s")?)
    } else {
        None
    };
    let before = unpublished(admin).await?;
    let mut relay = Command::new(&args.handoff)
        .args([
            "relay",
            "--relay-id",
            "bench-console",
            "--nats-url",
            &args.nats_url,
            "--stream",
            STREAM,
            "--subject-prefix",
            "bench_console",
        ])
        .env("HANDOFF_DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("while starting handoff relay")?;
    let began = Instant::now();
    let mut requests = 0;
    if let Some(console) = &console {
        // An operator watching: the overview and the status API once a second.
        let http = reqwest::Client::new();
        while began.elapsed() < args.drain_phase {
            let tick = Instant::now();
            for path in ["/", "/api/v1/status"] {
                http.get(format!("{}{path}", console.url))
                    .bearer_auth(TOKEN)
                    .send()
                    .await?
                    .bytes()
                    .await?;
                requests += 1;
            }
            tokio::time::sleep(Duration::from_secs(1).saturating_sub(tick.elapsed())).await;
        }
    } else {
        tokio::time::sleep(args.drain_phase).await;
    }
    // SIGTERM: the relay finishes its batch and marks what the broker acknowledged.
    // SAFETY: a signal to the child this function started and has not reaped.
    unsafe {
        libc::kill(relay.id() as i32, libc::SIGTERM);
    }
    relay.wait()?;
    let seconds = began.elapsed().as_secs_f64();
    drop(console);
    let published = before - unpublished(admin).await?;
    Ok(RelayPhase {
        round,
        with_console,
        seconds,
        published,
        events_per_second: published as f64 / seconds,
        console_requests: requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let figures = latency("x", (1..=100).map(f64::from).collect(), 99.0);
        assert_eq!(
            (figures.p50_ms, figures.p99_ms, figures.max_ms),
            (50.0, 99.0, 100.0)
        );
        assert!(figures.met);
        let one = latency("y", vec![5.0], 1.0);
        assert_eq!((one.p50_ms, one.p99_ms), (5.0, 5.0));
        assert!(!one.met);
    }

    #[test]
    fn the_scratch_url_names_the_scratch_database() {
        assert_eq!(
            scratch_url(
                "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable",
                "b_1"
            )
            .unwrap(),
            "postgres://postgres@127.0.0.1:5432/b_1?sslmode=disable"
        );
    }
}
