//! The charges and their idempotency keys in PostgreSQL: each charge is written in one
//! transaction together with its key and the response its retries get.

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::idempotency::{Fingerprint, IdempotencyKey};

const CREATE_TABLES_SQL: &str = include_str!("queries/create_tables.sql");
const CLAIM_KEY_SQL: &str = include_str!("queries/claim_key.sql");
const INSERT_CHARGE_SQL: &str = include_str!("queries/insert_charge.sql");
const LOAD_KEY_SQL: &str = include_str!("queries/load_key.sql");
const LIST_CHARGES_SQL: &str = include_str!("queries/list_charges.sql");

/// The body of `POST /charges`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargeRequest {
    /// The order paid for.
    pub order_id: Uuid,
    /// The amount to charge, in cents; must be positive.
    pub amount_cents: i64,
}

/// A charge the provider made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// `ch_` and a UUID v7 in simple form.
    pub charge_id: String,
    /// The order paid for.
    pub order_id: Uuid,
    /// The amount charged, in cents.
    pub amount_cents: i64,
}

/// A response as stored with its idempotency key and replayed to retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status.
    pub status: u16,
    /// JSON body, byte for byte as first answered.
    pub body: String,
}

/// What `create_charge` did. Either way, its transaction has committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This request created the charge; the response is stored with the key.
    Created(StoredResponse),
    /// An earlier request with the same key and the same body created it; this is its stored
    /// response, and nothing was written.
    Replayed(StoredResponse),
}

impl Outcome {
    /// The response to answer.
    pub fn response(&self) -> &StoredResponse {
        match self {
            Self::Created(response) | Self::Replayed(response) => response,
        }
    }

    /// Whether the response is replayed from an earlier request.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Self::Replayed(_))
    }
}

/// Why a charge was not created or replayed. Nothing was written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChargeError {
    /// The amount is zero or negative.
    #[error("amount must be positive, got {0} cents")]
    InvalidAmount(i64),
    /// The key was used before with a different request.
    #[error("idempotency key was used for a different request")]
    KeyReused,
    /// The key conflicted but its row was gone when read: cannot happen while keys are never
    /// deleted, and safe to retry if it does.
    #[error("idempotency key is being processed, retry")]
    KeyInFlight,
    /// The database failed; the transaction was rolled back.
    #[error("while creating a charge: {0}")]
    Database(#[source] sqlx::Error),
}

/// The kind of a [`ChargeError`], to match on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ChargeErrorKind {
    /// [`ChargeError::InvalidAmount`].
    InvalidAmount,
    /// [`ChargeError::KeyReused`].
    KeyReused,
    /// [`ChargeError::KeyInFlight`].
    KeyInFlight,
    /// [`ChargeError::Database`].
    Database,
}

impl ChargeError {
    /// The kind of this error.
    pub fn kind(&self) -> ChargeErrorKind {
        match self {
            Self::InvalidAmount(_) => ChargeErrorKind::InvalidAmount,
            Self::KeyReused => ChargeErrorKind::KeyReused,
            Self::KeyInFlight => ChargeErrorKind::KeyInFlight,
            Self::Database(_) => ChargeErrorKind::Database,
        }
    }
}

impl From<sqlx::Error> for ChargeError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

/// A failure of the provider's other database operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The tables could not be created.
    #[error("while creating the provider's tables: {0}")]
    CreateTables(#[source] sqlx::Error),
    /// The charges could not be read.
    #[error("while listing charges: {0}")]
    ListCharges(#[source] sqlx::Error),
}

/// Creates the provider's tables (`provider_idempotency_keys`, `provider_charges`) when missing,
/// in the first schema of the connection's `search_path`.
///
/// # Errors
///
/// [`StoreError::CreateTables`]; nothing is created then.
///
/// # Cancel safety
///
/// Cancel safe: the transaction rolls back if the future is dropped.
pub async fn create_tables(conn: &mut PgConnection) -> Result<(), StoreError> {
    use sqlx::{Connection, Executor};

    let mut tx = conn.begin().await.map_err(StoreError::CreateTables)?;
    // No values are bound: the script is constant DDL, sent as one simple query. Through
    // `Executor::execute` rather than `raw_sql`, whose future a caller inside another `Send`
    // future (a test's setup) cannot prove `Send` for every lifetime of the connection.
    tx.execute(CREATE_TABLES_SQL)
        .await
        .map_err(StoreError::CreateTables)?;
    tx.commit().await.map_err(StoreError::CreateTables)
}

/// The charges over a pool (whose tables [`create_tables`] made).
#[derive(Debug, Clone)]
pub struct ChargeStore {
    pool: PgPool,
}

impl ChargeStore {
    /// Charges in the database of `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates a charge for `request` once per `key`: the first request with a key creates it and
    /// stores its `201` response with the key, in one transaction; a later one with the same key
    /// and request gets that response replayed and writes nothing. Concurrent requests with one
    /// key wait for the first one's transaction, so they never make two charges.
    ///
    /// Charges are NOT deduplicated by order: two keys for one order make two charges.
    ///
    /// # Errors
    ///
    /// [`ChargeError`]; nothing is written on error.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the database's sense: a dropped future rolls back, unless its commit was
    /// already sent, in which case the charge exists and a retry with the key replays it.
    pub async fn create_charge(
        &self,
        key: &IdempotencyKey,
        request: &ChargeRequest,
    ) -> Result<Outcome, ChargeError> {
        if request.amount_cents <= 0 {
            return Err(ChargeError::InvalidAmount(request.amount_cents));
        }
        let fingerprint = Fingerprint::of(request);
        let charge = Charge {
            charge_id: new_charge_id(),
            order_id: request.order_id,
            amount_cents: request.amount_cents,
        };
        let response = StoredResponse {
            status: 201,
            body: charge_json(&charge),
        };
        // The waiting on a concurrent insert of the key, and the read of the row it committed,
        // rely on READ COMMITTED; named here so a different server default cannot break them.
        let mut tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await?;
        let claimed: Option<i32> = sqlx::query_scalar(CLAIM_KEY_SQL)
            .bind(key.as_str())
            .bind(fingerprint.as_bytes())
            .bind(response.status as i16)
            .bind(&response.body)
            .fetch_optional(&mut *tx)
            .await?;
        if claimed.is_some() {
            sqlx::query(INSERT_CHARGE_SQL)
                .bind(&charge.charge_id)
                .bind(charge.order_id)
                .bind(charge.amount_cents)
                .bind(key.as_str())
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            tracing::info!(
                charge_id = %charge.charge_id,
                order_id = %charge.order_id,
                amount_cents = charge.amount_cents,
                "charge created"
            );
            return Ok(Outcome::Created(response));
        }
        // The key's transaction has committed (else the claim would still be waiting): a new
        // statement in READ COMMITTED sees its row.
        let stored: Option<(Vec<u8>, i16, String)> = sqlx::query_as(LOAD_KEY_SQL)
            .bind(key.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        tx.rollback().await?;
        match stored {
            Some((stored_fingerprint, status, body))
                if stored_fingerprint == fingerprint.as_bytes() =>
            {
                Ok(Outcome::Replayed(StoredResponse {
                    status: u16::try_from(status).unwrap_or(500),
                    body,
                }))
            }
            Some(_) => Err(ChargeError::KeyReused),
            None => Err(ChargeError::KeyInFlight),
        }
    }

    /// Every charge, in creation order.
    ///
    /// # Errors
    ///
    /// [`StoreError::ListCharges`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn list_charges(&self) -> Result<Vec<Charge>, StoreError> {
        let rows: Vec<(String, Uuid, i64)> = sqlx::query_as(LIST_CHARGES_SQL)
            .fetch_all(&self.pool)
            .await
            .map_err(StoreError::ListCharges)?;
        Ok(rows
            .into_iter()
            .map(|(charge_id, order_id, amount_cents)| Charge {
                charge_id,
                order_id,
                amount_cents,
            })
            .collect())
    }
}

/// A new charge id: `ch_` and a UUID v7 in simple form, so ids sort roughly by creation time.
fn new_charge_id() -> String {
    format!("ch_{}", Uuid::now_v7().simple())
}

fn charge_json(charge: &Charge) -> String {
    // Built as a Value, whose Display cannot fail, rather than through a fallible serialiser.
    serde_json::json!({
        "charge_id": charge.charge_id,
        "order_id": charge.order_id.to_string(),
        "amount_cents": charge.amount_cents,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charge_ids_are_ch_and_a_simple_uuid_v7() {
        let id = new_charge_id();
        let uuid = id.strip_prefix("ch_").expect("the ch_ prefix");
        assert_eq!(uuid.len(), 32);
        assert_eq!(Uuid::parse_str(uuid).unwrap().get_version_num(), 7);
    }

    #[test]
    fn the_charge_body_round_trips() {
        let charge = Charge {
            charge_id: new_charge_id(),
            order_id: Uuid::now_v7(),
            amount_cents: 1250,
        };
        let parsed: Charge = serde_json::from_str(&charge_json(&charge)).unwrap();
        assert_eq!(parsed, charge);
    }
}
