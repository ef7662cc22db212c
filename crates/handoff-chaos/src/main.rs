//! `handoff-chaos`: proof tooling for handoff. `check` runs the invariant checker.
//!
//! Exit codes: 0 every invariant holds, 1 the check could not run, 2 a violation was found.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use handoff_chaos::{check, CheckConfig};

#[derive(Parser, Debug)]
#[command(name = "handoff-chaos", version, about = "Proof tooling for handoff")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check the invariants (brief V2) over the databases and the stream.
    Check(CheckArgs),
}

#[derive(Args, Debug)]
struct CheckArgs {
    /// The order service's database (orders, idempotency records, outbox).
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// The NATS server.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// The JetStream stream the relay publishes to.
    #[arg(long, default_value = "HANDOFF")]
    stream: String,
    /// The relay's subject prefix.
    #[arg(long, default_value = "handoff")]
    subject_prefix: String,
    /// The inventory consumer's database.
    #[arg(long)]
    inventory_database_url: Option<String>,
    /// The payments consumer's database.
    #[arg(long)]
    payments_database_url: Option<String>,
    /// The payment provider's base URL, to check `GET /charges`.
    #[arg(long)]
    provider_url: Option<String>,
    /// Print the whole report as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    // clap exits 2 on a usage error, which here means "violation found": bad input exits 1.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            let code = if error.use_stderr() { 1 } else { 0 };
            let _ = error.print();
            return ExitCode::from(code);
        }
    };
    match run(cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(error) => {
            eprintln!("handoff-chaos: {error:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<bool> {
    let Command::Check(args) = cli.command;
    let runtime = tokio::runtime::Runtime::new().context("start the runtime")?;
    let config = CheckConfig {
        database_url: args.database_url,
        nats_url: args.nats_url,
        stream: args.stream,
        subject_prefix: args.subject_prefix,
        inventory_database_url: args.inventory_database_url,
        payments_database_url: args.payments_database_url,
        provider_url: args.provider_url,
    };
    let report = runtime.block_on(check(&config)).context("check")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "orders {}, mutations {}, intents {}, stream messages {}, duplicates absorbed {}, \
             violations {}",
            report.orders,
            report.mutations,
            report.intents,
            report.stream_messages,
            report.duplicates_absorbed,
            report.violations.len()
        );
        if let Some(first) = &report.first_violation {
            println!("first counter-example: {}", serde_json::to_string(first)?);
        }
    }
    Ok(report.holds())
}
