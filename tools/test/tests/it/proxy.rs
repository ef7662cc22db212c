//! The fault proxy against a real local echo server: each mode as a client sees it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use handoff_test::proxy::FaultProxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long a test waits for an answer it expects.
const ANSWER: Duration = Duration::from_secs(5);

/// How long silence must last to count as silence.
const SILENCE: Duration = Duration::from_millis(400);

/// An echo server on a free loopback port; it stops with the test's runtime.
async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = socket.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    addr
}

async fn proxy() -> FaultProxy {
    FaultProxy::start(echo_server().await).await.unwrap()
}

/// Sends `message` and reads the echo back, or fails on silence, an error or the end.
async fn round_trip(stream: &mut TcpStream, message: &[u8]) -> Result<(), String> {
    stream
        .write_all(message)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut back = vec![0u8; message.len()];
    match tokio::time::timeout(ANSWER, stream.read_exact(&mut back)).await {
        Ok(Ok(_)) if back == message => Ok(()),
        Ok(Ok(_)) => Err(format!("echoed {back:?}")),
        Ok(Err(e)) => Err(format!("read: {e}")),
        Err(_) => Err("no echo".into()),
    }
}

/// What a read sees within `SILENCE`: `None` for nothing at all.
async fn read_within_silence(stream: &mut TcpStream) -> Option<std::io::Result<usize>> {
    let mut buf = [0u8; 64];
    tokio::time::timeout(SILENCE, stream.read(&mut buf))
        .await
        .ok()
}

/// Whether the connection was closed by the other end (end of stream or reset) within
/// [`ANSWER`].
async fn closed(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(ANSWER, stream.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test]
async fn pass_through_forwards_both_ways_and_counts_connections() {
    let proxy = proxy().await;
    assert_eq!(proxy.accepted(), 0);
    let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut a, b"hello").await.unwrap();
    round_trip(&mut b, b"world").await.unwrap();
    let big = vec![7u8; 300_000];
    round_trip(&mut a, &big).await.unwrap();
    assert_eq!(proxy.accepted(), 2);
    assert_eq!(proxy.live(), 2);
    drop(a);
    let deadline = Instant::now() + ANSWER;
    while proxy.live() != 1 {
        assert!(Instant::now() < deadline, "a closed client is still live");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_delay_holds_every_chunk_in_both_directions() {
    let proxy = proxy().await;
    let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
    let started = Instant::now();
    round_trip(&mut stream, b"fast").await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(150));

    proxy.delay(Duration::from_millis(200));
    let started = Instant::now();
    round_trip(&mut stream, b"slow").await.unwrap();
    let took = started.elapsed();
    // Once on the way up, once on the way back.
    assert!(
        took >= Duration::from_millis(400),
        "round trip took {took:?}"
    );
    assert!(took < Duration::from_secs(2), "round trip took {took:?}");

    proxy.heal();
    let started = Instant::now();
    round_trip(&mut stream, b"fast again").await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(150));
}

#[tokio::test]
async fn a_cut_closes_live_connections_and_new_ones_pass() {
    let proxy = proxy().await;
    let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut old, b"before").await.unwrap();
    proxy.cut();
    assert!(closed(&mut old).await, "the live connection was not closed");
    let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut new, b"after").await.unwrap();
    assert_eq!(proxy.accepted(), 2);
}

#[tokio::test]
async fn a_black_hole_swallows_live_and_new_connections_silently_until_healed() {
    let proxy = proxy().await;
    let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut old, b"before").await.unwrap();

    proxy.black_hole();
    old.write_all(b"into the hole").await.unwrap();
    // Silence: no echo, and no end of stream either.
    assert!(read_within_silence(&mut old).await.is_none());
    // A new connection is accepted, and just as silent.
    let mut during = TcpStream::connect(proxy.addr()).await.unwrap();
    during.write_all(b"anyone?").await.unwrap();
    assert!(read_within_silence(&mut during).await.is_none());

    proxy.heal();
    let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut after, b"after").await.unwrap();
    // The connections caught in the hole stay dead: only a client's own timeout finds out.
    old.write_all(b"still there?").await.unwrap();
    assert!(read_within_silence(&mut old).await.is_none());
    assert!(read_within_silence(&mut during).await.is_none());
    assert_eq!(proxy.accepted(), 3);
    assert_eq!(proxy.live(), 3);

    // A cut ends them like any other.
    proxy.cut();
    assert!(closed(&mut old).await);
    assert!(closed(&mut during).await);
}

#[tokio::test]
async fn refusing_closes_new_connections_and_leaves_live_ones() {
    let proxy = proxy().await;
    let mut live = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut live, b"before").await.unwrap();

    proxy.refuse();
    let mut refused = TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(
        closed(&mut refused).await,
        "a new connection was not closed"
    );
    round_trip(&mut live, b"during").await.unwrap();

    proxy.heal();
    let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut after, b"after").await.unwrap();
    assert_eq!(proxy.accepted(), 3);
}

#[tokio::test]
async fn an_unreachable_upstream_closes_the_client() {
    // A port that was free a moment ago: nothing listens there.
    let free = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let proxy = FaultProxy::start(free).await.unwrap();
    let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(closed(&mut stream).await);
}

#[tokio::test]
async fn dropping_the_proxy_closes_everything() {
    let proxy = proxy().await;
    let addr = proxy.addr();
    let mut live = TcpStream::connect(addr).await.unwrap();
    round_trip(&mut live, b"hello").await.unwrap();
    proxy.black_hole();
    let mut swallowed = TcpStream::connect(addr).await.unwrap();
    drop(proxy);
    assert!(closed(&mut live).await);
    assert!(closed(&mut swallowed).await);
    let deadline = Instant::now() + ANSWER;
    while TcpStream::connect(addr).await.is_ok() {
        assert!(Instant::now() < deadline, "the proxy still listens");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
