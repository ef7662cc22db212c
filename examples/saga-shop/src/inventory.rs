//! The inventory service: reserves stock for a saga, and releases it as the compensation.

use handoff_postgres::Pooling;
use handoff_saga::{Command, Participant, StepError};
use serde_json::{json, Map, Value};
use sqlx::PgConnection;

/// The tables [`TABLES`] creates, checked at start behind a connection pooler.
pub const TABLE_NAMES: &[&str] = &["stock", "reservations", "release_failures"];

/// The service's own tables.
pub const TABLES: &str = "
CREATE TABLE IF NOT EXISTS stock (
    sku     text    PRIMARY KEY,
    on_hand integer NOT NULL CHECK (on_hand >= 0)
);
CREATE TABLE IF NOT EXISTS reservations (
    saga_id     uuid        PRIMARY KEY,
    sku         text        NOT NULL,
    quantity    integer     NOT NULL,
    reserved_at timestamptz NOT NULL DEFAULT now(),
    released_at timestamptz
);
-- Scripted failure: the release of these SKUs is refused (the warehouse system rejects it),
-- for as long as the row is here.
CREATE TABLE IF NOT EXISTS release_failures (
    sku text PRIMARY KEY
);";

/// The inventory participant.
#[derive(Debug, Clone, Copy, Default)]
pub struct Inventory {
    /// How its statements are sent: the consumer's and the `SagaParticipant`'s pooling.
    pub pooling: Pooling,
}

fn line(command: &Command) -> Result<(String, i32), StepError> {
    let sku = command.data["sku"].as_str();
    let quantity = command.data["quantity"]
        .as_i64()
        .and_then(|q| i32::try_from(q).ok());
    match (sku, quantity) {
        (Some(sku), Some(quantity)) if quantity > 0 => Ok((sku.to_owned(), quantity)),
        _ => Err(StepError::Refused(format!(
            "no valid sku and quantity in {}",
            command.data
        ))),
    }
}

impl Participant for Inventory {
    async fn perform(
        &self,
        tx: &mut PgConnection,
        command: &Command,
    ) -> Result<Map<String, Value>, StepError> {
        let (sku, quantity) = line(command)?;
        let taken =
            sqlx::query("UPDATE stock SET on_hand = on_hand - $2 WHERE sku = $1 AND on_hand >= $2")
                .persistent(self.pooling.named_statements())
                .bind(&sku)
                .bind(quantity)
                .execute(&mut *tx)
                .await?;
        if taken.rows_affected() == 0 {
            return Err(StepError::Refused(format!("not enough {sku} in stock")));
        }
        sqlx::query("INSERT INTO reservations (saga_id, sku, quantity) VALUES ($1, $2, $3)")
            .persistent(self.pooling.named_statements())
            .bind(command.saga_id)
            .bind(&sku)
            .bind(quantity)
            .execute(&mut *tx)
            .await?;
        let mut data = Map::new();
        data.insert("reserved".into(), json!(quantity));
        Ok(data)
    }

    async fn compensate(
        &self,
        tx: &mut PgConnection,
        command: &Command,
    ) -> Result<Map<String, Value>, StepError> {
        let (sku, _) = line(command)?;
        let refused: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM release_failures WHERE sku = $1)")
                .persistent(self.pooling.named_statements())
                .bind(&sku)
                .fetch_one(&mut *tx)
                .await?;
        if refused {
            return Err(StepError::Refused(format!(
                "the warehouse system refuses to release {sku}"
            )));
        }
        let released: Option<(String, i32)> = sqlx::query_as(
            "UPDATE reservations SET released_at = now() \
             WHERE saga_id = $1 AND released_at IS NULL RETURNING sku, quantity",
        )
        .persistent(self.pooling.named_statements())
        .bind(command.saga_id)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((sku, quantity)) = released {
            sqlx::query("UPDATE stock SET on_hand = on_hand + $2 WHERE sku = $1")
                .persistent(self.pooling.named_statements())
                .bind(&sku)
                .bind(quantity)
                .execute(&mut *tx)
                .await?;
        }
        Ok(Map::new())
    }
}
