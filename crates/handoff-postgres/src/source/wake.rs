//! LISTEN/NOTIFY wake-ups: an idle relay registers as waiting, so committing writers notify,
//! and sleeps on its listener until one does or its wait ends.

use std::time::{Duration, Instant};

use handoff_core::delivery::{SourceError, SourceErrorKind};
use sqlx::postgres::{PgListener, PgPool};

use super::pacing::LINGER;
use super::sessions::QueryTimedOut;
use super::PollingSource;
use crate::pooler::Pooling;
use crate::source_error::source_error;

/// The channel migration 0002's trigger notifies; its payload is the outbox's schema.
pub const WAKE_CHANNEL: &str = "handoff_outbox";

/// How long a wait for a notification lasts right after the relay registered as waiting.
///
/// Writers that inserted before the registration was visible did not notify, and their commits
/// can land just after the relay's last claim; one more claim after this short wait picks them
/// up, so the race costs milliseconds instead of a whole poll interval.
const SETTLE: Duration = Duration::from_millis(20);

/// The wake-up state. A tokio mutex: the listener is awaited while held.
#[derive(Default)]
pub(super) struct Wake {
    listener: Option<PgListener>,
    /// Until when writers notify on this relay's account, as far as this relay knows.
    pub(super) registered_until: Option<Instant>,
}

impl PollingSource {
    /// Stops the writers' notifications on this relay's account (at shutdown).
    ///
    /// # Errors
    ///
    /// The database could not be reached; the registration then expires after `wait_ttl`.
    pub async fn unregister(&self) -> Result<(), SourceError> {
        let mut wake = self.wake.lock().await;
        self.unwait(&mut wake).await
    }

    /// Stops the writers' notifications on this relay's account.
    pub(super) async fn unwait(&self, wake: &mut Wake) -> Result<(), SourceError> {
        let what = "while unregistering the wait";
        self.on_pooled_connection(what, async |conn| {
            sqlx::query(&self.sql.unwait)
                .persistent(self.named_statements())
                .bind(&self.config.relay_id)
                .execute(conn)
                .await
                .map(drop)
        })
        .await?;
        wake.registered_until = None;
        Ok(())
    }

    /// Whether an idle relay waits on LISTEN: asked for, and on a session of its own (LISTEN
    /// through a transaction pooler would be on whichever server connection ran it, which
    /// hands the notifications to nobody).
    pub fn listens(&self) -> bool {
        self.config.listen
            && (self.listen_pool.is_some() || self.config.pooling == Pooling::Session)
    }

    /// Listens for the writers' notifications on connections of `pool` instead of the
    /// source's own pool: a direct connection for LISTEN when the source's pool goes through a
    /// transaction pooler (`handoff relay --listen-database-url`).
    pub fn with_listen_pool(mut self, pool: PgPool) -> Self {
        self.listen_pool = Some(pool);
        self
    }

    /// Whether a notification's payload concerns this source's outbox. With the default schema
    /// the name is not known here, so every notification counts (a spurious wake-up is cheap).
    fn concerns_us(&self, payload: &str) -> bool {
        self.config.schema.name().is_none_or(|name| name == payload)
    }

    /// [`Source::wait_for_work`](handoff_core::delivery::Source::wait_for_work): polls again
    /// soon while lingering, else sleeps on LISTEN (registered so that writers notify) or, not
    /// listening, for `at_most`.
    pub(super) async fn wait_for_wake(&self, at_most: Duration) -> Result<(), SourceError> {
        let lingering = self
            .last_work
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|at| at.elapsed() < LINGER);
        if lingering {
            // Traffic is steady: poll, and make writers stop notifying on this relay's account
            // if an idle spell had registered it.
            if self.listens() {
                let mut wake = self.wake.lock().await;
                if wake.registered_until.is_some() {
                    self.unwait(&mut wake).await?;
                }
            }
            tokio::time::sleep(self.busy_poll().min(at_most)).await;
            return Ok(());
        }
        if !self.listens() {
            tokio::time::sleep(at_most).await;
            return Ok(());
        }
        let mut wake = self.wake.lock().await;
        if wake.listener.is_none() {
            let connect = async {
                let pool = self.listen_pool.as_ref().unwrap_or(&self.pool);
                let mut listener = PgListener::connect_with(pool).await?;
                listener.listen(WAKE_CHANNEL).await?;
                Ok::<_, sqlx::Error>(listener)
            };
            let listener = match tokio::time::timeout(self.config.query_timeout, connect).await {
                Ok(Ok(listener)) => listener,
                Ok(Err(e)) => return Err(source_error("while listening", e)),
                Err(_) => {
                    return Err(SourceError::with_kind(
                        SourceErrorKind::Timeout,
                        "while listening",
                        QueryTimedOut(self.config.query_timeout),
                    ))
                }
            };
            wake.listener = Some(listener);
            // Notifications sent before LISTEN took effect are gone: poll once more.
            return Ok(());
        }

        let now = Instant::now();
        let mut deadline = now + at_most;
        // Renew the registration before it could lapse during this wait.
        if wake
            .registered_until
            .is_none_or(|until| until < deadline + at_most)
        {
            let fresh = wake.registered_until.is_none();
            let what = "while registering the wait";
            self.on_pooled_connection(what, async |conn| {
                sqlx::query(&self.sql.wait)
                    .persistent(self.named_statements())
                    .bind(&self.config.relay_id)
                    .bind(self.config.wait_ttl.as_secs_f64())
                    .execute(conn)
                    .await
                    .map(drop)
            })
            .await?;
            wake.registered_until = Some(now + self.config.wait_ttl);
            if fresh {
                deadline = now + at_most.min(SETTLE);
            }
        }
        let Some(listener) = wake.listener.as_mut() else {
            return Ok(());
        };

        loop {
            match tokio::time::timeout_at(deadline.into(), listener.try_recv()).await {
                Err(_elapsed) => return Ok(()),
                Ok(Ok(Some(notification))) => {
                    if self.concerns_us(notification.payload()) {
                        // Several commits may have notified: one claim serves them all.
                        while listener.next_buffered().is_some() {}
                        return Ok(());
                    }
                }
                // The connection dropped and notifications may have been lost while it was
                // down: the caller polls again.
                Ok(Ok(None)) => return Ok(()),
                Ok(Err(e)) => {
                    wake.listener = None;
                    return Err(source_error("while waiting for notifications", e));
                }
            }
        }
    }
}
