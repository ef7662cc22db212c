//! `saga-shop`: the reference place-order saga (design F2), as three services with a database
//! of their own each.
//!
//! - [`orders`]: takes an order and starts its saga in the same transaction; it is the
//!   orchestrator, and confirms or cancels the order when the saga ends.
//! - [`inventory`]: reserves stock, and releases it as the compensation.
//! - [`payments`]: charges the payment provider under an idempotency key derived from the saga,
//!   and marks the charge refunded as the compensation.
//!
//! Each service runs its own relay in-process (its replies and commands leave through its own
//! outbox) and one consumer ([`service`]). The `saga-shop` binary runs one service per process,
//! so a test can SIGKILL any of them mid-saga.

pub mod inventory;
pub mod orders;
pub mod payments;
pub mod service;

use std::time::Duration;

use handoff_saga::{RetryPolicy, SagaDefinition, Step};

/// The saga's type.
pub const SAGA_TYPE: &str = "place-order";

/// Place an order: reserve its stock at `inventory`, then charge it at `payments`; the order is
/// confirmed when both succeeded. A declined charge releases the stock.
///
/// # Examples
///
/// ```
/// let saga = saga_shop::definition(std::time::Duration::from_secs(5));
/// assert_eq!(saga.steps().len(), 2);
/// assert_eq!(saga.steps()[0].compensation.as_deref(), Some("ReleaseStock"));
/// ```
pub fn definition(reply_timeout: Duration) -> SagaDefinition {
    let retry = RetryPolicy {
        reply_timeout,
        attempts: 3,
        backoff: Duration::from_millis(500),
        max_backoff: Duration::from_secs(5),
    };
    SagaDefinition::new(SAGA_TYPE)
        .step(
            Step::new("reserve-stock", "inventory", "ReserveStock")
                .compensated_by("ReleaseStock")
                .with_retry(retry),
        )
        .step(
            Step::new("charge", "payments", "Charge")
                .compensated_by("Refund")
                .with_retry(retry),
        )
}
