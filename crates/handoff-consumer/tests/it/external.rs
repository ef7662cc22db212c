//! Outside calls under an idempotency key (design C2): ambiguous attempts are retried with the
//! same key, every attempt and outcome is recorded, a recorded success is not sent again.

use std::sync::{Arc, Mutex};

use crate::common::{event, Setup};
use handoff_consumer::{CallFailure, CallPolicy, CallSuccess, ExternalCallError, ExternalCalls};
use handoff_core::intake::ReceivedEvent;
use handoff_postgres::{Inbox, Schema};

fn received(setup_event: &handoff_core::delivery::OutboxEvent) -> ReceivedEvent {
    ReceivedEvent {
        event_id: setup_event.event_id,
        aggregate_type: setup_event.aggregate_type.clone(),
        aggregate_id: setup_event.aggregate_id.clone(),
        sequence: setup_event.aggregate_sequence,
        event_type: setup_event.event_type.clone(),
        schema_version: 1,
        payload: setup_event.payload.clone(),
        headers: Vec::new(),
        replayed: false,
    }
}

async fn record(setup: &Setup, key: &str) -> (String, i32, Option<i32>, Option<String>) {
    sqlx::query_as(
        "SELECT status, attempts, response_status, response_body FROM external_calls \
         WHERE idempotency_key = $1",
    )
    .bind(key)
    .fetch_one(&setup.db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn ambiguous_attempts_are_retried_with_the_same_key_and_recorded() {
    let setup = Setup::new("external_ambiguous").await;
    let inbox = Inbox::new(Schema::default(), "payments").unwrap();
    let calls = ExternalCalls::new(setup.db.pool.clone(), inbox, CallPolicy::default());
    let event = received(&event("o-1", 1));
    let keys = Arc::new(Mutex::new(Vec::new()));

    let sent = keys.clone();
    let success = calls
        .call(&event, "", move |key| {
            let sent = sent.clone();
            async move {
                let mut sent = sent.lock().unwrap();
                sent.push(key);
                if sent.len() < 3 {
                    Err(CallFailure::Ambiguous("timed out after 500ms".into()))
                } else {
                    Ok(CallSuccess {
                        status: 201,
                        body: r#"{"charge_id":"ch_1"}"#.into(),
                        from_record: false,
                    })
                }
            }
        })
        .await
        .unwrap();
    assert_eq!(success.status, 201);
    let key = event.event_id.to_string();
    assert_eq!(
        *keys.lock().unwrap(),
        vec![key.clone(); 3],
        "one key for every attempt"
    );
    assert_eq!(
        record(&setup, &key).await,
        (
            "succeeded".into(),
            3,
            Some(201),
            Some(r#"{"charge_id":"ch_1"}"#.into())
        )
    );

    // A redelivery after a crash that lost the consumer's commit: answered from the record.
    let again = calls
        .call(&event, "", |_| async {
            panic!("a recorded success must not be sent again")
        })
        .await
        .unwrap();
    assert!(again.from_record);
    assert_eq!(again.body, r#"{"charge_id":"ch_1"}"#);
}

#[tokio::test]
async fn a_call_still_ambiguous_fails_retryable_and_a_refusal_fails_permanent() {
    let setup = Setup::new("external_outcomes").await;
    let inbox = Inbox::new(Schema::default(), "payments").unwrap();
    let calls = ExternalCalls::new(setup.db.pool.clone(), inbox, CallPolicy::default());

    let ambiguous = received(&event("o-2", 1));
    let error = calls
        .call(&ambiguous, "", |_| async {
            Err(CallFailure::Ambiguous("reset".into()))
        })
        .await
        .unwrap_err();
    assert!(
        matches!(error, ExternalCallError::Ambiguous { attempts: 3, .. }),
        "{error}"
    );
    let handler_error: handoff_consumer::HandlerError = error.into();
    assert_eq!(
        handler_error.kind(),
        handoff_consumer::HandlerErrorKind::Retryable
    );
    assert_eq!(
        record(&setup, &ambiguous.event_id.to_string()).await.0,
        "ambiguous"
    );

    let refused = received(&event("o-3", 1));
    let error = calls
        .call(&refused, "charge", |_| async {
            Err(CallFailure::Rejected {
                status: 402,
                body: "card declined".into(),
            })
        })
        .await
        .unwrap_err();
    let handler_error: handoff_consumer::HandlerError = error.into();
    assert_eq!(
        handler_error.kind(),
        handoff_consumer::HandlerErrorKind::Permanent
    );
    let key = format!("{}:charge", refused.event_id);
    assert_eq!(
        record(&setup, &key).await,
        (
            "rejected".into(),
            1,
            Some(402),
            Some("card declined".into())
        )
    );
}
