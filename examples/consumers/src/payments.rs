//! The `payments` consumer: charges every created order once at the payment provider, and
//! records the charge in its own `payments` table.
//!
//! The charge cannot join the consumer's transaction, so exactly-once rests on the provider's
//! `Idempotency-Key`: every attempt for one `OrderCreated` carries the event id as key (through
//! [`ExternalCalls`]), a timeout or a 5xx is retried only with that key, and the provider
//! answers a repeated key with the charge it already made. The payment row is then written in
//! the event's transaction, with a plain `INSERT`: the inbox is what keeps a redelivery from
//! applying twice, and a second row for one order would fail loudly instead of being hidden.

use std::error::Error as _;
use std::time::Duration;

use clap::Parser;
use handoff_consumer::{
    CallFailure, CallPolicy, CallSuccess, ExternalCalls, Handler, HandlerError,
};
use handoff_core::intake::ReceivedEvent;
use handoff_core::Event;
use handoff_postgres::{Migration, Pooling, Schema};
use order_service::events::OrderCreated;
use reqwest::Url;
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use tracing::info;
use uuid::Uuid;

use crate::common::{self, CommonArgs, OwnTables, RunError, AGGREGATE_TYPE};
use crate::upcast;

/// The consumer's default name (`--consumer-name`), also its JetStream durable name.
pub const DEFAULT_NAME: &str = "payments";

/// The currency the payment provider account settles in; its API takes bare minor units of it.
pub const SETTLEMENT_CURRENCY: &str = "EUR";

/// The consumer's own tables, recorded in `payments_migrations`.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "create_payments",
    up: CREATE_PAYMENTS_SQL,
    down: "DROP TABLE payments",
}];

const CREATE_PAYMENTS_SQL: &str = "\
-- payments 0001: the provider's charge for each order.
-- One row per order, enforced: a second charge recorded for an order is a bug that must fail
-- loudly, never be absorbed.
CREATE TABLE payments (
    order_id     uuid        NOT NULL,
    charge_id    text        NOT NULL,
    amount_cents bigint      NOT NULL,
    -- clock_timestamp(), not now(): the row is written after the provider answered, while now()
    -- is when the consumer's transaction began, before the call.
    charged_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT payments_pkey PRIMARY KEY (order_id),
    -- One charge pays one order.
    CONSTRAINT payments_charge_id_key UNIQUE (charge_id)
);
";

/// A plain INSERT on purpose (no ON CONFLICT): deduplication is the inbox's job, and a double
/// application must show as an error.
const INSERT_PAYMENT_SQL: &str =
    "INSERT INTO {payments} (order_id, charge_id, amount_cents) VALUES ($1, $2, $3)";

/// The `payments` command line.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "payments",
    version,
    about = "Reference consumer: charges each created order once, through Idempotency-Key"
)]
pub struct PaymentsArgs {
    /// The flags every reference consumer takes.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Base URL of the payment provider; charges are POSTed to URL/charges.
    #[arg(long, env = "PAYMENT_PROVIDER_URL")]
    pub provider_url: Url,
    /// How long one call to the provider may take before it counts as ambiguous (e.g. 2s).
    #[arg(long, env = "PAYMENT_PROVIDER_TIMEOUT", default_value = "2s",
        value_parser = humantime::parse_duration)]
    pub provider_timeout: Duration,
    /// Calls to the provider per delivery of one event; after that the broker's redelivery
    /// tries again, with the same key.
    #[arg(long, env = "HANDOFF_CALL_ATTEMPTS", default_value_t = 3)]
    pub call_attempts: u32,
}

/// Runs the `payments` consumer until SIGTERM or SIGINT (see [`common::run`]).
///
/// # Errors
///
/// [`RunError`] when it cannot start, in particular an `--ack-wait` too short for
/// `--call-attempts` calls of `--provider-timeout` each: the broker would redeliver an event
/// while its calls still run.
///
/// # Cancel safety
///
/// As [`common::run`].
pub async fn run(args: PaymentsArgs) -> Result<(), RunError> {
    let charges_url = charges_url(&args.provider_url)?;
    if args.provider_timeout.is_zero() {
        return Err(RunError::InvalidFlag {
            flag: "--provider-timeout",
            reason: "it must be above zero".to_owned(),
        });
    }
    if args.call_attempts == 0 {
        return Err(RunError::InvalidFlag {
            flag: "--call-attempts",
            reason: "at least one call per delivery is needed".to_owned(),
        });
    }
    let policy = CallPolicy {
        attempts_per_delivery: args.call_attempts,
        ..CallPolicy::default()
    };
    let longest = longest_delivery(&policy, args.provider_timeout);
    if args.common.ack_wait <= longest {
        return Err(RunError::InvalidFlag {
            flag: "--ack-wait",
            reason: format!(
                "{} does not cover {} calls of up to {} and the pauses between them ({} in all): \
                 the broker would redeliver events whose calls still run",
                humantime::format_duration(args.common.ack_wait),
                args.call_attempts,
                humantime::format_duration(args.provider_timeout),
                humantime::format_duration(longest)
            ),
        });
    }
    let http = reqwest::Client::builder()
        .timeout(args.provider_timeout)
        .build()
        .map_err(RunError::HttpClient)?;
    let own = OwnTables {
        history_table: "payments_migrations",
        migrations: MIGRATIONS,
    };
    // Two connections per event: the event's transaction, and the call record's own
    // connection, which must not wait for the transaction.
    common::run(&args.common, own, 2, |context| {
        let calls = ExternalCalls::new(context.pool.clone(), context.inbox.clone(), policy);
        Payments::new(calls, http, charges_url, &context.schema).with_pooling(context.pooling)
    })
    .await
}

/// `<provider>/charges`.
fn charges_url(provider: &Url) -> Result<Url, RunError> {
    let invalid = |reason: String| RunError::InvalidFlag {
        flag: "--provider-url",
        reason,
    };
    if !matches!(provider.scheme(), "http" | "https") {
        return Err(invalid(format!("{provider} is not an http(s) URL")));
    }
    let joined = format!("{}/charges", provider.as_str().trim_end_matches('/'));
    Url::parse(&joined).map_err(|e| invalid(format!("{joined}: {e}")))
}

/// The longest one delivery's calls can take: every attempt timing out, with the longest
/// pause between attempts.
fn longest_delivery(policy: &CallPolicy, timeout: Duration) -> Duration {
    let pauses = (1..policy.attempts_per_delivery)
        .map(|attempt| {
            let exponent = (attempt - 1).min(30);
            policy
                .backoff
                .initial
                .saturating_mul(1 << exponent)
                .min(policy.backoff.max)
        })
        .fold(Duration::ZERO, Duration::saturating_add);
    timeout
        .saturating_mul(policy.attempts_per_delivery)
        .saturating_add(pauses)
}

/// The body of `POST /charges`.
#[derive(Debug, Clone, Serialize)]
struct ChargeRequest {
    order_id: Uuid,
    amount_cents: i64,
}

/// What the consumer reads from the provider's answer.
#[derive(Debug, Clone, Deserialize)]
struct ChargeReply {
    charge_id: String,
    order_id: Option<Uuid>,
    amount_cents: Option<i64>,
}

/// The payments [`Handler`]: charges an `OrderCreated` through [`ExternalCalls`], then records
/// the charge in `payments`.
#[derive(Debug, Clone)]
pub struct Payments {
    calls: ExternalCalls,
    http: reqwest::Client,
    charges_url: Url,
    insert_payment_sql: String,
    /// Whether its statement may be cached under a name (not behind a transaction pooler).
    named_statements: bool,
}

impl Payments {
    /// A handler that POSTs charges to `charges_url` with `http` (whose timeout bounds one
    /// attempt) under `calls`, and records them in the `payments` table of `schema`.
    pub fn new(
        calls: ExternalCalls,
        http: reqwest::Client,
        charges_url: Url,
        schema: &Schema,
    ) -> Self {
        Self {
            calls,
            http,
            charges_url,
            insert_payment_sql: INSERT_PAYMENT_SQL
                .replace("{payments}", &schema.qualify("payments")),
            named_statements: true,
        }
    }

    /// The same handler with its statement sent as `pooling` requires: unnamed behind a
    /// transaction pooler.
    #[must_use]
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.named_statements = pooling.named_statements();
        self
    }

    /// One attempt of the charge under `key`.
    async fn charge(
        &self,
        key: String,
        request: &ChargeRequest,
    ) -> Result<CallSuccess, CallFailure> {
        let response = self
            .http
            .post(self.charges_url.clone())
            .header("Idempotency-Key", key)
            .json(request)
            .send()
            .await
            // Timeout, refused or reset connection: whether the charge happened is unknown.
            .map_err(|error| CallFailure::Ambiguous(describe(&error)))?;
        let status = response.status().as_u16();
        let body = response
            .text()
            .await
            .map_err(|error| CallFailure::Ambiguous(describe(&error)))?;
        classify(status, body)
    }
}

impl Handler for Payments {
    /// One event per transaction: the handler calls the payment provider, and a batch would
    /// keep its transaction (and the row locks of the events before) open across each call.
    fn allows_batches(&self) -> bool {
        false
    }

    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &ReceivedEvent,
    ) -> Result<(), HandlerError> {
        if event.aggregate_type != AGGREGATE_TYPE || event.event_type != OrderCreated::EVENT_TYPE {
            return Ok(());
        }
        let request = charge_request(event)?;
        if request.amount_cents == 0 {
            info!(order_id = %request.order_id, "nothing to charge for a free order");
            return Ok(());
        }
        let answer = self
            .calls
            .call(event, "", |key| self.charge(key, &request))
            .await?;
        let reply = read_reply(&answer.body, &request)?;
        sqlx::query(&self.insert_payment_sql)
            .persistent(self.named_statements)
            .bind(request.order_id)
            .bind(&reply.charge_id)
            .bind(request.amount_cents)
            .execute(&mut *tx)
            .await?;
        info!(order_id = %request.order_id, charge_id = %reply.charge_id,
            amount_cents = request.amount_cents, from_record = answer.from_record, "order charged");
        Ok(())
    }
}

/// What to charge for an `OrderCreated` of version 1 or 2 (read as version 2, see
/// [`upcast::order_created`]).
///
/// # Errors
///
/// A permanent [`HandlerError`]: an unreadable event, an order in another currency than the
/// provider account's, a negative total.
fn charge_request(event: &ReceivedEvent) -> Result<ChargeRequest, HandlerError> {
    let created = upcast::order_created(event)?;
    if created.currency != SETTLEMENT_CURRENCY {
        // Charging the amount as if it were in another currency would take the wrong money; an
        // operator decides (another provider account, a conversion) from the quarantine.
        return Err(HandlerError::permanent(format!(
            "order {} is in {}; the payment provider account settles {SETTLEMENT_CURRENCY} only",
            created.order_id, created.currency
        )));
    }
    if created.total_minor < 0 {
        return Err(HandlerError::permanent(format!(
            "order {} has a negative total {}",
            created.order_id, created.total_minor
        )));
    }
    Ok(ChargeRequest {
        order_id: created.order_id,
        amount_cents: created.total_minor,
    })
}

/// Sorts the provider's answer: 2xx took effect; 408, 409, 429 and 5xx (and anything else
/// unexpected) leave it unknown whether the charge happened, so only a retry with the same key
/// may follow; any other 4xx is a refusal, retrying which would be refused again.
fn classify(status: u16, body: String) -> Result<CallSuccess, CallFailure> {
    match status {
        200..=299 => Ok(CallSuccess {
            status,
            body,
            from_record: false,
        }),
        408 | 409 | 429 => Err(CallFailure::Ambiguous(format!(
            "status {status}: {}",
            clip(&body)
        ))),
        400..=499 => Err(CallFailure::Rejected { status, body }),
        _ => Err(CallFailure::Ambiguous(format!(
            "status {status}: {}",
            clip(&body)
        ))),
    }
}

/// The charge in the provider's answer, checked against what was asked.
fn read_reply(body: &str, request: &ChargeRequest) -> Result<ChargeReply, HandlerError> {
    // The charge happened but cannot be read: a redelivery would get the same answer from the
    // call record, so only an operator can sort it out (quarantine).
    let reply: ChargeReply = serde_json::from_str(body).map_err(|error| {
        HandlerError::permanent(format!(
            "the provider's answer for order {} does not parse: {error}: {}",
            request.order_id,
            clip(body)
        ))
    })?;
    let other_order = reply.order_id.is_some_and(|id| id != request.order_id);
    let other_amount = reply
        .amount_cents
        .is_some_and(|amount| amount != request.amount_cents);
    if other_order || other_amount {
        return Err(HandlerError::permanent(format!(
            "the provider answered charge {} for another order or amount than order {} of {} \
             cents: {}",
            reply.charge_id,
            request.order_id,
            request.amount_cents,
            clip(body)
        )));
    }
    Ok(reply)
}

/// A reqwest error with its causes, on one line (its own message is often just "error sending
/// request").
fn describe(error: &reqwest::Error) -> String {
    let mut message = if error.is_timeout() {
        format!("timed out: {error}")
    } else {
        error.to_string()
    };
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

/// At most 200 characters of a body, for error messages.
fn clip(body: &str) -> String {
    body.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use order_service::events::OrderCreatedVersion;
    use order_service::model::{Line, Order, Status};

    use super::*;

    #[test]
    fn answers_are_sorted_into_success_ambiguity_and_refusal() {
        assert!(classify(201, "{}".into()).is_ok());
        for status in [408, 409, 429, 500, 502, 504, 302] {
            assert!(
                matches!(classify(status, "x".into()), Err(CallFailure::Ambiguous(_))),
                "{status}"
            );
        }
        for status in [400, 401, 404, 422] {
            assert!(
                matches!(classify(status, "x".into()), Err(CallFailure::Rejected { status: s, .. }) if s == status),
                "{status}"
            );
        }
    }

    #[test]
    fn the_charges_url_follows_the_provider_url() {
        let url = |s: &str| charges_url(&Url::parse(s).unwrap()).unwrap().to_string();
        assert_eq!(
            url("http://127.0.0.1:8090"),
            "http://127.0.0.1:8090/charges"
        );
        assert_eq!(url("http://h/api/"), "http://h/api/charges");
        assert!(charges_url(&Url::parse("ftp://h").unwrap()).is_err());
    }

    #[test]
    fn the_longest_delivery_counts_every_attempt_and_pause() {
        let policy = CallPolicy::default();
        // 3 × 2 s, plus pauses of at most 200 ms and 400 ms.
        assert_eq!(
            longest_delivery(&policy, Duration::from_secs(2)),
            Duration::from_millis(6_600)
        );
    }

    fn created(version: OrderCreatedVersion, currency: &str) -> ReceivedEvent {
        let order = Order {
            order_id: Uuid::now_v7(),
            customer_id: "c".into(),
            status: Status::Open,
            lines: vec![Line {
                sku: "apple".into(),
                quantity: 3,
                unit_price_cents: 40,
            }],
            total_cents: 120,
            version: 1,
        };
        let new = version.event(&order).unwrap();
        ReceivedEvent {
            event_id: Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: order.order_id.to_string(),
            sequence: 1,
            event_type: "OrderCreated".into(),
            schema_version: new.schema_version(),
            payload: new.payload().replace("\"EUR\"", &format!("\"{currency}\"")),
            headers: vec![],
            replayed: false,
        }
    }

    #[test]
    fn versions_1_and_2_charge_the_same_and_another_currency_is_refused() {
        let v1 = charge_request(&created(OrderCreatedVersion::V1, "EUR")).unwrap();
        let v2 = charge_request(&created(OrderCreatedVersion::V2, "EUR")).unwrap();
        assert_eq!((v1.amount_cents, v2.amount_cents), (120, 120));
        let usd = charge_request(&created(OrderCreatedVersion::V2, "USD")).unwrap_err();
        assert_eq!(usd.kind(), handoff_consumer::HandlerErrorKind::Permanent);
        assert!(usd.to_string().contains("is in USD"), "{usd}");
    }

    #[test]
    fn a_reply_for_another_order_is_refused() {
        let request = ChargeRequest {
            order_id: Uuid::now_v7(),
            amount_cents: 500,
        };
        let same = format!(
            r#"{{"charge_id":"ch_1","order_id":"{}","amount_cents":500}}"#,
            request.order_id
        );
        assert_eq!(read_reply(&same, &request).unwrap().charge_id, "ch_1");
        let other = format!(
            r#"{{"charge_id":"ch_1","order_id":"{}","amount_cents":500}}"#,
            Uuid::now_v7()
        );
        assert!(read_reply(&other, &request).is_err());
        assert!(read_reply("<html>", &request).is_err());
    }
}
