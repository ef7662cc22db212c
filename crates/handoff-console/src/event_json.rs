//! An event's detail as JSON, as `handoff quarantine show --json` prints it and
//! `GET /api/v1/events/{id}` answers.

use handoff_postgres::EventDetail;

/// `detail` as JSON, plus `delivery_response`: the receipt as a JSON object when it is one
/// (the HTTP destination records its answer so); `delivery_receipt` stays the stored text.
///
/// # Errors
///
/// `serde_json` failed to serialise the detail.
pub fn event_json(detail: &EventDetail) -> Result<serde_json::Value, serde_json::Error> {
    let mut value = serde_json::to_value(detail)?;
    let response = detail
        .delivery_receipt
        .as_deref()
        .and_then(|receipt| serde_json::from_str::<serde_json::Value>(receipt).ok())
        .filter(serde_json::Value::is_object);
    if let (Some(response), Some(object)) = (response, value.as_object_mut()) {
        object.insert("delivery_response".to_owned(), response);
    }
    Ok(value)
}
