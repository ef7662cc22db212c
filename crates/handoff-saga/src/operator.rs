//! What operators see and do: list and show sagas, count them by state, and resume or resolve
//! a stuck one, each action leaving an audit row. Needs no saga definition, so the `handoff`
//! command can run it against any orchestrator's database.

use handoff_postgres::{Pooling, Schema};
use serde::Serialize;
use sqlx::{Acquire, Postgres};
use uuid::Uuid;

use crate::error::SagaError;
use crate::state::{HistoryEntry, OperatorAction, SagaCount, SagaRecord, SagaState, COLUMNS};
use crate::store::Store;

/// One saga with its history and the operator actions taken on it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SagaDetail {
    /// The saga's row.
    #[serde(flatten)]
    pub saga: SagaRecord,
    /// Its transitions, oldest first.
    pub history: Vec<HistoryEntry>,
    /// Operator actions, oldest first.
    pub actions: Vec<OperatorAction>,
}

/// The operators' view of the saga tables in one schema. Holds no connection: each call runs
/// on the pool or connection it is given (`&PgPool`, `&mut PgConnection`).
///
/// Every call sends its statements unnamed, inside one transaction (a savepoint when given one
/// already open), so it works through a transaction pooler such as PgBouncer
/// (docs/poolers.md): an operator command makes one call, so the direct path pays a parse per
/// statement and a `BEGIN`/`COMMIT`, not a cost per event.
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::{Pooling, Schema};
/// use handoff_saga::{SagaAdmin, SagaState};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let admin = SagaAdmin::new(&Schema::default());
/// for saga in admin.list(&pool, Some(SagaState::Stuck), 50).await? {
///     println!("{} stuck: {}", saga.saga_id, saga.stuck_reason.unwrap_or_default());
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SagaAdmin {
    store: Store,
}

impl SagaAdmin {
    /// The saga tables in `schema`.
    pub fn new(schema: &Schema) -> Self {
        Self {
            // Operator calls are rare: always the pooler-safe way.
            store: Store::new(schema, Pooling::Transaction),
        }
    }

    /// Sagas, most recently changed first; only those in `state` when given.
    ///
    /// # Errors
    ///
    /// [`SagaError::NotMigrated`] or [`SagaError::Database`].
    pub async fn list<'c>(
        &self,
        db: impl Acquire<'c, Database = Postgres>,
        state: Option<SagaState>,
        limit: i64,
    ) -> Result<Vec<SagaRecord>, SagaError> {
        let mut tx = db.begin().await.map_err(SagaError::Database)?;
        let sagas = sqlx::query_as(&self.store.list)
            .persistent(false)
            .bind(state.map(SagaState::as_str))
            .bind(limit)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| self.store.error(e))?;
        tx.commit().await.map_err(SagaError::Database)?;
        Ok(sagas)
    }

    /// One saga with its history and audit; `None` when there is no such saga.
    ///
    /// # Errors
    ///
    /// As [`list`](Self::list).
    pub async fn show<'c>(
        &self,
        db: impl Acquire<'c, Database = Postgres>,
        saga_id: Uuid,
    ) -> Result<Option<SagaDetail>, SagaError> {
        let mut tx = db.begin().await.map_err(SagaError::Database)?;
        let saga: Option<SagaRecord> = sqlx::query_as(&self.store.get)
            .persistent(false)
            .bind(saga_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.store.error(e))?;
        let Some(saga) = saga else { return Ok(None) };
        let history = sqlx::query_as(&self.store.history_of)
            .persistent(false)
            .bind(saga_id)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| self.store.error(e))?;
        let actions = sqlx::query_as(&self.store.actions_of)
            .persistent(false)
            .bind(saga_id)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| self.store.error(e))?;
        tx.commit().await.map_err(SagaError::Database)?;
        Ok(Some(SagaDetail {
            saga,
            history,
            actions,
        }))
    }

    /// Sagas per type and state, of those not ended (`running`, `compensating`, `stuck`):
    /// read from a partial index, so as cheap with a million ended sagas as with none.
    ///
    /// # Errors
    ///
    /// As [`list`](Self::list).
    pub async fn open_counts<'c>(
        &self,
        db: impl Acquire<'c, Database = Postgres>,
    ) -> Result<Vec<SagaCount>, SagaError> {
        let mut tx = db.begin().await.map_err(SagaError::Database)?;
        let counts = self.store.open_counts(&mut tx, None).await?;
        tx.commit().await.map_err(SagaError::Database)?;
        Ok(counts)
    }

    /// Moves a stuck saga again, for when the cause is fixed (the participant is back, its
    /// data repaired, the hook fixed):
    ///
    /// - stuck because its compensation kept failing: the saga turns `compensating` with a
    ///   fresh retry budget, and the orchestrator's next deadline sweep sends the compensation
    ///   again;
    /// - stuck because its deadline transition kept failing (it has a
    ///   [`resume_state`](SagaRecord::resume_state)): the saga returns to that state with its
    ///   deadline due now and its failure count at 0, so the next sweep tries the same
    ///   transition again.
    ///
    /// # Errors
    ///
    /// [`SagaError::NotFound`], [`SagaError::NotStuck`], [`SagaError::NoReason`], or a
    /// database error; nothing is written then.
    pub async fn resume<'c>(
        &self,
        db: impl Acquire<'c, Database = Postgres>,
        saga_id: Uuid,
        actor: &str,
        reason: &str,
    ) -> Result<SagaRecord, SagaError> {
        // SET reads the row as it was: resume_state decides before it is cleared.
        let set = "state = coalesce(resume_state, 'compensating'), \
                   attempt = CASE WHEN resume_state IS NULL THEN 0 ELSE attempt END, \
                   deadline_at = now(), \
                   deadline_kind = coalesce(resume_deadline_kind, 'retry'), \
                   stuck_reason = NULL, ended_at = NULL, transition_failures = 0, \
                   last_transition_error = NULL, resume_state = NULL, \
                   resume_deadline_kind = NULL";
        self.act(db, saga_id, actor, reason, "resume", "resumed", set)
            .await
    }

    /// Closes a stuck saga by hand: the operator has undone (or accepted) what the failing
    /// compensation could not. The saga ends `resolved`; the reason goes in the audit.
    ///
    /// # Errors
    ///
    /// As [`resume`](Self::resume).
    pub async fn resolve<'c>(
        &self,
        db: impl Acquire<'c, Database = Postgres>,
        saga_id: Uuid,
        actor: &str,
        reason: &str,
    ) -> Result<SagaRecord, SagaError> {
        let set = "state = 'resolved', deadline_at = NULL, deadline_kind = NULL, \
                   stuck_reason = NULL, ended_at = now(), resume_state = NULL, \
                   resume_deadline_kind = NULL";
        self.act(db, saga_id, actor, reason, "resolve", "resolved", set)
            .await
    }

    /// One operator action: in one transaction, check the saga is stuck, change it, and write
    /// the history and audit rows.
    #[allow(clippy::too_many_arguments)]
    async fn act<'c>(
        &self,
        db: impl Acquire<'c, Database = Postgres>,
        saga_id: Uuid,
        actor: &str,
        reason: &str,
        action: &str,
        kind: &str,
        set: &str,
    ) -> Result<SagaRecord, SagaError> {
        if reason.trim().is_empty() {
            return Err(SagaError::NoReason);
        }
        let mut tx = db.begin().await.map_err(SagaError::Database)?;
        let before = self
            .store
            .lock(&mut tx, saga_id)
            .await?
            .ok_or(SagaError::NotFound(saga_id))?;
        if before.state != SagaState::Stuck {
            return Err(SagaError::NotStuck {
                saga_id,
                state: before.state,
            });
        }
        let sql = format!(
            "UPDATE {} SET {set}, version = version + 1, updated_at = now() \
             WHERE saga_id = $1 RETURNING {COLUMNS}",
            self.store.sagas()
        );
        let after: SagaRecord = sqlx::query_as(&sql)
            .persistent(false)
            .bind(saga_id)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| self.store.error(e))?;
        let detail = format!("{actor}: {reason}");
        self.store
            .record(
                &mut tx,
                saga_id,
                after.version,
                after.state,
                after.step,
                kind,
                Some(&detail),
            )
            .await?;
        sqlx::query(&self.store.audit)
            .persistent(false)
            .bind(saga_id)
            .bind(action)
            .bind(reason)
            .bind(actor)
            .bind(before.state.as_str())
            .bind(after.state.as_str())
            .execute(&mut *tx)
            .await
            .map_err(|e| self.store.error(e))?;
        tx.commit().await.map_err(SagaError::Database)?;
        tracing::info!(%saga_id, action, actor, reason, "operator action on a stuck saga");
        Ok(after)
    }
}
