//! Redis for tests: the local server's URL, a stream key of the test's own (deleted with its
//! dedup keys and consumer groups when dropped), and what a stream holds, read through the
//! destination's read-back.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_test::redis::{read_stream, ScratchStream};
//!
//! # async fn example() {
//! let stream = ScratchStream::new("my-test");
//! // ... run a relay with `--redis-stream stream.key()` ...
//! let messages = read_stream(stream.key()).await;
//! assert!(messages.iter().all(|m| m.event_id.is_some()));
//! # }
//! ```

use handoff_core::readback::{MessageScan, ReadBack, ReadFrom, StoredMessage};
use handoff_redis::redis;
use handoff_redis::{RedisConfig, RedisTransport};

/// The local Redis: `REDIS_URL`, else `redis://127.0.0.1:6379`.
pub fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A plain (blocking) connection to [`url`], for looking behind the destination's back.
///
/// # Panics
///
/// When the server cannot be reached.
pub fn connection() -> redis::Connection {
    redis::Client::open(url())
        .and_then(|client| client.get_connection())
        .unwrap_or_else(|e| panic!("connect to redis at {}: {e}", url()))
}

/// A stream key no other test uses (`handoff-test:<test>:<uuid>`); on drop every key that
/// starts with it (the stream, the transport's dedup keys) is deleted.
#[derive(Debug)]
pub struct ScratchStream {
    key: String,
}

impl ScratchStream {
    /// A fresh key named after `test`.
    pub fn new(test: &str) -> ScratchStream {
        ScratchStream {
            key: format!("handoff-test:{test}:{}", uuid::Uuid::now_v7()),
        }
    }

    /// The stream key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// A transport configuration onto this stream on [`url`], defaults otherwise.
    pub fn config(&self) -> RedisConfig {
        RedisConfig {
            url: url(),
            stream: self.key.clone(),
            ..RedisConfig::default()
        }
    }

    /// How many entries the stream holds (0 when it does not exist).
    pub fn len(&self) -> usize {
        redis::cmd("XLEN")
            .arg(&self.key)
            .query(&mut connection())
            .expect("XLEN")
    }

    /// Whether the stream holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many entries consumer group `group` has delivered and not had acknowledged.
    pub fn pending(&self, group: &str) -> usize {
        let summary: redis::Value = redis::cmd("XPENDING")
            .arg(&self.key)
            .arg(group)
            .query(&mut connection())
            .expect("XPENDING");
        match summary {
            redis::Value::Array(parts) => match parts.first() {
                Some(redis::Value::Int(n)) => usize::try_from(*n).unwrap_or(0),
                other => panic!("unexpected XPENDING summary {other:?}"),
            },
            other => panic!("unexpected XPENDING reply {other:?}"),
        }
    }
}

impl Drop for ScratchStream {
    fn drop(&mut self) {
        let Ok(mut connection) = redis::Client::open(url()).and_then(|c| c.get_connection()) else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.key))
            .query(&mut connection)
            .unwrap_or_default();
        for key in keys {
            let _: Result<(), _> = redis::cmd("DEL").arg(key).query(&mut connection);
        }
    }
}

/// Every entry of `stream` on [`url`], in stream order, through [`RedisTransport`]'s
/// read-back.
///
/// # Panics
///
/// When the server cannot be reached or the stream does not exist.
pub async fn read_stream(stream: &str) -> Vec<StoredMessage> {
    let transport = RedisTransport::connect(RedisConfig {
        url: url(),
        stream: stream.to_owned(),
        ..RedisConfig::default()
    })
    .await
    .expect("connect to redis");
    read_all(&transport).await
}

/// Everything `destination` holds, from the start, through the read-back seam.
///
/// # Panics
///
/// When the read-back fails.
pub async fn read_all(destination: &impl ReadBack) -> Vec<StoredMessage> {
    let mut scan = destination
        .read_back(ReadFrom::Start)
        .await
        .expect("start the read-back");
    let mut messages = Vec::new();
    while let Some(message) = scan.next().await.expect("read back") {
        messages.push(message);
    }
    messages
}
