//! Sorting a database error met by a source (the polling source here, the CDC source in
//! `handoff-cdc`) into a [`SourceErrorKind`]: worth retrying, or not. The relay retries the
//! retryable kinds with backoff and stops on the others, instead of retrying forever a query
//! that cannot succeed (a missing table, a refused permission).
//!
//! Only errors known to be permanent are sorted as such; anything unknown stays retryable, as
//! every source error was before kinds existed.

use handoff_core::delivery::{SourceError, SourceErrorKind};

use crate::connect::is_rustls;

/// The kind of a database error met by a source.
///
/// By SQLSTATE where the server answered: connection exceptions (class 08), a server shutting
/// down or starting (57P01-57P03), insufficient resources (class 53), deadlocks and
/// serialization failures (40P01, 40001), a lock not available (55P03) and a read-only
/// transaction (25006, a failover pointing at a replica) are
/// [`Unavailable`](SourceErrorKind::Unavailable); a cancelled statement (57014, a
/// `statement_timeout`) is a [`Timeout`](SourceErrorKind::Timeout); a missing table, column,
/// function, type or schema (42P01, 42703, 42883, 42704, 3F000) is
/// [`Schema`](SourceErrorKind::Schema); a refused login (class 28), a missing permission
/// (42501) or database (3D000) is [`Permanent`](SourceErrorKind::Permanent). Without an answer:
/// I/O and pool errors are `Unavailable`, a TLS failure or invalid settings `Permanent`, a row
/// that does not decode `Schema`.
///
/// # Examples
///
/// ```
/// use handoff_core::delivery::SourceErrorKind;
/// use handoff_postgres::source_error_kind;
///
/// let decode = sqlx::Error::ColumnNotFound("claim_until".into());
/// assert_eq!(source_error_kind(&decode), SourceErrorKind::Schema);
/// assert_eq!(source_error_kind(&sqlx::Error::PoolTimedOut), SourceErrorKind::Unavailable);
/// ```
pub fn source_error_kind(error: &sqlx::Error) -> SourceErrorKind {
    match error {
        sqlx::Error::Database(db) => db
            .code()
            .map_or(SourceErrorKind::Unavailable, |code| sqlstate_kind(&code)),
        sqlx::Error::Tls(_) | sqlx::Error::Configuration(_) => SourceErrorKind::Permanent,
        sqlx::Error::Io(io) if is_rustls(io) => SourceErrorKind::Permanent,
        sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::TypeNotFound { .. } => SourceErrorKind::Schema,
        _ => SourceErrorKind::Unavailable,
    }
}

/// The kind of a server's answer by its SQLSTATE.
fn sqlstate_kind(code: &str) -> SourceErrorKind {
    match code {
        "57014" => SourceErrorKind::Timeout,
        "42P01" | "42703" | "42883" | "42704" | "3F000" => SourceErrorKind::Schema,
        "42501" | "3D000" => SourceErrorKind::Permanent,
        _ if code.starts_with("28") => SourceErrorKind::Permanent,
        _ => SourceErrorKind::Unavailable,
    }
}

/// `error` wrapped with what the source was doing, of its [kind](source_error_kind).
pub fn source_error(context: &str, error: sqlx::Error) -> SourceError {
    SourceError::with_kind(source_error_kind(&error), context, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_sort_into_kinds() {
        for (code, kind) in [
            ("08006", SourceErrorKind::Unavailable),
            ("57P01", SourceErrorKind::Unavailable),
            ("40P01", SourceErrorKind::Unavailable),
            ("53300", SourceErrorKind::Unavailable),
            ("57014", SourceErrorKind::Timeout),
            ("42P01", SourceErrorKind::Schema),
            ("42703", SourceErrorKind::Schema),
            ("42501", SourceErrorKind::Permanent),
            ("28P01", SourceErrorKind::Permanent),
            ("23505", SourceErrorKind::Unavailable),
        ] {
            assert_eq!(sqlstate_kind(code), kind, "{code}");
        }
    }
}
