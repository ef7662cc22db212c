//! What the receivers did, read from their own databases and from the provider's API, printed
//! next to what the order service's database says they should have done, and the final
//! reconciliation: orders, reservations and charges agree.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use sqlx::PgPool;

use crate::consumers::{processed, INVENTORY, PAYMENTS};
use crate::table::{self, Align};
use crate::walkthrough::short_id;

/// How long one request to the provider may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The connections the ledger is read through.
pub struct Sources<'a> {
    /// The order service's database: the orders, their lines and the outbox.
    pub orders: &'a PgPool,
    /// The inventory consumer's database.
    pub inventory: &'a PgPool,
    /// The payments consumer's database.
    pub payments: &'a PgPool,
    /// The provider's API, `http://host:port`.
    pub provider_url: &'a str,
}

/// Everything the demo compares, read at one moment.
#[derive(Clone, PartialEq)]
pub struct Ledger {
    /// Per created order, the total of its `OrderCreated` event: what payments should charge.
    created: BTreeMap<String, i64>,
    /// Per event id, its order and type, to name the order of an external call.
    events: HashMap<String, (String, String)>,
    /// Per SKU ever ordered, the quantity of the open orders' lines: what inventory should hold.
    expected_stock: BTreeMap<String, i64>,
    /// Inventory's `stock` table.
    stock: BTreeMap<String, i64>,
    /// Payments' `payments` table, in charge order.
    payments: Vec<Payment>,
    /// The provider's charges, in creation order.
    charges: Vec<Charge>,
    /// The provider's counters.
    stats: Stats,
    /// Payments' `external_calls` rows.
    calls: Vec<Call>,
    /// Per consumer, the events in its `processed_events`.
    processed: [i64; 2],
    /// Per consumer, the events in its `consumer_quarantine`.
    quarantined: [i64; 2],
}

/// One row of payments' `payments` table.
#[derive(Clone, PartialEq, sqlx::FromRow)]
struct Payment {
    order_id: String,
    charge_id: Option<String>,
    amount_cents: Option<i64>,
    charged_at: Option<DateTime<Utc>>,
}

/// One charge of the provider's `GET /charges`.
#[derive(Clone, PartialEq, Deserialize)]
struct Charge {
    charge_id: String,
    order_id: String,
    amount_cents: i64,
}

/// The provider's `GET /stats`, counted since it started.
#[derive(Clone, Copy, PartialEq, Deserialize)]
struct Stats {
    requests: u64,
    charges_created: u64,
    replayed: u64,
    injected_timeouts: u64,
    injected_errors: u64,
}

/// One row of payments' `external_calls` table.
#[derive(Clone, PartialEq, sqlx::FromRow)]
struct Call {
    event_id: String,
    idempotency_key: String,
    status: String,
    attempts: i32,
    response_status: Option<i32>,
}

impl Ledger {
    /// Reads the orders, both consumers' tables and the provider's charges and counters.
    pub async fn read(sources: &Sources<'_>) -> Result<Self> {
        let created: Vec<(String, i64)> = sqlx::query_as(
            // Each schema version names the total its own way (version 1 in cents, version 2
            // in minor units of an explicit currency, EUR for every order of the demo).
            "SELECT aggregate_id, CASE schema_version \
                 WHEN 1 THEN (payload->>'total_cents')::bigint \
                 WHEN 2 THEN (payload->>'total_minor')::bigint END \
             FROM outbox WHERE event_type = 'OrderCreated'",
        )
        .fetch_all(sources.orders)
        .await
        .context("while reading the OrderCreated events")?;
        let events: Vec<(String, String, String)> =
            sqlx::query_as("SELECT event_id::text, aggregate_id, event_type FROM outbox")
                .fetch_all(sources.orders)
                .await
                .context("while reading the outbox's event ids")?;
        // Every SKU ever ordered, with 0 when only cancelled orders held it: inventory released
        // it, and its row must say 0 (or be absent).
        let expected_stock: Vec<(String, i64)> = sqlx::query_as(
            "SELECT l.sku, sum(CASE WHEN o.status = 'open' THEN l.quantity ELSE 0 END)::bigint \
             FROM order_lines l JOIN orders o USING (order_id) GROUP BY l.sku",
        )
        .fetch_all(sources.orders)
        .await
        .context("while reading the order service's order lines")?;
        let stock: Vec<(String, i64)> = sqlx::query_as("SELECT sku, reserved FROM stock")
            .fetch_all(sources.inventory)
            .await
            .context("while reading inventory's stock table")?;
        let payments: Vec<Payment> = sqlx::query_as(
            "SELECT order_id::text AS order_id, charge_id, amount_cents, charged_at \
             FROM payments ORDER BY charged_at, order_id",
        )
        .fetch_all(sources.payments)
        .await
        .context("while reading payments' table payments")?;
        let calls: Vec<Call> = sqlx::query_as(
            "SELECT event_id::text AS event_id, idempotency_key, status, attempts, \
             response_status FROM external_calls WHERE consumer_name = $1 \
             ORDER BY first_tried_at, idempotency_key",
        )
        .bind(PAYMENTS)
        .fetch_all(sources.payments)
        .await
        .context("while reading payments' external_calls")?;

        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .context("while building the HTTP client")?;
        let charges: Vec<Charge> = get_json(&client, sources.provider_url, "/charges").await?;
        let stats: Stats = get_json(&client, sources.provider_url, "/stats").await?;

        Ok(Self {
            created: created.into_iter().collect(),
            events: events
                .into_iter()
                .map(|(id, order, event_type)| (id, (order, event_type)))
                .collect(),
            expected_stock: expected_stock.into_iter().collect(),
            stock: stock.into_iter().collect(),
            payments,
            charges,
            stats,
            calls,
            processed: [
                processed(sources.inventory, INVENTORY).await?,
                processed(sources.payments, PAYMENTS).await?,
            ],
            quarantined: [
                quarantined(sources.inventory, INVENTORY).await?,
                quarantined(sources.payments, PAYMENTS).await?,
            ],
        })
    }

    /// Every SKU in the stock table or in an order, with what inventory holds and what the
    /// open orders need; an absent row holds 0.
    fn skus(&self) -> Vec<(&str, i64, i64)> {
        let names: BTreeSet<&str> = self
            .stock
            .keys()
            .chain(self.expected_stock.keys())
            .map(String::as_str)
            .collect();
        names
            .into_iter()
            .map(|sku| {
                (
                    sku,
                    self.stock.get(sku).copied().unwrap_or(0),
                    self.expected_stock.get(sku).copied().unwrap_or(0),
                )
            })
            .collect()
    }

    /// Inventory's stock next to the open orders' lines.
    pub fn print_inventory(&self) {
        let cells: Vec<Vec<String>> = self
            .skus()
            .into_iter()
            .map(|(sku, reserved, expected)| {
                vec![
                    sku.to_owned(),
                    if self.stock.contains_key(sku) {
                        reserved.to_string()
                    } else {
                        "(no row)".to_owned()
                    },
                    expected.to_string(),
                    verdict(reserved == expected).to_owned(),
                ]
            })
            .collect();
        table::print(
            &["SKU", "RESERVED", "OPEN ORDERS NEED", "EQUAL"],
            &[Align::Left, Align::Right, Align::Right, Align::Left],
            &cells,
        );
        println!(
            "   RESERVED: inventory's stock table, in its own database. OPEN ORDERS NEED: the \
             lines of the\n   orders not cancelled, read from the order service's own tables. \
             The cancelled order's\n   quantities were added, then released; the other order's \
             sku-1 stays reserved"
        );
        self.print_processed(0, INVENTORY);
    }

    /// Payments' rows, the provider's charges and counters, and the calls payments made.
    pub fn print_payments(&self) {
        println!("   payments' table payments, in its own database:");
        let cells: Vec<Vec<String>> = self
            .payments
            .iter()
            .map(|payment| {
                vec![
                    short_id(&payment.order_id),
                    payment
                        .charge_id
                        .as_deref()
                        .map_or("-".to_owned(), short_charge),
                    payment
                        .amount_cents
                        .map_or("-".to_owned(), |a| a.to_string()),
                    self.created
                        .get(&payment.order_id)
                        .map_or("-".to_owned(), i64::to_string),
                    payment
                        .charged_at
                        .map_or("-".to_owned(), |at| at.format("%H:%M:%S%.3f").to_string()),
                ]
            })
            .collect();
        table::print(
            &[
                "ORDER",
                "CHARGE",
                "AMOUNT",
                "ORDERCREATED TOTAL",
                "CHARGED AT",
            ],
            &[
                Align::Left,
                Align::Left,
                Align::Right,
                Align::Right,
                Align::Left,
            ],
            &cells,
        );
        println!(
            "   it charges what OrderCreated says; in this reference, lines added later are not \
             charged and\n   a cancelled order is not refunded, so the cancelled order keeps its \
             charge"
        );
        self.print_processed(1, PAYMENTS);

        println!("\n   the provider's charges (GET /charges), in its own database:");
        let cells: Vec<Vec<String>> = self
            .charges
            .iter()
            .map(|charge| {
                vec![
                    short_charge(&charge.charge_id),
                    short_id(&charge.order_id),
                    charge.amount_cents.to_string(),
                ]
            })
            .collect();
        table::print(
            &["CHARGE", "ORDER", "AMOUNT"],
            &[Align::Left, Align::Left, Align::Right],
            &cells,
        );

        println!("\n   payments' external_calls: its record of each call, kept across retries:");
        let cells: Vec<Vec<String>> = self
            .calls
            .iter()
            .map(|call| {
                let (order, event_type) = self
                    .events
                    .get(&call.event_id)
                    .map_or(("?", "?"), |(o, t)| (o.as_str(), t.as_str()));
                vec![
                    short_id(order),
                    event_type.to_owned(),
                    short_id(&call.idempotency_key),
                    call.status.clone(),
                    call.attempts.to_string(),
                    call.response_status
                        .map_or("-".to_owned(), |s| s.to_string()),
                ]
            })
            .collect();
        table::print(
            &[
                "ORDER",
                "EVENT",
                "IDEMPOTENCY-KEY",
                "STATUS",
                "ATTEMPTS",
                "ANSWER",
            ],
            &[
                Align::Left,
                Align::Left,
                Align::Left,
                Align::Left,
                Align::Right,
                Align::Right,
            ],
            &cells,
        );
        if !self.calls.is_empty() && self.calls.iter().all(|c| c.idempotency_key == c.event_id) {
            println!("   each Idempotency-Key is the id of the event that caused the call");
        }
        let retried = self.calls.iter().filter(|c| c.attempts > 1).count();
        let stats = &self.stats;
        println!(
            "\n   the provider's counters (GET /stats): {} POST /charges; {} created a charge, {} \
             got the\n   stored answer of an earlier request with the same key; {} injected \
             timeouts, {} injected errors",
            stats.requests,
            stats.charges_created,
            stats.replayed,
            stats.injected_timeouts,
            stats.injected_errors
        );
        if stats.injected_timeouts > 0 {
            let plural = if retried == 1 { "" } else { "s" };
            println!(
                "   Each injected timeout committed its charge, then held the answer: payments \
                 timed out\n   after {} without knowing whether the order was charged (the \
                 ambiguous case), and\n   retried with the same Idempotency-Key; the provider \
                 answered from its stored response,\n   so {retried} call{plural} took more than \
                 one attempt and no order was charged twice",
                crate::consumers::PROVIDER_TIMEOUT,
            );
        } else {
            println!("   No injected timeout happened in this run: every first attempt succeeded");
        }
    }

    /// The summary's lines about the receivers: how long they took to apply `events`, and what
    /// the redelivery (`redelivered` messages to each consumer) changed: nothing.
    pub fn summary(&self, events: usize, took: Duration, redelivered: [u64; 2]) -> Vec<String> {
        let retried = self.calls.iter().filter(|c| c.attempts > 1).count();
        vec![
            format!(
                "{:<30}{events} by inventory, {events} by payments, within {} ms",
                "events applied by consumers:",
                took.as_millis()
            ),
            format!(
                "{:<30}{} for {} orders; {} ambiguous timeouts, retried with the same key",
                "charges at the provider:",
                self.charges.len(),
                self.created.len(),
                retried,
            ),
            format!(
                "{:<30}{} to inventory, {} to payments, all in processed_events: nothing twice",
                "redelivered events:", redelivered[0], redelivered[1]
            ),
        ]
    }

    fn print_processed(&self, index: usize, name: &str) {
        let of = if name.ends_with('s') { "'" } else { "'s" };
        println!(
            "   {name}{of} processed_events: {} events, one per event it applied (or skipped), \
             written in the\n   transaction of its effect; its consumer_quarantine: {} events",
            self.processed[index], self.quarantined[index]
        );
    }

    /// What changed from `before` to `self`, one phrase per table; empty when nothing did.
    pub fn changes_since(&self, before: &Ledger) -> Vec<&'static str> {
        let mut changed = Vec::new();
        if self.stock != before.stock {
            changed.push("inventory's stock");
        }
        if self.processed != before.processed {
            changed.push("processed_events");
        }
        if self.payments != before.payments {
            changed.push("payments' rows");
        }
        if self.calls != before.calls {
            changed.push("payments' external_calls");
        }
        if self.charges != before.charges {
            changed.push("the provider's charges");
        }
        if self.stats.requests != before.stats.requests {
            changed.push("the provider's request count");
        }
        changed
    }

    /// The final line when orders, charges and reservations agree; otherwise an error holding
    /// the same line, marked MISMATCH, and every difference.
    pub fn reconcile(&self, events: usize) -> Result<String> {
        let mut problems = Vec::new();
        let orders = self.created.len();

        // Charges: exactly one per order at the provider, of its OrderCreated total, and the
        // one payments recorded.
        let mut per_order: BTreeMap<&str, Vec<&Charge>> = BTreeMap::new();
        for charge in &self.charges {
            per_order.entry(&charge.order_id).or_default().push(charge);
        }
        let mut amounts_equal = true;
        for (order, charges) in &per_order {
            match self.created.get(*order) {
                None => problems.push(format!(
                    "the provider charged order {order}, which the order service never created"
                )),
                Some(total) => {
                    if charges.len() > 1 {
                        problems.push(format!("order {order} was charged {} times", charges.len()));
                    }
                    for charge in charges {
                        if charge.amount_cents != *total {
                            amounts_equal = false;
                            problems.push(format!(
                                "charge {} of order {order} is {} cents, its OrderCreated total \
                                 {total}",
                                charge.charge_id, charge.amount_cents
                            ));
                        }
                    }
                }
            }
        }
        for order in self.created.keys() {
            if !per_order.contains_key(order.as_str()) {
                problems.push(format!("order {order} was never charged"));
            }
        }
        if self.stats.charges_created != self.charges.len() as u64 {
            problems.push(format!(
                "the provider counted {} charges created, and lists {}",
                self.stats.charges_created,
                self.charges.len()
            ));
        }

        // Payments: one row per order, naming the provider's charge of that order.
        let mut paid: BTreeMap<&str, usize> = BTreeMap::new();
        for payment in &self.payments {
            *paid.entry(&payment.order_id).or_default() += 1;
            let charge = self
                .charges
                .iter()
                .find(|c| Some(&c.charge_id) == payment.charge_id.as_ref());
            match charge {
                Some(charge)
                    if charge.order_id == payment.order_id
                        && Some(charge.amount_cents) == payment.amount_cents => {}
                Some(charge) => problems.push(format!(
                    "payments records charge {} for order {} ({:?} cents), the provider has it \
                     for order {} ({} cents)",
                    charge.charge_id,
                    payment.order_id,
                    payment.amount_cents,
                    charge.order_id,
                    charge.amount_cents
                )),
                None => problems.push(format!(
                    "payments records charge {:?} for order {}, unknown to the provider",
                    payment.charge_id, payment.order_id
                )),
            }
        }
        for order in self.created.keys() {
            if !paid.contains_key(order.as_str()) {
                problems.push(format!("payments has no row for order {order}"));
            }
        }
        for (order, rows) in &paid {
            if *rows > 1 {
                problems.push(format!("payments has {rows} rows for order {order}"));
            }
        }

        // Reservations, per SKU.
        let skus = self.skus();
        let mut reservations_equal = true;
        let listed: Vec<String> = skus
            .iter()
            .map(|(sku, reserved, expected)| {
                if reserved == expected {
                    format!("{sku} {reserved} = {expected}")
                } else {
                    reservations_equal = false;
                    problems.push(format!(
                        "inventory reserves {reserved} of {sku}, the open orders need {expected}"
                    ));
                    format!("{sku} {reserved} ≠ {expected}")
                }
            })
            .collect();

        // Both consumers saw every event, and gave up on none.
        for (index, name) in [INVENTORY, PAYMENTS].into_iter().enumerate() {
            if self.processed[index] != events as i64 {
                problems.push(format!(
                    "{name} processed {} events of {events}",
                    self.processed[index]
                ));
            }
            if self.quarantined[index] != 0 {
                problems.push(format!(
                    "{name} quarantined {} events",
                    self.quarantined[index]
                ));
            }
        }

        let line = format!(
            "reconciliation: {orders} orders, {} payments, {} charges ({} distinct orders, \
             amounts {}), reservations {} per sku ({}): {}",
            self.payments.len(),
            self.charges.len(),
            per_order.len(),
            if amounts_equal { "equal" } else { "differ" },
            if reservations_equal {
                "equal"
            } else {
                "differ"
            },
            listed.join(", "),
            if problems.is_empty() {
                "OK"
            } else {
                "MISMATCH"
            }
        );
        if problems.is_empty() {
            Ok(line)
        } else {
            anyhow::bail!("{line}\n  - {}", problems.join("\n  - "))
        }
    }
}

async fn quarantined(pool: &PgPool, name: &str) -> Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM consumer_quarantine WHERE consumer_name = $1")
        .bind(name)
        .fetch_one(pool)
        .await
        .with_context(|| format!("while counting {name}'s consumer_quarantine"))
}

async fn get_json<T: serde::de::DeserializeOwned>(
    client: &reqwest::Client,
    base: &str,
    path: &str,
) -> Result<T> {
    let response = client
        .get(format!("{base}{path}"))
        .send()
        .await
        .with_context(|| format!("GET {path}: no response from the payment provider"))?;
    let status = response.status();
    let bytes = response
        .bytes()
        .await
        .with_context(|| format!("GET {path}: while reading the provider's response"))?;
    anyhow::ensure!(
        status.is_success(),
        "GET {path} at the provider answered {status}: {}",
        String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
    );
    serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "GET {path} at the provider answered something unexpected: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        )
    })
}

fn verdict(equal: bool) -> &'static str {
    if equal {
        "yes"
    } else {
        "NO"
    }
}

/// `ch_…` and the last 8 characters: the provider's charge ids are `ch_` and a UUIDv7.
fn short_charge(id: &str) -> String {
    match id.strip_prefix("ch_") {
        Some(rest) => format!("ch_{}", short_id(rest)),
        None => short_id(id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER_A: &str = "0198a000-0000-7000-8000-00000000000a";
    const ORDER_B: &str = "0198a000-0000-7000-8000-00000000000b";

    fn charge(id: &str, order: &str, amount: i64) -> Charge {
        Charge {
            charge_id: id.to_owned(),
            order_id: order.to_owned(),
            amount_cents: amount,
        }
    }

    fn payment(order: &str, charge: &str, amount: i64) -> Payment {
        Payment {
            order_id: order.to_owned(),
            charge_id: Some(charge.to_owned()),
            amount_cents: Some(amount),
            charged_at: None,
        }
    }

    /// Two orders, both charged once, sku-1 released by a cancellation.
    fn balanced() -> Ledger {
        Ledger {
            created: [(ORDER_A.to_owned(), 1000), (ORDER_B.to_owned(), 450)].into(),
            events: HashMap::new(),
            expected_stock: [("sku-1".to_owned(), 0), ("sku-3".to_owned(), 3)].into(),
            stock: [("sku-1".to_owned(), 0), ("sku-3".to_owned(), 3)].into(),
            payments: vec![
                payment(ORDER_A, "ch_a", 1000),
                payment(ORDER_B, "ch_b", 450),
            ],
            charges: vec![charge("ch_a", ORDER_A, 1000), charge("ch_b", ORDER_B, 450)],
            stats: Stats {
                requests: 3,
                charges_created: 2,
                replayed: 1,
                injected_timeouts: 1,
                injected_errors: 0,
            },
            calls: Vec::new(),
            processed: [4, 4],
            quarantined: [0, 0],
        }
    }

    #[test]
    fn a_balanced_ledger_reconciles() {
        let line = balanced().reconcile(4).expect("balanced");
        assert_eq!(
            line,
            "reconciliation: 2 orders, 2 payments, 2 charges (2 distinct orders, amounts equal), \
             reservations equal per sku (sku-1 0 = 0, sku-3 3 = 3): OK"
        );
    }

    #[test]
    fn a_second_charge_and_a_wrong_reservation_are_named() {
        let mut ledger = balanced();
        ledger.charges.push(charge("ch_c", ORDER_A, 1000));
        ledger.stats.charges_created = 3;
        ledger.stock.insert("sku-1".to_owned(), 2);
        let error = ledger.reconcile(4).expect_err("unbalanced").to_string();
        assert!(
            error.starts_with(
                "reconciliation: 2 orders, 2 payments, 3 charges (2 distinct orders, amounts \
                 equal), reservations differ per sku (sku-1 2 ≠ 0, sku-3 3 = 3): MISMATCH"
            ),
            "{error}"
        );
        assert!(
            error.contains(&format!("order {ORDER_A} was charged 2 times")),
            "{error}"
        );
        assert!(error.contains("inventory reserves 2 of sku-1"), "{error}");
    }

    #[test]
    fn a_missing_payment_and_a_redelivery_gap_are_named() {
        let mut ledger = balanced();
        ledger.payments.pop();
        ledger.processed[1] = 3;
        let error = ledger.reconcile(4).expect_err("unbalanced").to_string();
        assert!(
            error.contains(&format!("payments has no row for order {ORDER_B}")),
            "{error}"
        );
        assert!(
            error.contains("payments processed 3 events of 4"),
            "{error}"
        );
    }
}
