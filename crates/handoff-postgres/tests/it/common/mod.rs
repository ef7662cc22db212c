//! Setup shared by the integration tests.

pub mod claims;
pub mod previous_release;

use handoff_postgres::{Outbox, OutboxConfig};
use handoff_test::{factory, TestDb};

/// A fresh schema with handoff's migrations applied, and an outbox for the test events.
pub async fn migrated(name: &str) -> (TestDb, Outbox) {
    let db = TestDb::migrated(name).await;
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    (db, outbox)
}
