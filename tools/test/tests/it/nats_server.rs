//! `NatsServer` and `read_stream`: a private broker that stops, dies and comes back on its port
//! with its streams, and a reader that returns every stored message in order.

use std::net::TcpStream;

use async_nats::jetstream;
use handoff_test::nats::{create_stream, read_stream, unique_name, NatsServer};

#[tokio::test]
async fn private_server_stops_restarts_on_its_port_and_keeps_its_streams() {
    let mut server = NatsServer::start().unwrap_or_else(|e| panic!("{e}"));
    let port = server.port();
    let dir = server.store_dir().to_owned();
    assert_eq!(server.url(), format!("nats://127.0.0.1:{port}"));

    let client = async_nats::connect(server.url()).await.expect("connect");
    create_stream(&client, "KEPT", "kept").await;
    let context = jetstream::new(client.clone());
    context
        .publish("kept.a", "one".into())
        .await
        .expect("publish")
        .await
        .expect("ack");

    server.stop().expect("stop");
    assert!(!server.is_running());
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    server.start_again().expect("start again");
    assert_eq!(server.port(), port);
    TcpStream::connect(("127.0.0.1", port)).expect("listening again");

    server.kill().expect("kill");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    server.start_again().expect("start again after kill");

    // A fresh client: the first one may still be waiting out its reconnect backoff.
    let client = async_nats::connect(server.url()).await.expect("reconnect");
    let messages = read_stream(&client, "KEPT").await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].payload, b"one");
    assert!(server.log_tail().contains("Server is ready"));

    drop(server);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    assert!(!dir.exists());
}

#[tokio::test]
async fn read_stream_returns_every_message_in_order_with_headers() {
    const COUNT: usize = 20_000;
    const CHUNK: usize = 1_000;
    let server = NatsServer::start().unwrap_or_else(|e| panic!("{e}"));
    let client = async_nats::connect(server.url()).await.expect("connect");
    let name = unique_name("read_all");
    create_stream(&client, &name, &name).await;
    assert!(read_stream(&client, &name).await.is_empty());

    let context = jetstream::new(client.clone());
    // Pipelined, but awaited per chunk: an unawaited ack holds one of the context's 5000
    // in-flight permits.
    let mut acks = Vec::with_capacity(CHUNK);
    for i in 0..COUNT {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("n", i.to_string());
        headers.append("multi", "first");
        headers.append("multi", "second");
        let subject = format!("{name}.s{}", i % 7);
        let ack = context
            .publish_with_headers(subject, headers, i.to_string().into())
            .await
            .expect("publish");
        acks.push(ack);
        if acks.len() == CHUNK || i + 1 == COUNT {
            for ack in acks.drain(..) {
                ack.await.expect("ack");
            }
        }
    }

    let messages = read_stream(&client, &name).await;
    assert_eq!(messages.len(), COUNT);
    for (i, message) in messages.iter().enumerate() {
        assert_eq!(message.sequence, i as u64 + 1);
        assert_eq!(message.subject, format!("{name}.s{}", i % 7));
        assert_eq!(message.payload, i.to_string().as_bytes());
        assert_eq!(message.header("n"), Some(i.to_string().as_str()));
        let multi: Vec<_> = message
            .headers
            .iter()
            .filter(|(n, _)| n == "multi")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(multi, ["first", "second"]);
    }
}

#[test]
fn a_server_that_cannot_start_reports_its_log() {
    let error = NatsServer::start_with_args(&["--no-such-flag"]).unwrap_err();
    assert!(
        error.to_string().contains("exited before it was ready"),
        "{error}"
    );
}
