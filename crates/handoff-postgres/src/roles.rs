//! Least-privilege roles for handoff's tables: the SQL `handoff roles --print` prints.
//!
//! Three NOLOGIN group roles, each with only what one part of the system does:
//!
//! - **writer**: enqueues events (INSERT into the outbox and what enqueue needs beside it);
//!   cannot update or delete an event, so it can neither mark one published nor rewrite it;
//! - **relay**: reads events and updates only their delivery columns (lease, attempts,
//!   errors, `published_at`, receipt, hold) and its own wait rows; cannot change a payload;
//! - **operator**: status, quarantine, replay, reconcile, cleanup, the consumer quarantine and
//!   sagas.
//!
//! The SQL lives in `queries/roles.sql`; it is idempotent, so it is run again after every
//! upgrade's `handoff migrate`.

use crate::schema::{Schema, SchemaError};

const ROLES_SQL: &str = include_str!("../queries/roles.sql");

/// The default prefix of the role names: `handoff_writer`, `handoff_relay`,
/// `handoff_operator`.
pub const DEFAULT_ROLE_PREFIX: &str = "handoff";

/// Why the roles' SQL could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RolesError {
    /// The schema is not a plain identifier.
    #[error("{0}")]
    Schema(#[from] SchemaError),
    /// The role prefix is not a plain identifier short enough for every role name.
    #[error(
        "role prefix {0:?} is not a plain identifier ([a-z_][a-z0-9_]*, at most {max} bytes)",
        max = MAX_ROLE_PREFIX_BYTES
    )]
    Prefix(String),
}

/// The longest role prefix: PostgreSQL's 63-byte identifiers, less `_operator`.
pub const MAX_ROLE_PREFIX_BYTES: usize = 63 - "_operator".len();

/// The three roles' names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoleNames {
    /// Enqueues events only.
    pub writer: String,
    /// Publishes: reads events, updates their delivery columns.
    pub relay: String,
    /// Runs the operator's commands.
    pub operator: String,
}

impl RoleNames {
    /// `<prefix>_writer`, `<prefix>_relay`, `<prefix>_operator`.
    ///
    /// # Errors
    ///
    /// [`RolesError::Prefix`] unless `prefix` matches `[a-z_][a-z0-9_]*` and is at most
    /// [`MAX_ROLE_PREFIX_BYTES`] long.
    pub fn with_prefix(prefix: &str) -> Result<RoleNames, RolesError> {
        // The same rule as schema names; the suffix only adds plain characters.
        let plain = Schema::named(prefix).is_ok() && prefix.len() <= MAX_ROLE_PREFIX_BYTES;
        if !plain {
            return Err(RolesError::Prefix(prefix.to_owned()));
        }
        Ok(RoleNames {
            writer: format!("{prefix}_writer"),
            relay: format!("{prefix}_relay"),
            operator: format!("{prefix}_operator"),
        })
    }
}

impl Default for RoleNames {
    fn default() -> Self {
        RoleNames {
            writer: format!("{DEFAULT_ROLE_PREFIX}_writer"),
            relay: format!("{DEFAULT_ROLE_PREFIX}_relay"),
            operator: format!("{DEFAULT_ROLE_PREFIX}_operator"),
        }
    }
}

/// The SQL that creates the three roles (when missing) and grants them their privileges on
/// handoff's tables in `schema`. Identifiers are checked to be plain and double-quoted.
///
/// # Errors
///
/// [`RolesError::Schema`] for a schema name that is not a plain identifier.
///
/// # Examples
///
/// ```
/// use handoff_postgres::{roles_sql, RoleNames};
///
/// let sql = roles_sql("events", &RoleNames::default())?;
/// assert!(sql.contains(r#"GRANT INSERT ON "events".outbox TO "handoff_writer";"#));
/// assert!(roles_sql("Robert'); DROP", &RoleNames::default()).is_err());
/// # Ok::<(), handoff_postgres::RolesError>(())
/// ```
pub fn roles_sql(schema: &str, names: &RoleNames) -> Result<String, RolesError> {
    Schema::named(schema)?;
    for name in [&names.writer, &names.relay, &names.operator] {
        // Names built by hand rather than by with_prefix get the same check.
        if Schema::named(name.as_str()).is_err() {
            return Err(RolesError::Prefix(name.clone()));
        }
    }
    let quoted = |name: &str| format!("\"{name}\"");
    Ok(ROLES_SQL
        .replace("{schema_name}", &quoted(schema))
        .replace("{writer_name}", &names.writer)
        .replace("{relay_name}", &names.relay)
        .replace("{operator_name}", &names.operator)
        .replace("{writer}", &quoted(&names.writer))
        .replace("{relay}", &quoted(&names.relay))
        .replace("{operator}", &quoted(&names.operator)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_placeholder_is_filled_and_names_are_quoted() {
        let names = RoleNames::with_prefix("t1").unwrap();
        let sql = roles_sql("s1", &names).unwrap();
        assert!(!sql.contains('{') && !sql.contains('}'), "{sql}");
        assert!(sql.contains(r#"CREATE ROLE "t1_writer" NOLOGIN;"#));
        assert!(sql.contains("rolname = 't1_operator'"));
        assert!(sql.contains(r#"ON "s1".outbox TO "t1_relay";"#));
    }

    #[test]
    fn only_plain_prefixes_are_taken() {
        assert!(RoleNames::with_prefix("Bad").is_err());
        assert!(RoleNames::with_prefix("a\"b").is_err());
        assert!(RoleNames::with_prefix(&"a".repeat(MAX_ROLE_PREFIX_BYTES + 1)).is_err());
        assert!(RoleNames::with_prefix(&"a".repeat(MAX_ROLE_PREFIX_BYTES)).is_ok());
    }

    #[test]
    fn the_writer_gets_no_update_and_the_relay_no_payload() {
        let sql = roles_sql("public", &RoleNames::default()).unwrap();
        let grants: Vec<&str> = sql
            .split(';')
            .map(str::trim)
            .filter(|s| s.contains("GRANT") && s.contains("ON \"public\".outbox "))
            .collect();
        for grant in &grants {
            let to = grant.rsplit("TO").next().unwrap();
            if to.contains("handoff_writer") {
                assert!(
                    !grant.contains("UPDATE") && !grant.contains("DELETE"),
                    "{grant}"
                );
            }
            if to.contains("handoff_relay") {
                assert!(!grant.contains("payload"), "{grant}");
            }
        }
        assert!(grants.len() >= 5, "{grants:?}");
    }
}
