//! `handoff cleanup`: delete or archive published rows (and dedup rows) past retention, in short
//! batches (design O2, C5). The batch logic is `handoff_postgres::Cleanup`; this module reads the
//! flags, draws the progress bar, handles SIGINT/SIGTERM and prints the summary.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::{bail, Result};
use handoff_postgres::{Cleanup, CleanupConfig, CleanupPhase, CleanupReport, BATCH_SIZE_RANGE};
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::watch;

use crate::args::{duration, DatabaseArgs};

/// The name the cleanup's connection carries in `pg_stat_activity`.
const APPLICATION_NAME: &str = "handoff-cleanup";

/// Flags of `handoff cleanup`.
#[derive(clap::Args)]
pub struct CleanupArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    /// Published rows whose published_at is older than this go: the replay horizon.
    #[arg(long, value_parser = duration, default_value = "7d")]
    retention: Duration,
    /// Never delete a published row younger than this (the broker may still lose it and
    /// `handoff reconcile` needs the row); a shorter --retention is refused.
    #[arg(long, value_parser = duration, default_value = "10m")]
    broker_durability_horizon: Duration,
    /// Also delete consumer dedup rows (processed_events) older than this; must be at least
    /// --retention, so a replayed event still finds its dedup row.
    #[arg(long, value_parser = duration)]
    dedup_retention: Option<Duration>,
    /// Move the published rows into outbox_archive instead of deleting them.
    #[arg(long)]
    archive: bool,
    /// Primary-key entries read per batch; each batch is one short transaction.
    #[arg(long, default_value_t = 5_000, value_parser = batch_size)]
    batch_size: usize,
    /// Sleep between batches.
    #[arg(long, value_parser = duration, default_value = "0s")]
    pause: Duration,
    /// How long a batch may wait for a row lock before it backs off and retries.
    #[arg(long, value_parser = duration, default_value = "1s")]
    lock_timeout: Duration,
    /// Count what would be removed; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
}

fn batch_size(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if BATCH_SIZE_RANGE.contains(&n) {
        Ok(n)
    } else {
        Err(format!("{n} is outside 1..=100000"))
    }
}

/// Runs `handoff cleanup`.
pub async fn run(args: CleanupArgs) -> Result<()> {
    // Checked before connecting: bad horizons change nothing, not even the run log.
    let mut config = CleanupConfig {
        schema: args.database.schema()?,
        retention: args.retention,
        broker_durability_horizon: args.broker_durability_horizon,
        dedup_retention: args.dedup_retention,
        archive: args.archive,
        batch_size: args.batch_size,
        pause: args.pause,
        lock_timeout: args.lock_timeout,
        dry_run: args.dry_run,
        ..CleanupConfig::default()
    };
    config.validate()?;
    let mut conn = args.database.connect_migrated(APPLICATION_NAME).await?;
    // Behind a transaction pooler every statement goes unnamed, in a transaction of its own.
    config.pooling = args.database.pooling(APPLICATION_NAME).await?;
    let cleanup = Cleanup::new(config)?;

    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("stopping after the current batch");
        stop_tx.send_replace(true);
    });

    let bar = if std::io::stderr().is_terminal() {
        let (outbox_rows, dedup_rows) = cleanup.estimate_rows(&mut conn).await?;
        let bar = ProgressBar::new(outbox_rows);
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>8} [{bar:40}] {pos}/{len} scanned, {msg} ({per_sec}, {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_prefix("outbox");
        Some((bar, dedup_rows))
    } else {
        None
    };
    let mut phase = CleanupPhase::Outbox;
    let verb = if args.dry_run { "to delete" } else { "deleted" };
    let result = cleanup
        .run(&mut conn, stop, |progress| {
            let Some((bar, dedup_rows)) = &bar else {
                return;
            };
            if progress.phase != phase {
                phase = progress.phase;
                bar.set_prefix("dedup");
                bar.set_length(*dedup_rows);
                bar.reset();
            }
            // The estimate can be low: never let the position run past the end.
            if progress.scanned > bar.length().unwrap_or(0) {
                bar.set_length(progress.scanned);
            }
            bar.set_position(progress.scanned);
            bar.set_message(format!("{} {verb}", progress.deleted));
        })
        .await;
    if let Some((bar, _)) = &bar {
        bar.finish_and_clear();
    }
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string(&summary_json(&report))?);
    } else {
        println!("{}", summary_line(&report));
    }
    if report.interrupted {
        bail!("interrupted: the run stopped before its walk completed (finished_at stays NULL)");
    }
    Ok(())
}

/// SIGINT (Ctrl-C) or SIGTERM (systemd, kill).
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            // Without a SIGTERM handler only Ctrl-C stops early.
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

fn rows_per_second(report: &CleanupReport) -> f64 {
    let secs = report.elapsed.as_secs_f64();
    if secs > 0.0 {
        (report.outbox_scanned + report.dedup_scanned) as f64 / secs
    } else {
        0.0
    }
}

fn summary_json(report: &CleanupReport) -> serde_json::Value {
    serde_json::json!({
        "run_id": report.run_id,
        "dry_run": report.dry_run,
        "archived": report.archived,
        "interrupted": report.interrupted,
        "outbox_cutoff": report.outbox_cutoff,
        "dedup_cutoff": report.dedup_cutoff,
        "outbox_scanned": report.outbox_scanned,
        "outbox_deleted": report.outbox_deleted,
        "dedup_scanned": report.dedup_scanned,
        "dedup_deleted": report.dedup_deleted,
        "batches": report.batches,
        "longest_batch_ms": report.longest_batch.as_secs_f64() * 1000.0,
        "lock_retries": report.lock_retries,
        "elapsed_ms": report.elapsed.as_secs_f64() * 1000.0,
        "scanned_rows_per_second": rows_per_second(report),
    })
}

fn summary_line(report: &CleanupReport) -> String {
    let (verb, outbox_verb) = match (report.dry_run, report.archived) {
        (true, _) => ("would delete", "would remove"),
        (false, true) => ("deleted", "archived"),
        (false, false) => ("deleted", "deleted"),
    };
    let dedup = match report.dedup_cutoff {
        Some(_) => format!(", {verb} {} dedup rows", report.dedup_deleted),
        None => String::new(),
    };
    let run = match report.run_id {
        Some(id) => format!(" (run {id})"),
        None => " (dry run: nothing changed)".to_owned(),
    };
    format!(
        "cleanup{}: {outbox_verb} {} of {} outbox rows published before {}{dedup}; \
         {} batches in {:.1} s, longest {:.0} ms{run}",
        if report.interrupted {
            " interrupted"
        } else {
            ""
        },
        report.outbox_deleted,
        report.outbox_scanned,
        report
            .outbox_cutoff
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        report.batches,
        report.elapsed.as_secs_f64(),
        report.longest_batch.as_secs_f64() * 1000.0,
    )
}
