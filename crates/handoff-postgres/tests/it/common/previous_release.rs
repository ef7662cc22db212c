//! A schema as an earlier release left it, for the upgrade tests (`parking`, `order_holes`,
//! `mark`).

use handoff_postgres::{Migrator, Schema, HANDOFF_MIGRATIONS};
use sqlx::PgConnection;

/// Applies handoff's migrations up to `last` and no further, to the schema of `conn`'s
/// `search_path`: what the release whose last migration that was left.
pub async fn migrated_through(conn: &mut PgConnection, last: i64) {
    let end = HANDOFF_MIGRATIONS
        .iter()
        .position(|m| m.version == last)
        .unwrap_or_else(|| panic!("no migration {last}"));
    Migrator::new(
        Schema::default(),
        "handoff_migrations",
        &HANDOFF_MIGRATIONS[..=end],
    )
    .run(conn)
    .await
    .unwrap();
}
