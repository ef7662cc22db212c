//! `handoff-test`: support for handoff's integration tests (not published).
//!
//! - [`TestDb`]: a fresh schema per test in the real PostgreSQL named by `DATABASE_URL`
//!   (default `postgres://postgres@127.0.0.1:5432/test`), so tests run in parallel without
//!   sharing rows; dropped (with everything in it) when the test ends.
//! - [`factory`]: events and catalogs for tests, instead of hand-written rows.
//! - [`conformance`]: the transport conformance suite every destination runs.
//! - [`intake_conformance`]: the intake conformance suite every intake (consumer side) runs.
//! - [`source_conformance`]: the source conformance suite every relay source (polling, log,
//!   logical) runs.
//! - [`counting`]: [`counting::CountingSource`], a decorator that counts a relay's calls to a
//!   real source (claims, marks, errors).
//! - [`faults`]: [`faults::Faulty`], the fault-injecting decorator around a real transport.
//! - [`inbox`] (feature `inbox`): a consumer under test on any intake, recording each
//!   application of an effect.
//! - [`nats`] (feature `nats`): the shared NATS server's URL, a private `nats-server` to stop
//!   and kill, and reading a stream back.
//! - [`rabbitmq`]: a private RabbitMQ node, for tests that raise its memory alarm or change its
//!   limits without touching the shared broker.
//! - [`redis`] (feature `redis`): the local Redis's URL, a stream key of the test's own, and
//!   reading a stream back.
//! - [`tansu`]: a private tansu broker (Kafka protocol) for the Kafka destination's tests.
//! - [`pgbouncer`]: a private PgBouncer in transaction pooling mode, and a database of its own
//!   for a test behind it.
//! - [`process`]: SIGTERM to a child process, sent once it handles it (not before its
//!   handler is installed, when the signal would kill it outright).
//! - [`proxy`]: a loopback TCP proxy with network faults (delay, cut, black hole, refusal).
//! - [`tls`]: a throwaway certificate authority with server and client certificates.
//! - `browser` (feature `browser`): a chromedriver on a free port and a WebDriver client, for
//!   the console's tests in a real browser.
//! - [`free_port`]: the one way a test picks a loopback port for a server of its own.
//! - [`eventually`]: the one way a test waits for a condition (no sleeps, no home-made deadline
//!   loops), and [`pending_rows`]: the one query for the outbox rows not yet published.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

#[cfg(feature = "browser")]
pub mod browser;
pub mod cluster;
pub mod conformance;
pub mod counting;
pub mod factory;
pub mod faults;
#[cfg(feature = "inbox")]
pub mod inbox;
pub mod intake_conformance;
#[cfg(feature = "nats")]
pub mod nats;
pub mod pgbouncer;
pub mod process;
pub mod proxy;
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
pub mod source_conformance;
pub mod tansu;
pub mod tls;
mod wait;

pub use wait::{eventually, pending_rows, OnTimeout, Outcome, Verbatim, POLL_INTERVAL};

/// The server tests run against when `DATABASE_URL` is not set.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The base URL for tests.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// A schema of its own for one test, with a pool whose connections use it as `search_path`.
///
/// Everything a test creates without naming a schema lands in it; dropping the `TestDb` drops the
/// schema.
pub struct TestDb {
    /// Connections whose `search_path` is this test's schema.
    pub pool: PgPool,
    schema: String,
    options: PgConnectOptions,
    /// The database URL the schema lives in.
    url: String,
}

impl TestDb {
    /// As [`new`](Self::new), with handoff's migrations applied in the schema.
    ///
    /// # Panics
    ///
    /// When PostgreSQL is unreachable or a migration fails.
    pub async fn migrated(name: &str) -> Self {
        let db = Self::new(name).await;
        let mut conn = db.pool.acquire().await.unwrap();
        handoff_postgres::Migrator::handoff(handoff_postgres::Schema::default())
            .run(&mut conn)
            .await
            .unwrap();
        drop(conn);
        db
    }

    /// Creates the schema `t_<name>_<pid>_<n>` (the name sanitised and shortened).
    ///
    /// # Panics
    ///
    /// When PostgreSQL is unreachable: a test cannot go on without it.
    pub async fn new(name: &str) -> Self {
        Self::with_pool_size(name, 20).await
    }

    /// As [`new`](Self::new), with at most `max_connections` pooled connections.
    pub async fn with_pool_size(name: &str, max_connections: u32) -> Self {
        Self::create(&database_url(), name, max_connections).await
    }

    /// As [`new`](Self::new), in the database `url` names instead of `DATABASE_URL`'s (for a
    /// test that needs a database of its own, such as one that reads per-database statistics).
    pub async fn in_database(url: &str, name: &str) -> Self {
        Self::create(url, name, 20).await
    }

    async fn create(url: &str, name: &str, max_connections: u32) -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let clean = sanitize(name, 40);
        let schema = format!(
            "t_{clean}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let base = PgConnectOptions::from_str(url)
            .expect("DATABASE_URL is a valid PostgreSQL URL")
            .disable_statement_logging();
        let mut admin = PgConnection::connect_with(&base)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {url} is unreachable: {e}"));
        sqlx::raw_sql(&format!(
            "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE; CREATE SCHEMA \"{schema}\""
        ))
        .execute(&mut admin)
        .await
        .expect("create the test schema");
        let options = base.options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(options.clone())
            .await
            .expect("connect the test pool");
        Self {
            pool,
            schema,
            options,
            url: url.to_owned(),
        }
    }

    /// The schema's name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// Connect options that select this schema, for a connection outside the pool.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// A URL that selects this schema, for a child process that reads `DATABASE_URL`.
    pub fn url(&self) -> String {
        let base = &self.url;
        let sep = if base.contains('?') { '&' } else { '?' };
        format!("{base}{sep}options=-c%20search_path%3D{}", self.schema)
    }

    /// The outbox rows of this schema not yet published: [`pending_rows`] on the pool.
    pub async fn pending_rows(&self) -> i64 {
        let schema = handoff_postgres::Schema::named(self.schema.as_str())
            .expect("a test schema's name is a plain identifier");
        pending_rows(&self.pool, &schema).await
    }

    /// Enqueues `event` through `outbox` in a transaction of its own, committed.
    ///
    /// # Panics
    ///
    /// When the enqueue or the commit fails.
    pub async fn enqueue_alone(
        &self,
        outbox: &handoff_postgres::Outbox,
        event: handoff_core::NewEvent,
    ) {
        let mut tx = self.pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, &[event])
            .await
            .unwrap_or_else(|e| panic!("enqueue: {e}"));
        tx.commit().await.unwrap();
    }

    /// `SELECT count(*)` of a table in this schema.
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\".{table}", self.schema))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("count {table}: {e}"))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime, which cannot be blocked on; a short-lived thread
        // with its own runtime does the async cleanup and is joined so the schema is gone when
        // the test returns.
        let schema = self.schema.clone();
        let options = self.options.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio_runtime();
            runtime.block_on(async move {
                if let Ok(mut conn) = PgConnection::connect_with(&options).await {
                    // A session the test left idle in a transaction (a handler's future
                    // cancelled mid-transaction, its connection back in the test's pool, which
                    // is still open here) keeps its locks in the schema, and the DROP waited
                    // for it for ever. So the DROP waits 10 s at most; then the sessions holding
                    // locks on the schema's relations are ended and the DROP runs again.
                    let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
                    let _ = sqlx::raw_sql("SET lock_timeout = '10s'")
                        .execute(&mut conn)
                        .await;
                    if sqlx::raw_sql(&drop).execute(&mut conn).await.is_err() {
                        let _ = sqlx::query(
                            "SELECT pg_terminate_backend(l.pid)
                             FROM pg_locks l
                             JOIN pg_class c ON c.oid = l.relation
                             JOIN pg_namespace n ON n.oid = c.relnamespace
                             WHERE n.nspname = $1 AND l.pid <> pg_backend_pid()
                             GROUP BY l.pid",
                        )
                        .bind(&schema)
                        .execute(&mut conn)
                        .await;
                        let _ = sqlx::raw_sql(&drop).execute(&mut conn).await;
                    }
                }
            });
        })
        .join();
    }
}

/// `name` lowercased, reduced to `[a-z0-9_]` (anything else becomes `_`) and cut to `max`
/// characters: a piece of a schema, stream or subject name made from a test's name.
pub(crate) fn sanitize(name: &str, max: usize) -> String {
    let mut clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    clean.truncate(max);
    clean
}

fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("build a cleanup runtime")
}

/// A loopback port that was free a moment ago: bind port 0, read the port, release it.
///
/// Another process may take it before the caller's server binds it; servers started by this
/// crate pick again when their bind fails with "address in use".
///
/// # Errors
///
/// When no loopback socket can be bound.
///
/// # Examples
///
/// ```
/// let port = handoff_test::free_port()?;
/// assert_ne!(port, 0);
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn free_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// A name for one test's stream and subject prefix, unique across parallel test processes:
/// `t_<prefix>_<16 hex digits>`, with `prefix` lowercased, reduced to `[a-z0-9_]` and cut to 32
/// characters.
///
/// It is valid both as a JetStream stream name and as one subject token, so a test can use the
/// same string for both.
///
/// # Examples
///
/// ```
/// let name = handoff_test::unique_name("Publish & read");
/// assert!(name.starts_with("t_publish___read_"));
/// assert_ne!(name, handoff_test::unique_name("Publish & read"));
/// ```
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let clean = crate::sanitize(prefix, 32);
    // A process-random hasher over pid, counter and time: unique within a process by the
    // counter, across processes by the pid and the random keys.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let hash = RandomState::new().hash_one((
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        nanos,
    ));
    format!("t_{clean}_{hash:016x}")
}
