//! `handoff cdc`: deploy-time setup of the logical-replication source, and the slot's health.
//!
//! `setup` creates the publication and the slot (never the relay: a slot created once rows exist
//! misses them, so it is a deploy step), sets the rows mode, and with `--recreate-lost-slot`
//! performs the first step of the lost-slot runbook. `status` prints the slot's health and exits
//! 2 when the slot is lost or missing, or when it may retain less WAL than `--min-safe-wal`.

use std::process::ExitCode;

use anyhow::Result;
use handoff_cdc::{setup, slot_health, CdcNames, RowMode};
use serde_json::json;

use crate::args::DatabaseArgs;

const ALERTING: u8 = 2;

#[derive(clap::Args)]
pub struct CdcArgs {
    #[command(subcommand)]
    command: CdcCommand,
}

#[derive(clap::Subcommand)]
enum CdcCommand {
    /// Create the publication and the logical slot, and set the rows mode (idempotent).
    Setup(SetupArgs),
    /// The slot's health: lag, WAL retention margin, wal_status. Exit 2 when it needs a person.
    Status(StatusArgs),
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Rows {
    /// Keep outbox rows and mark them published (replay, reconcile and lost-slot recovery work).
    Keep,
    /// Delete each outbox row in the transaction that wrote it; the WAL carries the event.
    Delete,
}

#[derive(clap::Args)]
struct SetupArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    /// Replication slot to create.
    #[arg(long, env = "HANDOFF_SLOT", default_value = "handoff")]
    slot: String,
    /// Publication to create (inserts on the outbox only).
    #[arg(long, env = "HANDOFF_PUBLICATION", default_value = "handoff_outbox")]
    publication: String,
    /// What becomes of an outbox row once its event is in the WAL.
    #[arg(long, value_enum, default_value = "keep")]
    rows: Rows,
    /// Drop a slot PostgreSQL invalidated and create it again (the lost-slot runbook).
    #[arg(long)]
    recreate_lost_slot: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct StatusArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    /// Replication slot to inspect.
    #[arg(long, env = "HANDOFF_SLOT", default_value = "handoff")]
    slot: String,
    /// Alert when the slot may retain fewer bytes of WAL than this before it is invalidated.
    #[arg(long, default_value_t = 1 << 30)]
    min_safe_wal: i64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: CdcArgs) -> Result<ExitCode> {
    match args.command {
        CdcCommand::Setup(args) => run_setup(args).await,
        CdcCommand::Status(args) => run_status(args).await,
    }
}

async fn run_setup(args: SetupArgs) -> Result<ExitCode> {
    let names = CdcNames::new(&args.slot, &args.publication)?;
    let mut conn = args.database.connect_migrated("handoff-cdc").await?;
    let rows = match args.rows {
        Rows::Keep => RowMode::Keep,
        Rows::Delete => RowMode::Delete,
    };
    let report = setup(
        &mut conn,
        &args.database.schema()?,
        &names,
        rows,
        args.recreate_lost_slot,
    )
    .await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let verb = |created: bool| if created { "created" } else { "exists" };
        println!(
            "publication {}: {}",
            names.publication,
            verb(report.publication_created)
        );
        let slot = if report.slot_recreated {
            "recreated (it was lost)"
        } else {
            verb(report.slot_created)
        };
        println!("slot {}: {slot}", names.slot);
        println!("rows: {:?}", report.rows);
        if report.unpublished_rows > 0 {
            println!(
                "{} unpublished outbox rows: the relay publishes them from the table at its \
                 next start, then follows the stream",
                report.unpublished_rows
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_status(args: StatusArgs) -> Result<ExitCode> {
    let mut conn = args.database.connect_migrated("handoff-cdc").await?;
    let health = slot_health(&mut conn, &args.slot).await?;
    let mut alerts = Vec::new();
    match &health {
        None => alerts.push(format!("slot {} does not exist", args.slot)),
        Some(h) if h.is_lost() => alerts.push(format!(
            "slot {} is lost: run `handoff cdc setup --recreate-lost-slot`, then restart the relay",
            args.slot
        )),
        Some(h) => {
            if let Some(safe) = h.safe_wal_bytes {
                if safe < args.min_safe_wal {
                    alerts.push(format!(
                        "slot {} may retain only {safe} more bytes of WAL before it is lost",
                        args.slot
                    ));
                }
            }
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "slot": args.slot,
                "health": health,
                "alerts": alerts,
                "healthy": alerts.is_empty(),
            }))?
        );
    } else {
        match &health {
            Some(h) => {
                println!(
                    "slot {}: wal_status {}",
                    args.slot,
                    h.wal_status.as_deref().unwrap_or("?")
                );
                println!("  active: {}", h.active);
                println!("  lag: {} bytes", h.lag_bytes.unwrap_or(0));
                match h.safe_wal_bytes {
                    Some(safe) => println!("  safe WAL margin: {safe} bytes"),
                    None => println!("  safe WAL margin: unlimited (max_slot_wal_keep_size = -1)"),
                }
                println!(
                    "  confirmed: {}",
                    h.confirmed_flush_lsn.as_deref().unwrap_or("-")
                );
            }
            None => println!("slot {}: missing", args.slot),
        }
        for alert in &alerts {
            println!("ALERT {alert}");
        }
    }
    Ok(if alerts.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(ALERTING)
    })
}
