//! The console's actions: on held outbox events (retry, repair, skip) the `Quarantine` calls
//! `handoff quarantine` makes, on a consumer's quarantine (retry, skip) the
//! `ConsumerQuarantine` calls `handoff consumer quarantine` makes, on stuck sagas (resume,
//! resolve) the `SagaAdmin` calls `handoff saga` makes; each with the signed-in actor, audited
//! in the same tables, and refused on a read-only console. Pages and the API both come
//! through here.

use handoff_postgres::{ActionRecord, ConsumerQuarantine, EventDetail, Quarantine, QuarantineRef};
use handoff_saga::{SagaAdmin, SagaRecord};
use uuid::Uuid;

use crate::auth::Identity;
use crate::config::ConsumerDatabase;
use crate::{AppState, ConsoleError};

/// Refuses every action on a read-only console.
fn writable(state: &AppState) -> Result<(), ConsoleError> {
    if state.config.read_only {
        return Err(ConsoleError::ReadOnly);
    }
    Ok(())
}

/// The outbox's quarantine, checking repairs against the configured limits.
pub(crate) fn outbox_quarantine(state: &AppState) -> Quarantine {
    Quarantine::new(&state.config.schema).with_limits(state.config.limits.clone())
}

fn quarantine(state: &AppState) -> Result<Quarantine, ConsoleError> {
    writable(state)?;
    Ok(outbox_quarantine(state))
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

/// What a repair of held event `id` with `payload` would do, checked as the repair checks it
/// (held, and the payload passes every enqueue's checks) without writing: the event as it
/// stands, for the review. Refused on a read-only console like the repair itself.
pub(crate) async fn check_repair(
    state: &AppState,
    id: Uuid,
    payload: &str,
) -> Result<EventDetail, ConsoleError> {
    let quarantine = quarantine(state)?;
    let mut conn = state.pool.acquire().await?;
    Ok(quarantine.check_repair(&mut conn, id, payload).await?)
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

/// The consumer `name` given to the console, and its quarantine.
pub(crate) fn consumer<'s>(
    state: &'s AppState,
    name: &str,
) -> Result<(&'s ConsumerDatabase, ConsumerQuarantine), ConsoleError> {
    let database = state
        .config
        .consumers
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| ConsoleError::UnknownConsumer(name.to_owned()))?;
    let quarantine = ConsumerQuarantine::new(&database.schema, &database.name)?;
    Ok((database, quarantine))
}

/// Has consumer `name` apply quarantined row `row` again through its inbox.
pub(crate) async fn consumer_retry(
    state: &AppState,
    identity: &Identity,
    name: &str,
    row: QuarantineRef,
) -> Result<ActionRecord, ConsoleError> {
    writable(state)?;
    let (database, quarantine) = consumer(state, name)?;
    let mut conn = database.pool.acquire().await?;
    let record = quarantine.retry(&mut conn, row, &identity.actor).await?;
    tracing::info!(consumer = name, %row, actor = %identity.actor, action_id = record.action_id, "console: consumer row retried");
    Ok(record)
}

/// Closes consumer `name`'s row `row` without applying it; `past_gap` as
/// `handoff consumer quarantine skip --past-gap`.
pub(crate) async fn consumer_skip(
    state: &AppState,
    identity: &Identity,
    name: &str,
    row: QuarantineRef,
    reason: &str,
    past_gap: bool,
) -> Result<handoff_postgres::SkipRecord, ConsoleError> {
    writable(state)?;
    let (database, quarantine) = consumer(state, name)?;
    let mut conn = database.pool.acquire().await?;
    let record = if past_gap {
        quarantine
            .skip_past_gap(&mut conn, row, reason, &identity.actor)
            .await?
    } else {
        quarantine
            .skip(&mut conn, row, reason, &identity.actor)
            .await?
    };
    tracing::info!(consumer = name, %row, actor = %identity.actor, action_id = record.action.action_id, "console: consumer row skipped");
    Ok(record)
}

/// Moves stuck saga `id` again with a fresh retry budget.
pub(crate) async fn saga_resume(
    state: &AppState,
    identity: &Identity,
    id: Uuid,
    reason: &str,
) -> Result<SagaRecord, ConsoleError> {
    writable(state)?;
    let saga = SagaAdmin::new(&state.config.schema)
        .resume(&state.pool, id, &identity.actor, reason)
        .await?;
    tracing::info!(saga_id = %id, actor = %identity.actor, "console: saga resumed");
    Ok(saga)
}

/// Closes stuck saga `id` by hand; `reason` is required.
pub(crate) async fn saga_resolve(
    state: &AppState,
    identity: &Identity,
    id: Uuid,
    reason: &str,
) -> Result<SagaRecord, ConsoleError> {
    writable(state)?;
    let saga = SagaAdmin::new(&state.config.schema)
        .resolve(&state.pool, id, &identity.actor, reason)
        .await?;
    tracing::info!(saga_id = %id, actor = %identity.actor, "console: saga resolved");
    Ok(saga)
}
