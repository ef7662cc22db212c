//! Requests, responses and the rules a request must follow.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The most lines one order may have.
pub const MAX_LINES: usize = 100;
/// The most units of one line.
pub const MAX_QUANTITY: i32 = 10_000;
/// The highest unit price, in cents.
pub const MAX_UNIT_PRICE_CENTS: i64 = 1_000_000_000;
/// The longest customer id or SKU, in bytes.
pub const MAX_ID_BYTES: usize = 128;

/// `POST /orders`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateOrder {
    /// Who orders.
    pub customer_id: String,
    /// At least one line.
    pub lines: Vec<Line>,
}

/// One order line; also the body of `POST /orders/{id}/lines`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Line {
    /// What is ordered.
    pub sku: String,
    /// How many, 1 to [`MAX_QUANTITY`].
    pub quantity: i32,
    /// Price of one unit, in cents.
    pub unit_price_cents: i64,
}

/// `POST /orders/{id}/cancel` (the body is optional).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelOrder {
    /// Why, for the event; free text.
    #[serde(default)]
    pub reason: Option<String>,
}

/// An order as the API returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    /// The order's id, also its outbox `aggregate_id`.
    pub order_id: Uuid,
    /// Who ordered.
    pub customer_id: String,
    /// `open` or `cancelled`.
    pub status: Status,
    /// Its lines, in the order they were added.
    pub lines: Vec<Line>,
    /// Sum of quantity × unit price over the lines.
    pub total_cents: i64,
    /// How many events the order has emitted; the sequence of its latest event.
    pub version: i64,
}

/// The state of an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, sqlx::Type)]
#[serde(rename_all = "lowercase")]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum Status {
    /// Lines can be added.
    Open,
    /// Final.
    Cancelled,
}

/// A request that breaks a rule, with a message for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

impl CreateOrder {
    /// Checks the request.
    ///
    /// # Errors
    ///
    /// [`Invalid`] naming the first broken rule.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_id("customer_id", &self.customer_id)?;
        if self.lines.is_empty() || self.lines.len() > MAX_LINES {
            return Err(Invalid(format!("an order has 1 to {MAX_LINES} lines")));
        }
        self.lines.iter().try_for_each(Line::validate)
    }

    /// The order total, in cents.
    pub fn total_cents(&self) -> i64 {
        self.lines.iter().map(Line::amount_cents).sum()
    }
}

impl Line {
    /// Checks the line.
    ///
    /// # Errors
    ///
    /// [`Invalid`] naming the first broken rule.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_id("sku", &self.sku)?;
        if !(1..=MAX_QUANTITY).contains(&self.quantity) {
            return Err(Invalid(format!("quantity must be 1 to {MAX_QUANTITY}")));
        }
        if !(0..=MAX_UNIT_PRICE_CENTS).contains(&self.unit_price_cents) {
            return Err(Invalid(format!(
                "unit_price_cents must be 0 to {MAX_UNIT_PRICE_CENTS}"
            )));
        }
        Ok(())
    }

    /// quantity × unit price, in cents (bounded by the validation limits, so no overflow).
    pub fn amount_cents(&self) -> i64 {
        i64::from(self.quantity) * self.unit_price_cents
    }
}

impl CancelOrder {
    /// Checks the request.
    ///
    /// # Errors
    ///
    /// [`Invalid`] when the reason is too long or holds a NUL.
    pub fn validate(&self) -> Result<(), Invalid> {
        match &self.reason {
            Some(r) if r.len() > 1024 || r.contains('\0') => {
                Err(Invalid("reason is at most 1024 bytes of text".into()))
            }
            _ => Ok(()),
        }
    }
}

fn check_id(field: &str, value: &str) -> Result<(), Invalid> {
    if value.is_empty() || value.len() > MAX_ID_BYTES || value.chars().any(char::is_control) {
        return Err(Invalid(format!(
            "{field} must be 1 to {MAX_ID_BYTES} bytes without control characters"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(quantity: i32, unit_price_cents: i64) -> Line {
        Line {
            sku: "sku-1".into(),
            quantity,
            unit_price_cents,
        }
    }

    #[test]
    fn orders_need_a_customer_and_one_to_a_hundred_valid_lines() {
        let ok = CreateOrder {
            customer_id: "c-1".into(),
            lines: vec![line(2, 500)],
        };
        assert!(ok.validate().is_ok());
        assert_eq!(ok.total_cents(), 1000);
        let bad = [
            CreateOrder {
                customer_id: String::new(),
                ..ok.clone()
            },
            CreateOrder {
                lines: vec![],
                ..ok.clone()
            },
            CreateOrder {
                lines: vec![line(2, 500); 101],
                ..ok.clone()
            },
            CreateOrder {
                lines: vec![line(0, 500)],
                ..ok.clone()
            },
            CreateOrder {
                lines: vec![line(1, -1)],
                ..ok.clone()
            },
            CreateOrder {
                customer_id: "a\0b".into(),
                ..ok.clone()
            },
        ];
        for order in bad {
            assert!(order.validate().is_err(), "{order:?}");
        }
    }

    #[test]
    fn the_largest_valid_order_total_fits_in_i64() {
        let order = CreateOrder {
            customer_id: "c".into(),
            lines: vec![line(MAX_QUANTITY, MAX_UNIT_PRICE_CENTS); MAX_LINES],
        };
        assert!(order.validate().is_ok());
        assert!(order.total_cents() > 0);
    }
}
