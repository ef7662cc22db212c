//! The payments service: charges the payment provider for a saga, and marks the charge
//! refunded as the compensation.
//!
//! The charge cannot join the service's transaction, so it goes out under the idempotency key
//! `saga-<saga id>-charge`: the same for every attempt and every resend of the command, so an
//! ambiguous answer (a timeout after the provider charged) is retried without charging twice.

use std::time::Duration;

use handoff_consumer::HandlerError;
use handoff_postgres::Pooling;
use handoff_saga::{Command, Participant, StepError};
use reqwest::Url;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use sqlx::PgConnection;
use tracing::{info, warn};

/// The tables [`TABLES`] creates, checked at start behind a connection pooler.
pub const TABLE_NAMES: &[&str] = &["payments"];

/// The service's own table.
pub const TABLES: &str = "
CREATE TABLE IF NOT EXISTS payments (
    saga_id      uuid        PRIMARY KEY,
    charge_id    text        NOT NULL UNIQUE,
    amount_cents bigint      NOT NULL,
    charged_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    refunded_at  timestamptz
);";

/// The payments participant.
#[derive(Debug, Clone)]
pub struct Payments {
    http: reqwest::Client,
    charges: Url,
    attempts: u32,
    pooling: Pooling,
}

impl Payments {
    /// Charges at `<provider>/charges`, each call bounded by `timeout`, `attempts` calls per
    /// delivery.
    ///
    /// # Errors
    ///
    /// When the URL or the HTTP client cannot be built.
    pub fn new(provider: &Url, timeout: Duration, attempts: u32) -> anyhow::Result<Self> {
        let charges = Url::parse(&format!(
            "{}/charges",
            provider.as_str().trim_end_matches('/')
        ))?;
        let http = reqwest::Client::builder().timeout(timeout).build()?;
        Ok(Self {
            http,
            charges,
            attempts: attempts.max(1),
            pooling: Pooling::Session,
        })
    }

    /// Sends its statements as `pooling` requires (the consumer's and the `SagaParticipant`'s
    /// pooling). Default: [`Pooling::Session`].
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// The charge, retried under the same key while the answer is ambiguous.
    async fn charge(&self, command: &Command, amount_cents: i64) -> Result<String, StepError> {
        #[derive(Deserialize)]
        struct Charge {
            charge_id: String,
        }
        let key = format!("saga-{}-charge", command.saga_id);
        let body = json!({ "order_id": command.saga_id, "amount_cents": amount_cents });
        let mut last = String::new();
        for attempt in 1..=self.attempts {
            let sent = self
                .http
                .post(self.charges.clone())
                .header("Idempotency-Key", &key)
                .json(&body)
                .send()
                .await;
            match sent {
                Ok(response) if response.status().is_success() => {
                    let charge: Charge = response
                        .json()
                        .await
                        .map_err(|e| StepError::Retry(HandlerError::retryable(e.to_string())))?;
                    return Ok(charge.charge_id);
                }
                Ok(response) if response.status().is_client_error() => {
                    let status = response.status();
                    let text = response.text().await.unwrap_or_default();
                    return Err(StepError::Refused(format!(
                        "the provider refused the charge ({status}): {text}"
                    )));
                }
                // A timeout, a reset, a 5xx: the charge may have happened. Only the same key
                // may ask again.
                Ok(response) => last = format!("status {}", response.status()),
                Err(error) => last = error.to_string(),
            }
            warn!(saga_id = %command.saga_id, attempt, %key, error = last, "ambiguous charge; asking again with the same key");
        }
        // Still unknown: the delivery is retried later, still with the same key.
        Err(StepError::Retry(HandlerError::retryable(format!(
            "charge still ambiguous: {last}"
        ))))
    }
}

impl Participant for Payments {
    async fn perform(
        &self,
        tx: &mut PgConnection,
        command: &Command,
    ) -> Result<Map<String, Value>, StepError> {
        if command.data["card"] == json!("declined") {
            return Err(StepError::Refused("card declined".into()));
        }
        let amount_cents = command.data["amount_cents"]
            .as_i64()
            .ok_or_else(|| StepError::Refused("no amount_cents".into()))?;
        let charge_id = self.charge(command, amount_cents).await?;
        sqlx::query("INSERT INTO payments (saga_id, charge_id, amount_cents) VALUES ($1, $2, $3)")
            .persistent(self.pooling.named_statements())
            .bind(command.saga_id)
            .bind(&charge_id)
            .bind(amount_cents)
            .execute(&mut *tx)
            .await?;
        info!(saga_id = %command.saga_id, charge_id, amount_cents, "charged");
        let mut data = Map::new();
        data.insert("charge_id".into(), json!(charge_id));
        Ok(data)
    }

    async fn compensate(
        &self,
        tx: &mut PgConnection,
        command: &Command,
    ) -> Result<Map<String, Value>, StepError> {
        // The fake provider has no refund API; the refund is recorded here, once.
        sqlx::query(
            "UPDATE payments SET refunded_at = now() WHERE saga_id = $1 AND refunded_at IS NULL",
        )
        .persistent(self.pooling.named_statements())
        .bind(command.saga_id)
        .execute(&mut *tx)
        .await?;
        Ok(Map::new())
    }
}
