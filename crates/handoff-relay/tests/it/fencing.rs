//! Fencing over the real PostgreSQL: a relay whose write of an outcome lags past the lease the
//! outcome was decided under, while the relay claimed the event again under a new lease, changes
//! nothing with that write. Every update of the outbox row's lease columns is logged by an audit
//! trigger, so the test sees each write that took effect, not only the end state.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_core::delivery::{
    Claim, Failure, Lease, OutboxEvent, PublishError, PublishErrorKind, Published, Receipt,
    Released, Settled, Source, SourceError, Transport,
};
use handoff_core::EventId;
use handoff_postgres::{Outbox, OutboxConfig, PollingConfig, PollingSource, Schema};
use handoff_relay::{Backoff, Relay, RelayConfig};
use handoff_test::{eventually, factory, TestDb};
use tokio::sync::Notify;

/// Logs every update of an outbox row's lease, availability or attempts, old and new values.
const AUDIT: &str = r#"
CREATE TABLE outbox_audit (
    n bigserial PRIMARY KEY,
    event_id uuid NOT NULL,
    old_claimed_by text,
    new_claimed_by text,
    old_claim_until int8,
    new_claim_until int8,
    old_available_at timestamptz,
    new_available_at timestamptz,
    old_attempt_count int,
    new_attempt_count int,
    new_published_at timestamptz
);
CREATE FUNCTION outbox_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outbox_audit (event_id, old_claimed_by, new_claimed_by, old_claim_until,
                              new_claim_until, old_available_at, new_available_at,
                              old_attempt_count, new_attempt_count, new_published_at)
    VALUES (OLD.event_id, OLD.claimed_by, NEW.claimed_by,
            (extract(epoch FROM OLD.claim_until) * 1000000)::int8,
            (extract(epoch FROM NEW.claim_until) * 1000000)::int8,
            OLD.available_at, NEW.available_at, OLD.attempt_count, NEW.attempt_count,
            NEW.published_at);
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_audit
    AFTER UPDATE OF claimed_by, claim_until, available_at, attempt_count ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_audit();
"#;

/// One audit row: holder and lease end (microseconds, the lease token's terms) before and
/// after, attempts before and after, whether the update marked the event published.
type AuditRow = (
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    i32,
    i32,
    bool,
);

/// The polling source, whose first failure write waits until the relay has claimed the failed
/// event again: the relay's bookkeeping lags past the lease the failure was decided under.
struct LaggingSource {
    inner: PollingSource,
    /// The lease of every non-empty claim, in claim order, with its events.
    claims: Mutex<Vec<(Option<Lease>, Vec<EventId>)>>,
    claimed: Notify,
    /// Whether the first failure write was held back already.
    lagged: Mutex<bool>,
    /// Every failure the relay wrote, and what each write reported.
    failures: Mutex<Vec<(Failure, Settled)>>,
    /// Every acknowledgement the relay wrote.
    published: Mutex<Vec<Published>>,
}

impl LaggingSource {
    /// How many non-empty claims carried `event_id`.
    fn claims_of(&self, event_id: EventId) -> usize {
        let claims = self.claims.lock().unwrap();
        claims
            .iter()
            .filter(|(_, ids)| ids.contains(&event_id))
            .count()
    }
}

impl Source for LaggingSource {
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        let claim = self.inner.claim(max, max_bytes).await?;
        if !claim.events.is_empty() {
            let ids = claim.events.iter().map(|e| e.event_id).collect();
            self.claims.lock().unwrap().push((claim.lease, ids));
            self.claimed.notify_waiters();
        }
        Ok(claim)
    }

    async fn mark_published(&self, published: &[Published]) -> Result<(), SourceError> {
        self.inner.mark_published(published).await?;
        self.published.lock().unwrap().extend_from_slice(published);
        Ok(())
    }

    async fn record_failures(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        let lag = !std::mem::replace(&mut *self.lagged.lock().unwrap(), true);
        if lag {
            // Frozen until the lease ran out and the relay claimed the event again.
            let event_id = failures[0].event_id;
            let reclaimed = async {
                loop {
                    let claimed = self.claimed.notified();
                    if self.claims_of(event_id) >= 2 {
                        return;
                    }
                    claimed.await;
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(20), reclaimed).await;
        }
        let settled = self.inner.record_failures(failures).await?;
        let mut written = self.failures.lock().unwrap();
        written.extend(failures.iter().map(|f| (f.clone(), settled)));
        Ok(settled)
    }

    async fn release(&self, released: &[Released]) -> Result<Settled, SourceError> {
        self.inner.release(released).await
    }

    async fn wait_for_work(&self, at_most: Duration) -> Result<(), SourceError> {
        self.inner.wait_for_work(at_most).await
    }
}

/// A destination that times out on the first publish of each event and accepts it afterwards.
#[derive(Default)]
struct FirstTimeout {
    seen: Mutex<HashSet<EventId>>,
}

impl Transport for FirstTimeout {
    async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
        if self.seen.lock().unwrap().insert(event.event_id) {
            return Err(PublishError::new(
                PublishErrorKind::Timeout,
                "no ack in time",
            ));
        }
        Ok(Receipt::new("accepted"))
    }

    async fn wait_until_ready(&self, _at_most: Duration) -> bool {
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_written_after_its_lease_ran_out_never_takes_effect_over_the_new_lease() {
    let db = TestDb::migrated("relay_fencing_lag").await;
    sqlx::raw_sql(AUDIT).execute(&db.pool).await.unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    db.enqueue_alone(&outbox, factory::event("a", 0)).await;
    let event_id: EventId = sqlx::query_scalar("SELECT event_id FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();

    let config = PollingConfig {
        schema: Schema::named(db.schema()).unwrap(),
        relay_id: "relay-a".into(),
        // Short, so the lagging failure write outlives it.
        lease: Duration::from_secs(1),
        ..PollingConfig::default()
    };
    let source = Arc::new(LaggingSource {
        inner: PollingSource::new(db.pool.clone(), config).unwrap(),
        claims: Mutex::new(Vec::new()),
        claimed: Notify::new(),
        lagged: Mutex::new(false),
        failures: Mutex::new(Vec::new()),
        published: Mutex::new(Vec::new()),
    });
    let quick = Backoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(50),
    };
    let relay_config = RelayConfig {
        retry_backoff: quick,
        outage_backoff: quick,
        poll_interval: Duration::from_millis(50),
        lease_margin: Duration::from_millis(200),
        mark_interval: Duration::from_millis(10),
        ..RelayConfig::default()
    };
    let relay = Relay::from_shared(
        source.clone(),
        Arc::new(FirstTimeout::default()),
        relay_config,
    )
    .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async {
        let _ = stop_rx.await;
    }));

    eventually(
        "the event is published under its second lease",
        Duration::from_secs(30),
        async || {
            sqlx::query_scalar::<_, bool>(
                "SELECT published_at IS NOT NULL FROM outbox WHERE event_id = $1",
            )
            .bind(event_id)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        },
    )
    .await;
    let _ = stop_tx.send(());
    run.await.unwrap();

    let claims = source.claims.lock().unwrap().clone();
    assert!(claims.len() >= 2, "claimed, then claimed again: {claims:?}");
    let (first, second) = (claims[0].0, claims[1].0);
    assert!(first.is_some() && second.is_some() && first != second);

    // The relay carried each outcome's own lease from its claim to the write.
    let failures = source.failures.lock().unwrap().clone();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let (failure, settled) = &failures[0];
    assert_eq!(failure.event_id, event_id);
    assert_eq!(
        failure.lease, first,
        "the failure carries the first claim's lease"
    );
    // Every write that took effect: the two claims and the mark; no failure or release.
    let audit: Vec<AuditRow> = sqlx::query_as(
        "SELECT old_claimed_by, new_claimed_by, old_claim_until, new_claim_until, \
         old_attempt_count, new_attempt_count, new_published_at IS NOT NULL \
         FROM outbox_audit ORDER BY n",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let relay_a = Some("relay-a".to_string());
    let (first_token, second_token) = (first.map(|l| l.token()), second.map(|l| l.token()));
    let marked_until = audit.get(2).and_then(|row| row.3);
    assert_eq!(
        audit,
        vec![
            (None, relay_a.clone(), None, first_token, 0, 0, false),
            (
                relay_a.clone(),
                relay_a.clone(),
                first_token,
                second_token,
                0,
                0,
                false
            ),
            // The mark ends the lease at its own now().
            (
                relay_a.clone(),
                relay_a,
                second_token,
                marked_until,
                0,
                0,
                true
            ),
        ],
        "a write under the first lease took effect over the second"
    );
    assert_eq!(settled.stale, 1, "the late failure write is counted stale");
    assert_eq!(claims.len(), 2, "claimed twice: {claims:?}");
    let published = source.published.lock().unwrap().clone();
    assert_eq!(published.len(), 1);
    assert_eq!(
        published[0].lease, second,
        "the ack carries the second claim's lease"
    );
}
