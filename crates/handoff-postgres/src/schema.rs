//! Where handoff's tables live.

/// The PostgreSQL schema holding handoff's tables.
///
/// [`Schema::default()`] means "whatever the connection's `search_path` resolves", which is
/// `public` on a stock database; [`Schema::named`] pins every query to one schema, so several
/// outboxes (or several tests) can share a database.
///
/// Schema names are identifiers, which SQL cannot take as parameters; they are therefore checked
/// to be plain lowercase identifiers and always double-quoted where they are spliced into SQL.
///
/// # Examples
///
/// ```
/// use handoff_postgres::Schema;
///
/// assert_eq!(Schema::named("events")?.qualify("outbox"), r#""events".outbox"#);
/// assert_eq!(Schema::default().qualify("outbox"), "outbox");
/// assert!(Schema::named("Robert'); DROP TABLE students;--").is_err());
/// # Ok::<(), handoff_postgres::SchemaError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schema(Option<String>);

/// A schema name that is not a plain identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("schema name {0:?} is not a plain identifier ([a-z_][a-z0-9_]*, at most 63 bytes)")]
pub struct SchemaError(pub String);

impl Schema {
    /// A named schema.
    ///
    /// # Errors
    ///
    /// [`SchemaError`] unless the name matches `[a-z_][a-z0-9_]*` and is at most 63 bytes (the
    /// PostgreSQL identifier limit).
    pub fn named(name: impl Into<String>) -> Result<Self, SchemaError> {
        let name = name.into();
        let mut bytes = name.bytes();
        let ok = name.len() <= 63
            && bytes
                .next()
                .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
            && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if ok {
            Ok(Self(Some(name)))
        } else {
            Err(SchemaError(name))
        }
    }

    /// The schema's name, or `None` for the connection's default.
    pub fn name(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// `table` qualified with this schema: `"name".table`, or `table` for the default.
    pub fn qualify(&self, table: &str) -> String {
        format!("{}{table}", self.prefix())
    }

    /// The text put before a table name: `"name".`, or nothing for the default.
    pub(crate) fn prefix(&self) -> String {
        match &self.0 {
            Some(name) => format!("\"{name}\"."),
            None => String::new(),
        }
    }

    pub(crate) fn create_sql(&self) -> Option<String> {
        self.0
            .as_ref()
            .map(|name| format!("CREATE SCHEMA IF NOT EXISTS \"{name}\""))
    }

    /// `SET [LOCAL] search_path` to this schema, or `None` for the default (leave it alone).
    pub(crate) fn set_search_path_sql(&self, local: bool) -> Option<String> {
        let scope = if local { "LOCAL " } else { "" };
        self.0
            .as_ref()
            .map(|name| format!("SET {scope}search_path TO \"{name}\""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_identifiers_are_schema_names() {
        for ok in ["events", "_t1", "handoff_test_42"] {
            assert!(Schema::named(ok).is_ok(), "{ok}");
        }
        for bad in ["", "1abc", "Events", "a-b", "a\"b", "a b", &"a".repeat(64)] {
            assert!(Schema::named(bad).is_err(), "{bad:?}");
        }
    }
}
