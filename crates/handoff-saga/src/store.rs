//! The saga tables' SQL, in one place for the orchestrator and the operators' commands: the
//! row lock, the history row every transition writes, and the per-state counts.

use handoff_postgres::{Pooling, Schema};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::SagaError;
use crate::state::{SagaCount, SagaRecord, SagaState, COLUMNS};

/// The statements on the saga tables of one schema, built once.
#[derive(Debug, Clone)]
pub(crate) struct Store {
    schema: Schema,
    /// Whether statements may be prepared under a name and cached: not behind a transaction
    /// pooler (docs/poolers.md).
    pub(crate) named: bool,
    sagas: String,
    pub(crate) insert: String,
    pub(crate) lock_due: String,
    pub(crate) due: String,
    pub(crate) update: String,
    pub(crate) postpone: String,
    pub(crate) list: String,
    pub(crate) get: String,
    pub(crate) history_of: String,
    pub(crate) actions_of: String,
    pub(crate) audit: String,
    lock: String,
    history: String,
    open_counts: String,
}

impl Store {
    pub(crate) fn new(schema: &Schema, pooling: Pooling) -> Self {
        let sagas = schema.qualify("saga_instances");
        let history = schema.qualify("saga_history");
        let actions = schema.qualify("saga_operator_actions");
        Self {
            schema: schema.clone(),
            named: pooling.named_statements(),
            sagas: sagas.clone(),
            insert: format!(
                "INSERT INTO {sagas} (saga_id, saga_type, state, step, data, attempt, command_id, \
                 deadline_at, deadline_kind) \
                 VALUES ($1, $2, 'running', 0, $3, 1, $4, now() + $5 * interval '1 second', 'reply') \
                 ON CONFLICT (saga_id) DO NOTHING"
            ),
            lock_due: format!(
                "SELECT {COLUMNS} FROM {sagas} \
                 WHERE saga_id = $1 AND deadline_at <= now() FOR UPDATE SKIP LOCKED"
            ),
            due: format!(
                "SELECT saga_id FROM {sagas} \
                 WHERE deadline_at <= now() AND saga_type = ANY($1) \
                 ORDER BY deadline_at LIMIT $2"
            ),
            update: format!(
                "UPDATE {sagas} SET state = $2, step = $3, data = $4, version = version + 1, \
                 attempt = $5, command_id = coalesce($6, command_id), \
                 deadline_at = now() + $7 * interval '1 second', deadline_kind = $8, \
                 failure = coalesce($9, failure), stuck_reason = $10, updated_at = now(), \
                 ended_at = CASE WHEN $2 IN ('completed', 'compensated', 'resolved') \
                                 THEN now() END, \
                 transition_failures = $12, last_transition_error = $13, \
                 resume_state = $14, resume_deadline_kind = $15 \
                 WHERE saga_id = $1 AND version = $11 \
                 RETURNING {COLUMNS}"
            ),
            // Not a transition (no version, no history row): the failed one rolled back, and
            // this only moves the saga's own timer out of the way of the others. The version
            // check leaves alone a saga that a reply moved meanwhile; SKIP LOCKED, so the sweep
            // never waits on a row someone else holds (it is due again next round then).
            postpone: format!(
                "UPDATE {sagas} SET transition_failures = $2, last_transition_error = $3, \
                 deadline_at = now() + $4 * interval '1 second' \
                 WHERE saga_id = (SELECT saga_id FROM {sagas} \
                                  WHERE saga_id = $1 AND version = $5 \
                                    AND state IN ('running', 'compensating') \
                                  FOR UPDATE SKIP LOCKED)"
            ),
            list: format!(
                "SELECT {COLUMNS} FROM {sagas} WHERE ($1::text IS NULL OR state = $1) \
                 ORDER BY updated_at DESC, saga_id LIMIT $2"
            ),
            get: format!("SELECT {COLUMNS} FROM {sagas} WHERE saga_id = $1"),
            history_of: format!(
                "SELECT version, state, step, kind, detail, at FROM {history} \
                 WHERE saga_id = $1 ORDER BY version"
            ),
            actions_of: format!(
                "SELECT action_id, action, reason, actor, state_before, state_after, acted_at \
                 FROM {actions} WHERE saga_id = $1 ORDER BY action_id"
            ),
            audit: format!(
                "INSERT INTO {actions} (saga_id, action, reason, actor, state_before, state_after) \
                 VALUES ($1, $2, $3, $4, $5, $6)"
            ),
            lock: format!("SELECT {COLUMNS} FROM {sagas} WHERE saga_id = $1 FOR UPDATE"),
            history: format!(
                "INSERT INTO {history} (saga_id, version, state, step, kind, detail) \
                 VALUES ($1, $2, $3, $4, $5, $6)"
            ),
            open_counts: format!(
                "SELECT saga_type, state, count(*) AS count FROM {sagas} \
                 WHERE state IN ('running', 'compensating', 'stuck') \
                   AND ($1::text[] IS NULL OR saga_type = ANY($1)) \
                 GROUP BY saga_type, state ORDER BY saga_type, state"
            ),
        }
    }

    /// `saga_instances`, qualified by the schema.
    pub(crate) fn sagas(&self) -> &str {
        &self.sagas
    }

    /// The error for a failed statement: a missing table means the migrations did not run.
    pub(crate) fn error(&self, error: sqlx::Error) -> SagaError {
        SagaError::from_sqlx(error, &self.schema)
    }

    /// The saga's row, locked until the transaction ends; `None` when there is no such saga.
    pub(crate) async fn lock(
        &self,
        tx: &mut PgConnection,
        saga_id: Uuid,
    ) -> Result<Option<SagaRecord>, SagaError> {
        sqlx::query_as(&self.lock)
            .persistent(self.named)
            .bind(saga_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.error(e))
    }

    /// Writes the `saga_history` row of the transition that brought the saga to `version`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn record(
        &self,
        tx: &mut PgConnection,
        saga_id: Uuid,
        version: i64,
        state: SagaState,
        step: i32,
        kind: &str,
        detail: Option<&str>,
    ) -> Result<(), SagaError> {
        sqlx::query(&self.history)
            .persistent(self.named)
            .bind(saga_id)
            .bind(version)
            .bind(state.as_str())
            .bind(step)
            .bind(kind)
            .bind(detail)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// Sagas running, compensating or stuck, per type and state; only the `saga_types` given.
    pub(crate) async fn open_counts(
        &self,
        conn: &mut PgConnection,
        saga_types: Option<&[String]>,
    ) -> Result<Vec<SagaCount>, SagaError> {
        // Unnamed: a periodic count, also read by `handoff status` through a transaction
        // pooler (docs/poolers.md); the parse costs nothing next to the scan.
        sqlx::query_as(&self.open_counts)
            .persistent(false)
            .bind(saga_types)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.error(e))
    }
}
