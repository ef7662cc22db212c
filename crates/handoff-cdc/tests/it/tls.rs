//! The CDC source over TLS: a private logical-replication PostgreSQL that takes `hostssl`
//! connections only, the replication connection (libpq, through pg_walstream) given a
//! `sslmode=verify-full` URL with the CA in `sslrootcert`.

use std::time::Duration;

use crate::common::{eventually, Fixture};
use handoff_cdc::RowMode;
use handoff_test::nats::read_stream;
use handoff_test::tls::TestCa;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_logical_source_streams_over_verify_full() {
    let ca = TestCa::new("cdc-tls").unwrap();
    let fx = Fixture::start_tls("cdc_tls", RowMode::Keep, &ca).await;
    let config = fx.logical_config();
    assert!(
        config
            .replication_url
            .contains("sslmode=verify-full&sslrootcert="),
        "the replication URL carries the TLS parameters"
    );
    let relay = fx.relay().await;
    fx.enqueue("tls-order", 1, 10).await;
    eventually("10 events published", Duration::from_secs(30), || async {
        read_stream(&fx.client, &fx.stream).await.len() >= 10
    })
    .await;

    // The walsender's session is encrypted: the server accepted TLS from libpq.
    let (walsenders, encrypted): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a \
         JOIN pg_stat_ssl s USING (pid) WHERE a.backend_type = 'walsender'",
    )
    .fetch_one(&fx.db.pool)
    .await
    .unwrap();
    assert_eq!((walsenders, encrypted), (1, 1));

    let report = relay.stop().await;
    assert_eq!(report.published, 10);
}
