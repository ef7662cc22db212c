//! The `handoff` command: operate a handoff outbox.
//!
//! `handoff migrate` applies the embedded schema migrations; `handoff relay` publishes committed
//! outbox events to a destination (NATS JetStream, Kafka, RabbitMQ, HTTP: one file each in
//! [`destination`]); `status`, `quarantine`, `replay`, `reconcile` and `cleanup`
//! are the operator's commands, `consumer quarantine` the consumers' operator's, `saga` the
//! sagas' operator's. `roles` prints the least-privilege roles' SQL; `console` serves the web
//! console. Each lives in its own module; [`reference`] renders every flag as
//! `docs/configuration.md`.

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Subcommand};
use handoff_postgres::{Migrator, Schema};

mod args;
mod cdc;
mod cleanup;
mod console;
mod consumer;
mod destination;
mod format;
mod quarantine;
mod reconcile;
mod reference;
mod relay;
mod replay;
mod republish;
mod roles;
mod saga;
mod status;

#[derive(clap::Parser)]
#[command(
    name = "handoff",
    version,
    about = "Operate a handoff transactional outbox"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// `--otlp-endpoint`: where trace spans go (nowhere without it).
    #[command(flatten)]
    otlp: handoff_telemetry::OtlpArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Apply pending schema migrations (idempotent; safe to run from several processes at once).
    Migrate(MigrateArgs),
    /// Publish committed outbox events to the destination until SIGTERM/SIGINT.
    // Each flag's help on its own line: `-h` fits 100 columns (tests/it/cli_names.rs).
    #[command(next_line_help = true)]
    Relay(Box<relay::RelayArgs>),
    /// The outbox at a glance: backlog, quarantine, stuck aggregates, table sizes, last cleanup.
    /// Exits 2 when an alert condition holds.
    Status(status::StatusArgs),
    /// Events held for an operator: list, show, retry, repair, skip; hold a pending one.
    Quarantine(quarantine::QuarantineArgs),
    /// A consumer's side, in its own database: `consumer quarantine list|show|retry|skip`.
    Consumer(consumer::ConsumerArgs),
    /// Republish retained events (by aggregate, event type, time range) with a replay marker.
    Replay(replay::ReplayArgs),
    /// Check that every retained published event is in the stream; republish the missing ones.
    Reconcile(reconcile::ReconcileArgs),
    /// Delete (or archive) published rows and dedup rows past their retention, in short batches.
    Cleanup(cleanup::CleanupArgs),
    /// Set up and inspect the logical-replication source (`handoff relay --source logical`).
    Cdc(cdc::CdcArgs),
    /// Sagas an orchestrator runs in this database: list, show, resume or resolve a stuck one.
    Saga(saga::SagaArgs),
    /// Serve the web console and the admin HTTP API (/api/v1/) until SIGTERM/SIGINT.
    Console(console::ConsoleArgs),
    /// Print the SQL of least-privilege roles (writer, relay, operator) for handoff's tables.
    Roles(roles::RolesArgs),
    /// Print the configuration reference (docs/configuration.md) from these flags' definitions.
    #[command(hide = true)]
    Reference,
}

/// `handoff`'s command line: the flags' definitions, with each `HANDOFF_` variable's older
/// name read where it is not set (`handoff_telemetry::env`).
fn command() -> clap::Command {
    handoff_telemetry::env::with_fallbacks(Cli::command())
}

#[derive(clap::Args)]
struct MigrateArgs {
    /// PostgreSQL URL (the password is never logged).
    ///
    /// TLS settings included (`?sslmode=verify-full&sslrootcert=FILE`); or from the file
    /// HANDOFF_DATABASE_URL_FILE names.
    #[arg(
        long,
        env = "HANDOFF_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    database_url: String,
    /// Schema for handoff's tables [default: search_path].
    ///
    /// Without it, the connection's search_path (usually `public`).
    #[arg(long, env = "HANDOFF_SCHEMA")]
    schema: Option<String>,
    /// Only check that the database is current: exit 0 current, 2 pending, 1 error.
    ///
    /// Status 2 when migrations are pending (the schema needs `handoff migrate`), 1 on any
    /// error (no connection, a changed migration). A schema a newer release migrated further is
    /// current for this binary: status 0, with a warning naming the versions it does not know.
    #[arg(long)]
    check: bool,
}

fn main() -> std::process::ExitCode {
    // `<VAR>_FILE` (DATABASE_URL_FILE, ...) before anything reads the environment; then the
    // runtime.
    handoff_telemetry::secrets::run_main(async_main)
}

async fn async_main() -> std::process::ExitCode {
    // `handoff status | head` must end quietly when the reader goes away, as other command
    // line tools do, instead of panicking on the broken pipe: Rust ignores SIGPIPE by default.
    // SAFETY: restoring a signal's default disposition at start-up, before anything is written,
    // has no memory-safety preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Test builds only: reads FAILPOINTS (see handoff_relay::failpoints).
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    // The matches are kept: the relay lays its flags over its config file with them.
    let parsed = command()
        .try_get_matches()
        .and_then(|matches| Ok((Cli::from_arg_matches(&matches)?, matches)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(error) => {
            let error = error.format(&mut command());
            // Usage errors exit 1, not clap's 2: status 2 is what `status` and `reconcile`
            // report to scripts as an alert, and a typo must not read as one.
            let _ = error.print();
            return if error.use_stderr() {
                std::process::ExitCode::FAILURE
            } else {
                std::process::ExitCode::SUCCESS
            };
        }
    };
    // One line per cause, never a backtrace: this is an operator's tool.
    match run(cli, &matches).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli, matches: &clap::ArgMatches) -> Result<std::process::ExitCode> {
    // Kept until the command ends: dropping it sends the spans still buffered.
    let _telemetry = handoff_telemetry::Telemetry::builder("handoff")
        .default_filter("info,sqlx=warn,async_nats=warn")
        .otlp(&cli.otlp)
        .init()?;
    let success = |()| std::process::ExitCode::SUCCESS;
    match cli.command {
        // `migrate --check` tells a script by its exit code whether the schema needs a run.
        Command::Migrate(args) => migrate(args).await,
        Command::Relay(_) => match matches.subcommand_matches("relay") {
            Some(relay) => relay::run(relay).await.map(success),
            None => unreachable!("the relay command was parsed from its matches"),
        },
        // These two tell a script by their exit code whether something needs a person.
        Command::Status(args) => status::run(args).await,
        Command::Reconcile(args) => reconcile::run(args).await,
        Command::Quarantine(args) => quarantine::run(args).await.map(success),
        Command::Consumer(args) => consumer::run(args).await.map(success),
        Command::Replay(args) => replay::run(args).await.map(success),
        Command::Cleanup(args) => cleanup::run(args).await.map(success),
        Command::Cdc(args) => cdc::run(args).await,
        Command::Saga(args) => saga::run(args).await.map(success),
        Command::Roles(args) => roles::run(args).map(success),
        Command::Console(args) => console::run(args).await.map(success),
        Command::Reference => {
            print!("{}", reference::markdown(&Cli::command()));
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}

/// `handoff migrate`; with `--check`, exit status 0 when the schema is current, 2 when
/// migrations are pending (the uniform "needs attention" status of `status` and `reconcile`),
/// 1 on an error.
async fn migrate(args: MigrateArgs) -> Result<std::process::ExitCode> {
    let schema = match args.schema {
        Some(name) => Schema::named(name)?,
        None => Schema::default(),
    };
    let database = args::DatabaseArgs {
        database_url: args.database_url,
        schema: None,
    };
    let options = database.options("handoff-migrate")?;
    let mut conn = database.connect("handoff-migrate").await?;
    let migrator = Migrator::handoff(schema);
    if !args.check {
        // Migrations hold a session advisory lock and set the session's search_path: a
        // transaction pooler would leave both on a server connection other clients share.
        Migrator::ensure_direct(&options).await?;
    }
    if args.check {
        return match migrator.check(&mut conn).await {
            Ok(report) => {
                println!(
                    "schema is current ({} migration(s) applied)",
                    report.already_applied.len()
                );
                Ok(std::process::ExitCode::SUCCESS)
            }
            Err(error) if error.kind() == handoff_postgres::MigrateErrorKind::Behind => {
                println!("{error} (run `handoff migrate`)");
                Ok(std::process::ExitCode::from(2))
            }
            Err(error) => Err(error.into()),
        };
    }
    let report = migrator.run(&mut conn).await?;
    if report.applied.is_empty() {
        println!(
            "schema is current ({} migration(s) applied)",
            report.already_applied.len()
        );
    } else {
        println!("applied migration(s) {:?}", report.applied);
    }
    Ok(std::process::ExitCode::SUCCESS)
}
