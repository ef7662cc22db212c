//! The declared event types an outbox accepts.

use std::collections::{BTreeMap, BTreeSet};

use crate::{Event, ValidationError};

/// The set of declared `(aggregate type, event type, schema version)` triples.
///
/// An outbox refuses any event not declared here, so consumers are never sent a type or version
/// nobody agreed on. Declare every version still emitted; old versions that are only replayed can
/// stay declared too, since declaring costs nothing.
///
/// # Examples
///
/// ```
/// use handoff_core::EventCatalog;
///
/// let catalog = EventCatalog::new()
///     .declare("order", "OrderCreated", 1)
///     .declare("order", "OrderCreated", 2);
/// assert!(catalog.is_declared("order", "OrderCreated", 2));
/// assert!(!catalog.is_declared("order", "OrderShipped", 1));
/// ```
#[derive(Debug, Clone, Default)]
pub struct EventCatalog {
    /// `(aggregate type, event type)` → declared versions.
    types: BTreeMap<(String, String), BTreeSet<i32>>,
}

impl EventCatalog {
    /// An empty catalog, which accepts nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares a typed [`Event`].
    pub fn with<E: Event>(self) -> Self {
        self.declare(E::AGGREGATE_TYPE, E::EVENT_TYPE, E::SCHEMA_VERSION)
    }

    /// Declares an event type and version by name, for events built with
    /// [`NewEvent::new`](crate::NewEvent::new).
    pub fn declare(
        mut self,
        aggregate_type: impl Into<String>,
        event_type: impl Into<String>,
        schema_version: i32,
    ) -> Self {
        self.types
            .entry((aggregate_type.into(), event_type.into()))
            .or_default()
            .insert(schema_version);
        self
    }

    /// Whether the triple is declared.
    pub fn is_declared(&self, aggregate_type: &str, event_type: &str, schema_version: i32) -> bool {
        self.check(aggregate_type, event_type, schema_version)
            .is_ok()
    }

    /// Checks that the triple is declared.
    ///
    /// # Errors
    ///
    /// [`ValidationError::UnknownEventType`] or [`ValidationError::UnknownSchemaVersion`].
    pub fn check(
        &self,
        aggregate_type: &str,
        event_type: &str,
        schema_version: i32,
    ) -> Result<(), ValidationError> {
        // The key is owned; a lookup by borrowed parts would need a custom Borrow impl, and the
        // two small allocations are noise next to the database round trip that follows.
        let versions = self
            .types
            .get(&(aggregate_type.to_owned(), event_type.to_owned()))
            .ok_or_else(|| ValidationError::UnknownEventType {
                aggregate_type: aggregate_type.to_owned(),
                event_type: event_type.to_owned(),
            })?;
        if versions.contains(&schema_version) {
            Ok(())
        } else {
            Err(ValidationError::UnknownSchemaVersion {
                event_type: event_type.to_owned(),
                version: schema_version,
                declared: versions.iter().copied().collect(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ValidationErrorKind;

    #[test]
    fn unknown_type_and_unknown_version_are_told_apart() {
        let catalog = EventCatalog::new().declare("order", "OrderCreated", 1);
        let kind = |t, v| catalog.check("order", t, v).unwrap_err().kind();
        assert_eq!(
            kind("OrderShipped", 1),
            ValidationErrorKind::UnknownEventType
        );
        assert_eq!(
            kind("OrderCreated", 2),
            ValidationErrorKind::UnknownSchemaVersion
        );
        assert!(catalog.check("order", "OrderCreated", 1).is_ok());
    }

    #[test]
    fn a_type_declared_for_one_aggregate_is_unknown_for_another() {
        let catalog = EventCatalog::new().declare("order", "Created", 1);
        assert!(!catalog.is_declared("invoice", "Created", 1));
    }
}
