//! `reference_consumers::provider`: a fake but realistic payment provider, the external system
//! the payments consumer charges. It honours `Idempotency-Key` the way Stripe does: the first
//! request with a key creates a charge and stores its response in the same PostgreSQL
//! transaction; retries with the key and the same body get that response replayed
//! (`Idempotent-Replayed: true`); the key with another body is refused. It does NOT deduplicate
//! by order: two keys for one order make two charges, so a consumer's double charge shows.
//!
//! Fault injection produces the ambiguous case: a request whose charge committed can still
//! time out or fail, and only a retry with the same key tells the client what happened.
//!
//! - [`idempotency`]: keys and request fingerprints;
//! - [`store`]: the tables and the one-transaction charge;
//! - [`faults`]: the fault settings and the seeded draw;
//! - [`api`]: the axum routes and the counters.
//!
//! # Examples
//!
//! ```no_run
//! use reference_consumers::provider::{
//!     create_tables, ChargeStore, FaultInjector, FaultSettings, Provider,
//! };
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/provider").await?;
//! create_tables(&mut *pool.acquire().await?).await?;
//! let faults = FaultInjector::new(FaultSettings::default(), 42)?;
//! let provider = Provider::new(ChargeStore::new(pool), faults);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! axum::serve(listener, provider.router()).await?;
//! # Ok(())
//! # }
//! ```

pub mod api;
pub mod faults;
pub mod idempotency;
pub mod store;

pub use api::{Provider, StatsSnapshot, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use faults::{Fault, FaultInjector, FaultMode, FaultPatch, FaultSettings, FaultSettingsError};
pub use idempotency::{Fingerprint, IdempotencyKey, InvalidKey, MAX_KEY_BYTES};
pub use store::{
    create_tables, Charge, ChargeError, ChargeErrorKind, ChargeRequest, ChargeStore, Outcome,
    StoreError, StoredResponse,
};
