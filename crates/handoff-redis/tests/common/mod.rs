//! Shared by the Redis tests: the local server's URL, a stream key of the test's own (deleted
//! with its dedup keys and groups when the test ends), and readers of what the stream holds.

#![allow(dead_code)]

use handoff_core::readback::{MessageScan, ReadBack, ReadFrom, StoredMessage};
use handoff_redis::redis;
use handoff_redis::{IntakeConfig, RedisConfig, RedisTransport};

/// The local Redis (`REDIS_URL`, else `redis://127.0.0.1:6379`).
pub fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A stream key no other test uses, removed with everything under it on drop.
pub struct Scratch {
    pub stream: String,
}

impl Scratch {
    pub fn new(test: &str) -> Scratch {
        Scratch {
            stream: format!("handoff-test:{test}:{}", uuid::Uuid::now_v7()),
        }
    }

    pub fn config(&self) -> RedisConfig {
        RedisConfig {
            url: url(),
            stream: self.stream.clone(),
            ..RedisConfig::default()
        }
    }

    pub fn intake(&self, group: &str, consumer: &str) -> IntakeConfig {
        IntakeConfig {
            url: url(),
            stream: self.stream.clone(),
            group: group.to_owned(),
            consumer: consumer.to_owned(),
            ..IntakeConfig::default()
        }
    }

    /// How many entries the stream holds.
    pub fn len(&self) -> usize {
        redis::cmd("XLEN")
            .arg(&self.stream)
            .query(&mut connection())
            .unwrap()
    }

    /// How many entries `group` has delivered and not had acknowledged.
    pub fn pending(&self, group: &str) -> usize {
        let summary: redis::Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(group)
            .query(&mut connection())
            .unwrap();
        match summary {
            redis::Value::Array(parts) => match parts.first() {
                Some(redis::Value::Int(n)) => usize::try_from(*n).unwrap(),
                other => panic!("unexpected XPENDING summary {other:?}"),
            },
            other => panic!("unexpected XPENDING reply {other:?}"),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let mut connection = connection();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.stream))
            .query(&mut connection)
            .unwrap_or_default();
        for key in keys {
            let _: Result<(), _> = redis::cmd("DEL").arg(key).query(&mut connection);
        }
    }
}

/// A plain (blocking) connection to the local Redis, for looking behind the crate's back.
pub fn connection() -> redis::Connection {
    redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap()
}

/// Everything the stream holds, through the read-back seam.
pub async fn read_all(transport: &RedisTransport) -> Vec<StoredMessage> {
    let mut scan = transport.read_back(ReadFrom::Start).await.unwrap();
    let mut messages = Vec::new();
    while let Some(message) = scan.next().await.unwrap() {
        messages.push(message);
    }
    messages
}
