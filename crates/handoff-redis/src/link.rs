//! One Redis connection shared by concurrent calls, replaced when it breaks.
//!
//! redis-rs's multiplexed connection pipelines concurrent commands over one socket. It does not
//! replace itself after a response timeout (a silent partition would keep every later call
//! timing out), so this module does: a call that fails on the connection itself forgets it, and
//! the next call opens a new one.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, ServerErrorKind};

use crate::error::CallError;
use crate::{config, ConnectError};

/// A connection to one server, opened on first use and again after it broke.
pub(crate) struct Link {
    client: redis::Client,
    /// The URL without its password, for messages.
    pub(crate) server: String,
    connect_timeout: Duration,
    /// The open connection and its serial; `None` before the first call and after a break.
    /// std Mutex: never held across `.await`.
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    /// One connection attempt at a time: concurrent calls wait for the first.
    opening: tokio::sync::Mutex<()>,
    serial: AtomicU64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// A link to `url`, not yet connected.
    pub(crate) fn new(url: &str, connect_timeout: Duration) -> Result<Link, ConnectError> {
        let client = redis::Client::open(url).map_err(|e| ConnectError::InvalidUrl {
            reason: e.to_string(),
        })?;
        Ok(Link {
            client,
            server: config::redact(url),
            connect_timeout,
            current: Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            serial: AtomicU64::new(0),
        })
    }

    /// The open connection, opening one if there is none.
    pub(crate) async fn connection(&self) -> Result<(u64, MultiplexedConnection), ConnectError> {
        if let Some(open) = self.open() {
            return Ok(open);
        }
        let _opening = self.opening.lock().await;
        if let Some(open) = self.open() {
            return Ok(open);
        }
        // Timeouts are the callers' own (tokio's), so a blocking read may wait longer.
        let settings = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(None);
        let attempt = self
            .client
            .get_multiplexed_async_connection_with_config(&settings);
        let connection = match tokio::time::timeout(self.connect_timeout, attempt).await {
            Ok(Ok(connection)) => connection,
            Ok(Err(error)) => return Err(self.connect_error(error)),
            Err(_elapsed) => {
                return Err(ConnectError::TimedOut {
                    server: self.server.clone(),
                    timeout: self.connect_timeout,
                })
            }
        };
        let serial = self.serial.fetch_add(1, Ordering::Relaxed) + 1;
        *self.lock() = Some((serial, connection.clone()));
        tracing::debug!(server = %self.server, serial, "connected to redis");
        Ok((serial, connection))
    }

    /// Runs `call` on the open connection (opening one when there is none), all within
    /// `timeout`; a failure of the connection itself (dropped, silent, unreachable) forgets it so
    /// the next call opens a new one.
    pub(crate) async fn call<T, F, Fut>(&self, timeout: Duration, call: F) -> Result<T, CallError>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        let (serial, connection) = match tokio::time::timeout_at(deadline, self.connection()).await
        {
            Ok(opened) => opened.map_err(CallError::Connect)?,
            // Nothing was sent: the server is as good as unreachable.
            Err(_elapsed) => {
                return Err(CallError::Connect(ConnectError::TimedOut {
                    server: self.server.clone(),
                    timeout,
                }))
            }
        };
        let result = match tokio::time::timeout_at(deadline, call(connection)).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(error)) => CallError::Redis(error),
            Err(_elapsed) => CallError::TimedOut(timeout),
        };
        if result.breaks_connection() {
            self.forget(serial);
        }
        Err(result)
    }

    /// Forgets connection `serial` if it is still the current one.
    pub(crate) fn forget(&self, serial: u64) {
        let mut current = self.lock();
        if current.as_ref().is_some_and(|(open, _)| *open == serial) {
            tracing::debug!(server = %self.server, serial, "dropping a broken redis connection");
            *current = None;
        }
    }

    fn open(&self) -> Option<(u64, MultiplexedConnection)> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(u64, MultiplexedConnection)>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn connect_error(&self, error: RedisError) -> ConnectError {
        let server = self.server.clone();
        let refused = matches!(
            error.kind(),
            ErrorKind::AuthenticationFailed | ErrorKind::Server(ServerErrorKind::NoPerm)
        ) || matches!(error.code(), Some("WRONGPASS" | "NOAUTH"));
        if refused {
            ConnectError::Unauthorized {
                server,
                source: error,
            }
        } else {
            ConnectError::Unreachable {
                server,
                source: error,
            }
        }
    }
}
