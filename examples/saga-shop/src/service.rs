//! What every saga-shop service runs: its database (handoff's tables and its own), a relay for
//! its outbox, and one consumer; the orders service also runs the orchestrator's deadlines.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use handoff_consumer::{Consumer, ConsumerConfig, Handler};
use handoff_nats::{IntakeConfig, JetStreamConfig, JetStreamIntake, JetStreamTransport};
use handoff_postgres::{MigrateError, Migrator, PollingConfig, PollingSource, Pooling, Schema};
use handoff_relay::{Relay, RelayConfig};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Where a service's database and broker are.
#[derive(clap::Args, Debug, Clone)]
pub struct ServiceArgs {
    /// The service's own database.
    #[arg(
        long,
        env = "HANDOFF_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub database_url: String,
    /// The NATS server.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    /// The JetStream stream every service publishes to.
    #[arg(long, env = "SHOP_STREAM", default_value = "SHOP")]
    pub stream: String,
    /// The subject prefix.
    #[arg(long, env = "SHOP_PREFIX", default_value = "shop")]
    pub subject_prefix: String,
    /// The relay's lease: after a crash, the restarted relay takes the crashed one's events
    /// over once it ends. A publish is not started in the last half of it.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub lease: Duration,
    /// Serve Prometheus metrics (relay, consumer, and for orders the sagas' `handoff_sagas`
    /// and `handoff_saga_transitions_total`) at http://ADDR/metrics.
    #[arg(long, env = "SHOP_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
}

/// One running service.
pub struct Running {
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Running {
    /// A future that completes when the service is told to stop.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut stopped = self.stop.subscribe();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    }

    /// Runs `task` until the service stops.
    pub fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Stops everything and waits for it.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
    }
}

/// A service's own tables: the idempotent DDL that creates them, and their names.
#[derive(Debug, Clone, Copy)]
pub struct Tables {
    /// `CREATE TABLE IF NOT EXISTS ...`, run at start on a direct connection.
    pub create: &'static str,
    /// The tables `create` makes, checked at start behind a connection pooler.
    pub names: &'static [&'static str],
}

/// Connects to the service's database and tells whether `HANDOFF_DATABASE_URL` goes through a
/// connection pooler ([`Pooling::detect`]): behind one (PgBouncer in transaction mode) every
/// statement must go unnamed and inside a transaction, which the returned [`Pooling`] says to
/// everything the service builds on the pool.
///
/// # Errors
///
/// When the URL is invalid or the database cannot be reached.
pub async fn connect(args: &ServiceArgs) -> Result<(PgPool, Pooling)> {
    if let Some(addr) = args.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("while serving metrics on {addr}"))?;
    }
    let options = handoff_postgres::connect_options(&args.database_url)
        .context("invalid HANDOFF_DATABASE_URL")?;
    let pooling = Pooling::detect(&options)
        .await
        .context("while checking whether HANDOFF_DATABASE_URL goes through a connection pooler")?;
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(5))
        // libpq's reading of sslmode and sslrootcert (see handoff_postgres::connect_options).
        .connect_with(options)
        .await
        .context("while connecting to PostgreSQL (check HANDOFF_DATABASE_URL)")?;
    Ok((pool, pooling))
}

/// Sets the database up: on a direct connection, migrates handoff's tables and creates
/// `tables`. Behind a connection pooler it only checks them: migrations need a session of
/// their own, which a transaction pooler does not give.
///
/// # Errors
///
/// Behind a pooler, when handoff's migrations are pending or one of `tables` is missing,
/// saying to set the database up over a direct connection; any database error.
pub async fn prepare(pool: &PgPool, pooling: Pooling, tables: Tables) -> Result<()> {
    let migrator = Migrator::handoff(Schema::default());
    if pooling == Pooling::Session {
        migrator.run(&mut *pool.acquire().await?).await?;
        sqlx::raw_sql(tables.create).execute(pool).await?;
        return Ok(());
    }
    // Migrator::check runs unnamed in a transaction of its own: safe through the pooler.
    match migrator.check(&mut *pool.acquire().await?).await {
        Ok(_) => {}
        // Pending migrations: say that they need a direct connection, not just "behind".
        Err(MigrateError::Behind { .. }) => return Err(MigrateError::ThroughPooler.into()),
        Err(error) => return Err(error.into()),
    }
    let mut tx = pool.begin().await?;
    let missing: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM unnest($1::text[]) AS name WHERE to_regclass(name) IS NULL",
    )
    .persistent(false)
    .bind(tables.names)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    if !missing.is_empty() {
        anyhow::bail!(
            "the service's tables {} are missing, and HANDOFF_DATABASE_URL goes through a connection \
             pooler (such as PgBouncer in transaction mode), where saga-shop does not create \
             them: start this service once with HANDOFF_DATABASE_URL pointing at PostgreSQL itself \
             (it migrates and creates its tables at start)",
            missing.join(", ")
        );
    }
    Ok(())
}

/// Starts the relay of the service's outbox on `pool` and a consumer named `name` of the
/// `<prefix>.<aggregate_type>.>` subjects with `handler`, their statements sent as `pooling`
/// requires. The database must be [`prepare`]d.
///
/// Behind a transaction pooler the relay cannot `LISTEN` for new events and polls every second
/// instead.
///
/// # Errors
///
/// When the broker cannot be reached or set up, or a setting is refused.
pub async fn start<H: Handler>(
    args: &ServiceArgs,
    pool: &PgPool,
    pooling: Pooling,
    name: &str,
    aggregate_type: &str,
    handler: H,
) -> Result<Running> {
    let transport = JetStreamTransport::connect(
        &args.nats_url,
        JetStreamConfig {
            stream: args.stream.clone(),
            subject_prefix: args.subject_prefix.clone(),
            ..JetStreamConfig::default()
        },
    )
    .await
    .context("while connecting to NATS (check NATS_URL)")?;
    transport.ensure_stream().await?;
    let source = PollingSource::new(
        pool.clone(),
        PollingConfig {
            relay_id: format!("saga-shop-{name}-{}", std::process::id()),
            lease: args.lease,
            pooling,
            ..PollingConfig::default()
        },
    )?;
    let relay = Relay::new(
        source,
        transport,
        RelayConfig {
            // The default margin (10 s) is for the default 30 s lease: a publish must never
            // start when its lease could end before the broker answers.
            lease_margin: args.lease / 2,
            ..RelayConfig::default()
        },
    )?;
    let intake = JetStreamIntake::connect(
        &args.nats_url,
        IntakeConfig {
            stream: args.stream.clone(),
            subject_prefix: args.subject_prefix.clone(),
            durable_name: name.to_owned(),
            filter_subject: Some(format!("{}.{aggregate_type}.>", args.subject_prefix)),
            ack_wait: Duration::from_secs(15),
            ..IntakeConfig::default()
        },
    )
    .await?;
    let config = ConsumerConfig {
        name: name.to_owned(),
        retry_backoff: handoff_core::Backoff {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(2),
        },
        // A payment provider that keeps timing out must not land a charge in the quarantine.
        max_deliveries: 1000,
        pooling,
        // One event per transaction: the participants update shared rows (the stock levels
        // every order reserves from) or call the payment provider, and concurrent batches
        // would take those rows' locks in different orders and deadlock (BatchConfig's
        // trade-off).
        batch: None,
        ..ConsumerConfig::default()
    };
    let consumer = Consumer::new(config, pool.clone(), handler)?;

    let (stop, _) = watch::channel(false);
    let mut running = Running {
        stop,
        tasks: JoinSet::new(),
    };
    let stopped = running.stopped();
    running.spawn(async move {
        relay.run(stopped).await;
    });
    let stopped = running.stopped();
    running.spawn(async move { consumer.run(intake, stopped).await });
    Ok(running)
}

/// Completes on SIGTERM or SIGINT.
///
/// # Errors
///
/// When the handlers cannot be installed.
pub fn shutdown_signal() -> Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
