//! `handoff consumer quarantine`: the deliveries a consumer gave up on (`consumer_quarantine`,
//! in the consumer's own database). `list` and `show` read; `retry` has the running consumer
//! apply a row again through its inbox, `skip` closes it for good (advancing its aggregate past
//! it when it is next in line); both record who did what in `consumer_quarantine_actions`.

use anyhow::Result;
use handoff_postgres::{
    ConsumerQuarantine, ConsumerQuarantineDetail, ConsumerQuarantined, QuarantineRef,
};

use crate::args::DatabaseArgs;
use crate::format::{self, printable, since};
use crate::quarantine::ActorArgs;

#[derive(clap::Args)]
pub struct ConsumerArgs {
    #[command(subcommand)]
    command: ConsumerCommand,
}

#[derive(clap::Subcommand)]
enum ConsumerCommand {
    /// Deliveries a consumer gave up on: list, show, retry, skip.
    Quarantine(QuarantineArgs),
}

#[derive(clap::Args)]
struct QuarantineArgs {
    #[command(subcommand)]
    command: QuarantineCommand,
}

/// The consumer whose quarantine is read or changed.
#[derive(clap::Args)]
struct ConsumerName {
    /// The consumer's name (its `ConsumerConfig::name`), as its `--consumer-name`.
    #[arg(
        long = "consumer-name",
        alias = "consumer",
        env = "HANDOFF_CONSUMER_NAME",
        value_name = "NAME"
    )]
    name: String,
}

#[derive(clap::Subcommand)]
enum QuarantineCommand {
    /// Open rows (quarantined, retry requested), the oldest first.
    List {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        consumer: ConsumerName,
        /// Most rows shown.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Resolved rows too (applied by a retry, skipped, ...).
        #[arg(long)]
        all: bool,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One row in full: status, the stored message, and every action taken on it.
    Show {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        consumer: ConsumerName,
        /// The row: its quarantine id (an integer) or its event id (a UUID).
        row: QuarantineRef,
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Have the running consumer apply a row again through its inbox and handler (the cause is
    /// fixed); it picks the row up within seconds and records the outcome.
    Retry {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        consumer: ConsumerName,
        /// The row: its quarantine id (an integer) or its event id (a UUID).
        row: QuarantineRef,
        #[command(flatten)]
        actor: ActorArgs,
    },
    /// Never apply a row: close it with a reason, record its event as processed, and move its
    /// aggregate past it when it is next in line so the aggregate's later events apply.
    Skip {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        consumer: ConsumerName,
        /// The row: its quarantine id (an integer) or its event id (a UUID).
        row: QuarantineRef,
        /// Why; kept in the audit. Required.
        #[arg(long)]
        reason: String,
        /// Also for an event ahead of its aggregate: the aggregate moves to it, and the missing
        /// events before it are recorded and never applied when they arrive.
        #[arg(long)]
        past_gap: bool,
        #[command(flatten)]
        actor: ActorArgs,
    },
}

pub async fn run(args: ConsumerArgs) -> Result<()> {
    let ConsumerCommand::Quarantine(args) = args.command;
    match args.command {
        QuarantineCommand::List {
            database,
            consumer,
            limit,
            all,
            json,
        } => {
            let quarantine = ConsumerQuarantine::new(&database.schema()?, &consumer.name)?;
            let mut conn = database.connect_migrated("handoff-consumer").await?;
            let rows = quarantine.list(&mut conn, limit, all).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print_list(&consumer.name, &rows);
            }
        }
        QuarantineCommand::Show {
            database,
            consumer,
            row,
            json,
        } => {
            let quarantine = ConsumerQuarantine::new(&database.schema()?, &consumer.name)?;
            let mut conn = database.connect_migrated("handoff-consumer").await?;
            let detail = quarantine.show(&mut conn, row).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&detail)?);
            } else {
                print_detail(&detail);
            }
        }
        QuarantineCommand::Retry {
            database,
            consumer,
            row,
            actor,
        } => {
            let quarantine = ConsumerQuarantine::new(&database.schema()?, &consumer.name)?;
            let mut conn = database.connect_migrated("handoff-consumer").await?;
            let record = quarantine.retry(&mut conn, row, &actor.name()).await?;
            println!(
                "{row} marked for retry: consumer {} applies it again within seconds (action {})",
                consumer.name, record.action_id
            );
        }
        QuarantineCommand::Skip {
            database,
            consumer,
            row,
            reason,
            past_gap,
            actor,
        } => {
            let quarantine = ConsumerQuarantine::new(&database.schema()?, &consumer.name)?;
            let mut conn = database.connect_migrated("handoff-consumer").await?;
            let record = if past_gap {
                quarantine
                    .skip_past_gap(&mut conn, row, &reason, &actor.name())
                    .await?
            } else {
                quarantine
                    .skip(&mut conn, row, &reason, &actor.name())
                    .await?
            };
            let moved = if record.advanced {
                "its aggregate moved past it"
            } else {
                "its aggregate's sequence unchanged"
            };
            println!(
                "skipped {row}: recorded as processed, never applied; {moved} (action {})",
                record.action.action_id
            );
        }
    }
    Ok(())
}

/// `type/id #seq`, or `-` for a malformed message.
fn place(row: &ConsumerQuarantined) -> String {
    match (
        &row.aggregate_type,
        &row.aggregate_id,
        row.aggregate_sequence,
    ) {
        (Some(kind), Some(id), Some(sequence)) => format!("{kind}/{id} #{sequence}"),
        _ => "-".to_owned(),
    }
}

/// Where the row stands against its aggregate: next, ahead (a gap), or stale.
fn line(row: &ConsumerQuarantined) -> String {
    let Some(sequence) = row.aggregate_sequence else {
        return "-".to_owned();
    };
    let last = row.last_sequence.unwrap_or(0);
    if sequence == last + 1 {
        "next".to_owned()
    } else if sequence > last + 1 {
        format!("gap (at {last})")
    } else {
        format!("stale (at {last})")
    }
}

fn print_list(consumer: &str, rows: &[ConsumerQuarantined]) {
    if rows.is_empty() {
        println!("no quarantined deliveries for consumer {consumer}");
        return;
    }
    println!(
        "{:>6}  {:<36}  {:<32}  {:<12}  {:<17}  {:<15}  {:>5}  {:>9}  REASON",
        "ID", "EVENT ID", "AGGREGATE", "LINE", "KIND", "STATUS", "DELIV", "AGE"
    );
    for row in rows {
        println!(
            "{:>6}  {:<36}  {:<32}  {:<12}  {:<17}  {:<15}  {:>5}  {:>9}  {}",
            row.quarantine_id,
            row.event_id.map_or("-".to_owned(), |id| id.to_string()),
            place(row),
            line(row),
            row.reason_kind,
            match &row.resolution {
                Some(resolution) => format!("{}:{resolution}", row.status),
                None => row.status.clone(),
            },
            row.deliveries,
            since(row.quarantined_at),
            printable(&row.reason),
        );
    }
}

fn print_detail(detail: &ConsumerQuarantineDetail) {
    let row = &detail.row;
    println!("row          {}", row.quarantine_id);
    println!("consumer     {}", row.consumer_name);
    println!(
        "event        {}",
        row.event_id.map_or("-".to_owned(), |id| id.to_string())
    );
    match &row.resolution {
        Some(resolution) => println!(
            "status       {} ({resolution}{})",
            row.status,
            row.resolved_at
                .map_or(String::new(), |at| format!(", {}", at.to_rfc3339()))
        ),
        None => println!("status       {}", row.status),
    }
    println!("aggregate    {} ({})", place(row), line(row));
    if let (Some(kind), Some(version)) = (&row.event_type, row.schema_version) {
        println!("type         {kind} v{version}");
    }
    println!(
        "quarantined  {} ({}) after {} deliver{}",
        row.quarantined_at.to_rfc3339(),
        since(row.quarantined_at),
        row.deliveries,
        if row.deliveries == 1 { "y" } else { "ies" }
    );
    println!("kind         {}", row.reason_kind);
    println!("reason       {}", printable(&row.reason));
    if row.retries > 0 || row.retry_requested_at.is_some() {
        println!(
            "retries      {}{}",
            row.retries,
            row.retry_requested_at.map_or(String::new(), |at| format!(
                ", last requested {}",
                at.to_rfc3339()
            ))
        );
    }
    println!("headers      {}", detail.headers);
    println!("payload");
    match serde_json::from_str::<serde_json::Value>(&detail.payload) {
        Ok(json) => println!(
            "{}",
            serde_json::to_string_pretty(&json).unwrap_or_else(|_| detail.payload.clone())
        ),
        Err(_) => println!("{}", printable(&detail.payload)),
    }
    format::print_actions(&detail.actions, printable);
}
