//! The handler wrapper that crashes the consumer between the effect and the commit.

use std::sync::Arc;

use handoff_consumer::{Gap, GapDecision, Handler, HandlerError};
use handoff_core::intake::ReceivedEvent;
use sqlx::PgConnection;

use crate::broker::Broker;

/// The user's handler, and a crash after it: when the run's seed says so, the handler has
/// applied the event through the transaction (and done whatever it does outside it) and the
/// process dies before the commit. The check then drops the consumer, the transaction rolls
/// back, and the broker delivers the event again: the window a non-idempotent outside effect
/// shows itself in.
pub(crate) struct Crashing<H> {
    pub(crate) inner: Arc<H>,
    pub(crate) broker: Arc<Broker>,
}

impl<H: Handler> Handler for Crashing<H> {
    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        self.inner.handle(tx, event).await?;
        if self.broker.crash_before_commit(event) {
            // Never returns: the check drops the consumer's tasks, this one with them.
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn reconcile(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
        gap: Gap,
    ) -> Result<GapDecision, HandlerError> {
        self.inner.reconcile(tx, event, gap).await
    }

    fn allows_batches(&self) -> bool {
        self.inner.allows_batches()
    }
}
