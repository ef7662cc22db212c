//! The orders service: the order row and its saga start in one transaction; the saga's end
//! confirms or cancels the order in the transaction that ends it.

use handoff_postgres::Pooling;
use handoff_saga::{HookError, Orchestrator, SagaHooks, SagaRecord};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::SAGA_TYPE;

/// The tables [`TABLES`] creates, checked at start behind a connection pooler.
pub const TABLE_NAMES: &[&str] = &["shop_orders"];

/// The service's own table.
pub const TABLES: &str = "
CREATE TABLE IF NOT EXISTS shop_orders (
    order_id     uuid        PRIMARY KEY,
    sku          text        NOT NULL,
    quantity     integer     NOT NULL CHECK (quantity > 0),
    amount_cents bigint      NOT NULL CHECK (amount_cents >= 0),
    -- The demo's scripted card: 'ok' or 'declined'.
    card         text        NOT NULL,
    -- pending while its saga runs (or is stuck), then confirmed or cancelled.
    status       text        NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'confirmed', 'cancelled')),
    updated_at   timestamptz NOT NULL DEFAULT now()
);";

/// An order as placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderRequest {
    /// What.
    pub sku: String,
    /// How many.
    pub quantity: i32,
    /// For how much.
    pub amount_cents: i64,
    /// `ok`, or `declined` for a card the payments service refuses.
    pub card: String,
}

/// Writes the order and starts its saga (same id) in one transaction, with its statements sent
/// as the orchestrator's [`Orchestrator::pooling`] requires.
///
/// # Errors
///
/// A database or saga error; nothing is written then.
pub async fn place(
    pool: &PgPool,
    orchestrator: &Orchestrator<Hooks>,
    request: &OrderRequest,
) -> anyhow::Result<Uuid> {
    let order_id = Uuid::now_v7();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO shop_orders (order_id, sku, quantity, amount_cents, card) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .persistent(orchestrator.pooling().named_statements())
    .bind(order_id)
    .bind(&request.sku)
    .bind(request.quantity)
    .bind(request.amount_cents)
    .bind(&request.card)
    .execute(&mut *tx)
    .await?;
    let data = json!({
        "order_id": order_id,
        "sku": request.sku,
        "quantity": request.quantity,
        "amount_cents": request.amount_cents,
        "card": request.card,
    });
    orchestrator
        .start(&mut tx, SAGA_TYPE, order_id, data)
        .await?;
    tx.commit().await?;
    Ok(order_id)
}

/// Confirms or cancels the order when its saga ends.
#[derive(Debug, Clone, Copy, Default)]
pub struct Hooks {
    /// How the hooks' statements are sent: the orchestrator's
    /// [`OrchestratorConfig::pooling`](handoff_saga::OrchestratorConfig::pooling).
    pub pooling: Pooling,
}

impl SagaHooks for Hooks {
    async fn completed(&self, tx: &mut PgConnection, saga: &SagaRecord) -> Result<(), HookError> {
        set_status(tx, saga.saga_id, "confirmed", self.pooling).await
    }

    async fn compensated(&self, tx: &mut PgConnection, saga: &SagaRecord) -> Result<(), HookError> {
        set_status(tx, saga.saga_id, "cancelled", self.pooling).await
    }
}

async fn set_status(
    tx: &mut PgConnection,
    order_id: Uuid,
    status: &str,
    pooling: Pooling,
) -> Result<(), HookError> {
    // Only from pending: a second end of one order is a bug that must fail loudly.
    let updated = sqlx::query(
        "UPDATE shop_orders SET status = $2, updated_at = now() \
         WHERE order_id = $1 AND status = 'pending'",
    )
    .persistent(pooling.named_statements())
    .bind(order_id)
    .bind(status)
    .execute(&mut *tx)
    .await?;
    if updated.rows_affected() != 1 {
        return Err(HookError(format!("order {order_id} is not pending")));
    }
    Ok(())
}
