//! [`FaultProxy`]: a loopback TCP proxy that puts network faults between a client and a server
//! (delay, cut, black hole, refusal), for the reconnect paths of the relay and the consumers.
//!
//! Tests start one in front of nats-server or PostgreSQL and hand the *proxy's* address to the
//! process under test; the faults are then switched on and off while it runs. Everything is
//! real TCP on 127.0.0.1, so the client library sees what it would see on a network: bytes late,
//! a connection reset, or silence.
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//! use handoff_test::proxy::FaultProxy;
//!
//! # async fn example() -> std::io::Result<()> {
//! let proxy = FaultProxy::start("127.0.0.1:4222".parse().unwrap()).await?;
//! let url = format!("nats://{}", proxy.addr()); // give this to the process under test
//! proxy.delay(Duration::from_millis(300)); // every chunk 300 ms late, both ways
//! proxy.black_hole(); // live connections go silent; new ones are swallowed too
//! proxy.heal(); // new connections pass again (the swallowed ones stay dead)
//! proxy.cut(); // every live connection closed now
//! proxy.freeze_after(1 << 20); // stop reading, both ways, after 1 MiB more toward the client
//! proxy.thaw();
//! assert!(proxy.accepted() >= 1, "{url} was used");
//! # Ok(())
//! # }
//! ```

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Chunks read from one side and not yet written to the other, per direction: beyond this the
/// proxy stops reading, so a slow (delayed) side pushes back on the sender as TCP would.
const QUEUE: usize = 256;

/// Bytes read at once.
const CHUNK: usize = 16 * 1024;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Forward as it comes, each chunk after `delay` (zero: at once).
    Pass { delay: Duration },
    /// Swallow everything, in both directions, on every live and new connection.
    BlackHole,
    /// Close new connections at once; live ones pass.
    Refuse,
}

/// The fault setting every connection watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    mode: Mode,
    /// Incremented by [`FaultProxy::cut`]: a connection opened before the current value ends.
    cuts: u64,
}

/// A loopback TCP proxy in front of one upstream address, with switchable faults.
///
/// Pass-through by default. The faults:
///
/// - [`delay`](Self::delay): every chunk is forwarded that much later, in both directions (a
///   latency, not a bandwidth cap: chunks in flight overlap);
/// - [`cut`](Self::cut): every live connection is closed now (both sockets dropped, which the
///   peers see as a reset or end of stream); new connections pass as before;
/// - [`black_hole`](Self::black_hole): a silent partition. Live connections stop forwarding
///   and new ones are accepted but never connected upstream; what either side sends is read
///   and dropped, and neither side hears of the other closing. Nothing tells a client its
///   connection is dead: only its own timeouts or keepalives can;
/// - [`refuse`](Self::refuse): new connections are closed as soon as they are accepted;
/// - [`freeze_after`](Self::freeze_after): a frozen client. Once that many more bytes went
///   toward the client, the proxy stops reading from both sides, so TCP's flow control pushes
///   back on the server as a client would that stopped reading (SIGSTOP, a paused container):
///   its writes block once the socket buffers are full. [`thaw`](Self::thaw) reads again;
/// - [`heal`](Self::heal): back to pass-through for new connections. A connection caught in the
///   black hole stays silent for good (as after a failover or a NAT that lost its state): the
///   client must notice and reconnect, which is what the black hole is there to test.
///
/// Dropping the proxy stops listening and closes every connection.
///
/// See the [module documentation](self) for an example.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    state: watch::Sender<State>,
    counters: Arc<Counters>,
    /// Accepts connections; its [`JoinSet`] owns the connections' tasks, so aborting it on drop
    /// ends them all.
    acceptor: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Counters {
    accepted: AtomicU64,
    live: AtomicUsize,
    /// Bytes still forwarded toward clients before the proxy freezes ([`FaultProxy::freeze_after`]).
    downstream_left: AtomicI64,
    /// No socket is read while set.
    frozen: AtomicBool,
    /// SO_RCVBUF of the sockets toward the upstream opened from now on (0: the system's).
    upstream_receive_buffer: AtomicU32,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            accepted: AtomicU64::new(0),
            live: AtomicUsize::new(0),
            downstream_left: AtomicI64::new(i64::MAX),
            frozen: AtomicBool::new(false),
            upstream_receive_buffer: AtomicU32::new(0),
        }
    }
}

impl FaultProxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to `upstream`.
    ///
    /// Must be called inside a tokio runtime (with I/O and time enabled); the proxy's tasks run
    /// on it.
    ///
    /// # Errors
    ///
    /// The listening socket could not be bound.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves nothing behind.
    pub async fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        FaultProxy::start_on(([127, 0, 0, 1], 0).into(), upstream).await
    }

    /// As [`start`](Self::start), listening on `listen`: the address of a proxy dropped
    /// before, to bring a destination back where its clients look for it.
    ///
    /// # Errors
    ///
    /// The listening socket could not be bound (another process took the port meanwhile).
    ///
    /// # Cancel safety
    ///
    /// As [`start`](Self::start).
    pub async fn start_on(listen: SocketAddr, upstream: SocketAddr) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (state, watcher) = watch::channel(State {
            mode: Mode::Pass {
                delay: Duration::ZERO,
            },
            cuts: 0,
        });
        let counters = Arc::new(Counters::default());
        let acceptor = tokio::spawn(accept(listener, upstream, watcher, counters.clone()));
        Ok(FaultProxy {
            addr,
            upstream,
            state,
            counters,
            acceptor,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address traffic is forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Forwards every chunk `delay` late, both directions, from now on (live connections
    /// included). `Duration::ZERO` is plain pass-through.
    pub fn delay(&self, delay: Duration) {
        self.state
            .send_modify(|state| state.mode = Mode::Pass { delay });
    }

    /// Closes every live connection now (a swallowed one included); later connections follow
    /// the current mode.
    pub fn cut(&self) {
        self.state.send_modify(|state| state.cuts += 1);
    }

    /// Starts a silent partition: live connections forward nothing more, ever; new ones are
    /// accepted and swallowed, until [`heal`](Self::heal).
    pub fn black_hole(&self) {
        self.state.send_modify(|state| state.mode = Mode::BlackHole);
    }

    /// Closes new connections as soon as they are accepted, until [`heal`](Self::heal); live
    /// connections go on.
    pub fn refuse(&self) {
        self.state.send_modify(|state| state.mode = Mode::Refuse);
    }

    /// Back to pass-through without delay for new connections (and live ones that still
    /// forward). Connections swallowed by a black hole stay silent.
    pub fn heal(&self) {
        self.delay(Duration::ZERO);
    }

    /// Stops reading from every socket, both ways, once `bytes` more have been forwarded toward
    /// the clients (at once for 0): the clients hear nothing more and, as the socket buffers
    /// fill, the servers' writes block, as with a client that stopped reading. Until
    /// [`thaw`](Self::thaw).
    pub fn freeze_after(&self, bytes: u64) {
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.counters.downstream_left.store(bytes, Ordering::SeqCst);
        self.counters.frozen.store(bytes == 0, Ordering::SeqCst);
    }

    /// Gives the sockets toward the upstream that open from now on a receive buffer of `bytes`
    /// (the kernel's autotuning off), so that a [`freeze_after`](Self::freeze_after) pushes
    /// back on the server after about that much, as a client's own small buffer would, rather
    /// than after the tens of megabytes loopback autotuning allows.
    pub fn limit_upstream_receive_buffer(&self, bytes: u32) {
        self.counters
            .upstream_receive_buffer
            .store(bytes, Ordering::SeqCst);
    }

    /// Whether a [`freeze_after`](Self::freeze_after) has set in.
    pub fn is_frozen(&self) -> bool {
        self.counters.frozen.load(Ordering::SeqCst)
    }

    /// Reads again after [`freeze_after`](Self::freeze_after).
    pub fn thaw(&self) {
        self.counters
            .downstream_left
            .store(i64::MAX, Ordering::SeqCst);
        self.counters.frozen.store(false, Ordering::SeqCst);
    }

    /// Connections accepted so far, refused and swallowed ones included: after a fault, a
    /// count above the number of clients means they reconnected.
    pub fn accepted(&self) -> u64 {
        self.counters.accepted.load(Ordering::Relaxed)
    }

    /// Connections open now (swallowed ones included).
    pub fn live(&self) -> usize {
        self.counters.live.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    state: watch::Receiver<State>,
    counters: Arc<Counters>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else {
                    // Out of file descriptors and the like: try again shortly.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                counters.accepted.fetch_add(1, Ordering::Relaxed);
                let now = *state.borrow();
                if now.mode == Mode::Refuse {
                    drop(client);
                    continue;
                }
                let _ = client.set_nodelay(true);
                let live = Live::new(counters.clone());
                connections.spawn(serve(client, upstream, state.clone(), now.cuts, live, counters.clone()));
            }
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Counts a connection as live while it exists.
struct Live(Arc<Counters>);

impl Live {
    fn new(counters: Arc<Counters>) -> Self {
        counters.live.fetch_add(1, Ordering::Relaxed);
        Live(counters)
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One connection, until it is cut or both sides are done.
async fn serve(
    client: TcpStream,
    upstream: SocketAddr,
    mut state: watch::Receiver<State>,
    born: u64,
    _live: Live,
    counters: Arc<Counters>,
) {
    let cut = |state: &State| state.cuts > born;
    // Swallowed: nothing is forwarded any more, for the rest of the connection's life.
    let dead = Arc::new(AtomicBool::new(state.borrow().mode == Mode::BlackHole));
    let (client_read, client_write) = client.into_split();
    if dead.load(Ordering::Relaxed) {
        // Never connected upstream: the client's bytes go nowhere.
        tokio::select! {
            () = swallow(client_read) => {}
            () = until(&mut state, cut) => {}
        }
        drop(client_write);
        return;
    }
    let server = tokio::select! {
        connected = connect(upstream, counters.upstream_receive_buffer.load(Ordering::SeqCst)) => match connected {
            Ok(server) => server,
            // The upstream is down: the client sees its connection closed, as through a
            // real proxy.
            Err(_) => return,
        },
        () = until(&mut state, cut) => return,
    };
    let _ = server.set_nodelay(true);
    let (server_read, server_write) = server.into_split();
    let upstream_way = direction(
        client_read,
        server_write,
        state.clone(),
        dead.clone(),
        (counters.clone(), false),
    );
    let downstream_way = direction(
        server_read,
        client_write,
        state.clone(),
        dead.clone(),
        (counters, true),
    );
    // A failed socket ends the whole connection, as it would end a real one.
    let both = async {
        let _ = tokio::try_join!(upstream_way, downstream_way);
    };
    let watch_faults = async {
        loop {
            if state.changed().await.is_err() {
                // The proxy is gone.
                return;
            }
            let now = *state.borrow_and_update();
            if cut(&now) {
                return;
            }
            if now.mode == Mode::BlackHole {
                dead.store(true, Ordering::Relaxed);
            }
        }
    };
    tokio::select! {
        () = both => {}
        () = watch_faults => {}
    }
}

/// Connects to `upstream`, with a receive buffer of `receive_buffer` bytes unless 0.
async fn connect(upstream: SocketAddr, receive_buffer: u32) -> io::Result<TcpStream> {
    if receive_buffer == 0 {
        return TcpStream::connect(upstream).await;
    }
    let socket = if upstream.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_recv_buffer_size(receive_buffer)?;
    socket.connect(upstream).await
}

/// Completes once `done` holds for the state, or the proxy is gone.
async fn until(state: &mut watch::Receiver<State>, done: impl Fn(&State) -> bool) {
    let _ = state.wait_for(|s| done(s)).await;
}

/// Reads and drops everything until the peer closes.
async fn swallow(mut from: OwnedReadHalf) {
    let mut buf = vec![0u8; CHUNK];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
    // A swallowed connection does not tell the other side it ended: wait for the cut or the
    // proxy's end.
    std::future::pending::<()>().await;
}

/// Forwards `from` to `to`, each chunk after the delay current when it was read; once `dead`,
/// reads and drops instead. Reads nothing while the proxy is frozen; toward the client
/// (`downstream`), counts the bytes down to the freeze. `Ok` when the end of stream was passed
/// on, `Err` when either socket failed (the whole connection is then closed).
async fn direction(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    state: watch::Receiver<State>,
    dead: Arc<AtomicBool>,
    (counters, downstream): (Arc<Counters>, bool),
) -> Result<(), ()> {
    let (queue, mut queued) = mpsc::channel::<(Instant, Vec<u8>)>(QUEUE);
    let dead_reader = dead.clone();
    let reader = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            while counters.frozen.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let n = match from.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => n,
                Err(_) if dead_reader.load(Ordering::Relaxed) => break,
                Err(_) => return Err(()),
            };
            if downstream {
                let n = i64::try_from(n).unwrap_or(i64::MAX);
                if counters.downstream_left.fetch_sub(n, Ordering::SeqCst) <= n {
                    counters.frozen.store(true, Ordering::SeqCst);
                }
            }
            if dead_reader.load(Ordering::Relaxed) {
                continue;
            }
            let delay = match state.borrow().mode {
                Mode::Pass { delay } => delay,
                Mode::Refuse => Duration::ZERO,
                Mode::BlackHole => {
                    dead_reader.store(true, Ordering::Relaxed);
                    continue;
                }
            };
            if queue
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .await
                .is_err()
            {
                return Err(());
            }
        }
        // End of stream on this side: the writer finishes what is queued, then passes the end
        // on, unless the connection is swallowed, which never tells the other side.
        drop(queue);
        if dead_reader.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
        Ok(())
    };
    let writer = async move {
        while let Some((at, chunk)) = queued.recv().await {
            tokio::time::sleep_until(at).await;
            if dead.load(Ordering::Relaxed) {
                continue;
            }
            if to.write_all(&chunk).await.is_err() {
                return Err(());
            }
        }
        if dead.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
        let _ = to.shutdown().await;
        Ok(())
    };
    tokio::try_join!(reader, writer).map(|_| ())
}
