//! `PrivatePostgres`: a throwaway server that starts, serves, and is gone when dropped.

use std::net::TcpStream;
use std::time::Duration;

use handoff_test::cluster::PrivatePostgres;
use sqlx::Connection;

#[tokio::test]
async fn private_postgres_serves_queries_and_is_gone_after_drop() {
    let server = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .expect("start task")
        .unwrap_or_else(|e| panic!("{e}"));
    let port = server.port();
    let dir = server.dir().to_owned();
    assert_eq!(
        server.url("postgres"),
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    );

    let mut conn = sqlx::PgConnection::connect(&server.url("postgres"))
        .await
        .expect("connect");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut conn)
        .await
        .expect("select 1");
    assert_eq!(one, 1);
    drop(conn);

    tokio::task::spawn_blocking(move || drop(server))
        .await
        .expect("drop task");
    let refused = TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(2),
    );
    assert!(
        refused.is_err(),
        "port {port} still accepts connections after drop"
    );
    assert!(!dir.exists(), "{} still exists after drop", dir.display());
}

#[tokio::test]
async fn private_postgres_recovers_after_postmaster_kill() {
    let mut server = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .expect("start task")
        .unwrap_or_else(|e| panic!("{e}"));
    let url = server.url("postgres");
    let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
    sqlx::raw_sql("CREATE TABLE survives (n int); INSERT INTO survives VALUES (7)")
        .execute(&mut conn)
        .await
        .expect("create and insert");
    drop(conn);

    let server = tokio::task::spawn_blocking(move || {
        server.kill_postmaster()?;
        server.start_again()?;
        Ok::<_, handoff_test::cluster::ClusterError>(server)
    })
    .await
    .expect("restart task")
    .unwrap_or_else(|e| panic!("{e}"));

    let mut conn = sqlx::PgConnection::connect(&url).await.expect("reconnect");
    let n: i32 = sqlx::query_scalar("SELECT n FROM survives")
        .fetch_one(&mut conn)
        .await
        .expect("select");
    assert_eq!(n, 7, "committed row survives a postmaster crash");
    drop(conn);
    tokio::task::spawn_blocking(move || server.stop())
        .await
        .expect("stop task")
        .expect("stop");
}

/// `start_tls`: `verify-full` with the server's CA connects over TLS; a plain connection is
/// refused by the server itself (its `pg_hba.conf` has `hostssl` lines only); a client trusting
/// another CA refuses the server's certificate.
#[tokio::test(flavor = "multi_thread")]
async fn private_postgres_with_tls_takes_only_verified_tls_connections() {
    use handoff_test::tls::TestCa;
    let ca = TestCa::new("private-postgres").expect("test CA");
    let server = tokio::task::block_in_place(|| PrivatePostgres::start_tls(&ca))
        .unwrap_or_else(|e| panic!("{e}"));
    // The server and its URL keep their own copies of the CA's files.
    drop(ca);
    let url = server.tls_url("postgres");
    assert!(url.starts_with(&format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert=",
        server.port()
    )));

    let mut conn = sqlx::PgConnection::connect(&url)
        .await
        .expect("verify-full");
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .expect("pg_stat_ssl");
    assert!(ssl, "the connection is not encrypted");
    drop(conn);

    let plain = format!("{}?sslmode=disable", server.url("postgres"));
    let refused = sqlx::PgConnection::connect(&plain)
        .await
        .expect_err("a plain connection must be refused");
    let code = refused
        .as_database_error()
        .and_then(|e| e.code().map(|c| c.into_owned()));
    assert_eq!(code.as_deref(), Some("28000"), "{refused}");

    let other = TestCa::new("wrong").expect("second CA");
    let wrong = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        server.port(),
        other.ca_path().display()
    );
    let error = sqlx::PgConnection::connect(&wrong)
        .await
        .expect_err("a certificate from another CA must be refused");
    assert_eq!(
        handoff_postgres::connect_error_kind(&error),
        handoff_postgres::ConnectErrorKind::Tls,
        "{error}"
    );
    tokio::task::block_in_place(move || drop(server));
}

/// `start_tls_client_cert`: `sslcert` and `sslkey` in the URL reach the TLS handshake; without
/// them the server refuses the client.
#[tokio::test(flavor = "multi_thread")]
async fn private_postgres_with_client_certificates_takes_sslcert_and_sslkey() {
    use handoff_test::tls::TestCa;
    let ca = TestCa::new("client-cert").expect("test CA");
    let client = ca.client("postgres").expect("client certificate");
    let server = tokio::task::block_in_place(|| PrivatePostgres::start_tls_client_cert(&ca))
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "{}&sslcert={}&sslkey={}",
        server.tls_url("postgres"),
        client.cert.display(),
        client.key.display()
    );
    let mut conn = sqlx::PgConnection::connect(&url)
        .await
        .expect("a client certificate is accepted");
    let (ssl, client_dn): (bool, Option<String>) =
        sqlx::query_as("SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .expect("pg_stat_ssl");
    assert!(ssl);
    assert_eq!(client_dn.as_deref(), Some("/CN=postgres"));
    drop(conn);

    let error = sqlx::PgConnection::connect(&server.tls_url("postgres"))
        .await
        .expect_err("no client certificate, no connection");
    let code = error
        .as_database_error()
        .and_then(|e| e.code().map(|c| c.into_owned()));
    assert_eq!(code.as_deref(), Some("28000"), "{error}");
    tokio::task::block_in_place(move || drop(server));
}
