//! Retry, skip and repair: the `Quarantine` calls `handoff quarantine` makes, with the signed-in
//! actor, refused on a read-only console. Pages and the API both come through here.

use handoff_postgres::{ActionRecord, Quarantine};
use uuid::Uuid;

use crate::auth::Identity;
use crate::{AppState, ConsoleError};

fn quarantine(state: &AppState) -> Result<Quarantine, ConsoleError> {
    if state.config.read_only {
        return Err(ConsoleError::ReadOnly);
    }
    Ok(Quarantine::new(&state.config.schema))
}

/// Publishes held event `id` as it is, with a fresh attempt budget.
pub(crate) async fn retry(
    state: &AppState,
    identity: &Identity,
    id: Uuid,
) -> Result<ActionRecord, ConsoleError> {
    let quarantine = quarantine(state)?;
    let mut conn = state.pool.acquire().await?;
    let record = quarantine.retry(&mut conn, id, &identity.actor).await?;
    tracing::info!(event_id = %id, actor = %identity.actor, action_id = record.action_id, "console: retried");
    Ok(record)
}

/// Skips held event `id`: a skip marker goes out in its place. `reason` is required.
pub(crate) async fn skip(
    state: &AppState,
    identity: &Identity,
    id: Uuid,
    reason: &str,
) -> Result<ActionRecord, ConsoleError> {
    let quarantine = quarantine(state)?;
    let mut conn = state.pool.acquire().await?;
    let record = quarantine
        .skip(&mut conn, id, reason, &identity.actor)
        .await?;
    tracing::info!(event_id = %id, actor = %identity.actor, action_id = record.action_id, "console: skipped");
    Ok(record)
}

/// Replaces held event `id`'s payload with `payload` (checked as any enqueue), then publishes it.
pub(crate) async fn repair(
    state: &AppState,
    identity: &Identity,
    id: Uuid,
    payload: &str,
) -> Result<ActionRecord, ConsoleError> {
    let quarantine = quarantine(state)?;
    let mut conn = state.pool.acquire().await?;
    let record = quarantine
        .repair(&mut conn, id, payload, &identity.actor)
        .await?;
    tracing::info!(event_id = %id, actor = %identity.actor, action_id = record.action_id, "console: repaired");
    Ok(record)
}
