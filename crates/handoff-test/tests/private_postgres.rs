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
