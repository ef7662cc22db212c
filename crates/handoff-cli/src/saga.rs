//! `handoff saga`: the sagas an orchestrator runs in this database (design F2). `list` and
//! `show` read; `resume` and `resolve` act on a stuck saga and record who did what, and why,
//! in `saga_operator_actions`.

use anyhow::{Context, Result};
use handoff_saga::{SagaAdmin, SagaDetail, SagaRecord, SagaState};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::args::DatabaseArgs;
use crate::format::since;
use crate::quarantine::ActorArgs;

#[derive(clap::Args)]
pub struct SagaArgs {
    #[command(subcommand)]
    command: SagaCommand,
}

#[derive(clap::Subcommand)]
enum SagaCommand {
    /// Sagas, the most recently changed first.
    List {
        #[command(flatten)]
        database: DatabaseArgs,
        /// Only sagas in this state: running, compensating, completed, compensated, stuck,
        /// resolved.
        #[arg(long, value_parser = parse_state)]
        state: Option<SagaState>,
        /// Most sagas shown.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One saga in full: state, data, every transition, every operator action.
    Show {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The saga id.
        saga_id: Uuid,
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Send a stuck saga's failing compensation again, with a fresh retry budget (its cause
    /// is fixed). A running orchestrator picks it up within its sweep interval.
    Resume {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The saga id.
        saga_id: Uuid,
        /// Why, for the audit.
        #[arg(long, default_value = "resumed by an operator")]
        reason: String,
        #[command(flatten)]
        actor: ActorArgs,
        /// Print the saga as JSON afterwards.
        #[arg(long)]
        json: bool,
    },
    /// Close a stuck saga by hand (what its compensation could not undo was dealt with
    /// outside): it ends `resolved`, and nothing is sent.
    Resolve {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The saga id.
        saga_id: Uuid,
        /// Why; kept in the audit. Required.
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        actor: ActorArgs,
        /// Print the saga as JSON afterwards.
        #[arg(long)]
        json: bool,
    },
}

fn parse_state(s: &str) -> Result<SagaState, String> {
    s.parse().map_err(|_| {
        let names: Vec<_> = SagaState::ALL.iter().map(|s| s.as_str()).collect();
        format!("unknown saga state {s:?}; one of {}", names.join(", "))
    })
}

/// One connection to a migrated database (a database without the saga tables says so
/// plainly), and the saga tables in its schema.
async fn admin(database: &DatabaseArgs) -> Result<(PgConnection, SagaAdmin)> {
    let conn = database.connect_migrated("handoff-saga").await?;
    Ok((conn, SagaAdmin::new(&database.schema()?)))
}

pub async fn run(args: SagaArgs) -> Result<()> {
    match args.command {
        SagaCommand::List {
            database,
            state,
            limit,
            json,
        } => {
            let (mut conn, admin) = admin(&database).await?;
            let sagas = admin.list(&mut conn, state, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&sagas)?);
            } else {
                print_list(&sagas);
            }
        }
        SagaCommand::Show {
            database,
            saga_id,
            json,
        } => {
            let (mut conn, admin) = admin(&database).await?;
            let detail = admin
                .show(&mut conn, saga_id)
                .await?
                .with_context(|| format!("no saga {saga_id}"))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&detail)?);
            } else {
                print_detail(&detail)?;
            }
        }
        SagaCommand::Resume {
            database,
            saga_id,
            reason,
            actor,
            json,
        } => {
            let (mut conn, admin) = admin(&database).await?;
            let saga = admin
                .resume(&mut conn, saga_id, &actor.name(), &reason)
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&saga)?);
            } else {
                // Resume puts the saga back where it was stuck: a failing compensation is sent
                // again, a failing deadline transition is tried again; either with a fresh
                // retry budget.
                println!(
                    "resumed {saga_id}: {} at step {}, with a fresh retry budget",
                    saga.state.as_str(),
                    saga.step
                );
            }
        }
        SagaCommand::Resolve {
            database,
            saga_id,
            reason,
            actor,
            json,
        } => {
            let (mut conn, admin) = admin(&database).await?;
            let saga = admin
                .resolve(&mut conn, saga_id, &actor.name(), &reason)
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&saga)?);
            } else {
                println!("resolved {saga_id} by hand: {reason}");
            }
        }
    }
    Ok(())
}

fn print_list(sagas: &[SagaRecord]) {
    if sagas.is_empty() {
        println!("no sagas");
        return;
    }
    println!(
        "{:<36}  {:<16}  {:<12}  {:>4}  {:>7}  {:>12}  WHY",
        "SAGA ID", "TYPE", "STATE", "STEP", "ATTEMPT", "CHANGED"
    );
    for saga in sagas {
        println!(
            "{:<36}  {:<16}  {:<12}  {:>4}  {:>7}  {:>12}  {}",
            saga.saga_id,
            saga.saga_type,
            saga.state,
            saga.step,
            saga.attempt,
            since(saga.updated_at),
            saga.stuck_reason
                .as_deref()
                .or(saga.failure.as_deref())
                .unwrap_or("-"),
        );
    }
}

fn print_detail(detail: &SagaDetail) -> Result<()> {
    let saga = &detail.saga;
    println!("saga         {}", saga.saga_id);
    println!("type         {}", saga.saga_type);
    println!("state        {}", saga.state);
    println!("step         {} (attempt {})", saga.step, saga.attempt);
    println!("version      {}", saga.version);
    println!(
        "started      {} ({})",
        saga.created_at.to_rfc3339(),
        since(saga.created_at)
    );
    if let Some(at) = saga.ended_at {
        println!("ended        {} ({})", at.to_rfc3339(), since(at));
    }
    if let (Some(at), Some(kind)) = (saga.deadline_at, &saga.deadline_kind) {
        println!("next         {kind} deadline at {}", at.to_rfc3339());
    }
    if let Some(failure) = &saga.failure {
        println!("failure      {failure}");
    }
    if let Some(reason) = &saga.stuck_reason {
        println!("stuck        {reason}");
    }
    println!("data");
    println!("{}", serde_json::to_string_pretty(&saga.data)?);
    println!("history");
    for entry in &detail.history {
        println!(
            "  v{:<3} {}  {:<22} {:<12} step {}{}",
            entry.version,
            entry.at.to_rfc3339(),
            entry.kind,
            entry.state,
            entry.step,
            entry
                .detail
                .as_deref()
                .map_or(String::new(), |d| format!(": {d}")),
        );
    }
    if detail.actions.is_empty() {
        println!("actions      none");
    } else {
        println!("actions");
        for action in &detail.actions {
            println!(
                "  #{} {} by {} at {}: {} ({} -> {})",
                action.action_id,
                action.action,
                action.actor,
                action.acted_at.to_rfc3339(),
                action.reason,
                action.state_before,
                action.state_after,
            );
        }
    }
    Ok(())
}
