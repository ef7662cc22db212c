//! Where the demo's data lives: a fresh database on the PostgreSQL the user already runs, or on
//! a private throwaway server when none is reachable.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use handoff_test::cluster::PrivatePostgres;
use reqwest::Url;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// The server tried when `HANDOFF_DATABASE_URL` is not set.
const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How long to wait for a server before calling it unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The demo's own database, removed by [`remove`](Self::remove).
pub struct DemoDatabase {
    /// `handoff_demo_<pid>`.
    name: String,
    /// A URL of the server's maintenance database, to drop ours from.
    admin_url: String,
    /// The URL of our database, for the service and for reading the outbox.
    url: String,
    /// `handoff_demo_<pid>_<role>`: the databases of the consumers and the payment provider,
    /// next to ours on the same server, each listed here before it is created.
    siblings: Vec<String>,
    /// The task running CREATE DATABASE, while it runs.
    creating: Option<tokio::task::JoinHandle<Result<bool>>>,
    /// Connections to our database, once it exists.
    pool: Option<PgPool>,
    /// The private server, when we started one; stopping it removes everything.
    private: Option<PrivatePostgres>,
}

/// Why the first server could not be used.
enum Unusable {
    /// Nothing answered: start a private server instead.
    Unreachable(String),
    /// Something answered and refused; falling back would hide the user's problem.
    Refused(anyhow::Error),
}

impl DemoDatabase {
    /// Connects to `HANDOFF_DATABASE_URL` (or the local default), or starts a private server, and
    /// creates the database `handoff_demo_<pid>` on it. Returns its URL and a pool.
    ///
    /// The database is put in `slot` before it is created, so that an interruption at any
    /// point still leads to its removal ([`remove`](Self::remove) drops it if it exists).
    pub async fn prepare(slot: &mut Option<DemoDatabase>) -> Result<(String, PgPool)> {
        let explicit = handoff_telemetry::env::var("HANDOFF_DATABASE_URL");
        let base = explicit.clone().unwrap_or_else(|| DEFAULT_URL.to_owned());
        let shown = redacted(&base);
        let name = format!("handoff_demo_{}", std::process::id());

        let (admin, database) = match connect(&base).await {
            Ok(admin) => {
                println!("   using the server at {shown}");
                let url = with_database(&base, &name)?;
                let database = Self {
                    name,
                    admin_url: base,
                    url,
                    siblings: Vec::new(),
                    creating: None,
                    pool: None,
                    private: None,
                };
                (admin, slot.insert(database))
            }
            // An explicit URL that answers but refuses (bad password, missing database) is the
            // user's to fix. With the default URL, any failure means "no usable local server".
            Err(Unusable::Refused(error)) if explicit.is_some() => {
                return Err(error.context(format!(
                    "while connecting to HANDOFF_DATABASE_URL ({shown})"
                )));
            }
            Err(Unusable::Refused(error)) => {
                Self::start_private(slot, &shown, &format!("{error:#}"), name).await?
            }
            Err(Unusable::Unreachable(reason)) => {
                Self::start_private(slot, &shown, &reason, name).await?
            }
        };
        // CREATE DATABASE runs in its own task, and `remove` waits for it: were the demo
        // interrupted mid-statement, the server could otherwise commit the database after our
        // cleanup had looked for it.
        let handle = database
            .creating
            .insert(tokio::spawn(create(admin, database.name.clone())));
        let created = handle.await;
        database.creating = None;
        let created = created.context("the task creating the database failed")??;
        if !created {
            let name = database.name.clone();
            let server = redacted(&database.admin_url);
            // Not ours: forget it rather than drop it at exit.
            *slot = None;
            bail!(
                "the database {name} already exists on {server}, left by an earlier run; drop \
                 it with: psql -c 'DROP DATABASE {name}'"
            );
        }
        let pool = pool(&database.url).await?;
        database.pool = Some(pool.clone());
        println!(
            "   created the database {} (removed again at exit)",
            database.name
        );
        Ok((database.url.clone(), pool))
    }

    /// `handoff_demo_<pid>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates the database `<ours>_<role>` on the same server, for another service of the
    /// demo (a consumer, the payment provider), and returns its URL. It is dropped at exit with
    /// ours, or goes with the private server.
    pub async fn create_sibling(&mut self, role: &str) -> Result<String> {
        let name = format!("{}_{role}", self.name);
        let url = with_database(&self.admin_url, &name)?;
        let admin = connect(&self.admin_url).await.map_err(|e| match e {
            Unusable::Unreachable(reason) => {
                anyhow::anyhow!("the server is not reachable: {reason}")
            }
            Unusable::Refused(error) => error,
        })?;
        // Listed before it is created: `remove` drops it if it exists, and waits for `creating`
        // (see `prepare` on why).
        self.siblings.push(name.clone());
        let handle = self
            .creating
            .insert(tokio::spawn(create(admin, name.clone())));
        let created = handle.await;
        self.creating = None;
        let created = created.context("the task creating the database failed")??;
        if !created {
            // Not ours: forget it rather than drop it at exit.
            self.siblings.retain(|sibling| *sibling != name);
            bail!(
                "the database {name} already exists on {}, left by an earlier run; drop it \
                 with: psql -c 'DROP DATABASE {name}'",
                redacted(&self.admin_url)
            );
        }
        Ok(url)
    }

    /// Starts a private server, puts it in `slot` and connects to its maintenance database.
    async fn start_private<'a>(
        slot: &'a mut Option<DemoDatabase>,
        shown: &str,
        reason: &str,
        name: String,
    ) -> Result<(PgConnection, &'a mut DemoDatabase)> {
        println!(
            "   PostgreSQL not reachable at {shown} ({reason});\n   starting a private throwaway \
             server in {}/...",
            std::env::temp_dir().display()
        );
        // If we are interrupted meanwhile, the blocking task still finishes and drops the server,
        // which stops it.
        let server = tokio::task::spawn_blocking(PrivatePostgres::start)
            .await
            .context("the task starting the private server failed")?
            .context("while starting a private PostgreSQL server")?;
        println!(
            "   private server ready on 127.0.0.1:{}, data in {} (removed at exit)",
            server.port(),
            server.dir().display()
        );
        let database = slot.insert(Self {
            admin_url: server.url("postgres"),
            url: server.url(&name),
            name,
            siblings: Vec::new(),
            creating: None,
            pool: None,
            private: Some(server),
        });
        let admin = connect(&database.admin_url).await.map_err(|e| match e {
            Unusable::Unreachable(reason) => {
                anyhow::anyhow!("the private server is not reachable: {reason}")
            }
            Unusable::Refused(error) => error.context("while connecting to the private server"),
        })?;
        Ok((admin, database))
    }

    /// Drops the database, or stops the private server and removes its directory. Reports
    /// problems instead of failing: it runs at exit.
    pub async fn remove(self) {
        if let Some(creating) = self.creating {
            let _ = tokio::time::timeout(Duration::from_secs(30), creating).await;
        }
        if let Some(pool) = &self.pool {
            pool.close().await;
        }
        if let Some(server) = self.private {
            let dir = server.dir().to_owned();
            match tokio::task::spawn_blocking(move || server.stop()).await {
                Ok(Ok(())) => println!(
                    "cleaned up: stopped the private PostgreSQL server, removed {}",
                    dir.display()
                ),
                Ok(Err(error)) => eprintln!("warning: while stopping the private server: {error}"),
                Err(error) => eprintln!("warning: while stopping the private server: {error}"),
            }
            return;
        }
        // The siblings first: nothing refers to them, and ours is the one named in errors.
        let names: Vec<&str> = self
            .siblings
            .iter()
            .map(String::as_str)
            .chain([self.name.as_str()])
            .collect();
        let dropped = async {
            let mut dropped = Vec::new();
            let mut admin = match PgConnection::connect(&self.admin_url).await {
                Ok(admin) => admin,
                Err(error) => return Err((error, dropped)),
            };
            for name in &names {
                // The name is generated by us (letters, digits, underscores), never user input,
                // so quoting it as an identifier is safe; identifiers cannot be bound parameters.
                let drop =
                    sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                        .execute(&mut admin)
                        .await;
                if let Err(error) = drop {
                    return Err((error, dropped));
                }
                dropped.push(*name);
            }
            let _ = admin.close().await;
            Ok(dropped)
        };
        match dropped.await {
            Ok(_) if self.siblings.is_empty() => {
                println!("cleaned up: dropped the database {}", self.name)
            }
            // `handoff_demo_1, handoff_demo_1_{inventory,payments}`: shorter than every name.
            Ok(_) => println!(
                "cleaned up: dropped the databases {0}, {0}_{{{1}}}",
                self.name,
                self.siblings
                    .iter()
                    .map(|s| s.strip_prefix(&format!("{}_", self.name)).unwrap_or(s))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Err((error, dropped)) => {
                let left: Vec<&str> = names
                    .iter()
                    .filter(|name| !dropped.contains(name))
                    .copied()
                    .collect();
                eprintln!(
                    "warning: could not drop the database(s) {} ({error}); drop them by hand",
                    left.join(", ")
                );
            }
        }
    }
}

async fn connect(url: &str) -> Result<PgConnection, Unusable> {
    let options = PgConnectOptions::from_str(url)
        .map_err(|e| Unusable::Refused(anyhow::Error::new(e).context("invalid PostgreSQL URL")))?
        .disable_statement_logging();
    match tokio::time::timeout(CONNECT_TIMEOUT, options.connect()).await {
        Err(_) => Err(Unusable::Unreachable(format!(
            "no answer within {}s",
            CONNECT_TIMEOUT.as_secs()
        ))),
        Ok(Err(sqlx::Error::Io(error))) => Err(Unusable::Unreachable(error.to_string())),
        // sqlx repeats its source in its own message: keep the message only.
        Ok(Err(error)) => Err(Unusable::Refused(anyhow::anyhow!("{error}"))),
        Ok(Ok(conn)) => Ok(conn),
    }
}

/// Creates the database `name`; `false` when it already exists.
async fn create(mut admin: PgConnection, name: String) -> Result<bool> {
    // See `remove` on why formatting the generated name into the statement is safe.
    let sql = format!("CREATE DATABASE \"{name}\"");
    let created = sqlx::query(&sql)
        .persistent(false)
        .execute(&mut admin)
        .await;
    let _ = admin.close().await;
    match created {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => Ok(false),
        Err(error) => bail!("while creating the database {name}: {error}"),
    }
}

/// A small pool on `url`: the demo's reads are few and sequential.
pub async fn pool(url: &str) -> Result<PgPool> {
    let options = PgConnectOptions::from_str(url)?.disable_statement_logging();
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| anyhow::anyhow!("while connecting to the demo database: {e}"))
}

/// `base` with its database (the URL path) replaced by `name`; query parameters are kept.
fn with_database(base: &str, name: &str) -> Result<String> {
    let mut url = Url::parse(base).context("DATABASE_URL is not a URL")?;
    url.set_path(&format!("/{name}"));
    Ok(url.into())
}

/// `url` with any password replaced, for printing.
fn redacted(url: &str) -> String {
    match Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            // Cannot fail: a URL with a password has a host.
            let _ = parsed.set_password(Some("***"));
            parsed.into()
        }
        Ok(parsed) => parsed.into(),
        Err(_) => "(an unparsable URL)".to_owned(),
    }
}
