//! Setup shared by the integration tests.

use handoff_postgres::{Migrator, Outbox, OutboxConfig, Schema};
use handoff_test::{factory, TestDb};

/// A fresh schema with handoff's migrations applied, and an outbox for the test events.
pub async fn migrated(name: &str) -> (TestDb, Outbox) {
    let db = TestDb::new(name).await;
    let mut conn = db.pool.acquire().await.unwrap();
    Migrator::handoff(Schema::default())
        .run(&mut conn)
        .await
        .unwrap();
    let outbox = Outbox::new(OutboxConfig::default(), factory::catalog()).unwrap();
    (db, outbox)
}
