//! The reference order service: for one command it writes an order in PostgreSQL and enqueues
//! the matching event (`OrderCreated`, `OrderLineAdded`, `OrderCancelled`) in the SAME local
//! transaction, together with the command's idempotency record and response (design W1, W5).
//!
//! - [`model`]: requests, responses, validation;
//! - [`events`]: the events and their catalog;
//! - [`idempotency`]: keys and request fingerprints;
//! - [`store`]: the commands, each one transaction;
//! - [`api`]: the axum routes.

pub mod api;
pub mod events;
pub mod failpoints;
pub mod idempotency;
pub mod model;
pub mod store;

use handoff::postgres::{MigrateError, Migration, MigrationReport};
use handoff::{Migrator, OrderMode, Outbox, OutboxConfig, Pooling, Schema};
use sqlx::{PgConnection, PgPool};

/// The service's own migrations, recorded apart from handoff's.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "create_orders",
    up: include_str!("../migrations/0001_create_orders.up.sql"),
    down: include_str!("../migrations/0001_create_orders.down.sql"),
}];

/// The migrators the service needs, in order: handoff's tables, then its own.
pub fn migrators() -> [Migrator; 2] {
    [
        Migrator::handoff(Schema::default()),
        Migrator::new(Schema::default(), "order_service_migrations", MIGRATIONS),
    ]
}

/// Applies every pending migration.
///
/// # Errors
///
/// [`MigrateError`] from either set.
pub async fn migrate(conn: &mut PgConnection) -> Result<Vec<MigrationReport>, MigrateError> {
    let mut reports = Vec::new();
    for migrator in migrators() {
        reports.push(migrator.run(conn).await?);
    }
    Ok(reports)
}

/// Checks that no migration is pending, without applying any.
///
/// # Errors
///
/// [`MigrateError::Behind`] when the schema is behind.
pub async fn check_migrations(conn: &mut PgConnection) -> Result<(), MigrateError> {
    for migrator in migrators() {
        migrator.check(conn).await?;
    }
    Ok(())
}

/// The outbox the service enqueues through.
pub fn outbox() -> Outbox {
    outbox_in(OrderMode::Aggregate)
}

/// The outbox the service enqueues through, in `order` mode: with [`OrderMode::Global`] every
/// event also takes the next global sequence (docs/global-order.md).
pub fn outbox_in(order: OrderMode) -> Outbox {
    outbox_for(order, Pooling::Session)
}

/// The outbox the service enqueues through, in `order` mode, with its statements sent as
/// `pooling` requires: [`Pooling::Transaction`] when `DATABASE_URL` goes through a transaction
/// pooler (docs/poolers.md).
pub fn outbox_for(order: OrderMode, pooling: Pooling) -> Outbox {
    let config = OutboxConfig {
        order,
        pooling,
        ..OutboxConfig::default()
    };
    // The default configuration, whatever the order mode, is valid by construction.
    Outbox::new(config, events::catalog()).expect("default outbox config is valid")
}

/// The HTTP application over `pool` (already migrated), writing the current `OrderCreated`.
pub fn app(pool: PgPool) -> axum::Router {
    app_writing(pool, events::OrderCreatedVersion::default())
}

/// The HTTP application over `pool` (already migrated), writing `OrderCreated` in `version`.
pub fn app_writing(pool: PgPool, version: events::OrderCreatedVersion) -> axum::Router {
    app_with(pool, version, OrderMode::Aggregate)
}

/// The HTTP application over `pool` (already migrated), writing `OrderCreated` in `version`
/// and enqueueing in `order` mode.
pub fn app_with(
    pool: PgPool,
    version: events::OrderCreatedVersion,
    order: OrderMode,
) -> axum::Router {
    app_pooled(pool, version, order, Pooling::Session)
}

/// [`app_with`] over a pool whose connections may go through a transaction pooler
/// (`pooling`): every statement then goes unnamed, inside a transaction.
pub fn app_pooled(
    pool: PgPool,
    version: events::OrderCreatedVersion,
    order: OrderMode,
    pooling: Pooling,
) -> axum::Router {
    api::router(store::Store::new(pool, outbox_for(order, pooling)).writing_order_created(version))
}
