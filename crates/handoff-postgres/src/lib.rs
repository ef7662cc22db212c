//! `handoff-postgres`: the PostgreSQL side of the handoff outbox.
//!
//! Citations such as (design W1, P5) point at the requirements in docs/design.md; terms such as
//! head, parked or held are defined in docs/glossary.md.
//!
//! - [`Migrator`] applies handoff's embedded, versioned migrations (the `outbox`, `outbox_heads`
//!   and `processed_events` tables) into a configurable [`Schema`].
//! - [`Outbox`] validates events and enqueues them inside the caller's own transaction, through
//!   sqlx ([`Outbox::enqueue`]) or, with the `tokio-postgres` feature, through a tokio-postgres
//!   client or transaction. It never commits: the caller's commit makes the business change and
//!   its events durable together, and a rollback leaves neither (design W1, W4).
//!
//! - [`PollingSource`] is the relay's source of committed events: it leases rows in short
//!   `FOR UPDATE SKIP LOCKED` claims, records acknowledgements and failures, and wakes an idle
//!   relay through LISTEN/NOTIFY (design P1-P3, P7).
//!
//! - [`Inbox`] is the consumer side (design C1-C5): the dedup row and the per-aggregate sequence
//!   written in the consumer's own transaction, the consumer quarantine, and the record of
//!   outside calls made under an idempotency key. [`ConsumerQuarantine`] is the operator's
//!   side of that quarantine: list, show, retry (applied again by the consumer) and skip, each
//!   audited.
//!
//! - [`Cleanup`] deletes (or archives) published outbox rows and dedup rows past their
//!   retention in short keyset batches beside running relays (design O2, C5).
//! - [`RetainedEvents`] reads published rows back page by page, each aggregate in sequence
//!   order, for replays and for reconciling the broker with the outbox (design O3).
//!
//! - [`roles_sql`]: least-privilege roles (writer, relay, operator) over these tables;
//!   [`ReadyProbe`]: the database half of a readiness probe.
//! - [`Pooling`]: whether a transaction pooler (PgBouncer `pool_mode = transaction`) may sit
//!   between handoff and PostgreSQL, detected or configured; under it every statement is
//!   unnamed and runs inside a transaction (`docs/poolers.md`).
//! - [`bounded_release`]: pool options that close a connection whose server went silent instead
//!   of letting it hold a pool slot.
//!
//! The relay loop, consumers and operator commands build on the same tables in their own crates.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_core::{EventCatalog, NewEvent};
//! use handoff_postgres::{Migrator, Outbox, OutboxConfig, Schema};
//! use sqlx::Connection;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1/app").await?;
//! Migrator::handoff(Schema::default()).run(&mut conn).await?;
//!
//! let catalog = EventCatalog::new().declare("order", "OrderCreated", 1);
//! let outbox = Outbox::new(OutboxConfig::default(), catalog)?;
//!
//! let mut tx = conn.begin().await?;
//! let event = NewEvent::new("order", "o-1", "OrderCreated", 1, r#"{"customer_id":"c-1"}"#);
//! let enqueued = outbox.enqueue(&mut tx, &[event]).await?;
//! assert_eq!(enqueued[0].aggregate_sequence, 1);
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod cleanup;
mod connect;
mod consumer_quarantine;
mod health;
mod inbox;
mod migrate;
mod outbox;
mod pool;
mod pooler;
mod quarantine;
mod retained;
mod roles;
mod schema;
mod source;
mod source_error;
mod status;
mod trace;

pub use cleanup::{
    Cleanup, CleanupConfig, CleanupError, CleanupErrorKind, CleanupPhase, CleanupProgress,
    CleanupReport, BATCH_SIZE_RANGE,
};
pub use connect::{
    check_tls_files, connect_error_kind, connect_options, libpq_tls, tls_files, ConnectErrorKind,
    DatabaseUrlError, TlsFile, TlsFileError,
};
pub use consumer_quarantine::{
    ConsumerQuarantine, ConsumerQuarantineCount, ConsumerQuarantineDetail, ConsumerQuarantineError,
    ConsumerQuarantineErrorKind, ConsumerQuarantined, QuarantineRef, QuarantineRefError,
    RetryClaim, RetryOutcome, SkipRecord,
};
pub use handoff_core::OrderMode;
pub use health::{ReadyError, ReadyErrorKind, ReadyProbe};
pub use inbox::{
    validate_consumer_name, Admission, BatchAdmission, CallRecord, CallResponse, CallStatus, Inbox,
    InboxError, InboxErrorKind, QuarantineKind, MAX_CONSUMER_NAME_BYTES,
};
pub use migrate::{
    MigrateError, MigrateErrorKind, Migration, MigrationReport, Migrator, HANDOFF_MIGRATIONS,
};
pub use outbox::{
    DriverError, EnqueueCall, EnqueueError, EnqueueErrorKind, Enqueued, Outbox, OutboxConfig,
};
pub use pool::bounded_release;
pub use pooler::Pooling;
pub use quarantine::{
    ActionRecord, EventDetail, EventState, Quarantine, QuarantineAction, QuarantineError,
    QuarantineErrorKind, QuarantinedEvent, MAX_ACTOR_BYTES, MAX_SKIP_REASON_BYTES,
};
pub use retained::{
    RetainedCursor, RetainedError, RetainedErrorKind, RetainedEvent, RetainedEvents,
    RetainedFilter, RetainedFilterError,
};
pub use roles::{roles_sql, RoleNames, RolesError, DEFAULT_ROLE_PREFIX, MAX_ROLE_PREFIX_BYTES};
pub use schema::{Schema, SchemaError};
pub use source::{
    default_relay_id, header_pairs, read_outbox_event, Backlog, OtherLane, PollingConfig,
    PollingConfigError, PollingSource, WAKE_CHANNEL,
};
pub use source_error::{source_error, source_error_kind};
pub use status::{CleanupRun, RelaySeen, Status, StatusReport, StuckAggregate, TableSize};
