//! The one place where the reference consumers read old schema versions (design O4).
//!
//! Each evolved event type has one function here that takes a delivered event in any version
//! the consumers know and returns it in the newest one; the handlers only ever see the newest
//! version. So adding a version means: add its type, translate the previous newest into it
//! here, and change the handlers once. A version newer than the consumer knows (written by a
//! service deployed before the consumer was upgraded) is a permanent error: the event goes to
//! the consumer quarantine with the reason, and once the consumer is upgraded an operator
//! retries it from there. Guessing at an unknown shape, or acknowledging it unapplied, would
//! lose the effect silently.
//!
//! # Examples
//!
//! ```
//! use handoff_core::intake::ReceivedEvent;
//! use reference_consumers::upcast;
//!
//! let order_id = uuid::Uuid::now_v7();
//! let v1 = ReceivedEvent {
//!     event_id: uuid::Uuid::now_v7(),
//!     aggregate_type: "order".into(),
//!     aggregate_id: order_id.to_string(),
//!     sequence: 1,
//!     event_type: "OrderCreated".into(),
//!     schema_version: 1,
//!     payload: format!(r#"{{"order_id":"{order_id}","customer_id":"c-1",
//!         "lines":[{{"sku":"apple","quantity":3,"unit_price_cents":40}}],"total_cents":120}}"#),
//!     headers: vec![],
//!     replayed: true,
//! };
//! let created = upcast::order_created(&v1)?;
//! assert_eq!((created.currency.as_str(), created.total_minor), ("EUR", 120));
//! assert_eq!(created.lines[0].unit_price_minor, 40);
//! # Ok::<(), handoff_consumer::HandlerError>(())
//! ```

use handoff_consumer::HandlerError;
use handoff_core::intake::ReceivedEvent;
use handoff_core::Event;
use order_service::events::{OrderCreated, OrderCreatedV2, PricedLine, CURRENCY};
use serde::de::DeserializeOwned;

/// `OrderCreated` in the newest version these consumers read, whatever version was delivered.
///
/// Version 1 carried its amounts as bare cents of the shop's one currency (EUR, by the
/// version 1 contract); version 2 names the currency and calls the amounts minor units, so the
/// translation fills in the currency and renames the amounts, with no arithmetic.
///
/// # Errors
///
/// A permanent [`HandlerError`] (the event goes to the consumer quarantine): a version other
/// than 1 or 2, or a payload that does not parse as the version it claims.
pub fn order_created(event: &ReceivedEvent) -> Result<OrderCreatedV2, HandlerError> {
    match event.schema_version {
        1 => parse::<OrderCreated>(event).map(order_created_v1_to_v2),
        2 => parse::<OrderCreatedV2>(event),
        other => Err(unknown_version(
            OrderCreatedV2::EVENT_TYPE,
            other,
            OrderCreatedV2::SCHEMA_VERSION,
        )),
    }
}

/// Translates an `OrderCreated` of version 1 into version 2.
pub fn order_created_v1_to_v2(v1: OrderCreated) -> OrderCreatedV2 {
    OrderCreatedV2 {
        order_id: v1.order_id,
        customer_id: v1.customer_id,
        currency: CURRENCY.to_owned(),
        lines: v1
            .lines
            .into_iter()
            .map(|line| PricedLine {
                sku: line.sku,
                quantity: line.quantity,
                unit_price_minor: line.unit_price_cents,
            })
            .collect(),
        total_minor: v1.total_cents,
    }
}

/// The payload of `event` as `E`, for an event type that has only ever had one version.
///
/// # Errors
///
/// A permanent [`HandlerError`]: another schema version, or a payload that does not parse.
pub fn single_version<E: Event + DeserializeOwned>(
    event: &ReceivedEvent,
) -> Result<E, HandlerError> {
    if event.schema_version != E::SCHEMA_VERSION {
        return Err(unknown_version(
            E::EVENT_TYPE,
            event.schema_version,
            E::SCHEMA_VERSION,
        ));
    }
    parse(event)
}

/// The payload as `E`, whose version the caller has checked.
fn parse<E: Event + DeserializeOwned>(event: &ReceivedEvent) -> Result<E, HandlerError> {
    serde_json::from_str(&event.payload).map_err(|error| {
        HandlerError::permanent(format!(
            "{} schema version {} payload does not parse: {error}",
            E::EVENT_TYPE,
            event.schema_version
        ))
    })
}

/// The quarantine reason for a version this consumer cannot read. It names what to do, since
/// an operator reads it in `consumer_quarantine.reason`.
fn unknown_version(event_type: &str, version: i32, newest: i32) -> HandlerError {
    let known = if newest == 1 {
        "version 1".to_owned()
    } else {
        format!("versions 1 to {newest}")
    };
    let advice = if version > newest {
        "upgrade this consumer, then retry the event from the quarantine"
    } else {
        "versions start at 1: the writer is broken"
    };
    HandlerError::permanent(format!(
        "{event_type} schema version {version} is not supported (this consumer reads {known}): \
         {advice}"
    ))
}

#[cfg(test)]
mod tests {
    use handoff_consumer::HandlerErrorKind;
    use order_service::events::OrderCreatedVersion;
    use order_service::model::{Line, Order, Status};
    use uuid::Uuid;

    use super::*;

    fn order() -> Order {
        let lines = vec![
            Line {
                sku: "apple".into(),
                quantity: 3,
                unit_price_cents: 40,
            },
            Line {
                sku: "pear".into(),
                quantity: 1,
                unit_price_cents: 125,
            },
        ];
        Order {
            order_id: Uuid::now_v7(),
            customer_id: "c-1".into(),
            status: Status::Open,
            total_cents: lines.iter().map(Line::amount_cents).sum(),
            lines,
            version: 1,
        }
    }

    /// The event the order service writes for `order` in `version`, as delivered.
    fn delivered(order: &Order, version: OrderCreatedVersion) -> ReceivedEvent {
        let event = version.event(order).unwrap();
        received(event.schema_version(), event.payload().to_owned())
    }

    fn received(schema_version: i32, payload: String) -> ReceivedEvent {
        ReceivedEvent {
            event_id: Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "o".into(),
            sequence: 1,
            event_type: "OrderCreated".into(),
            schema_version,
            payload,
            headers: vec![],
            replayed: false,
        }
    }

    #[test]
    fn version_1_upcasts_to_exactly_what_version_2_says() {
        let order = order();
        let from_v1 = order_created(&delivered(&order, OrderCreatedVersion::V1)).unwrap();
        let v2 = order_created(&delivered(&order, OrderCreatedVersion::V2)).unwrap();
        assert_eq!(from_v1, v2);
        assert_eq!((v2.currency.as_str(), v2.total_minor), ("EUR", 245));
        assert_eq!(v2.lines[1].unit_price_minor, 125);
    }

    #[test]
    fn a_newer_version_is_permanent_and_says_what_to_do() {
        let v2 = OrderCreatedVersion::V2.event(&order()).unwrap();
        let error = order_created(&received(3, v2.payload().to_owned())).unwrap_err();
        assert_eq!(error.kind(), HandlerErrorKind::Permanent);
        let reason = error.to_string();
        assert!(
            reason.contains("OrderCreated schema version 3 is not supported"),
            "{reason}"
        );
        assert!(reason.contains("versions 1 to 2"), "{reason}");
        assert!(reason.contains("upgrade this consumer"), "{reason}");
        let zero = order_created(&received(0, "{}".into())).unwrap_err();
        assert!(zero.to_string().contains("writer is broken"), "{zero}");
    }

    #[test]
    fn a_payload_of_the_other_version_does_not_parse() {
        let order = order();
        let v1 = OrderCreatedVersion::V1.event(&order).unwrap();
        let v2 = OrderCreatedVersion::V2.event(&order).unwrap();
        // A writer that labels its payload with the wrong version is caught, not misread.
        for (version, payload) in [(2, v1.payload()), (1, v2.payload())] {
            let error = order_created(&received(version, payload.to_owned())).unwrap_err();
            assert_eq!(error.kind(), HandlerErrorKind::Permanent);
            assert!(
                error.to_string().contains(&format!(
                    "OrderCreated schema version {version} payload does not parse"
                )),
                "{error}"
            );
        }
    }

    #[test]
    fn single_version_events_refuse_any_other_version() {
        let payload =
            r#"{"order_id":"7f1c0e9a-0000-7000-8000-000000000001","reason":null,"lines":[]}"#;
        let mut event = received(1, payload.to_owned());
        event.event_type = "OrderCancelled".into();
        assert!(single_version::<order_service::events::OrderCancelled>(&event).is_ok());
        event.schema_version = 2;
        let error = single_version::<order_service::events::OrderCancelled>(&event).unwrap_err();
        assert!(
            error.to_string().contains(
                "OrderCancelled schema version 2 is not supported (this consumer reads version 1)"
            ),
            "{error}"
        );
    }
}
