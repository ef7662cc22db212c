//! Flags the operator commands share, and the parsing of times they accept.

use std::str::FromStr;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use handoff_postgres::{Migrator, Pooling, Schema};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

/// Where handoff's tables are.
#[derive(clap::Args, Clone)]
#[command(next_help_heading = "Database")]
pub struct DatabaseArgs {
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
    pub database_url: String,
    /// Schema of handoff's tables [default: search_path].
    ///
    /// Without it, the connection's search_path (usually `public`).
    #[arg(long, env = "HANDOFF_SCHEMA")]
    pub schema: Option<String>,
}

impl DatabaseArgs {
    /// The configured schema, checked.
    pub fn schema(&self) -> Result<Schema> {
        Ok(match &self.schema {
            Some(name) => Schema::named(name.clone())?,
            None => Schema::default(),
        })
    }

    /// One connection, named after the command in `pg_stat_activity`.
    pub async fn connect(&self, application: &str) -> Result<PgConnection> {
        let options = self.options(application)?;
        handoff_postgres::check_tls_files(&options)
            .map_err(|e| anyhow::anyhow!("PostgreSQL TLS settings: {e}"))?;
        PgConnection::connect_with(&options).await.map_err(|error| {
            match handoff_postgres::connect_error_kind(&error) {
                handoff_postgres::ConnectErrorKind::Tls => postgres_refused(&options, error),
                _ => anyhow::Error::new(error).context(
                    "while connecting to PostgreSQL (check --database-url / HANDOFF_DATABASE_URL)",
                ),
            }
        })
    }

    /// One connection to a database whose handoff schema is up to date: an operator command on
    /// a database `handoff migrate` has not prepared says so, instead of failing on a missing
    /// table.
    pub async fn connect_migrated(&self, application: &str) -> Result<PgConnection> {
        let mut conn = self.connect(application).await?;
        Migrator::handoff(self.schema()?)
            .check(&mut conn)
            .await
            .context("the outbox schema is not ready (run `handoff migrate` first)")?;
        Ok(conn)
    }

    /// Whether the URL goes through a connection pooler ([`Pooling::detect`]), for commands
    /// whose statements must then go unnamed and in transactions.
    pub async fn pooling(&self, application: &str) -> Result<Pooling> {
        Pooling::detect(&self.options(application)?)
            .await
            .context("while checking whether the database url goes through a connection pooler")
    }

    /// The connection options, for commands that need a pool.
    pub fn options(&self, application: &str) -> Result<PgConnectOptions> {
        Ok(handoff_postgres::connect_options(&self.database_url)
            .map_err(|e| anyhow::anyhow!("invalid database url: {}", redact(&e.to_string())))?
            .application_name(application)
            .log_statements(tracing::log::LevelFilter::Debug))
    }
}

/// The error that ends the command when PostgreSQL refuses the connection for good, on one line
/// (`main` prints the causes joined): a TLS failure says which settings to check.
pub fn postgres_refused(options: &PgConnectOptions, error: sqlx::Error) -> anyhow::Error {
    let (host, port) = (options.get_host(), options.get_port());
    match handoff_postgres::connect_error_kind(&error) {
        handoff_postgres::ConnectErrorKind::Tls => {
            // The innermost cause only ("invalid peer certificate: UnknownIssuer"): sqlx's
            // wrapper repeats it.
            let mut reason: &dyn std::error::Error = &error;
            while let Some(source) = reason.source() {
                reason = source;
            }
            anyhow::anyhow!(
                "TLS with PostgreSQL at {host}:{port} failed, not retrying: {reason} (check \
                 sslmode, sslrootcert and the host name in the database URL)"
            )
        }
        _ => anyhow::Error::new(error).context(format!(
            "PostgreSQL at {host}:{port} refused the connection"
        )),
    }
}

/// An instant given as an RFC 3339 timestamp (`2026-12-04T10:00:00Z`) or as a duration back from
/// now (`15m`, `2h`, `7d`).
///
/// # Examples
///
/// `--since 2h` is two hours before the command started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instant(pub DateTime<Utc>);

impl FromStr for Instant {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(at) = DateTime::parse_from_rfc3339(s) {
            return Ok(Instant(at.with_timezone(&Utc)));
        }
        match humantime::parse_duration(s) {
            Ok(back) => SystemTime::now()
                .checked_sub(back)
                .map(|at| Instant(at.into()))
                .ok_or_else(|| format!("{s} back from now is before the epoch")),
            Err(_) => Err(format!(
                "{s:?} is neither an RFC 3339 timestamp (2026-12-04T10:00:00Z) \
                 nor a duration back from now (15m, 2h, 7d)"
            )),
        }
    }
}

/// A duration flag such as `7d` or `90s`.
pub fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (e.g. 15m, 2h, 7d)"))
}

/// Hides anything between `://` and `@` (user and password) in a message that may quote a URL.
pub fn redact(message: &str) -> String {
    match (message.find("://"), message.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            format!("{}://***{}", &message[..start], &message[at..])
        }
        _ => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_are_timestamps_or_durations_back() {
        let at: Instant = "2026-12-04T10:00:00Z".parse().unwrap();
        assert_eq!(at.0.to_rfc3339(), "2026-12-04T10:00:00+00:00");
        let before = Utc::now();
        let back: Instant = "2h".parse().unwrap();
        let age = before - back.0;
        assert!(age >= chrono::Duration::minutes(119) && age <= chrono::Duration::minutes(121));
        assert!("yesterday".parse::<Instant>().is_err());
        assert!("".parse::<Instant>().is_err());
    }

    #[test]
    fn urls_lose_their_credentials() {
        assert_eq!(
            redact("bad url postgres://me:secret@db/x"),
            "bad url postgres://***@db/x"
        );
    }
}
