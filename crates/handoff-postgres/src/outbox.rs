//! Enqueue events inside the caller's own transaction.

use std::sync::Arc;

use handoff_core::{
    EventCatalog, EventId, Limits, LimitsError, NewEvent, OrderMode, ValidationError,
};
use sqlx::PgConnection;

use crate::pooler::Pooling;
use crate::schema::Schema;

/// How an [`Outbox`] is set up.
///
/// # Examples
///
/// ```
/// use handoff_postgres::{OrderMode, OutboxConfig, Schema};
///
/// let config = OutboxConfig { schema: Schema::named("events")?, ..OutboxConfig::default() };
/// assert!(config.validate().is_ok());
///
/// // Strict global order (docs/global-order.md): every event also takes the next number of
/// // one sequence over the whole outbox; run the relay with `--order global` to publish it.
/// let global = OutboxConfig { order: OrderMode::Global, ..OutboxConfig::default() };
/// assert_eq!(global.order.to_string(), "global");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct OutboxConfig {
    /// The schema holding `outbox` and `outbox_heads`. Default: the connection's `search_path`.
    pub schema: Schema,
    /// Size and shape limits checked before anything is written.
    pub limits: Limits,
    /// Per-aggregate order (the default) or strict global order. In
    /// [`OrderMode::Global`] every event also takes the next global sequence in the caller's
    /// transaction, which serialises all global-order writers on one row until they commit
    /// (needs migration 0006).
    pub order: OrderMode,
    /// [`Pooling::Transaction`] when the caller's connections may go through a transaction
    /// pooler: the enqueue statements are then sent unnamed (the caller's transaction keeps
    /// them on one server connection). Default: [`Pooling::Session`], cached named statements.
    pub pooling: Pooling,
}

impl OutboxConfig {
    /// Checks the configuration.
    ///
    /// # Errors
    ///
    /// [`LimitsError`] when a limit would refuse every event.
    pub fn validate(&self) -> Result<(), LimitsError> {
        self.limits.validate()
    }
}

/// Where one enqueued event landed in its aggregate's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// The event's id.
    pub event_id: EventId,
    /// Its position in the aggregate's history: 1 for the aggregate's first event.
    pub aggregate_sequence: i64,
}

/// Why an enqueue failed.
///
/// Validation errors are found before any SQL is sent, so the caller's transaction is untouched
/// and can go on. Any other error came from the database: the transaction is then aborted and
/// must be rolled back, which also discards everything else it wrote.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// Event `index` of the batch was refused; nothing was sent to the database.
    #[error("event {index} refused: {source}")]
    Invalid {
        /// Position of the refused event in the batch.
        index: usize,
        /// Why it was refused.
        #[source]
        source: ValidationError,
    },
    /// An event with this id is already in the outbox (a command that already committed is
    /// being run again: its own idempotency check should have caught it first).
    #[error("an event with one of these ids is already in the outbox")]
    DuplicateEventId,
    /// [`Outbox::enqueue_versioned`] was given events of several aggregates.
    #[error("enqueue_versioned takes the events of one aggregate")]
    MixedAggregates,
    /// [`Outbox::enqueue_versioned`] was given a first sequence below 1.
    #[error("sequence {0} is invalid: sequences start at 1")]
    InvalidSequence(i64),
    /// A caller-assigned sequence is already taken in this aggregate: the caller's version was
    /// stale. Re-read the aggregate and retry the whole transaction.
    #[error("a sequence given to enqueue_versioned is already used by this aggregate")]
    SequenceTaken,
    /// [`Outbox::enqueue_versioned`] (or a statement running an [`EnqueueCall`]) was given a
    /// first sequence that would leave a hole: the sequence before it was never written to this
    /// aggregate (and was not cleaned up after publishing). Nothing was written; a later event
    /// is never published past a missing one (order fails closed, migration 0011), so the
    /// database refuses it up front. The caller's version is ahead of its events: a bug in its
    /// lock rule, or events written through another path.
    #[error("enqueue_versioned would leave a hole in the aggregate's sequence: {0}")]
    SequenceGap(#[source] DriverError),
    /// [`Outbox::enqueue_versioned`] (or a statement running an [`EnqueueCall`]) was given a
    /// first sequence below one the aggregate already holds (written, or published and cleaned
    /// up), though not that sequence itself (that is [`SequenceTaken`](Self::SequenceTaken)):
    /// the caller writes the aggregate's sequences backwards. Nothing was written; accepted, the
    /// event would be published after the later ones (migration 0018). Not retryable: a lower
    /// sequence never becomes valid. Roll the transaction back.
    #[error("enqueue_versioned was given a sequence behind one the aggregate already holds: {0}")]
    SequenceBackwards(#[source] DriverError),
    /// The outbox tables do not exist in the configured schema.
    #[error("the outbox tables are missing; run `handoff migrate` (schema {schema})")]
    NotMigrated {
        /// The schema that was searched.
        schema: String,
    },
    /// The transaction lost a serialisation or deadlock race; retry the whole transaction.
    #[error("while enqueueing, the transaction conflicted with another one: {0}")]
    Conflict(#[source] DriverError),
    /// Any other database error.
    #[error("while enqueueing: {0}")]
    Database(#[source] DriverError),
}

/// An error from whichever PostgreSQL driver the caller enqueued through.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// From sqlx.
    #[error(transparent)]
    Sqlx(sqlx::Error),
    /// From tokio-postgres.
    #[cfg(feature = "tokio-postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio-postgres")))]
    #[error(transparent)]
    TokioPostgres(tokio_postgres::Error),
}

/// The kind of an [`EnqueueError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnqueueErrorKind {
    /// Refused before anything was written; see [`ValidationError::kind`].
    Invalid(handoff_core::ValidationErrorKind),
    /// See [`EnqueueError::DuplicateEventId`].
    DuplicateEventId,
    /// See [`EnqueueError::MixedAggregates`] and [`EnqueueError::InvalidSequence`]: a caller bug,
    /// found before anything was sent.
    Misuse,
    /// See [`EnqueueError::SequenceTaken`]; retrying after re-reading the aggregate can succeed.
    SequenceTaken,
    /// See [`EnqueueError::SequenceGap`]: the caller's version skips a sequence.
    SequenceGap,
    /// See [`EnqueueError::SequenceBackwards`]: the caller's version goes back.
    SequenceBackwards,
    /// See [`EnqueueError::NotMigrated`].
    NotMigrated,
    /// See [`EnqueueError::Conflict`]; retrying the transaction can succeed.
    Conflict,
    /// See [`EnqueueError::Database`].
    Database,
}

impl EnqueueError {
    /// The kind of this error.
    pub fn kind(&self) -> EnqueueErrorKind {
        match self {
            Self::Invalid { source, .. } => EnqueueErrorKind::Invalid(source.kind()),
            Self::DuplicateEventId => EnqueueErrorKind::DuplicateEventId,
            Self::MixedAggregates | Self::InvalidSequence(_) => EnqueueErrorKind::Misuse,
            Self::SequenceTaken => EnqueueErrorKind::SequenceTaken,
            Self::SequenceGap(_) => EnqueueErrorKind::SequenceGap,
            Self::SequenceBackwards(_) => EnqueueErrorKind::SequenceBackwards,
            Self::NotMigrated { .. } => EnqueueErrorKind::NotMigrated,
            Self::Conflict(_) => EnqueueErrorKind::Conflict,
            Self::Database(_) => EnqueueErrorKind::Database,
        }
    }

    /// Whether retrying the caller's whole transaction can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Conflict(_) | Self::SequenceTaken)
    }
}

/// The write side of the outbox: validates events and inserts them in the caller's transaction.
///
/// An `Outbox` is cheap to clone (the catalog and the SQL are shared) and holds no connection:
/// every call borrows the caller's.
///
/// # Examples
///
/// ```no_run
/// use handoff_core::{Event, EventCatalog, NewEvent};
/// use handoff_postgres::{Outbox, OutboxConfig};
///
/// #[derive(serde::Serialize)]
/// struct OrderCreated { customer_id: String }
/// impl Event for OrderCreated {
///     const AGGREGATE_TYPE: &'static str = "order";
///     const EVENT_TYPE: &'static str = "OrderCreated";
///     const SCHEMA_VERSION: i32 = 1;
/// }
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = Outbox::new(OutboxConfig::default(), EventCatalog::new().with::<OrderCreated>())?;
///
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id, customer_id) VALUES ($1, $2)")
///     .bind("o-1")
///     .bind("c-1")
///     .execute(&mut *tx)
///     .await?;
/// let event = NewEvent::from_event("o-1", &OrderCreated { customer_id: "c-1".into() })?;
/// outbox.enqueue(&mut tx, &[event]).await?;
/// tx.commit().await?; // the order and its event, or neither
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: OutboxConfig,
    catalog: EventCatalog,
    enqueue_sql: String,
    /// The enqueue statement of global order mode.
    enqueue_global_sql: String,
    /// The global head update of global order mode.
    global_reserve_sql: String,
}

/// The enqueue statement, with `{schema}` to be replaced by the schema prefix.
const ENQUEUE_SQL: &str = include_str!("../queries/enqueue.sql");
/// [`ENQUEUE_SQL`] with a global sequence per event.
const ENQUEUE_GLOBAL_SQL: &str = include_str!("../queries/enqueue_global.sql");
/// Reserves places in the global lane.
const GLOBAL_RESERVE_SQL: &str = include_str!("../queries/global_reserve.sql");

impl Outbox {
    /// An outbox accepting the events declared in `catalog`.
    ///
    /// # Errors
    ///
    /// [`LimitsError`] when the configuration is invalid.
    pub fn new(config: OutboxConfig, catalog: EventCatalog) -> Result<Self, LimitsError> {
        config.validate()?;
        let prefix = config.schema.prefix();
        let enqueue_sql = ENQUEUE_SQL.replace("{schema}", &prefix);
        let enqueue_global_sql = ENQUEUE_GLOBAL_SQL.replace("{schema}", &prefix);
        let global_reserve_sql = GLOBAL_RESERVE_SQL.replace("{schema}", &prefix);
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                catalog,
                enqueue_sql,
                enqueue_global_sql,
                global_reserve_sql,
            }),
        })
    }

    /// Whether statements may be cached under a name (not behind a transaction pooler).
    fn named_statements(&self) -> bool {
        self.inner.config.pooling.named_statements()
    }

    /// The configuration this outbox was built with.
    pub fn config(&self) -> &OutboxConfig {
        &self.inner.config
    }

    /// The declared events.
    pub fn catalog(&self) -> &EventCatalog {
        &self.inner.catalog
    }

    /// Checks every event of a batch, without touching the database.
    ///
    /// # Errors
    ///
    /// [`EnqueueError::Invalid`] for the first refused event.
    pub fn validate(&self, events: &[NewEvent]) -> Result<(), EnqueueError> {
        for (index, event) in events.iter().enumerate() {
            event
                .validate(&self.inner.catalog, &self.inner.config.limits)
                .map_err(|source| EnqueueError::Invalid { index, source })?;
        }
        Ok(())
    }

    /// Enqueues `events` in the caller's open transaction, through sqlx. Never commits.
    ///
    /// Each aggregate's events get the next consecutive sequences, in the order given; one round
    /// trip per distinct aggregate in the batch. Until the caller's transaction ends, the head row
    /// of every aggregate touched stays locked, so other writers of those aggregates wait (and
    /// then continue after these sequences, with no gap and no unique violation). Aggregates are
    /// locked in a fixed order within a batch; across calls, lock aggregates in a consistent order
    /// as with any row locks, or retry on [`EnqueueErrorKind::Conflict`].
    ///
    /// Pass `&mut *tx` for an `sqlx::Transaction`, or a connection on which the caller already
    /// ran `BEGIN`. Outside a transaction the statement autocommits, which is almost never what
    /// an outbox user wants.
    ///
    /// In [`OrderMode::Global`] the batch first reserves its global sequences (one more round
    /// trip), in the order given, and the global head row stays locked until the transaction
    /// ends: every other global-order writer waits for this commit. Enqueue as late in the
    /// transaction as possible, and do not lock other rows after it that another global-order
    /// writer may hold while it waits here.
    ///
    /// # Errors
    ///
    /// [`EnqueueError::Invalid`] before anything is sent (the transaction can go on); after a
    /// database error the transaction is aborted and must be rolled back.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropping the future can leave some aggregates enqueued and not others.
    /// Roll the transaction back if the call is cancelled.
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
    ) -> Result<Vec<Enqueued>, EnqueueError> {
        self.validate(events)?;
        let mut groups = group_by_aggregate(events, &self.inner.config.limits);
        let global = self.inner.config.order == OrderMode::Global && !events.is_empty();
        if global {
            let last: i64 = sqlx::query_scalar(&self.inner.global_reserve_sql)
                .persistent(self.named_statements())
                .bind(events.len() as i64)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| self.classify_sqlx(e))?;
            assign_global(&mut groups, events, last);
        }
        let sql = if global {
            &self.inner.enqueue_global_sql
        } else {
            &self.inner.enqueue_sql
        };
        let mut enqueued = Vec::with_capacity(events.len());
        for group in groups {
            let mut query = sqlx::query_as(sql)
                .persistent(self.named_statements())
                .bind(group.aggregate_type)
                .bind(group.aggregate_id)
                .bind(&group.event_ids)
                .bind(&group.event_types)
                .bind(&group.schema_versions)
                .bind(&group.payloads)
                .bind(&group.headers);
            if global {
                query = query.bind(&group.global_sequences);
            }
            let rows: Vec<(uuid::Uuid, i64)> = query
                .fetch_all(&mut *conn)
                .await
                .map_err(|e| self.classify_sqlx(e))?;
            collect(&mut enqueued, rows);
        }
        Ok(order_as_given(events, enqueued))
    }

    /// Enqueues events of ONE aggregate at sequences the caller assigns: `first_sequence`,
    /// `first_sequence + 1`, ... in the order given. Never commits.
    ///
    /// For callers whose aggregate row already carries a version that they lock in the same
    /// transaction (`SELECT ... FOR UPDATE`, or the insert of a new aggregate): the version is
    /// the sequence, the caller's lock is the aggregate's lock rule (design W3), and the
    /// `outbox_heads` row is neither read nor written, which saves a heap and an index write per
    /// transaction. Use one mode per aggregate type: [`enqueue`](Self::enqueue) keeps its own
    /// count in `outbox_heads` and does not see sequences written here.
    ///
    /// In [`OrderMode::Global`] the events also take the next global sequences (through
    /// `handoff_enqueue_versioned_global`, migration 0006), which locks the global head row
    /// until the transaction ends, after the caller's own aggregate lock.
    ///
    /// # Errors
    ///
    /// [`EnqueueError::Invalid`] before anything is sent, also when the events are not all of one
    /// aggregate or `first_sequence < 1`; [`EnqueueError::SequenceTaken`] when a sequence is
    /// already used (the caller's version was stale: its lock rule is broken);
    /// [`EnqueueError::SequenceGap`] when `first_sequence - 1` was never written to the
    /// aggregate (nothing is written: a hole would hold every later event);
    /// [`EnqueueError::SequenceBackwards`] when the aggregate already holds a sequence above
    /// `first_sequence`, or cleaned one at or above it (nothing is written: the event would be
    /// published after the later ones); database errors
    /// as [`enqueue`](Self::enqueue). An aggregate the outbox has never seen (no row, no
    /// cleanup watermark) may start at any sequence: its earlier history may have been cleaned
    /// before migration 0011.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the sense that the single statement either ran or not; roll the
    /// transaction back if the call is cancelled.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::{EventCatalog, NewEvent};
    /// # use handoff_postgres::{Outbox, OutboxConfig};
    /// # async fn example(pool: sqlx::PgPool, outbox: Outbox) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// let version: i64 = sqlx::query_scalar(
    ///     "UPDATE orders SET version = version + 1 WHERE id = $1 RETURNING version",
    /// )
    /// .bind("o-1")
    /// .fetch_one(&mut *tx)
    /// .await?;
    /// let event = NewEvent::new("order", "o-1", "OrderCancelled", 1, "{}");
    /// outbox.enqueue_versioned(&mut tx, version, &[event]).await?;
    /// tx.commit().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn enqueue_versioned(
        &self,
        conn: &mut PgConnection,
        first_sequence: i64,
        events: &[NewEvent],
    ) -> Result<Vec<Enqueued>, EnqueueError> {
        // The same function versioned_call splices into callers' statements, called alone:
        // the versioned insert is written once, in the migration.
        let call = self.versioned_call(first_sequence, events)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!("SELECT {}", call.sql(1));
        call.bind(sqlx::query_scalar::<_, i64>(&sql).persistent(self.named_statements()))
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| self.classify_sqlx(e))?;
        Ok(sequenced(events, first_sequence))
    }

    /// Validates a batch for [`enqueue_versioned`](Self::enqueue_versioned) and returns it as a
    /// SQL call to splice into the caller's own statement, so that the business write and the
    /// events go to the server in ONE statement and ONE round trip.
    ///
    /// The call (`handoff_enqueue_versioned(...)`, installed by the migrations; in
    /// [`OrderMode::Global`] `handoff_enqueue_versioned_global(...)`, which also assigns the
    /// global sequences) returns the last sequence written. Calling it from a scalar subquery over the caller's data-modifying CTE
    /// enqueues the events only when the business write happened (an idempotent command whose
    /// key already exists writes nothing at all). Same rules and errors as `enqueue_versioned`,
    /// raised when the statement runs.
    ///
    /// # Errors
    ///
    /// [`EnqueueError::Invalid`], [`EnqueueError::MixedAggregates`],
    /// [`EnqueueError::InvalidSequence`], before anything is sent. Map the statement's own
    /// error with [`classify`](Self::classify).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use handoff_core::NewEvent;
    /// # use handoff_postgres::Outbox;
    /// # async fn example(pool: sqlx::PgPool, outbox: Outbox) -> Result<(), Box<dyn std::error::Error>> {
    /// let event = NewEvent::new("order", "o-1", "OrderCreated", 1, "{}");
    /// let call = outbox.versioned_call(1, &[event])?;
    /// let sql = format!(
    ///     "WITH new_order AS (INSERT INTO orders (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING id)
    ///      SELECT (SELECT {} FROM new_order)",
    ///     call.sql(2),
    /// );
    /// let mut tx = pool.begin().await?;
    /// let last: Option<i64> = call
    ///     .bind(sqlx::query_scalar(&sql).bind("o-1"))
    ///     .fetch_one(&mut *tx)
    ///     .await
    ///     .map_err(|e| outbox.classify(e))?;
    /// tx.commit().await?;
    /// assert_eq!(last, Some(1)); // None: the order existed, nothing was enqueued
    /// # Ok(())
    /// # }
    /// ```
    pub fn versioned_call(
        &self,
        first_sequence: i64,
        events: &[NewEvent],
    ) -> Result<EnqueueCall, EnqueueError> {
        let group = self.versioned_batch(first_sequence, events)?;
        Ok(EnqueueCall {
            function: self
                .inner
                .config
                .schema
                .qualify(match self.inner.config.order {
                    OrderMode::Aggregate => "handoff_enqueue_versioned",
                    OrderMode::Global => "handoff_enqueue_versioned_global",
                }),
            aggregate_type: group.as_ref().map_or("", |g| g.aggregate_type).to_owned(),
            aggregate_id: group.as_ref().map_or("", |g| g.aggregate_id).to_owned(),
            first_sequence,
            event_ids: group
                .as_ref()
                .map(|g| g.event_ids.clone())
                .unwrap_or_default(),
            event_types: group
                .as_ref()
                .map(|g| g.event_types.iter().map(|t| t.to_string()).collect())
                .unwrap_or_default(),
            schema_versions: group
                .as_ref()
                .map(|g| g.schema_versions.clone())
                .unwrap_or_default(),
            payloads: group
                .as_ref()
                .map(|g| g.payloads.iter().map(|p| p.to_string()).collect())
                .unwrap_or_default(),
            headers: group.map(|g| g.headers).unwrap_or_default(),
        })
    }

    /// Sorts a database error from a statement that ran an [`EnqueueCall`] into an
    /// [`EnqueueError`] (`SequenceTaken`, `SequenceGap`, `SequenceBackwards`, `DuplicateEventId`,
    /// `NotMigrated`, `Conflict`, or `Database`).
    pub fn classify(&self, error: sqlx::Error) -> EnqueueError {
        self.classify_sqlx(error)
    }

    /// Enqueues `events` in the caller's open tokio-postgres transaction. Never commits.
    ///
    /// Behaves as [`enqueue`](Self::enqueue). The statement is sent with `query_typed`, in one
    /// round trip per aggregate and without a separate prepare. Because tokio-postgres pipelines
    /// concurrent queries on one connection, the enqueue can be joined with the caller's own
    /// statements (`tokio::try_join!`) to add no round trip at all to the transaction.
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Self::enqueue).
    ///
    /// # Cancel safety
    ///
    /// As [`enqueue`](Self::enqueue).
    #[cfg(feature = "tokio-postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio-postgres")))]
    pub async fn enqueue_tokio_postgres<C>(
        &self,
        client: &C,
        events: &[NewEvent],
    ) -> Result<Vec<Enqueued>, EnqueueError>
    where
        C: tokio_postgres::GenericClient + Sync,
    {
        use tokio_postgres::types::Type;

        self.validate(events)?;
        let mut groups = group_by_aggregate(events, &self.inner.config.limits);
        let global = self.inner.config.order == OrderMode::Global && !events.is_empty();
        if global {
            let count = events.len() as i64;
            let row = client
                .query_typed_one(&self.inner.global_reserve_sql, &[(&count, Type::INT8)])
                .await
                .map_err(|e| self.classify_tokio_postgres(e))?;
            let last: i64 = row
                .try_get(0)
                .map_err(|e| EnqueueError::Database(DriverError::TokioPostgres(e)))?;
            assign_global(&mut groups, events, last);
        }
        let mut enqueued = Vec::with_capacity(events.len());
        for group in groups {
            let mut params: Vec<(&(dyn tokio_postgres::types::ToSql + Sync), Type)> = vec![
                (&group.aggregate_type, Type::TEXT),
                (&group.aggregate_id, Type::TEXT),
                (&group.event_ids, Type::UUID_ARRAY),
                (&group.event_types, Type::TEXT_ARRAY),
                (&group.schema_versions, Type::INT4_ARRAY),
                (&group.payloads, Type::TEXT_ARRAY),
                (&group.headers, Type::TEXT_ARRAY),
            ];
            let sql = if global {
                params.push((&group.global_sequences, Type::INT8_ARRAY));
                &self.inner.enqueue_global_sql
            } else {
                &self.inner.enqueue_sql
            };
            let rows = client
                .query_typed(sql, &params)
                .await
                .map_err(|e| self.classify_tokio_postgres(e))?;
            collect(&mut enqueued, tokio_postgres_rows(&rows)?);
        }
        Ok(order_as_given(events, enqueued))
    }

    /// [`enqueue_versioned`](Self::enqueue_versioned) through a tokio-postgres client or
    /// transaction, sent with `query_typed` so it pipelines with the caller's own statements.
    ///
    /// # Errors
    ///
    /// As [`enqueue_versioned`](Self::enqueue_versioned).
    ///
    /// # Cancel safety
    ///
    /// As [`enqueue_versioned`](Self::enqueue_versioned).
    #[cfg(feature = "tokio-postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio-postgres")))]
    pub async fn enqueue_versioned_tokio_postgres<C>(
        &self,
        client: &C,
        first_sequence: i64,
        events: &[NewEvent],
    ) -> Result<Vec<Enqueued>, EnqueueError>
    where
        C: tokio_postgres::GenericClient + Sync,
    {
        let call = self.versioned_call(first_sequence, events)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!("SELECT {}", call.sql(1));
        client
            .query_typed(&sql, &call.tokio_postgres_params())
            .await
            .map_err(|e| self.classify_tokio_postgres(e))?;
        Ok(sequenced(events, first_sequence))
    }

    /// The checks every caller-versioned enqueue makes before any SQL: the batch is valid, of
    /// one aggregate, and starts at a sequence of at least 1. `None` for an empty batch.
    fn versioned_batch<'a>(
        &self,
        first_sequence: i64,
        events: &'a [NewEvent],
    ) -> Result<Option<AggregateBatch<'a>>, EnqueueError> {
        self.validate(events)?;
        let mut groups = group_by_aggregate(events, &self.inner.config.limits);
        if groups.len() > 1 {
            return Err(EnqueueError::MixedAggregates);
        }
        if first_sequence < 1 {
            return Err(EnqueueError::InvalidSequence(first_sequence));
        }
        Ok(groups.pop())
    }

    fn classify_sqlx(&self, error: sqlx::Error) -> EnqueueError {
        let code = error
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned());
        let constraint = error
            .as_database_error()
            .and_then(|e| e.constraint())
            .map(str::to_owned);
        self.classify_code(
            code.as_deref(),
            constraint.as_deref(),
            DriverError::Sqlx(error),
        )
    }

    #[cfg(feature = "tokio-postgres")]
    fn classify_tokio_postgres(&self, error: tokio_postgres::Error) -> EnqueueError {
        let db = error.as_db_error();
        let code = db.map(|e| e.code().code().to_owned());
        let constraint = db.and_then(|e| e.constraint()).map(str::to_owned);
        self.classify_code(
            code.as_deref(),
            constraint.as_deref(),
            DriverError::TokioPostgres(error),
        )
    }

    fn classify_code(
        &self,
        sqlstate: Option<&str>,
        constraint: Option<&str>,
        error: DriverError,
    ) -> EnqueueError {
        match (sqlstate, constraint) {
            (Some("23505"), Some("outbox_pkey")) => EnqueueError::DuplicateEventId,
            (Some("23505"), Some("outbox_aggregate_sequence_key")) => EnqueueError::SequenceTaken,
            // Raised by handoff_check_no_hole (migration 0011).
            (Some("HO001"), _) => EnqueueError::SequenceGap(error),
            // Raised by handoff_check_no_hole (migration 0018).
            (Some("HO002"), _) => EnqueueError::SequenceBackwards(error),
            // undefined_table; undefined_function (global order mode before migration 0006)
            (Some("42P01" | "42883"), _) => EnqueueError::NotMigrated {
                schema: self
                    .inner
                    .config
                    .schema
                    .name()
                    .unwrap_or("search_path default")
                    .to_owned(),
            },
            // serialization_failure, deadlock_detected
            (Some("40001" | "40P01"), _) => EnqueueError::Conflict(error),
            _ => EnqueueError::Database(error),
        }
    }
}

/// A validated batch as a call to splice into the caller's statement; see
/// [`Outbox::versioned_call`].
#[derive(Debug, Clone)]
pub struct EnqueueCall {
    function: String,
    aggregate_type: String,
    aggregate_id: String,
    first_sequence: i64,
    event_ids: Vec<uuid::Uuid>,
    event_types: Vec<String>,
    schema_versions: Vec<i32>,
    payloads: Vec<String>,
    headers: Vec<String>,
}

impl EnqueueCall {
    /// How many placeholders the call takes.
    pub const PARAMS: usize = 8;

    /// The call, with placeholders `$first` to `$first + 7`, such as
    /// `handoff_enqueue_versioned($2::text, ..., $9::text[])`.
    pub fn sql(&self, first: usize) -> String {
        let types = [
            "text", "text", "int8", "uuid[]", "text[]", "int4[]", "text[]", "text[]",
        ];
        let args: Vec<String> = types
            .iter()
            .enumerate()
            .map(|(i, t)| format!("${}::{t}", first + i))
            .collect();
        format!("{}({})", self.function, args.join(", "))
    }

    /// Binds the call's eight values after the caller's own, in placeholder order. Works on
    /// `sqlx::query`, `query_as` and `query_scalar`.
    pub fn bind<'q, Q: Bind<'q>>(&'q self, query: Q) -> Q {
        query
            .bind_value(&self.aggregate_type)
            .bind_value(&self.aggregate_id)
            .bind_value(self.first_sequence)
            .bind_value(&self.event_ids)
            .bind_value(&self.event_types)
            .bind_value(&self.schema_versions)
            .bind_value(&self.payloads)
            .bind_value(&self.headers)
    }
}

impl EnqueueCall {
    /// The call's eight values with their types, for tokio-postgres's `query_typed`.
    #[cfg(feature = "tokio-postgres")]
    fn tokio_postgres_params(
        &self,
    ) -> [(
        &(dyn tokio_postgres::types::ToSql + Sync),
        tokio_postgres::types::Type,
    ); 8] {
        use tokio_postgres::types::Type;
        [
            (&self.aggregate_type, Type::TEXT),
            (&self.aggregate_id, Type::TEXT),
            (&self.first_sequence, Type::INT8),
            (&self.event_ids, Type::UUID_ARRAY),
            (&self.event_types, Type::TEXT_ARRAY),
            (&self.schema_versions, Type::INT4_ARRAY),
            (&self.payloads, Type::TEXT_ARRAY),
            (&self.headers, Type::TEXT_ARRAY),
        ]
    }
}

/// An sqlx query that takes one more bound value; implemented for `Query`, `QueryAs` and
/// `QueryScalar` so [`EnqueueCall::bind`] works with each.
pub trait Bind<'q>: Sized {
    /// Binds `value` to the next placeholder.
    fn bind_value<T>(self, value: T) -> Self
    where
        T: 'q + sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send;
}

type PgArgs = sqlx::postgres::PgArguments;

impl<'q> Bind<'q> for sqlx::query::Query<'q, sqlx::Postgres, PgArgs> {
    fn bind_value<T>(self, value: T) -> Self
    where
        T: 'q + sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
    {
        self.bind(value)
    }
}

impl<'q, O> Bind<'q> for sqlx::query::QueryAs<'q, sqlx::Postgres, O, PgArgs> {
    fn bind_value<T>(self, value: T) -> Self
    where
        T: 'q + sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
    {
        self.bind(value)
    }
}

impl<'q, O> Bind<'q> for sqlx::query::QueryScalar<'q, sqlx::Postgres, O, PgArgs> {
    fn bind_value<T>(self, value: T) -> Self
    where
        T: 'q + sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
    {
        self.bind(value)
    }
}

/// The events of one aggregate, as the arrays the enqueue statement takes.
struct AggregateBatch<'a> {
    aggregate_type: &'a str,
    aggregate_id: &'a str,
    event_ids: Vec<uuid::Uuid>,
    event_types: Vec<&'a str>,
    schema_versions: Vec<i32>,
    payloads: Vec<&'a str>,
    headers: Vec<String>,
    /// Filled by [`assign_global`] in global order mode only.
    global_sequences: Vec<i64>,
}

/// Gives the events of a batch the global sequences `last - n + 1 ..= last` in the order the
/// caller gave them (so one aggregate's events keep their relative order globally too).
fn assign_global(groups: &mut [AggregateBatch<'_>], events: &[NewEvent], last: i64) {
    let first = last - events.len() as i64 + 1;
    for (event, global) in events.iter().zip(first..) {
        if let Some(group) = groups.iter_mut().find(|g| {
            (g.aggregate_type, g.aggregate_id) == (event.aggregate_type(), event.aggregate_id())
        }) {
            group.global_sequences.push(global);
        }
    }
}

/// Splits a batch by aggregate, keeping each aggregate's events in the order given, and sorts
/// the groups by aggregate so that one batch always locks its head rows in the same order.
/// Each event's headers are stored as [`crate::trace::stored_headers`] gives them (with the
/// current trace context under the `otel` feature), within `limits`.
fn group_by_aggregate<'a>(events: &'a [NewEvent], limits: &Limits) -> Vec<AggregateBatch<'a>> {
    let mut groups: Vec<AggregateBatch<'_>> = Vec::new();
    for event in events {
        let key = (event.aggregate_type(), event.aggregate_id());
        let index = match groups
            .iter()
            .position(|g| (g.aggregate_type, g.aggregate_id) == key)
        {
            Some(i) => i,
            None => {
                groups.push(AggregateBatch {
                    aggregate_type: key.0,
                    aggregate_id: key.1,
                    event_ids: Vec::new(),
                    event_types: Vec::new(),
                    schema_versions: Vec::new(),
                    payloads: Vec::new(),
                    headers: Vec::new(),
                    global_sequences: Vec::new(),
                });
                groups.len() - 1
            }
        };
        let group = &mut groups[index];
        group.event_ids.push(event.event_id());
        group.event_types.push(event.event_type());
        group.schema_versions.push(event.schema_version());
        group.payloads.push(event.payload());
        group
            .headers
            .push(crate::trace::stored_headers(event, limits));
    }
    groups.sort_by(|a, b| {
        (a.aggregate_type, a.aggregate_id).cmp(&(b.aggregate_type, b.aggregate_id))
    });
    groups
}

#[cfg(feature = "tokio-postgres")]
fn tokio_postgres_rows(
    rows: &[tokio_postgres::Row],
) -> Result<Vec<(uuid::Uuid, i64)>, EnqueueError> {
    rows.iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect::<Result<_, tokio_postgres::Error>>()
        .map_err(|e| EnqueueError::Database(DriverError::TokioPostgres(e)))
}

/// The results of a caller-versioned batch: `first, first + 1, ...` in the order given.
fn sequenced(events: &[NewEvent], first_sequence: i64) -> Vec<Enqueued> {
    events
        .iter()
        .zip(first_sequence..)
        .map(|(event, aggregate_sequence)| Enqueued {
            event_id: event.event_id(),
            aggregate_sequence,
        })
        .collect()
}

fn collect(enqueued: &mut Vec<Enqueued>, rows: Vec<(uuid::Uuid, i64)>) {
    enqueued.extend(
        rows.into_iter()
            .map(|(event_id, aggregate_sequence)| Enqueued {
                event_id,
                aggregate_sequence,
            }),
    );
}

/// Puts the results in the order of the input batch (the database returns them per group).
fn order_as_given(events: &[NewEvent], enqueued: Vec<Enqueued>) -> Vec<Enqueued> {
    events
        .iter()
        .filter_map(|e| {
            enqueued
                .iter()
                .find(|r| r.event_id == e.event_id())
                .copied()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_keep_the_given_order_within_an_aggregate_and_sort_across() {
        let events = [
            NewEvent::new("order", "b", "E", 1, "1"),
            NewEvent::new("order", "a", "E", 1, "2"),
            NewEvent::new("order", "b", "E", 1, "3"),
        ];
        let groups = group_by_aggregate(&events, &Limits::default());
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].aggregate_id, "a");
        assert_eq!(groups[1].aggregate_id, "b");
        assert_eq!(groups[1].payloads, ["1", "3"]);
    }

    #[test]
    fn global_sequences_follow_the_given_order_across_groups() {
        let events = [
            NewEvent::new("order", "b", "E", 1, "1"),
            NewEvent::new("order", "a", "E", 1, "2"),
            NewEvent::new("order", "b", "E", 1, "3"),
        ];
        let mut groups = group_by_aggregate(&events, &Limits::default());
        assign_global(&mut groups, &events, 12);
        assert_eq!(groups[0].global_sequences, [11]);
        assert_eq!(groups[1].global_sequences, [10, 12]);
    }
}
