//! The code `docs/quickstart.md` walks through: an axum + sqlx service that writes an order and
//! its `OrderPlaced` event in one transaction, and a consumer (its own database, the inbox) that
//! creates a shipment once per order. The relay between them is the `handoff relay` command (or
//! [`handoff::relay`] embedded, as the test does).
//!
//! Place in the layout: an example, apart from the library crates; its test runs the page's flow
//! against a real PostgreSQL and NATS so the page cannot drift from the API.

use std::future::Future;
use std::net::SocketAddr;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use handoff::consumer::{Consumer, ConsumerConfig, Handler, HandlerError};
use handoff::core::intake::ReceivedEvent;
use handoff::nats::{IntakeConfig, JetStreamIntake};
// `MigrateError` is handoff's; `MigrationError` (below) is this crate's, and wraps it.
use handoff::{
    EnqueueError, EnqueueErrorKind, Event, EventCatalog, MigrateError, Migrator, NewEvent, Outbox,
    OutboxConfig, Schema, ValidationError,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

// --- The event -----------------------------------------------------------------------------

/// Published when an order is placed; the consumer decodes the same struct.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The order's id, also the event's aggregate id.
    pub order_id: String,
    /// Who placed it.
    pub customer_id: String,
    /// Its total, in cents.
    pub total_cents: i64,
}

impl Event for OrderPlaced {
    const AGGREGATE_TYPE: &'static str = "order";
    const EVENT_TYPE: &'static str = "OrderPlaced";
    const SCHEMA_VERSION: i32 = 1;
}

/// The outbox the service enqueues through: default settings, the events it may write.
pub fn outbox() -> Outbox {
    let catalog = EventCatalog::new().with::<OrderPlaced>();
    // The default configuration is valid by construction.
    Outbox::new(OutboxConfig::default(), catalog).expect("default outbox config is valid")
}

// --- Migrations ----------------------------------------------------------------------------

/// Why a database could not be brought up to date.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// handoff's own migrations (recorded in `handoff_migrations`).
    #[error("while applying handoff's migrations: {0}")]
    Handoff(#[from] MigrateError),
    /// The application's own `sqlx::migrate!` set (recorded in `_sqlx_migrations`).
    #[error("while applying the application's migrations: {0}")]
    App(#[from] sqlx::migrate::MigrateError),
    /// Taking a connection.
    #[error("while connecting: {0}")]
    Connect(#[from] sqlx::Error),
}

/// At the service's start: handoff's tables, then the service's own.
///
/// # Errors
///
/// When either set of migrations fails.
///
/// # Cancel safety
///
/// Not cancel safe: close the connection if the future is dropped mid-run.
pub async fn migrate_service(pool: &PgPool) -> Result<(), MigrationError> {
    let mut conn = pool.acquire().await?;
    // Recorded in `handoff_migrations`, under an advisory lock; safe to run from every replica.
    Migrator::handoff(Schema::default()).run(&mut conn).await?;
    // Recorded in `_sqlx_migrations`: the two sets never share version numbers.
    sqlx::migrate!("./migrations/service")
        .run(&mut *conn)
        .await?;
    Ok(())
}

// --- The HTTP handler ----------------------------------------------------------------------

/// What the handlers share: the pool and the outbox (both cheap to clone).
#[derive(Clone)]
pub struct AppState {
    /// The service's database, handoff's tables included.
    pub pool: PgPool,
    /// The outbox events are enqueued through.
    pub outbox: Outbox,
}

/// The service's routes: `POST /orders`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/orders", post(place_order))
        .with_state(state)
}

/// The body of `POST /orders`.
#[derive(Debug, Deserialize)]
pub struct PlaceOrder {
    /// Who places the order.
    pub customer_id: String,
    /// Its total, in cents; above zero.
    pub total_cents: i64,
}

/// The answer to `POST /orders`: the new order's id.
#[derive(Debug, Serialize, Deserialize)]
pub struct OrderCreated {
    /// The new order's id.
    pub order_id: String,
}

/// Why an order was not placed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlaceError {
    /// The request is refused as it stands.
    #[error("invalid order: {0}")]
    Invalid(&'static str),
    /// `NewEvent::from_event` refused the event: its payload did not serialise.
    #[error("while building the event: {0}")]
    Event(#[from] ValidationError),
    /// The event could not be enqueued.
    #[error("while enqueueing the event: {0}")]
    Enqueue(#[from] EnqueueError),
    /// The order's own statements or the commit failed.
    #[error("while writing the order: {0}")]
    Database(#[from] sqlx::Error),
}

/// `POST /orders`: the order and its event in one transaction, retried once when it lost a race.
pub async fn place_order(
    State(app): State<AppState>,
    Json(request): Json<PlaceOrder>,
) -> Result<(StatusCode, Json<OrderCreated>), PlaceError> {
    let order_id = match write_order(&app, &request).await {
        // A serialisation or deadlock race: the transaction was rolled back as a whole, so
        // running it again is safe. Once; after that the client decides (503, Retry-After).
        Err(PlaceError::Enqueue(e)) if e.is_retryable() => {
            tracing::info!(error = %e, "order lost a race, retrying once");
            write_order(&app, &request).await?
        }
        result => result?,
    };
    Ok((StatusCode::CREATED, Json(OrderCreated { order_id })))
}

/// One attempt: the order row and its `OrderPlaced` in ONE transaction.
async fn write_order(app: &AppState, request: &PlaceOrder) -> Result<String, PlaceError> {
    if request.customer_id.is_empty() {
        return Err(PlaceError::Invalid("customer_id is empty"));
    }
    if request.total_cents <= 0 {
        return Err(PlaceError::Invalid("total_cents must be above zero"));
    }
    let order_id = uuid::Uuid::now_v7().to_string();
    let event = NewEvent::from_event(
        &order_id,
        &OrderPlaced {
            order_id: order_id.clone(),
            customer_id: request.customer_id.clone(),
            total_cents: request.total_cents,
        },
    )?;
    let mut tx = app.pool.begin().await?;
    sqlx::query("INSERT INTO orders (id, customer_id, total_cents) VALUES ($1, $2, $3)")
        .bind(&order_id)
        .bind(&request.customer_id)
        .bind(request.total_cents)
        .execute(&mut *tx)
        .await?;
    // In the caller's transaction; never commits. On an error `tx` is dropped: rolled back,
    // order row included.
    app.outbox.enqueue(&mut tx, &[event]).await?;
    tx.commit().await?;
    Ok(order_id)
}

impl IntoResponse for PlaceError {
    fn into_response(self) -> Response {
        let retry = [(header::RETRY_AFTER, "1")];
        match &self {
            Self::Invalid(reason) => (StatusCode::UNPROCESSABLE_ENTITY, *reason).into_response(),
            // Found before any SQL ran: a payload over the size limit, an unknown event type.
            Self::Enqueue(e) if matches!(e.kind(), EnqueueErrorKind::Invalid(_)) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "the order's event is refused",
            )
                .into_response(),
            Self::Enqueue(e) if e.is_retryable() => {
                (StatusCode::SERVICE_UNAVAILABLE, retry, "busy, retry").into_response()
            }
            Self::Database(sqlx::Error::PoolTimedOut) => {
                (StatusCode::SERVICE_UNAVAILABLE, retry, "overloaded, retry").into_response()
            }
            // The details go to the log, never to the client.
            _ => {
                tracing::error!(error = %self, "placing an order failed");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
            }
        }
    }
}

// --- The consumer --------------------------------------------------------------------------

/// At the consumer's start, in ITS OWN database: handoff's tables (the inbox among them), then
/// the consumer's own.
///
/// # Errors
///
/// When either set of migrations fails.
///
/// # Cancel safety
///
/// Not cancel safe: close the connection if the future is dropped mid-run.
pub async fn migrate_consumer(pool: &PgPool) -> Result<(), MigrationError> {
    let mut conn = pool.acquire().await?;
    // There is no inbox-only set: the full set also creates the outbox tables, which stay
    // empty unless this consumer enqueues events of its own.
    Migrator::handoff(Schema::default()).run(&mut conn).await?;
    sqlx::migrate!("./migrations/consumer")
        .run(&mut *conn)
        .await?;
    Ok(())
}

/// The consumer's effect: one shipment per order placed.
pub struct Shipping;

impl Handler for Shipping {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        match (event.event_type.as_str(), event.schema_version) {
            (OrderPlaced::EVENT_TYPE, 1) => {
                // A payload this code cannot read never will: quarantine it, do not retry.
                let order: OrderPlaced = serde_json::from_str(&event.payload)
                    .map_err(|e| HandlerError::permanent(format!("unreadable OrderPlaced: {e}")))?;
                // Through `tx`: the shipment, the inbox row and the aggregate's sequence commit
                // together, so a redelivered event finds its inbox row and is skipped.
                sqlx::query("INSERT INTO shipments (order_id, customer_id) VALUES ($1, $2)")
                    .bind(&order.order_id)
                    .bind(&order.customer_id)
                    .execute(&mut *tx)
                    .await?; // a sqlx::Error is retryable
                Ok(())
            }
            (OrderPlaced::EVENT_TYPE, version) => Err(HandlerError::permanent(format!(
                "OrderPlaced version {version} is not known here"
            ))),
            // Other events of the stream: nothing to do, recorded as processed.
            _ => Ok(()),
        }
    }
}

/// Where the consumer reads: the relay's stream and subject prefix.
#[derive(Debug, Clone)]
pub struct Bus {
    /// The NATS server, such as `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// The relay's `--stream`.
    pub stream: String,
    /// The relay's `--subject-prefix`.
    pub subject_prefix: String,
}

/// Why the consumer did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The JetStream pull consumer could not be set up.
    #[error("while connecting to NATS: {0}")]
    Intake(#[from] handoff::nats::IntakeConnectError),
    /// The consumer's settings were refused.
    #[error("consumer settings refused: {0}")]
    Config(#[from] handoff::consumer::ConfigError),
}

/// Runs the `shipping` consumer on `pool` (migrated with [`migrate_consumer`]) until `shutdown`.
///
/// # Errors
///
/// When NATS cannot be reached or the settings are refused; once running, failures are retried
/// or quarantined, never returned.
///
/// # Cancel safety
///
/// Cancel safe in effect: an event whose transaction did not commit is delivered again. Prefer
/// `shutdown`, which lets events in flight finish.
pub async fn run_consumer(
    pool: PgPool,
    bus: &Bus,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ConsumerError> {
    let intake = JetStreamIntake::connect(
        &bus.nats_url,
        IntakeConfig {
            stream: bus.stream.clone(),
            subject_prefix: bus.subject_prefix.clone(),
            // Every instance of the consumer shares the durable (and the work).
            durable_name: "shipping".into(),
            filter_subject: Some(format!("{}.order.>", bus.subject_prefix)),
            ..IntakeConfig::default()
        },
    )
    .await?;
    let config = ConsumerConfig {
        name: "shipping".into(),
        ..ConsumerConfig::default()
    };
    Consumer::new(config, pool, Shipping)?
        .run(intake, shutdown)
        .await;
    Ok(())
}

/// Serves the process's metrics (`handoff_consumer_*` among them) at `http://addr/metrics`.
/// Call it before [`Consumer::new`]: the consumer registers its metrics with the recorder
/// installed at that moment.
///
/// # Errors
///
/// When a recorder is already installed or `addr` cannot be bound.
pub fn serve_metrics(addr: SocketAddr) -> Result<(), metrics_exporter_prometheus::BuildError> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
}

#[cfg(test)]
mod tests {
    use handoff::postgres::DriverError;

    use super::*;

    fn status_and_retry(error: PlaceError) -> (StatusCode, Option<String>) {
        let response = error.into_response();
        let retry = response
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_owned());
        (response.status(), retry)
    }

    #[test]
    fn a_retryable_enqueue_failure_answers_503_with_retry_after() {
        let conflict = EnqueueError::Conflict(DriverError::Sqlx(sqlx::Error::PoolTimedOut));
        assert!(conflict.is_retryable());
        assert_eq!(
            status_and_retry(PlaceError::Enqueue(conflict)),
            (StatusCode::SERVICE_UNAVAILABLE, Some("1".to_owned()))
        );
        assert_eq!(
            status_and_retry(PlaceError::Enqueue(EnqueueError::SequenceTaken)),
            (StatusCode::SERVICE_UNAVAILABLE, Some("1".to_owned()))
        );
    }

    #[test]
    fn a_refused_order_or_event_answers_422_and_the_rest_500() {
        assert_eq!(
            status_and_retry(PlaceError::Invalid("customer_id is empty")).0,
            StatusCode::UNPROCESSABLE_ENTITY
        );
        // An event of a type the outbox's catalog does not hold is refused before any SQL.
        let stranger = NewEvent::new("order", "o-1", "OrderLost", 1, "{}");
        let refused = outbox().validate(&[stranger]).unwrap_err();
        assert!(matches!(refused.kind(), EnqueueErrorKind::Invalid(_)));
        assert_eq!(
            status_and_retry(PlaceError::Enqueue(refused)).0,
            StatusCode::UNPROCESSABLE_ENTITY
        );
        let missing = EnqueueError::NotMigrated {
            schema: "public".into(),
        };
        assert_eq!(
            status_and_retry(PlaceError::Enqueue(missing)),
            (StatusCode::INTERNAL_SERVER_ERROR, None)
        );
    }
}
