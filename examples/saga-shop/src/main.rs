//! `saga-shop orders|inventory|payments`: one service of the reference place-order saga per
//! process. Each prints `ready` once its relay and consumer run, and stops on SIGTERM.

use std::time::Duration;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use handoff_postgres::Schema;
use handoff_saga::{Orchestrator, OrchestratorConfig, SagaParticipant, REPLY_AGGREGATE_TYPE};
use reqwest::Url;
use saga_shop::service::{self, ServiceArgs, Tables};
use saga_shop::{inventory, orders, payments};

#[derive(Parser)]
#[command(
    name = "saga-shop",
    version,
    about = "The reference place-order saga, one service per process"
)]
struct Cli {
    #[command(subcommand)]
    service: Service,
}

#[derive(Subcommand)]
enum Service {
    /// The orchestrator: reads the participants' replies, fires the saga deadlines, confirms
    /// or cancels orders.
    Orders {
        #[command(flatten)]
        service: ServiceArgs,
        /// How long a participant may take to reply before its command is sent again.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        reply_timeout: Duration,
    },
    /// Reserves and releases stock.
    Inventory {
        #[command(flatten)]
        service: ServiceArgs,
    },
    /// Charges the payment provider, refunds.
    Payments {
        #[command(flatten)]
        service: ServiceArgs,
        /// The payment provider's base URL.
        #[arg(long, env = "PAYMENT_PROVIDER_URL")]
        provider_url: Url,
        /// How long one call to the provider may take before it counts as ambiguous.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        provider_timeout: Duration,
    },
}

fn main() -> std::process::ExitCode {
    // `<VAR>_FILE` (DATABASE_URL_FILE, ...) before anything reads the environment; then the
    // runtime.
    handoff_telemetry::secrets::run_main(async_main)
}

async fn async_main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn,async_nats=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // HANDOFF_DATABASE_URL and HANDOFF_NATS_URL, or the older names when they are not set.
    let matches = handoff_telemetry::env::with_fallbacks(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Logs how the service reaches its database: behind a transaction pooler everything it sends
/// goes unnamed, in transactions.
fn announce(service: &str, pooling: handoff_postgres::Pooling) {
    tracing::info!(service, %pooling, "saga-shop service running");
}

async fn run(cli: Cli) -> Result<()> {
    // Installed first: a SIGTERM during start-up stops the service cleanly.
    let signal = service::shutdown_signal()?;
    let running = match cli.service {
        Service::Orders {
            service,
            reply_timeout,
        } => {
            let (pool, pooling) = service::connect(&service).await?;
            let tables = Tables {
                create: orders::TABLES,
                names: orders::TABLE_NAMES,
            };
            service::prepare(&pool, pooling, tables).await?;
            let orchestrator = Orchestrator::new(
                OrchestratorConfig {
                    pooling,
                    ..OrchestratorConfig::default()
                },
                [saga_shop::definition(reply_timeout)],
                orders::Hooks { pooling },
            )?;
            let handler = orchestrator.clone();
            let mut running = service::start(
                &service,
                &pool,
                pooling,
                "orders",
                REPLY_AGGREGATE_TYPE,
                handler,
            )
            .await?;
            let stopped = running.stopped();
            running.spawn(async move { orchestrator.run(pool, stopped).await });
            announce("orders", pooling);
            running
        }
        Service::Inventory { service } => {
            let (pool, pooling) = service::connect(&service).await?;
            let tables = Tables {
                create: inventory::TABLES,
                names: inventory::TABLE_NAMES,
            };
            service::prepare(&pool, pooling, tables).await?;
            let participant = inventory::Inventory { pooling };
            let handler = SagaParticipant::new("inventory", Schema::default(), participant)?
                .with_pooling(pooling);
            let running = service::start(
                &service,
                &pool,
                pooling,
                "inventory",
                "inventory-commands",
                handler,
            )
            .await?;
            announce("inventory", pooling);
            running
        }
        Service::Payments {
            service,
            provider_url,
            provider_timeout,
        } => {
            let (pool, pooling) = service::connect(&service).await?;
            let tables = Tables {
                create: payments::TABLES,
                names: payments::TABLE_NAMES,
            };
            service::prepare(&pool, pooling, tables).await?;
            let participant =
                payments::Payments::new(&provider_url, provider_timeout, 3)?.with_pooling(pooling);
            let handler = SagaParticipant::new("payments", Schema::default(), participant)?
                .with_pooling(pooling);
            let running = service::start(
                &service,
                &pool,
                pooling,
                "payments",
                "payments-commands",
                handler,
            )
            .await?;
            announce("payments", pooling);
            running
        }
    };
    println!("ready");
    signal.await;
    tracing::info!("stopping");
    running.stop().await;
    Ok(())
}
