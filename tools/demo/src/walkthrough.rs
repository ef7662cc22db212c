//! The commands the demo sends, what it reads back from the outbox, and the summary.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use chrono::{DateTime, Utc};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::destination::Destination;
use crate::stream::StreamCheck;
use crate::table::{self, Align};

/// How long one HTTP request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Width of the path column in the request log.
const PATH_WIDTH: usize = 26;

/// What the HTTP part did, for the summary.
pub struct Report {
    /// Each created order's id and the version the service last reported for it.
    pub orders: Vec<(String, i64)>,
    /// Retries answered from the idempotency record, without a second write.
    pub replayed: usize,
    /// Requests refused before anything was written (key reused, key missing).
    pub refused: usize,
}

/// One response, kept whole so a replay can be compared with the original.
struct Reply {
    status: StatusCode,
    replayed: bool,
    json: Value,
}

struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    /// Sends one request; `body` is sent as JSON exactly as given.
    async fn send(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> Result<Reply> {
        let mut request = self
            .client
            .request(method.clone(), format!("{}{path}", self.base));
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("{method} {path}: no response from the order service"))?;
        let status = response.status();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let bytes = response
            .bytes()
            .await
            .with_context(|| format!("{method} {path}: while reading the response"))?;
        let json = serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "{method} {path} answered {status} with a body that is not JSON: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            )
        })?;
        Ok(Reply {
            status,
            replayed,
            json,
        })
    }
}

/// Sends the demo's commands to the upgraded service at `base` (`http://host:port`) and one
/// order to the instance not yet upgraded at `old_base`, printing one line per request, and
/// checks each answer against the service's contract.
pub async fn drive(base: &str, old_base: &str) -> Result<Report> {
    let client = reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .context("while building the HTTP client")?;
    let api = Api {
        client: client.clone(),
        base: base.to_owned(),
    };
    let old_api = Api {
        client,
        base: old_base.to_owned(),
    };
    let mut report = Report {
        orders: Vec::new(),
        replayed: 0,
        refused: 0,
    };

    // Three orders, each with its own idempotency key; the second one reaches the instance not
    // yet upgraded, as a load balancer would send it during a rollout.
    let carts = [
        ("c-1", "sku-1", 2, 500),
        ("c-2", "sku-2", 1, 1200),
        ("c-3", "sku-3", 3, 150),
    ];
    let mut first: Option<(String, Value, Reply)> = None;
    for (index, (customer, sku, quantity, price)) in carts.into_iter().enumerate() {
        let (target, writes) = if index == 1 {
            (&old_api, "old instance, OrderCreated v1")
        } else {
            (&api, "OrderCreated v2")
        };
        let key = Uuid::now_v7().to_string();
        let body = json!({
            "customer_id": customer,
            "lines": [{"sku": sku, "quantity": quantity, "unit_price_cents": price}],
        });
        let reply = target
            .send(Method::POST, "/orders", Some(&key), Some(&body))
            .await?;
        expect(&reply, StatusCode::CREATED, "POST /orders")?;
        let order = Order::from_json(&reply.json, "POST /orders")?;
        ensure!(
            order.status == "open",
            "POST /orders returned an order with status {:?}, expected \"open\"",
            order.status
        );
        show(
            "POST",
            "/orders",
            reply.status,
            &format!("{} ({writes})", order.describe(true)),
        );
        report.orders.push((order.id.clone(), order.version));
        if first.is_none() {
            first = Some((key, body, reply));
        }
    }
    let Some((key, body, original)) = first else {
        bail!("no order was created");
    };
    let order_id = Order::from_json(&original.json, "POST /orders")?.id;

    // The client did not see the answer and retries: same key, same body.
    let retry = api
        .send(Method::POST, "/orders", Some(&key), Some(&body))
        .await?;
    ensure!(
        retry.status == original.status && retry.json == original.json,
        "a retry with the same Idempotency-Key and body answered {} {}, not the original {} {}",
        retry.status,
        retry.json,
        original.status,
        original.json
    );
    ensure!(
        retry.replayed,
        "a replayed response lacks the header Idempotent-Replayed: true"
    );
    show(
        "POST",
        "/orders",
        retry.status,
        "retry, same key and body: same response, no second order (Idempotent-Replayed: true)",
    );
    report.replayed += 1;

    // The same key for a different request is a client bug, refused before any write.
    let other = json!({
        "customer_id": "c-1",
        "lines": [{"sku": "sku-1", "quantity": 5, "unit_price_cents": 500}],
    });
    let reused = api
        .send(Method::POST, "/orders", Some(&key), Some(&other))
        .await?;
    expect_error(
        &reused,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
        "POST /orders",
    )?;
    show(
        "POST",
        "/orders",
        reused.status,
        "same key, other body: refused (idempotency_key_reused)",
    );
    report.refused += 1;

    // Without a key a retry could not be recognised, so the service refuses the command.
    let keyless = api.send(Method::POST, "/orders", None, Some(&body)).await?;
    expect_error(
        &keyless,
        StatusCode::BAD_REQUEST,
        "missing_idempotency_key",
        "POST /orders",
    )?;
    show(
        "POST",
        "/orders",
        keyless.status,
        "no Idempotency-Key: refused (missing_idempotency_key)",
    );
    report.refused += 1;

    // Two more commands on the first order: its events get sequences 2 and 3.
    let short = short_id(&order_id);
    let key = Uuid::now_v7().to_string();
    let line = json!({"sku": "sku-9", "quantity": 1, "unit_price_cents": 250});
    let path = format!("/orders/{order_id}/lines");
    let reply = api
        .send(Method::POST, &path, Some(&key), Some(&line))
        .await?;
    expect(&reply, StatusCode::OK, "POST /orders/{id}/lines")?;
    let order = Order::from_json(&reply.json, "POST /orders/{id}/lines")?;
    show(
        "POST",
        &format!("/orders/{short}/lines"),
        reply.status,
        &order.describe(false),
    );

    let key = Uuid::now_v7().to_string();
    let path = format!("/orders/{order_id}/cancel");
    let reply = api
        .send(Method::POST, &path, Some(&key), Some(&json!({})))
        .await?;
    expect(&reply, StatusCode::OK, "POST /orders/{id}/cancel")?;
    let order = Order::from_json(&reply.json, "POST /orders/{id}/cancel")?;
    ensure!(
        order.status == "cancelled",
        "POST /orders/{{id}}/cancel returned status {:?}, expected \"cancelled\"",
        order.status
    );
    show(
        "POST",
        &format!("/orders/{short}/cancel"),
        reply.status,
        &order.describe(false),
    );

    // A line of the cancelled order's SKU on another order, which stays open: a consumer that
    // reserves stock must release what the cancelled order held, and only that.
    let Some((second_id, _)) = report.orders.get(1).cloned() else {
        bail!("the demo created fewer than two orders");
    };
    let key = Uuid::now_v7().to_string();
    let line = json!({"sku": "sku-1", "quantity": 4, "unit_price_cents": 500});
    let path = format!("/orders/{second_id}/lines");
    let reply = api
        .send(Method::POST, &path, Some(&key), Some(&line))
        .await?;
    expect(&reply, StatusCode::OK, "POST /orders/{id}/lines")?;
    let order = Order::from_json(&reply.json, "POST /orders/{id}/lines")?;
    show(
        "POST",
        &format!("/orders/{}/lines", short_id(&second_id)),
        reply.status,
        &order.describe(false),
    );
    if let Some(entry) = report.orders.iter_mut().find(|(id, _)| *id == order.id) {
        entry.1 = order.version;
    }

    let reply = api
        .send(Method::GET, &format!("/orders/{order_id}"), None, None)
        .await?;
    expect(&reply, StatusCode::OK, "GET /orders/{id}")?;
    let order = Order::from_json(&reply.json, "GET /orders/{id}")?;
    show(
        "GET",
        &format!("/orders/{short}"),
        reply.status,
        &order.describe(true),
    );
    if let Some(entry) = report.orders.iter_mut().find(|(id, _)| *id == order.id) {
        entry.1 = order.version;
    }
    Ok(report)
}

/// One outbox row, as the demo shows it.
#[derive(sqlx::FromRow)]
pub struct OutboxRow {
    /// `OrderCreated`, ...
    pub event_type: String,
    /// The order id.
    pub aggregate_id: String,
    /// 1, 2, 3 ... per order.
    pub aggregate_sequence: i64,
    /// The payload's schema version.
    pub schema_version: i32,
    /// When the relay marked it published, after the broker's acknowledgement.
    pub published_at: Option<DateTime<Utc>>,
}

/// Reads every outbox row of the demo database, per order in sequence order.
pub async fn read_outbox(pool: &PgPool) -> Result<Vec<OutboxRow>> {
    sqlx::query_as(
        "SELECT event_type, aggregate_id, aggregate_sequence, schema_version, published_at \
         FROM outbox ORDER BY aggregate_id, aggregate_sequence",
    )
    .fetch_all(pool)
    .await
    .context("while reading the outbox table")
}

/// Prints the rows as an aligned table.
pub fn print_outbox(rows: &[OutboxRow]) {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            vec![
                row.event_type.clone(),
                short_id(&row.aggregate_id),
                row.aggregate_sequence.to_string(),
                row.schema_version.to_string(),
                match row.published_at {
                    Some(at) => at.format("%H:%M:%S%.3f").to_string(),
                    None => "pending".to_owned(),
                },
            ]
        })
        .collect();
    table::print(
        &["EVENT", "ORDER", "SEQ", "SCHEMA VER", "PUBLISHED"],
        &[
            Align::Left,
            Align::Left,
            Align::Right,
            Align::Right,
            Align::Left,
        ],
        &cells,
    );
}

/// Checks what the outbox promises: per order, sequences 1..n with no gap, and exactly one
/// event per command the service applied.
pub fn check_outbox(report: &Report, rows: &[OutboxRow]) -> Result<()> {
    let mut per_order: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for row in rows {
        per_order
            .entry(&row.aggregate_id)
            .or_default()
            .push(row.aggregate_sequence);
    }
    for (order, sequences) in &per_order {
        let expected: Vec<i64> = (1..=sequences.len() as i64).collect();
        ensure!(
            *sequences == expected,
            "the events of order {order} have sequences {sequences:?}, expected {expected:?}"
        );
    }
    for (order, version) in &report.orders {
        let events = per_order.get(order.as_str()).map_or(0, Vec::len);
        ensure!(
            events as i64 == *version,
            "order {order} is at version {version} but has {events} event(s) in the outbox"
        );
    }
    ensure!(
        per_order.len() == report.orders.len(),
        "the outbox holds events of {} order(s), the demo created {}",
        per_order.len(),
        report.orders.len()
    );
    println!(
        "   per order, sequences 1..n with no gap: one event per applied command, none for the \
         retry\n   or the refused commands; all pending, as no relay has run yet"
    );
    Ok(())
}

/// Prints which schema versions of `OrderCreated` the outbox holds, and checks both are there:
/// the old instance's version 1 and the upgraded ones' version 2.
pub fn print_versions(rows: &[OutboxRow]) -> Result<()> {
    let created = |version: i32| {
        rows.iter()
            .filter(|r| r.event_type == "OrderCreated" && r.schema_version == version)
            .count()
    };
    let (v1, v2) = (created(1), created(2));
    ensure!(
        v1 > 0 && v2 > 0,
        "the outbox holds {v1} OrderCreated v1 and {v2} v2 events, expected some of each"
    );
    println!(
        "   OrderCreated in two schema versions: {v1} x v1 (amounts in cents, from the old \
         instance)\n   and {v2} x v2 (minor units and a currency). Both are declared in the \
         service's event\n   catalog, so the old instance's events stay valid; the consumers \
         upcast v1 to v2 and\n   handle v2 only"
    );
    Ok(())
}

/// Prints the summary of a run whose checks all passed; `more` are the receivers' lines, in
/// the same form.
pub fn print_summary(
    destination: Destination,
    report: &Report,
    rows: &[OutboxRow],
    stream: &StreamCheck,
    more: &[String],
) {
    let published = rows.iter().filter(|r| r.published_at.is_some()).count();
    println!("   orders created:               {}", report.orders.len());
    println!(
        "   events in the outbox:         {} ({published} marked published by the relay)",
        rows.len()
    );
    let label = match destination {
        Destination::Nats => "messages in JetStream:",
        Destination::Kafka => "records in Kafka:",
        Destination::Amqp => "messages in RabbitMQ:",
    };
    println!(
        "   {label:<30}{}, one per event; per order 1..n in order, no gap, no duplicate",
        stream.messages
    );
    println!(
        "   idempotent retries absorbed:  {} replayed, {} refused; no second order, event or \
         message",
        report.replayed, report.refused
    );
    for line in more {
        println!("   {line}");
    }
    println!();
    let closing: &[&str] = match destination {
        Destination::Nats => &[
            "Delivery is at least once: had the relay crashed between JetStream's ack and marking the",
            "row, the next relay would publish again, and the stream would drop the copy by its",
            "Nats-Msg-Id (the event id) within its duplicate window. Consumers make the effect",
            "exactly-once by recording that id in their inbox (processed_events) in the transaction",
            "of the effect, and an outside call by retrying it only under the same Idempotency-Key.",
        ],
        Destination::Kafka => &[
            "Delivery is at least once: had the relay crashed between Kafka's delivery report and",
            "marking the row, the next relay would publish again, and the topic would hold a second",
            "record with the same ce-id, as after step 12: Kafka drops no copy by id. Consumers make",
            "the effect exactly-once by recording that id in their inbox (processed_events) in the",
            "transaction of the effect, and an outside call by retrying it only under the same",
            "Idempotency-Key.",
        ],
        Destination::Amqp => &[
            "Delivery is at least once: had the relay crashed between RabbitMQ's confirm and marking",
            "the row, the next relay would publish again, and the queues would hold a second copy",
            "with the same message_id, as after step 12: RabbitMQ drops no copy by id. Consumers make",
            "the effect exactly-once by recording that id in their inbox (processed_events) in the",
            "transaction of the effect, and an outside call by retrying it only under the same",
            "Idempotency-Key.",
        ],
    };
    for line in closing {
        println!("   {line}");
    }
}

/// The fields of an order response the demo shows.
struct Order {
    id: String,
    customer: String,
    status: String,
    lines: usize,
    total_cents: i64,
    version: i64,
}

impl Order {
    fn from_json(json: &Value, what: &str) -> Result<Self> {
        let field = |name: &str| {
            json.get(name)
                .with_context(|| format!("the response of {what} has no field {name:?}: {json}"))
        };
        let text = |name: &str| -> Result<String> {
            field(name)?
                .as_str()
                .map(str::to_owned)
                .with_context(|| format!("the field {name:?} of {what} is not a string: {json}"))
        };
        let number = |name: &str| -> Result<i64> {
            field(name)?
                .as_i64()
                .with_context(|| format!("the field {name:?} of {what} is not an integer: {json}"))
        };
        Ok(Self {
            id: text("order_id")?,
            customer: text("customer_id")?,
            status: text("status")?,
            lines: field("lines")?
                .as_array()
                .with_context(|| format!("the field \"lines\" of {what} is not a list: {json}"))?
                .len(),
            total_cents: number("total_cents")?,
            version: number("version")?,
        })
    }

    fn describe(&self, with_customer: bool) -> String {
        let customer = if with_customer {
            format!(" for {}", self.customer)
        } else {
            String::new()
        };
        let plural = if self.lines == 1 { "" } else { "s" };
        format!(
            "order {}{customer}: {}, {} line{plural}, {} cents, version {}",
            short_id(&self.id),
            self.status,
            self.lines,
            self.total_cents,
            self.version
        )
    }
}

fn expect(reply: &Reply, status: StatusCode, what: &str) -> Result<()> {
    ensure!(
        reply.status == status,
        "{what} answered {} (expected {status}): {}",
        reply.status,
        reply.json
    );
    Ok(())
}

fn expect_error(reply: &Reply, status: StatusCode, code: &str, what: &str) -> Result<()> {
    expect(reply, status, what)?;
    let got = reply.json.pointer("/error/code").and_then(Value::as_str);
    ensure!(
        got == Some(code),
        "{what} answered {status} without the error code {code:?}: {}",
        reply.json
    );
    Ok(())
}

fn show(method: &str, path: &str, status: StatusCode, result: &str) {
    println!(
        "   {method:<4} {path:<PATH_WIDTH$} {}  {result}",
        status.as_u16()
    );
}

/// The last 8 characters of an id: the order ids are UUIDv7, whose first characters are a
/// timestamp shared by orders created in the same minute, and whose last ones are random.
pub fn short_id(id: &str) -> String {
    let start = id.char_indices().rev().nth(7).map_or(0, |(i, _)| i);
    format!("…{}", &id[start..])
}
