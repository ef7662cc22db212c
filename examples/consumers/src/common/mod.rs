//! What the reference consumers (`inventory`, `payments`) share: their flags, their logging, and
//! [`run`], which migrates the consumer's own database, subscribes to the order events and runs
//! a [`Consumer`] until SIGTERM or SIGINT.
//!
//! Start-up is deliberately strict: an unreachable PostgreSQL or NATS, or a configuration the
//! consumer library refuses, ends the process with one `error: ...` line and exit status 1, so
//! a supervisor restarts it and an operator reads why. Once running, failures are the
//! consumer's business (retries, redeliveries, quarantine).//!
//! One concern per file: the flags (`args.rs`), [`RunError`] (`error.rs`), logging and exit
//! codes (`logging.rs`), the consumer's database (`database.rs`: migrations, dedup purge), the
//! `--broker` it consumes from (`broker.rs`) and the metrics and probes endpoint
//! (`observe.rs`); this file runs them in order. Every public item is reachable from
//! `common::`.

use std::time::Duration;

use handoff_consumer::{Consumer, Handler};
use handoff_postgres::{bounded_release, Inbox, Migrator, Pooling};
use sqlx::postgres::PgPoolOptions;
use tracing::info;

mod args;
mod broker;
mod database;
mod error;
mod logging;
mod observe;

pub use args::{parse_args, CommonArgs, GapPolicyArg};
pub use broker::BrokerArgs;
pub use database::{Context, OwnTables};
pub use error::RunError;
pub use logging::{exit_code, init_logging, init_telemetry};

use database::{detect_pooling, migrate, purge_dedup_rows, RELEASE_CHECK};
use logging::redact;
use observe::install_metrics;

/// The aggregate type whose events the reference consumers take: they subscribe to
/// `<subject-prefix>.order.*`.
pub const AGGREGATE_TYPE: &str = order_service::events::AGGREGATE_TYPE;

/// Runs a reference consumer until SIGTERM or SIGINT:
///
/// 1. checks the configuration (before touching anything);
/// 2. serves metrics and the `/healthz` and `/readyz` probes when `--metrics-addr` is set;
/// 3. connects to PostgreSQL, applies handoff's migrations (the inbox tables) and then `own`;
/// 4. builds the handler with `make_handler`;
/// 5. subscribes at the `--broker` (for NATS: creates or opens the durable consumer);
/// 6. prints `consuming <stream> as <consumer-name>` on stdout (the topic or queue for other
///    brokers), and runs.
///
/// `connections_per_event` is how many pooled connections applying one event may hold at once
/// (1, plus 1 for a handler that records outside calls on their own connections).
///
/// # Errors
///
/// [`RunError`] when the consumer cannot start; once it runs, it only stops on a signal.
///
/// # Cancel safety
///
/// As [`Consumer::run`]: dropping the future aborts the events being applied (their
/// transactions roll back, the broker redelivers them).
pub async fn run<H, F>(
    args: &CommonArgs,
    own: OwnTables,
    connections_per_event: u32,
    make_handler: F,
) -> Result<(), RunError>
where
    H: Handler,
    F: FnOnce(&Context) -> H,
{
    let mut config = args.consumer_config()?;
    config.validate()?;
    if args.ack_wait < Duration::from_secs(1) {
        return Err(RunError::InvalidFlag {
            flag: "--ack-wait",
            reason: format!(
                "{} is shorter than 1s",
                humantime::format_duration(args.ack_wait)
            ),
        });
    }
    let options = handoff_postgres::connect_options(&args.database_url)
        .map_err(|e| RunError::DatabaseUrl(redact(&e.to_string())))?
        .application_name(&config.name);
    let pooling = detect_pooling(&options).await?;
    config.pooling = pooling;
    let migrators = [
        Migrator::handoff(config.schema.clone()),
        Migrator::new(config.schema.clone(), own.history_table, own.migrations),
    ];
    // Kept for the whole run: dropping it stops the endpoint.
    let _endpoint = match args.metrics_addr {
        Some(addr) => Some(install_metrics(addr, &options, migrators).await?),
        None => None,
    };

    // Work abandoned at the apply timeout leaves its transaction open on the server when the
    // connection went silent, holding the aggregate's row locks, so the redelivery would block
    // behind it; the server ends such a session itself once it idles that long in a transaction.
    // A pooler refuses (or drops) startup options: there its own idle_transaction_timeout
    // plays this part (docs/poolers.md).
    let idle_limit = format!("{}ms", args.apply_timeout.as_millis());
    let options = match pooling {
        Pooling::Session => {
            options.options([("idle_in_transaction_session_timeout", idle_limit.as_str())])
        }
        _ => {
            info!("DATABASE_URL goes through a connection pooler: statements go unnamed, each in a transaction");
            options
        }
    };
    migrate(&options, &config.schema, own, pooling).await?;
    let per_event = u32::try_from(config.max_concurrency)
        .unwrap_or(u32::MAX)
        .saturating_mul(connections_per_event.max(1));
    // Beyond the events being applied: one for quarantine writes, one for the dedup purge.
    // Abandoned work (the apply timeout) hands back connections that may never answer again:
    // the bounded release check closes them instead of letting them hold pool slots.
    let pool = bounded_release(
        PgPoolOptions::new()
            .max_connections(per_event.saturating_add(2))
            .acquire_timeout(Duration::from_secs(10)),
        RELEASE_CHECK,
    )
    .connect_lazy_with(options);
    let inbox = Inbox::new(config.schema.clone(), &config.name)?.with_pooling(pooling);
    let context = Context {
        pool: pool.clone(),
        schema: config.schema.clone(),
        inbox: inbox.clone(),
        pooling,
    };
    let handler = make_handler(&context);
    let dedup_retention = config.dedup_retention;
    let consumer = Consumer::new(config, pool.clone(), handler)?;

    tokio::spawn(purge_dedup_rows(pool, inbox, dedup_retention));
    broker::consume(args, &consumer).await
}
