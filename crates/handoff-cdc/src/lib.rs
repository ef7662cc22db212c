//! `handoff-cdc`: the relay's source over PostgreSQL logical replication (design P9, F4).
//!
//! Instead of polling the outbox, the relay follows a `pgoutput` slot on a publication of the
//! outbox's inserts: committed transactions arrive whole and in commit order, are published
//! through the same relay loop (lanes, backoff, quarantine, metrics) and the same transport as
//! with the polling source, and the slot's position is confirmed only once the broker
//! acknowledged everything before it.
//!
//! - [`setup()`] creates the publication and the slot at deploy time (`handoff cdc setup`),
//!   and sets the [`RowMode`];
//! - [`LogicalSource`] is the relay's [`Source`](handoff_core::delivery::Source);
//! - [`slot_health`] reads what the lag metrics and alerts watch.
//!
//! docs/cdc.md explains when to choose it, the ack gating, and the runbook for a lost slot.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_cdc::{setup, CdcNames, RowMode};
//! use handoff_postgres::Schema;
//! # async fn example(conn: &mut sqlx::PgConnection) -> Result<(), handoff_cdc::SetupError> {
//! let names = CdcNames::new("handoff", "handoff_outbox")?;
//! let report = setup(conn, &Schema::default(), &names, RowMode::Keep, false).await?;
//! println!("slot created: {}", report.slot_created);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod metrics;
mod row;
mod setup;
mod source;
mod state;

pub use row::RowError;
pub use setup::{
    resolve_schema, rows_mode, setup, slot_health, CdcNames, RowMode, SetupReport, SlotHealth,
};
pub use source::{LogicalConfig, LogicalSource};

/// Why [`setup()`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A slot or publication name that is not a plain identifier.
    #[error("{0:?} is not a plain identifier ([a-z_][a-z0-9_]*, at most 63 bytes)")]
    Name(String),
    /// The server does not decode WAL logically.
    #[error("wal_level is {0}: set wal_level = logical and restart PostgreSQL")]
    WalLevel(String),
    /// The publication exists but does not cover the outbox.
    #[error("publication {publication} exists but does not publish {table}")]
    PublicationMismatch {
        /// The publication.
        publication: String,
        /// The outbox table it should cover.
        table: String,
    },
    /// The slot was invalidated; recreating it is an operator's decision.
    #[error(
        "replication slot {0} is lost (its WAL was removed): events committed since it fell \
         behind were never streamed; rerun with --recreate-lost-slot, then restart the relay \
         to publish them from the table (docs/cdc.md, runbook)"
    )]
    SlotLost(String),
    /// A statement failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Why [`LogicalSource::start`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The slot does not exist: the relay never creates one.
    #[error(
        "replication slot {0} does not exist: create it with `handoff cdc setup` at deploy time"
    )]
    SlotMissing(String),
    /// A statement failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}
