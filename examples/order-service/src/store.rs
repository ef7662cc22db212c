//! The order commands: each one transaction holding the order change, its outbox event and the
//! stored response of the command.

use handoff::postgres::EnqueueCall;
use handoff::{EnqueueError, NewEvent, Outbox, ValidationError};
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use uuid::Uuid;

use crate::events::{OrderCancelled, OrderCreatedVersion, OrderLineAdded};
use crate::failpoints::{self as fp, freeze_if_fired};
use crate::idempotency::{Fingerprint, IdempotencyKey};
use crate::model::{CancelOrder, CreateOrder, Invalid, Line, Order, Status};

const INSERT_ORDER_SQL: &str = include_str!("../queries/insert_order.sql");
const ADD_LINE_SQL: &str = include_str!("../queries/add_line.sql");
const CANCEL_ORDER_SQL: &str = include_str!("../queries/cancel_order.sql");

/// A response as stored with its idempotency key, and replayed to retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: serde_json::Value,
}

/// What a command did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This request ran the command; the response was stored with the key.
    Applied(StoredResponse),
    /// An earlier request with the same key and body ran it; this is its stored response.
    Replayed(StoredResponse),
}

/// Why a command was not applied. Nothing of it was written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The request breaks a rule.
    #[error("invalid request: {0}")]
    Invalid(#[from] Invalid),
    /// No such order.
    #[error("order not found")]
    NotFound,
    /// The order is cancelled; it takes no more commands.
    #[error("order is cancelled")]
    Cancelled,
    /// The key was used before for another request.
    #[error("idempotency key was used for another request")]
    KeyReused,
    /// The key's stored response vanished between the conflict and the read (cleanup ran);
    /// retrying is safe.
    #[error("idempotency key is being processed, retry")]
    KeyInFlight,
    /// The event could not be enqueued.
    #[error("while enqueueing the event: {0}")]
    Enqueue(#[from] EnqueueError),
    /// The event could not be built.
    #[error("while building the event: {0}")]
    Event(#[from] ValidationError),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// The order commands over a pool.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    outbox: Outbox,
    order_created: OrderCreatedVersion,
}

impl Store {
    /// Commands on `pool`, enqueueing through `outbox`; `OrderCreated` is written in its
    /// current version.
    pub fn new(pool: PgPool, outbox: Outbox) -> Self {
        Self {
            pool,
            outbox,
            order_created: OrderCreatedVersion::default(),
        }
    }

    /// The same store writing `OrderCreated` in `version`: an instance not yet upgraded keeps
    /// writing version 1 while the others write version 2.
    #[must_use]
    pub fn writing_order_created(mut self, version: OrderCreatedVersion) -> Self {
        self.order_created = version;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates an order and its `OrderCreated` event, once per idempotency key.
    ///
    /// # Errors
    ///
    /// [`CommandError`]; nothing is written on error.
    pub async fn create_order(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        request: &CreateOrder,
    ) -> Result<Outcome, CommandError> {
        request.validate()?;
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let created = create_order_in_tx_as(
            &mut tx,
            &self.outbox,
            self.order_created,
            key,
            fingerprint,
            request,
        )
        .await?;
        match created {
            Some(response) => {
                freeze_if_fired(fp::BEFORE_COMMIT).await;
                tx.commit().await?;
                freeze_if_fired(fp::AFTER_COMMIT).await;
                Ok(Outcome::Applied(response))
            }
            None => {
                tx.rollback().await?;
                replay(&mut conn, key, fingerprint, self.named()).await
            }
        }
    }

    /// Adds a line to an open order and emits `OrderLineAdded`, once per idempotency key.
    ///
    /// # Errors
    ///
    /// [`CommandError`]; nothing is written on error.
    pub async fn add_line(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        order_id: Uuid,
        line: &Line,
    ) -> Result<Outcome, CommandError> {
        line.validate()?;
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let mut order = match gate(&mut tx, order_id, key, fingerprint, self.named()).await? {
            Gate::Run(order) => order,
            Gate::Answer(answer) => {
                tx.rollback().await?;
                return answer;
            }
        };
        order.lines.push(line.clone());
        order.total_cents += line.amount_cents();
        order.version += 1;
        let line_no = order.lines.len() as i32;
        let response = ok_response(&order);
        let event = NewEvent::from_event(
            order_id.to_string(),
            &OrderLineAdded {
                order_id,
                line_no,
                line: line.clone(),
                total_cents: order.total_cents,
            },
        )?;
        let call = self.outbox.versioned_call(order.version, &[event])?;
        let sql = ADD_LINE_SQL.replace("{event}", &call.sql(12));
        let body = response.body.to_string();
        let query = sqlx::query_as(&sql)
            .persistent(self.named())
            .bind(key.as_str())
            .bind(fingerprint.as_bytes())
            .bind(response.status as i16)
            .bind(&body)
            .bind(order_id)
            .bind(line_no)
            .bind(&line.sku)
            .bind(line.quantity)
            .bind(line.unit_price_cents)
            .bind(order.total_cents)
            .bind(order.version);
        let applied = self.apply(&mut tx, &call, query).await?;
        finish(tx, applied, response, key, fingerprint, self.named()).await
    }

    /// Cancels an open order and emits `OrderCancelled`, once per idempotency key.
    ///
    /// # Errors
    ///
    /// [`CommandError`]; nothing is written on error.
    pub async fn cancel_order(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        order_id: Uuid,
        request: &CancelOrder,
    ) -> Result<Outcome, CommandError> {
        request.validate()?;
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let mut order = match gate(&mut tx, order_id, key, fingerprint, self.named()).await? {
            Gate::Run(order) => order,
            Gate::Answer(answer) => {
                tx.rollback().await?;
                return answer;
            }
        };
        order.status = Status::Cancelled;
        order.version += 1;
        let response = ok_response(&order);
        let event = NewEvent::from_event(
            order_id.to_string(),
            &OrderCancelled {
                order_id,
                reason: request.reason.clone(),
                lines: order.lines.clone(),
            },
        )?;
        let call = self.outbox.versioned_call(order.version, &[event])?;
        let sql = CANCEL_ORDER_SQL.replace("{event}", &call.sql(7));
        let body = response.body.to_string();
        let query = sqlx::query_as(&sql)
            .persistent(self.named())
            .bind(key.as_str())
            .bind(fingerprint.as_bytes())
            .bind(response.status as i16)
            .bind(&body)
            .bind(order_id)
            .bind(order.version);
        let applied = self.apply(&mut tx, &call, query).await?;
        finish(tx, applied, response, key, fingerprint, self.named()).await
    }

    /// Runs a command statement with its outbox call bound after the command's own values;
    /// whether the command applied (false: its key already existed, nothing was written).
    async fn apply<'q>(
        &self,
        tx: &mut PgConnection,
        call: &'q EnqueueCall,
        query: QueryAs<'q, Postgres, (i64, Option<i64>), PgArguments>,
    ) -> Result<bool, CommandError> {
        let (applied, _sequence) = call
            .bind(query)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| CommandError::Enqueue(self.outbox.classify(e)))?;
        Ok(applied > 0)
    }

    /// Reads an order.
    ///
    /// # Errors
    ///
    /// [`CommandError::Database`].
    pub async fn get_order(&self, order_id: Uuid) -> Result<Option<Order>, CommandError> {
        let mut conn = self.pool.acquire().await?;
        if self.named() {
            return Ok(read_order(&mut conn, order_id, false, true).await?);
        }
        // Behind a transaction pooler: two unnamed statements, kept on one server connection.
        let mut tx = conn.begin().await?;
        let order = read_order(&mut tx, order_id, false, false).await?;
        tx.commit().await?;
        Ok(order)
    }

    /// Whether statements may be cached under a name: not when the outbox says a transaction
    /// pooler may sit in front (docs/poolers.md).
    fn named(&self) -> bool {
        self.outbox.config().pooling.named_statements()
    }
}

/// Inserts a new order, its lines, the stored response AND its `OrderCreated` event in the
/// caller's transaction, all in one statement: the outbox call rides inside the business
/// statement, so the event adds no round trip. `None` when the key already exists: nothing was
/// written, and the caller must roll back and replay the stored response.
///
/// Public so the write-path benchmark measures exactly what the service runs.
///
/// # Errors
///
/// [`CommandError`]; the transaction must then be rolled back.
pub async fn create_order_in_tx(
    tx: &mut PgConnection,
    outbox: &Outbox,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    request: &CreateOrder,
) -> Result<Option<StoredResponse>, CommandError> {
    let version = OrderCreatedVersion::default();
    create_order_in_tx_as(tx, outbox, version, key, fingerprint, request).await
}

/// [`create_order_in_tx`] writing `OrderCreated` in schema `version`.
///
/// # Errors
///
/// [`CommandError`]; the transaction must then be rolled back.
pub async fn create_order_in_tx_as(
    tx: &mut PgConnection,
    outbox: &Outbox,
    version: OrderCreatedVersion,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    request: &CreateOrder,
) -> Result<Option<StoredResponse>, CommandError> {
    let order = new_order(request);
    let event = version.event(&order)?;
    // The order's version is its event sequence, and the order row is the aggregate's lock:
    // a new order's row is invisible to every other transaction until this one commits.
    let call = outbox.versioned_call(order.version, &[event])?;
    let response = created_response(&order);
    let named = outbox.config().pooling.named_statements();
    let (written, sequence) =
        write_new_order(tx, Some(&call), &order, &response, key, fingerprint, named)
            .await
            .map_err(|e| CommandError::Enqueue(outbox.classify(e)))?;
    debug_assert!(!written || sequence == Some(order.version));
    Ok(written.then_some(response))
}

/// The business half of [`create_order_in_tx`], the same statement without the outbox call:
/// the benchmark's baseline. `None` when the key already exists.
///
/// # Errors
///
/// [`CommandError::Database`].
pub async fn insert_order_in_tx(
    tx: &mut PgConnection,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    request: &CreateOrder,
) -> Result<Option<(Order, StoredResponse)>, CommandError> {
    let order = new_order(request);
    let response = created_response(&order);
    let (written, _) = write_new_order(tx, None, &order, &response, key, fingerprint, true).await?;
    Ok(written.then_some((order, response)))
}

fn new_order(request: &CreateOrder) -> Order {
    Order {
        order_id: Uuid::now_v7(),
        customer_id: request.customer_id.clone(),
        status: Status::Open,
        lines: request.lines.clone(),
        total_cents: request.total_cents(),
        version: 1,
    }
}

fn created_response(order: &Order) -> StoredResponse {
    StoredResponse {
        status: 201,
        body: order_json(order),
    }
}

/// Runs `insert_order.sql` for `order` and its stored `response`, with the outbox call spliced
/// in when given. Returns whether the order was written and the sequence of the event enqueued.
async fn write_new_order(
    tx: &mut PgConnection,
    call: Option<&EnqueueCall>,
    order: &Order,
    response: &StoredResponse,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    named: bool,
) -> Result<(bool, Option<i64>), sqlx::Error> {
    let event_sql = call.map_or_else(|| "NULL::bigint".to_owned(), |c| c.sql(11));
    let sql = INSERT_ORDER_SQL.replace("{event}", &event_sql);
    let body = response.body.to_string();
    let skus: Vec<&str> = order.lines.iter().map(|l| l.sku.as_str()).collect();
    let quantities: Vec<i32> = order.lines.iter().map(|l| l.quantity).collect();
    let prices: Vec<i64> = order.lines.iter().map(|l| l.unit_price_cents).collect();
    let query = sqlx::query_as::<_, (i64, Option<i64>)>(&sql)
        .persistent(named)
        .bind(key.as_str())
        .bind(fingerprint.as_bytes())
        .bind(response.status as i16)
        .bind(&body)
        .bind(order.order_id)
        .bind(&order.customer_id)
        .bind(order.total_cents)
        .bind(&skus)
        .bind(&quantities)
        .bind(&prices);
    let (lines, sequence) = match call {
        Some(call) => call.bind(query).fetch_one(&mut *tx).await?,
        None => query.fetch_one(&mut *tx).await?,
    };
    Ok((lines > 0, sequence))
}

fn order_json(order: &Order) -> serde_json::Value {
    // An Order has string keys and plain values only: it always serialises.
    serde_json::to_value(order).unwrap_or_default()
}

fn ok_response(order: &Order) -> StoredResponse {
    StoredResponse {
        status: 200,
        body: order_json(order),
    }
}

/// Whether a command on an existing order runs.
enum Gate {
    /// The order is open and the key is new: run the command on this (locked) order.
    Run(Order),
    /// Answer without running: the key's stored response, or a refusal.
    Answer(Result<Outcome, CommandError>),
}

/// Takes the order's lock, then decides whether the command runs.
async fn gate(
    conn: &mut PgConnection,
    order_id: Uuid,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    named: bool,
) -> Result<Gate, sqlx::Error> {
    let order = read_order(conn, order_id, true, named).await?;
    // The key first: a retry of a command that succeeded gets its stored response, not the
    // refusal its own success now causes (a retried cancel is not "already cancelled").
    if let Some(stored) = load_response(conn, key, named).await? {
        return Ok(Gate::Answer(compare(stored, fingerprint)));
    }
    Ok(match order {
        Some(order) if order.status == Status::Open => Gate::Run(order),
        Some(_) => Gate::Answer(Err(CommandError::Cancelled)),
        None => Gate::Answer(Err(CommandError::NotFound)),
    })
}

async fn read_order(
    conn: &mut PgConnection,
    order_id: Uuid,
    for_update: bool,
    named: bool,
) -> Result<Option<Order>, sqlx::Error> {
    // The row lock on the order is the aggregate's lock: commands on one order run one at a
    // time, so the version and total computed here are still right at commit.
    let sql = if for_update {
        "SELECT customer_id, status, total_cents, version FROM orders WHERE order_id = $1 FOR UPDATE"
    } else {
        "SELECT customer_id, status, total_cents, version FROM orders WHERE order_id = $1"
    };
    let Some((customer_id, status, total_cents, version)) =
        sqlx::query_as::<_, (String, Status, i64, i64)>(sql)
            .persistent(named)
            .bind(order_id)
            .fetch_optional(&mut *conn)
            .await?
    else {
        return Ok(None);
    };
    let lines = sqlx::query_as::<_, (String, i32, i64)>(
        "SELECT sku, quantity, unit_price_cents FROM order_lines WHERE order_id = $1 ORDER BY line_no",
    )
    .persistent(named)
    .bind(order_id)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|(sku, quantity, unit_price_cents)| Line {
        sku,
        quantity,
        unit_price_cents,
    })
    .collect();
    Ok(Some(Order {
        order_id,
        customer_id,
        status,
        lines,
        total_cents,
        version,
    }))
}

/// The fingerprint and response stored under `key`, if any.
async fn load_response(
    conn: &mut PgConnection,
    key: &IdempotencyKey,
    named: bool,
) -> Result<Option<(Vec<u8>, StoredResponse)>, sqlx::Error> {
    let row: Option<(Vec<u8>, i16, serde_json::Value)> = sqlx::query_as(
        "SELECT fingerprint, response_status, response_body FROM idempotency_keys
         WHERE idempotency_key = $1",
    )
    .persistent(named)
    .bind(key.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(|(fp, status, body)| {
        (
            fp,
            StoredResponse {
                status: status as u16,
                body,
            },
        )
    }))
}

fn compare(
    (stored_fingerprint, response): (Vec<u8>, StoredResponse),
    fingerprint: &Fingerprint,
) -> Result<Outcome, CommandError> {
    if stored_fingerprint == fingerprint.as_bytes() {
        Ok(Outcome::Replayed(response))
    } else {
        Err(CommandError::KeyReused)
    }
}

/// Commits an applied command, or reads the key's stored response (committed meanwhile by
/// another request), rolls back and replays it.
async fn finish(
    mut tx: sqlx::Transaction<'_, Postgres>,
    applied: bool,
    response: StoredResponse,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    named: bool,
) -> Result<Outcome, CommandError> {
    if applied {
        freeze_if_fired(fp::BEFORE_COMMIT).await;
        tx.commit().await?;
        freeze_if_fired(fp::AFTER_COMMIT).await;
        return Ok(Outcome::Applied(response));
    }
    let stored = load_response(&mut tx, key, named).await?;
    tx.rollback().await?;
    match stored {
        Some(stored) => compare(stored, fingerprint),
        None => Err(CommandError::KeyInFlight),
    }
}

/// After a conflict on the key: the key's committed response, compared with this request.
async fn replay(
    conn: &mut PgConnection,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    named: bool,
) -> Result<Outcome, CommandError> {
    let stored = if named {
        load_response(conn, key, true).await?
    } else {
        // Behind a transaction pooler: the unnamed statement in a transaction of its own.
        let mut tx = conn.begin().await?;
        let stored = load_response(&mut tx, key, false).await?;
        tx.commit().await?;
        stored
    };
    match stored {
        Some(stored) => compare(stored, fingerprint),
        None => Err(CommandError::KeyInFlight),
    }
}
