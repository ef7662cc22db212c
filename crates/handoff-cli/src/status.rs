//! `handoff status`: the outbox at a glance (design O1, O5), for a person or a script. Exits 2
//! when an alert condition holds, so a cron job or a health check can act on it.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use handoff_postgres::{ConsumerQuarantine, ConsumerQuarantineCount, Status, StatusReport};
use handoff_saga::{SagaAdmin, SagaCount, SagaRecord, SagaState};
use serde::Serialize;

use crate::args::{duration, DatabaseArgs};
use crate::format::{age, bytes, since};

/// The exit code when an alert condition holds.
const ALERTING: u8 = 2;

#[derive(clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// An aggregate whose first pending event is older than this is listed as stuck.
    #[arg(long, value_parser = duration, default_value = "1m")]
    stuck_after: Duration,
    /// Most stuck aggregates listed.
    #[arg(long, default_value_t = 10)]
    top: i64,
    /// Alert when the oldest pending event is older than this.
    #[arg(long, value_parser = duration, default_value = "5m")]
    max_pending_age: Duration,
}

/// The report as printed with `--json`: the numbers, the alerts that hold, and the verdict.
#[derive(Serialize)]
struct Output<'a> {
    #[serde(flatten)]
    report: &'a StatusReport,
    sagas: &'a Sagas,
    /// Open rows of each consumer's quarantine (consumers whose tables live in this database),
    /// by consumer name; consumers with none are absent.
    consumer_quarantine: &'a [ConsumerQuarantineCount],
    alerts: Vec<Alert>,
    healthy: bool,
}

/// The sagas not ended, and the stuck ones in full (design F2).
#[derive(Serialize)]
struct Sagas {
    /// Per type and state, of `running`, `compensating` and `stuck`.
    open: Vec<SagaCount>,
    stuck_count: i64,
    /// The most recently stuck, at most `--top`.
    stuck: Vec<SagaRecord>,
}

impl Sagas {
    async fn read(conn: &mut sqlx::PgConnection, args: &StatusArgs) -> Result<Self> {
        let admin = SagaAdmin::new(&args.database.schema()?);
        let open = admin.open_counts(&mut *conn).await?;
        let stuck_count = open
            .iter()
            .filter(|c| c.state == SagaState::Stuck.as_str())
            .map(|c| c.count)
            .sum();
        let stuck = admin
            .list(&mut *conn, Some(SagaState::Stuck), args.top)
            .await?;
        Ok(Self {
            open,
            stuck_count,
            stuck,
        })
    }
}

/// One alert condition that holds.
#[derive(Serialize)]
struct Alert {
    name: &'static str,
    message: String,
}

pub async fn run(args: StatusArgs) -> Result<ExitCode> {
    let mut conn = args.database.connect_migrated("handoff-status").await?;
    let report = Status::new(&args.database.schema()?)
        .read(&mut conn, args.stuck_after, args.top)
        .await?;
    // In a transaction: its statements then stay on one server connection behind a pooler.
    let mut tx = sqlx::Connection::begin(&mut conn).await?;
    let sagas = Sagas::read(&mut tx, &args).await?;
    tx.commit().await?;
    let consumers = ConsumerQuarantine::counts(&mut conn, &args.database.schema()?).await?;
    let alerts = alerts(&report, &sagas, &consumers, &args);
    if args.json {
        let output = Output {
            report: &report,
            sagas: &sagas,
            consumer_quarantine: &consumers,
            healthy: alerts.is_empty(),
            alerts,
        };
        println!("{}", serde_json::to_string_pretty(&output)?);
        return Ok(exit_code(output.healthy));
    }
    print_report(&report, &args);
    print_sagas(&sagas);
    print_consumer_quarantine(&consumers);
    if alerts.is_empty() {
        println!("healthy");
    }
    for alert in &alerts {
        println!("ALERT {}: {}", alert.name, alert.message);
    }
    Ok(exit_code(alerts.is_empty()))
}

fn exit_code(healthy: bool) -> ExitCode {
    if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(ALERTING)
    }
}

/// The conditions `deploy/prometheus/alerts.yml` also watches, judged from one reading.
fn alerts(
    report: &StatusReport,
    sagas: &Sagas,
    consumers: &[ConsumerQuarantineCount],
    args: &StatusArgs,
) -> Vec<Alert> {
    let mut alerts = Vec::new();
    for relay in report.relays.iter().filter(|r| r.alive) {
        if let Some(reason) = &relay.paused_reason {
            alerts.push(Alert {
                name: "destination_paused",
                message: format!(
                    "relay {} has paused its destination ({reason}): {}; it resumes by itself \
                     once a probe event gets through",
                    relay.relay_id,
                    relay.paused_cause.as_deref().unwrap_or("")
                ),
            });
        }
    }
    if sagas.stuck_count > 0 {
        alerts.push(Alert {
            name: "stuck_sagas",
            message: format!(
                "{} saga(s) stuck on a failing compensation; see `handoff saga list --state stuck`",
                sagas.stuck_count
            ),
        });
    }
    if report.quarantined > 0 {
        alerts.push(Alert {
            name: "quarantine_not_empty",
            message: format!(
                "{} event(s) held for an operator; see `handoff quarantine list`",
                report.quarantined
            ),
        });
    }
    for consumer in consumers {
        alerts.push(Alert {
            name: "consumer_quarantine_not_empty",
            message: format!(
                "consumer {} holds {} quarantined deliver(ies) ({} waiting for a retry); see \
                 `handoff consumer quarantine list --consumer {}`",
                consumer.consumer_name,
                consumer.quarantined + consumer.retry_requested,
                consumer.retry_requested,
                consumer.consumer_name
            ),
        });
    }
    if report.oldest_pending_age_seconds > args.max_pending_age.as_secs_f64() {
        alerts.push(Alert {
            name: "oldest_pending_too_old",
            message: format!(
                "the oldest pending event is {} old (limit {})",
                age(report.oldest_pending_age_seconds),
                age(args.max_pending_age.as_secs_f64())
            ),
        });
    }
    if report.stuck_aggregate_count > 0 {
        alerts.push(Alert {
            name: "stuck_aggregates",
            message: format!(
                "{} aggregate(s) waiting longer than {}",
                report.stuck_aggregate_count,
                age(args.stuck_after.as_secs_f64())
            ),
        });
    }
    if report.holes > 0 {
        alerts.push(Alert {
            name: "order_holes",
            message: format!(
                "{} pending event(s) wait for a sequence that was never written; find them with \
                 `handoff status` (stuck aggregates) and release each with `handoff quarantine \
                 skip --aggregate-type T --aggregate-id I --sequence N --reason ...`",
                report.holes
            ),
        });
    }
    if report.global_lane_blocked {
        alerts.push(Alert {
            name: "global_lane_blocked",
            message: format!(
                "the global lane is blocked: global sequence {} is held for an operator, or \
                 waits behind a held event of its aggregate, and no later global event is \
                 published until that event is retried or skipped (`handoff quarantine list`)",
                report.global_front.unwrap_or_default()
            ),
        });
    }
    if report.expired_leases > 0 {
        alerts.push(Alert {
            name: "expired_leases",
            message: format!(
                "{} leased event(s) past their lease: is any relay running?",
                report.expired_leases
            ),
        });
    }
    alerts
}

fn print_sagas(sagas: &Sagas) {
    if sagas.open.is_empty() {
        println!("sagas in flight      0");
        return;
    }
    println!("sagas in flight");
    for count in &sagas.open {
        println!(
            "  {:<26} {:<13} {}",
            count.saga_type, count.state, count.count
        );
    }
    for saga in &sagas.stuck {
        println!(
            "  stuck {} {} step {} since {}: {}",
            saga.saga_id,
            saga.saga_type,
            saga.step,
            since(saga.updated_at),
            saga.stuck_reason.as_deref().unwrap_or("-")
        );
    }
}

fn print_consumer_quarantine(consumers: &[ConsumerQuarantineCount]) {
    if consumers.is_empty() {
        println!("consumer quarantine  0");
        return;
    }
    println!("consumer quarantine");
    for consumer in consumers {
        println!(
            "  {:<26} {} quarantined, {} retry requested, oldest {}",
            consumer.consumer_name,
            consumer.quarantined,
            consumer.retry_requested,
            since(consumer.oldest_quarantined_at)
        );
    }
}

/// The relays: alive ones first (and why one paused its destination), then stopped ones, each
/// with when it was last seen.
fn print_relays(report: &StatusReport) {
    let alive = report.relays.iter().filter(|r| r.alive).count();
    println!(
        "relays               {alive} alive, {} stopped",
        report.relays.len() - alive
    );
    let now = chrono::Utc::now();
    for relay in &report.relays {
        let seen = (now - relay.last_seen).num_milliseconds().max(0) as f64 / 1000.0;
        let state = match (&relay.paused_reason, relay.alive) {
            (_, false) => "STOPPED".to_owned(),
            (Some(reason), true) => format!(
                "alive, destination PAUSED ({reason}: {})",
                relay.paused_cause.as_deref().unwrap_or("")
            ),
            (None, true) => "alive".to_owned(),
        };
        println!(
            "  {}  {}  last seen {} ago  host {} pid {} version {}",
            relay.relay_id,
            state,
            age(seen),
            relay.host.as_deref().unwrap_or("-"),
            relay.pid.map_or_else(|| "-".to_owned(), |p| p.to_string()),
            relay.version.as_deref().unwrap_or("-"),
        );
    }
}

fn print_report(report: &StatusReport, args: &StatusArgs) {
    print_relays(report);
    println!("pending              {}", report.pending);
    println!(
        "oldest pending age   {}",
        age(report.oldest_pending_age_seconds)
    );
    println!("quarantined          {}", report.quarantined);
    println!("expired leases       {}", report.expired_leases);
    println!(
        "holes                {} (pending events whose previous sequence was never written)",
        report.holes
    );
    if report.global_pending > 0 || report.global_lane_blocked {
        println!(
            "global lane          {} pending, front {}{}",
            report.global_pending,
            report
                .global_front
                .map_or_else(|| "-".to_owned(), |f| f.to_string()),
            if report.global_lane_blocked {
                " (BLOCKED: it or an earlier event of its aggregate is held for an operator)"
            } else {
                ""
            }
        );
    }
    println!(
        "stuck aggregates     {} (first pending event older than {})",
        report.stuck_aggregate_count,
        age(args.stuck_after.as_secs_f64())
    );
    for stuck in &report.stuck_aggregates {
        println!(
            "  {}/{}  waiting {}  {} pending  head #{} {} {} ({}, {} attempt(s)){}",
            stuck.aggregate_type,
            stuck.aggregate_id,
            age(stuck.oldest_pending_age_seconds),
            stuck.pending,
            stuck.head_sequence,
            stuck.head_event_type,
            stuck.head_event_id,
            stuck.head_state,
            stuck.head_attempts,
            stuck
                .head_last_error
                .as_deref()
                .map_or(String::new(), |e| format!(": {e}")),
        );
    }
    println!("tables");
    for table in &report.tables {
        println!(
            "  {:<26} {:>10}  ~{} rows",
            table.table,
            bytes(table.bytes),
            table.estimated_rows.max(0.0) as i64
        );
    }
    match &report.last_cleanup {
        None => println!("last cleanup         never"),
        Some(run) => println!(
            "last cleanup         started {}, {}: {} outbox row(s) {}, {} dedup row(s), {} batch(es), \
             longest {:.0} ms",
            since(run.started_at),
            run.finished_at
                .map_or("unfinished".to_owned(), |at| format!("finished {}", since(at))),
            run.outbox_deleted,
            if run.archived { "archived" } else { "deleted" },
            run.dedup_deleted,
            run.batches,
            run.longest_batch_ms
        ),
    }
}
