//! `reference-consumers`: reference consumers of the order service's events and the external
//! system they call.
//!
//! - [`provider`]: a fake payment provider that honours `Idempotency-Key` and can fail after
//!   applying a charge (the `payment-provider` binary);
//! - [`upcast`]: the one place where old schema versions of the order events are translated
//!   into the newest, which is all the handlers read.

pub mod common;
pub mod inventory;
pub mod payments;
pub mod provider;
pub mod upcast;
