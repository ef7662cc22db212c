//! `handoff status`: the outbox at a glance (design O1, O5), for a person or a script. Exits 2
//! when an alert condition holds, so a cron job or a health check can act on it.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use handoff_console::{Sagas, StatusDocument, StatusOptions};
use handoff_postgres::{ConsumerQuarantineCount, StatusReport};

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

pub async fn run(args: StatusArgs) -> Result<ExitCode> {
    let mut conn = args.database.connect_migrated("handoff-status").await?;
    let options = StatusOptions {
        stuck_after: args.stuck_after,
        top: args.top,
        max_pending_age: args.max_pending_age,
    };
    // The console's `GET /api/v1/status` answers the same document.
    let document = StatusDocument::read(&mut conn, &args.database.schema()?, options).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&document)?);
        return Ok(exit_code(document.healthy));
    }
    print_report(&document.report, &args);
    print_sagas(&document.sagas);
    print_consumer_quarantine(&document.consumer_quarantine);
    if document.alerts.is_empty() {
        println!("healthy");
    }
    for alert in &document.alerts {
        println!("ALERT {}: {}", alert.name, alert.message);
    }
    Ok(exit_code(document.healthy))
}

fn exit_code(healthy: bool) -> ExitCode {
    if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(ALERTING)
    }
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
        let ago = |at: Option<chrono::DateTime<chrono::Utc>>| {
            at.map_or_else(
                || "never".to_owned(),
                |at| {
                    let seconds = (now - at).num_milliseconds().max(0) as f64 / 1000.0;
                    format!("{} ago", age(seconds))
                },
            )
        };
        println!(
            "  {}  {}  last seen {} ago  host {} pid {} version {}  published {}, last claim {}, last mark {}",
            relay.relay_id,
            state,
            age(seen),
            relay.host.as_deref().unwrap_or("-"),
            relay.pid.map_or_else(|| "-".to_owned(), |p| p.to_string()),
            relay.version.as_deref().unwrap_or("-"),
            relay.published,
            ago(relay.last_claim_at),
            ago(relay.last_mark_at),
        );
    }
}

/// The log source's cursors: who reads each, how far behind it is, what its lane holds.
fn print_cursors(report: &StatusReport) {
    if report.cursors.is_empty() {
        return;
    }
    println!("cursors              {}", report.cursors.len());
    for cursor in &report.cursors {
        println!(
            "  {}  {}  behind {} event(s), oldest {}  lane {} aggregate(s)",
            cursor.cursor,
            match (&cursor.owner_relay, cursor.held) {
                (Some(relay), true) => format!("read by {relay}"),
                (Some(relay), false) => format!("NOT READ (last by {relay})"),
                (None, _) => "NOT READ (never)".to_owned(),
            },
            cursor.lag_events,
            age(cursor.lag_seconds),
            cursor.lane_aggregates,
        );
    }
    println!(
        "  (with the log source, `pending` below counts rows without published_at, which the \
         cursor does not write: read the lag above)"
    );
}

fn print_report(report: &StatusReport, args: &StatusArgs) {
    print_relays(report);
    print_cursors(report);
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
            match &stuck.head_hold_reason {
                Some(reason) => format!("HELD: {reason}"),
                None => stuck.head_state.clone(),
            },
            stuck.head_attempts,
            stuck
                .head_last_error
                .as_deref()
                .map_or(String::new(), |e| format!(": {e}")),
        );
    }
    println!("tables");
    for table in &report.tables {
        // Exact where counting is cheap; the planner's estimate, said to be one, beyond.
        let rows = match table.rows {
            Some(rows) => format!("{rows} rows"),
            None if table.estimated_rows < 0.0 => "rows not estimated yet (never analyzed)".into(),
            None => format!("~{} rows (estimate)", table.estimated_rows as i64),
        };
        println!("  {:<26} {:>10}  {rows}", table.table, bytes(table.bytes));
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
