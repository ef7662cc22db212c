//! [`PollingConfig`]: a polling source's settings, their checks, and the session options a
//! relay's connections should carry.

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

use crate::pooler::Pooling;
use crate::Schema;
use handoff_core::OrderMode;

// Named in the docs only.
#[cfg(doc)]
use super::{Backlog, PollingSource};

/// Settings of a [`PollingSource`].
#[derive(Debug, Clone)]
pub struct PollingConfig {
    /// The schema holding the outbox.
    pub schema: Schema,
    /// This relay's name in `claimed_by`. Two live relays must not share one.
    pub relay_id: String,
    /// How long a claim keeps its rows away from other relays. A relay that dies holding rows
    /// delays them by at most this; a relay must publish within it, so it must be well above
    /// the broker's publish timeout.
    pub lease: Duration,
    /// How long a sleeping relay's registration keeps writers notifying before it must be
    /// renewed; bounds the notifications a relay that died asleep still causes.
    pub wait_ttl: Duration,
    /// Whether an idle relay is woken by LISTEN/NOTIFY. Off, it only polls: every wait lasts
    /// the relay's whole poll interval (for measuring, or where NOTIFY is not allowed).
    pub listen: bool,
    /// An aggregate whose oldest unpublished event is older than this counts as stuck in
    /// [`Backlog::stuck_aggregates`]: one key stalled behind a poison event shows even while the
    /// totals look healthy.
    pub stuck_after: Duration,
    /// How long one database operation (taking a connection included) may take before it
    /// fails and its connection is closed instead of going back to the pool.
    ///
    /// A connection whose server went silent (a partition, a failover, a NAT that forgot the
    /// connection) never fails by itself: without this bound a claim on it waits forever and
    /// the relay stops. On expiry the operation fails like any database error (the relay
    /// retries with backoff) and the connection is closed, not pinged back into the pool, where
    /// the ping would hang as well and hold a pool slot for good. Well above the slowest claim
    /// of a batch; at least 100 ms. Default: 10 seconds.
    pub query_timeout: Duration,
    /// Which events this source hands out. [`OrderMode::Aggregate`] (the default): the
    /// per-aggregate events, in ordered lanes per aggregate; events with a global sequence are
    /// left alone. [`OrderMode::Global`]: only the global lane, from its lowest unpublished
    /// event on, to one relay at a time (needs migration 0006); per-aggregate events are left
    /// alone.
    pub order: OrderMode,
    /// Counted takeovers after which an event is held for an operator (reason `crash_loop`)
    /// instead of leased again. A takeover is a claim of an event whose earlier lease ran out
    /// unsettled; it is counted only when the relay that held the lease is gone: its session
    /// stopped heartbeating, or the relay restarted (see [`PollingSource::session_id`]). A
    /// lease that ran out under a live relay (a claim its client gave up on, slow marks, a short
    /// freeze) is taken over without counting, and a successful publish clears the count. An
    /// event whose publish kills the relay (a panic, an out-of-memory) never fails and so never
    /// reaches the attempt cap; this bound stops it from crash-looping every relay for ever.
    /// Default: 5.
    pub max_takeovers: i32,
    /// [`Pooling::Transaction`] when the pool goes through a transaction pooler: every
    /// statement is then unnamed and runs in a transaction of its own, and without a listen
    /// pool ([`PollingSource::with_listen_pool`]) LISTEN is not used (the relay polls).
    /// Default: [`Pooling::Session`].
    pub pooling: Pooling,
    /// Whether the relay's own commits (leases, marks, failure records, holds) wait for their
    /// WAL to reach disk. Off (the default), [`session_options`](Self::session_options) sets
    /// `synchronous_commit = off` for the relay's sessions: a claim or a mark returns without
    /// waiting behind the writers' flushes, which took 1 to 3 ms off the median commit →
    /// broker latency at 500 and 1,000 events/s (docs/benchmarks.md, "Design notes from measurements").
    ///
    /// What that risks: a PostgreSQL crash (not a relay crash) can forget the relay's last
    /// commits, at most three `wal_writer_delay`s of them (600 ms by default). The events
    /// those marks covered are published again after the restart, as after a relay crash
    /// (at least once, absorbed by the consumers' inbox); a forgotten lease or takeover count
    /// only lets a claim happen again. Nothing is lost and the order holds: the server keeps a
    /// prefix of its commits, never a later one without an earlier. The writers' commits,
    /// which hold the events themselves, are not touched; nor are operator commands. On
    /// (`handoff relay --synchronous-commit`), every relay commit is flushed as the server's
    /// setting says. Through a transaction pooler the sessions carry no options, and the
    /// server's setting applies.
    pub synchronous_commit: bool,
}

impl Default for PollingConfig {
    fn default() -> Self {
        PollingConfig {
            schema: Schema::default(),
            relay_id: default_relay_id(),
            lease: Duration::from_secs(30),
            wait_ttl: Duration::from_secs(60),
            listen: true,
            stuck_after: Duration::from_secs(60),
            query_timeout: Duration::from_secs(10),
            order: OrderMode::Aggregate,
            max_takeovers: 5,
            pooling: Pooling::Session,
            synchronous_commit: false,
        }
    }
}

/// A relay id for a relay that was given none: `relay-<host>-<pid>-<8 random hex digits>`
/// (`relay-<pid>-<8 random hex digits>` when the host has no name), new at every call. It is
/// [`PollingConfig::default`]'s and `handoff relay`'s default `--relay-id` (docs/relay.md).
///
/// The process id alone repeats: in containers every relay is pid 1, and a restarted relay
/// would take the id its dead predecessor left in `claimed_by`. The host name (from
/// `/proc/sys/kernel/hostname`, else `$HOSTNAME`; left out when neither is set) keeps the id
/// readable; the random suffix (from a UUIDv7's random bits) makes it unique per start.
pub fn default_relay_id() -> String {
    let host = host_name();
    let uuid = uuid::Uuid::now_v7().simple().to_string();
    // The last 32 bits of a UUIDv7 are random (the counter and the time are before them).
    let suffix = &uuid[uuid.len() - 8..];
    let pid = std::process::id();
    if host.is_empty() {
        format!("relay-{pid}-{suffix}")
    } else {
        format!("relay-{host}-{pid}-{suffix}")
    }
}

/// This host's name, from `/proc/sys/kernel/hostname`, else `$HOSTNAME`, cut to 64 of the
/// characters a relay id may hold; empty when neither is set.
pub(super) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|name| {
            name.trim()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
                .take(64)
                .collect::<String>()
        })
        .unwrap_or_default()
}

/// A [`PollingConfig`] that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PollingConfigError {
    /// The relay id is empty, longer than 255 bytes, or holds control characters.
    #[error("relay id {0:?} must be 1 to 255 printable characters")]
    InvalidRelayId(String),
    /// The lease is shorter than a second.
    #[error("lease of {0:?} is too short: at least 1s")]
    LeaseTooShort(Duration),
    /// The wait registration lives shorter than a second.
    #[error("wait ttl of {0:?} is too short: at least 1s")]
    WaitTtlTooShort(Duration),
    /// The query timeout is shorter than 100 ms.
    #[error("query timeout of {0:?} is too short: at least 100ms")]
    QueryTimeoutTooShort(Duration),
    /// The takeover bound is below one.
    #[error("max takeovers must be at least 1, got {0}")]
    NoTakeovers(i32),
}

impl PollingConfig {
    /// Checks the settings.
    ///
    /// # Errors
    ///
    /// The first setting that cannot work.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_postgres::PollingConfig;
    ///
    /// assert!(PollingConfig::default().validate().is_ok());
    /// let bad = PollingConfig { relay_id: String::new(), ..PollingConfig::default() };
    /// assert!(bad.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), PollingConfigError> {
        let id = &self.relay_id;
        if id.is_empty() || id.len() > 255 || id.chars().any(char::is_control) {
            return Err(PollingConfigError::InvalidRelayId(id.clone()));
        }
        if self.lease < Duration::from_secs(1) {
            return Err(PollingConfigError::LeaseTooShort(self.lease));
        }
        if self.wait_ttl < Duration::from_secs(1) {
            return Err(PollingConfigError::WaitTtlTooShort(self.wait_ttl));
        }
        if self.query_timeout < Duration::from_millis(100) {
            return Err(PollingConfigError::QueryTimeoutTooShort(self.query_timeout));
        }
        if self.max_takeovers < 1 {
            return Err(PollingConfigError::NoTakeovers(self.max_takeovers));
        }
        Ok(())
    }

    /// `options` with the session settings a relay's connections should carry, for a pool
    /// that reaches PostgreSQL directly or through a pooler in session mode:
    ///
    /// - `statement_timeout` a second above [`query_timeout`](Self::query_timeout). Past the
    ///   query timeout the relay closes the connection, but PostgreSQL notices only when it
    ///   next writes to the socket; without the setting a slow claim would run on, holding the
    ///   row locks it took, while every retry read around them.
    /// - `synchronous_commit = off`, unless [`synchronous_commit`](Self::synchronous_commit)
    ///   is set: the relay's own commits do not wait for their WAL flush (what that risks is
    ///   said there).
    /// - `jit = off`. The planner's cost estimate of a claim grows with the table (about
    ///   131,000 for a batch of 500 on an outbox of a million rows, past the default
    ///   `jit_above_cost` of 100,000), and then every claim spent 100 to 170 ms compiling
    ///   itself to machine code before a 30 ms run. A batch read by index gains nothing from
    ///   JIT. (The mark is a function that carries the setting itself, migration 0016.)
    ///
    /// A transaction pooler refuses these startup options: under [`Pooling::Transaction`]
    /// leave the options as they are; the source then sets `jit` for each claim's own
    /// transaction.
    ///
    /// # Examples
    ///
    /// ```
    /// use handoff_postgres::PollingConfig;
    /// use sqlx::postgres::PgConnectOptions;
    ///
    /// let config = PollingConfig::default();
    /// let options = config.session_options("postgres://localhost/app".parse::<PgConnectOptions>()?);
    /// // PgPoolOptions::new().connect_lazy_with(options), then PollingSource::new(pool, config).
    /// # Ok::<(), sqlx::Error>(())
    /// ```
    pub fn session_options(&self, options: PgConnectOptions) -> PgConnectOptions {
        let timeout = self.query_timeout + SERVER_TIMEOUT_MARGIN;
        let options = options.options([
            ("statement_timeout", format!("{}ms", timeout.as_millis())),
            ("jit", "off".to_owned()),
        ]);
        if self.synchronous_commit {
            options
        } else {
            options.options([("synchronous_commit", "off")])
        }
    }
}

/// How much longer than [`PollingConfig::query_timeout`] the server lets one of the relay's
/// statements run ([`PollingConfig::session_options`]).
const SERVER_TIMEOUT_MARGIN: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_relay_id_is_new_and_valid() {
        let ids: Vec<String> = (0..100)
            .map(|_| PollingConfig::default().relay_id)
            .collect();
        let distinct: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len(), "{ids:?}");
        let pid = format!("-{}-", std::process::id());
        for id in &ids {
            assert!(id.starts_with("relay-") && id.contains(&pid), "{id}");
            let suffix = id.rsplit('-').next().unwrap();
            assert!(
                suffix.len() == 8 && suffix.bytes().all(|b| b.is_ascii_hexdigit()),
                "{id}"
            );
            assert_eq!(
                PollingConfig {
                    relay_id: id.clone(),
                    ..PollingConfig::default()
                }
                .validate(),
                Ok(())
            );
        }
    }

    #[test]
    fn the_query_timeout_is_at_least_100ms() {
        let config = PollingConfig {
            query_timeout: Duration::from_millis(99),
            ..PollingConfig::default()
        };
        assert_eq!(
            config.validate(),
            Err(PollingConfigError::QueryTimeoutTooShort(
                Duration::from_millis(99)
            ))
        );
        let config = PollingConfig {
            query_timeout: Duration::from_millis(100),
            ..PollingConfig::default()
        };
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn relay_ids_must_be_printable() {
        for bad in [String::new(), "a\nb".to_string(), "x".repeat(256)] {
            let config = PollingConfig {
                relay_id: bad,
                ..PollingConfig::default()
            };
            assert!(matches!(
                config.validate(),
                Err(PollingConfigError::InvalidRelayId(_))
            ));
        }
    }
}
