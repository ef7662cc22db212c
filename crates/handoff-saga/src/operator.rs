//! What operators see and do: list and show sagas, count them by state, and resume or resolve
//! a stuck one, each action leaving an audit row. Needs no saga definition, so the `handoff`
//! command can run it against any orchestrator's database.

use handoff_postgres::Schema;
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::orchestrator::SagaError;
use crate::state::{HistoryEntry, OperatorAction, SagaRecord, SagaState, COLUMNS};

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

/// How many sagas of a type are in a state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct SagaCount {
    /// The saga type.
    pub saga_type: String,
    /// The state.
    pub state: String,
    /// How many.
    pub count: i64,
}

/// The operators' view of the saga tables in one schema.
///
/// # Examples
///
/// ```no_run
/// use handoff_postgres::Schema;
/// use handoff_saga::{SagaAdmin, SagaState};
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let admin = SagaAdmin::new(pool, Schema::default());
/// for saga in admin.list(Some(SagaState::Stuck), 50).await? {
///     println!("{} stuck: {}", saga.saga_id, saga.stuck_reason.unwrap_or_default());
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct SagaAdmin {
    pool: PgPool,
    schema: Schema,
}

impl SagaAdmin {
    /// The saga tables in `schema`, through `pool`.
    pub fn new(pool: PgPool, schema: Schema) -> Self {
        Self { pool, schema }
    }

    fn table(&self, name: &str) -> String {
        self.schema.qualify(name)
    }

    fn error(&self, error: sqlx::Error) -> SagaError {
        SagaError::from_sqlx(error, &self.schema)
    }

    /// Sagas, most recently changed first; only those in `state` when given.
    ///
    /// # Errors
    ///
    /// [`SagaError::NotMigrated`] or [`SagaError::Database`].
    pub async fn list(
        &self,
        state: Option<SagaState>,
        limit: i64,
    ) -> Result<Vec<SagaRecord>, SagaError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE ($1::text IS NULL OR state = $1) \
             ORDER BY updated_at DESC, saga_id LIMIT $2",
            self.table("saga_instances")
        );
        sqlx::query_as(&sql)
            .bind(state.map(SagaState::as_str))
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.error(e))
    }

    /// One saga with its history and audit; `None` when there is no such saga.
    ///
    /// # Errors
    ///
    /// As [`list`](Self::list).
    pub async fn show(&self, saga_id: Uuid) -> Result<Option<SagaDetail>, SagaError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE saga_id = $1",
            self.table("saga_instances")
        );
        let saga: Option<SagaRecord> = sqlx::query_as(&sql)
            .bind(saga_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.error(e))?;
        let Some(saga) = saga else { return Ok(None) };
        let history = sqlx::query_as(&format!(
            "SELECT version, state, step, kind, detail, at FROM {} \
             WHERE saga_id = $1 ORDER BY version",
            self.table("saga_history")
        ))
        .bind(saga_id)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.error(e))?;
        let actions = sqlx::query_as(&format!(
            "SELECT action_id, action, reason, actor, state_before, state_after, acted_at \
             FROM {} WHERE saga_id = $1 ORDER BY action_id",
            self.table("saga_operator_actions")
        ))
        .bind(saga_id)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.error(e))?;
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
    pub async fn open_counts(&self) -> Result<Vec<SagaCount>, SagaError> {
        let sql = format!(
            "SELECT saga_type, state, count(*) AS count FROM {} \
             WHERE state IN ('running', 'compensating', 'stuck') \
             GROUP BY saga_type, state ORDER BY saga_type, state",
            self.table("saga_instances")
        );
        sqlx::query_as(&sql)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.error(e))
    }

    /// Sends a stuck saga's compensation again, from a fresh retry budget: the saga turns
    /// `compensating` and the orchestrator's next deadline sweep sends the command. For when
    /// the cause is fixed (the participant is back, its data repaired).
    ///
    /// # Errors
    ///
    /// [`SagaError::NotFound`], [`SagaError::NotStuck`], [`SagaError::NoReason`], or a
    /// database error; nothing is written then.
    pub async fn resume(
        &self,
        saga_id: Uuid,
        actor: &str,
        reason: &str,
    ) -> Result<SagaRecord, SagaError> {
        let set = "state = 'compensating', attempt = 0, deadline_at = now(), \
                   deadline_kind = 'retry', stuck_reason = NULL, ended_at = NULL";
        self.act(saga_id, actor, reason, "resume", "resumed", set)
            .await
    }

    /// Closes a stuck saga by hand: the operator has undone (or accepted) what the failing
    /// compensation could not. The saga ends `resolved`; the reason goes in the audit.
    ///
    /// # Errors
    ///
    /// As [`resume`](Self::resume).
    pub async fn resolve(
        &self,
        saga_id: Uuid,
        actor: &str,
        reason: &str,
    ) -> Result<SagaRecord, SagaError> {
        let set = "state = 'resolved', deadline_at = NULL, deadline_kind = NULL, \
                   stuck_reason = NULL, ended_at = now()";
        self.act(saga_id, actor, reason, "resolve", "resolved", set)
            .await
    }

    /// One operator action: in one transaction, check the saga is stuck, change it, and write
    /// the history and audit rows.
    async fn act(
        &self,
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
        let mut tx = self.pool.begin().await.map_err(SagaError::Database)?;
        let before = self.lock(&mut tx, saga_id).await?;
        if before.state != SagaState::Stuck {
            return Err(SagaError::NotStuck {
                saga_id,
                state: before.state,
            });
        }
        let sql = format!(
            "UPDATE {} SET {set}, version = version + 1, updated_at = now() \
             WHERE saga_id = $1 RETURNING {COLUMNS}",
            self.table("saga_instances")
        );
        let after: SagaRecord = sqlx::query_as(&sql)
            .bind(saga_id)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| self.error(e))?;
        sqlx::query(&format!(
            "INSERT INTO {} (saga_id, version, state, step, kind, detail) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            self.table("saga_history")
        ))
        .bind(saga_id)
        .bind(after.version)
        .bind(after.state.as_str())
        .bind(after.step)
        .bind(kind)
        .bind(format!("{actor}: {reason}"))
        .execute(&mut *tx)
        .await
        .map_err(|e| self.error(e))?;
        sqlx::query(&format!(
            "INSERT INTO {} (saga_id, action, reason, actor, state_before, state_after) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            self.table("saga_operator_actions")
        ))
        .bind(saga_id)
        .bind(action)
        .bind(reason)
        .bind(actor)
        .bind(before.state.as_str())
        .bind(after.state.as_str())
        .execute(&mut *tx)
        .await
        .map_err(|e| self.error(e))?;
        tx.commit().await.map_err(SagaError::Database)?;
        tracing::info!(%saga_id, action, actor, reason, "operator action on a stuck saga");
        Ok(after)
    }

    async fn lock(&self, tx: &mut PgConnection, saga_id: Uuid) -> Result<SagaRecord, SagaError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE saga_id = $1 FOR UPDATE",
            self.table("saga_instances")
        );
        let saga: Option<SagaRecord> = sqlx::query_as(&sql)
            .bind(saga_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.error(e))?;
        saga.ok_or(SagaError::NotFound(saga_id))
    }
}
