//! What the `database_url` fuzz target runs, as a plain function: `fuzz_targets/database_url.rs`
//! and `crates/handoff-postgres/tests/it/fuzz_corpus.rs` both include this file as a module (it is
//! not part of `lib.rs`, which the handoff-core test includes and which depends on
//! `handoff-core` only).
//!
//! Depends on `handoff-postgres` and `sqlx`.

use std::str::FromStr;

use handoff_postgres::{connect_options, libpq_tls, tls_files, DatabaseUrlError};
use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

/// What [`database_url`] found.
#[derive(Debug)]
pub enum UrlOutcome {
    /// [`connect_options`] accepted the URL.
    Accepted,
    /// [`connect_options`] refused it as a URL sqlx parses but cannot use
    /// ([`DatabaseUrlError`]).
    Unusable,
    /// [`connect_options`] refused it otherwise (sqlx's own parse error, `sslrootcert=system`
    /// with a weaker `sslmode`).
    Refused,
}

/// Database URL parsing ([`connect_options`], as every binary reads `DATABASE_URL`) of `data`
/// (lossily decoded: a URL is text).
///
/// Invariants:
/// - nothing panics, whatever the URL (sqlx panics writing some options back into a URL, which
///   `connect_options` must refuse first);
/// - every refusal is a [`sqlx::Error::Configuration`];
/// - accepted options can be written back into a URL ([`ConnectOptions::to_url_lossy`], which
///   [`tls_files`] reads), and that URL is accepted again;
/// - options sqlx parses on its own (`PgConnectOptions::from_str`) go through [`libpq_tls`] and
///   [`tls_files`] without a panic.
pub fn database_url(data: &[u8]) -> UrlOutcome {
    let text = String::from_utf8_lossy(data);
    if let Ok(options) = PgConnectOptions::from_str(&text) {
        let _ = tls_files(&options);
        let _ = libpq_tls(options);
    }
    match connect_options(&text) {
        Ok(options) => {
            let _ = tls_files(&options);
            let again = options.to_url_lossy();
            assert!(
                connect_options(again.as_str()).is_ok(),
                "the URL sqlx writes back is refused"
            );
            UrlOutcome::Accepted
        }
        Err(sqlx::Error::Configuration(source)) => {
            if source.downcast_ref::<DatabaseUrlError>().is_some() {
                UrlOutcome::Unusable
            } else {
                UrlOutcome::Refused
            }
        }
        Err(other) => panic!("a refusal that is not a configuration error: {other:?}"),
    }
}
