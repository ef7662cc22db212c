//! The shared RabbitMQ of the tests (`AMQP_URL`, default the local broker), names of the
//! test's own, and reading queues back.

#![allow(dead_code)] // each test binary uses a part

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use handoff_amqp::lapin::options::{
    BasicGetOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use handoff_amqp::lapin::types::{AMQPValue, FieldTable};
use handoff_amqp::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use handoff_amqp::AmqpConfig;
use handoff_core::delivery::OutboxEvent;
use handoff_test::eventually;

/// The broker the tests use.
pub fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A name no other test (or test process) uses: `t_<prefix>_<random>`.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let hash = RandomState::new().hash_one((
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        nanos,
    ));
    format!("t_{prefix}_{hash:016x}")
}

/// A transport config for the test's own exchange and connection name.
pub fn config(exchange: &str) -> AmqpConfig {
    config_at(&url(), exchange)
}

/// As [`config`], on the broker at `url` (a private node).
pub fn config_at(url: &str, exchange: &str) -> AmqpConfig {
    AmqpConfig {
        url: url.to_owned(),
        exchange: exchange.to_owned(),
        connection_name: exchange.to_owned(),
        ..AmqpConfig::default()
    }
}

/// One message read back from a queue.
#[derive(Debug, Clone)]
pub struct Message {
    pub routing_key: String,
    pub properties: BasicProperties,
    pub body: String,
}

impl Message {
    /// Header `name` as a string.
    pub fn header(&self, name: &str) -> Option<String> {
        let headers = self.properties.headers().as_ref()?;
        match headers.inner().get(name)? {
            AMQPValue::LongString(value) => Some(value.to_string()),
            AMQPValue::ShortString(value) => Some(value.to_string()),
            other => Some(format!("{other:?}")),
        }
    }

    pub fn event_id(&self) -> uuid::Uuid {
        self.header("ce-id").unwrap().parse().unwrap()
    }

    pub fn aggregate_id(&self) -> String {
        handoff_core::subject::decode_token(&self.header("Handoff-Aggregate-Id").unwrap())
            .unwrap()
            .into_owned()
    }

    pub fn sequence(&self) -> i64 {
        self.header("Handoff-Sequence").unwrap().parse().unwrap()
    }
}

/// A connection of the test's own for declaring, reading and deleting; deletes the exchange and
/// queues it was told about when dropped.
pub struct Broker {
    pub connection: Connection,
    pub channel: Channel,
    url: String,
    exchanges: Vec<String>,
    queues: Vec<String>,
}

impl Broker {
    pub async fn new() -> Self {
        Self::at(&url()).await
    }

    /// As [`new`](Self::new), on the broker at `url` (a private node).
    pub async fn at(url: &str) -> Self {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("the test broker is reachable");
        let channel = connection.create_channel().await.unwrap();
        Self {
            connection,
            channel,
            url: url.to_owned(),
            exchanges: Vec::new(),
            queues: Vec::new(),
        }
    }

    /// Deletes `exchange` when dropped.
    pub fn owns_exchange(&mut self, exchange: &str) {
        self.exchanges.push(exchange.to_owned());
    }

    /// Deletes `queue` when dropped.
    pub fn owns_queue(&mut self, queue: &str) {
        self.queues.push(queue.to_owned());
    }

    /// Declares a durable queue bound to `exchange` with `binding_key`; deleted when dropped.
    pub async fn queue(&mut self, queue: &str, exchange: &str, binding_key: &str) {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        self.channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                binding_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        self.queues.push(queue.to_owned());
    }

    /// Every message in `queue` now (acknowledged, so removed), in queue order.
    pub async fn drain(&self, queue: &str) -> Vec<Message> {
        let mut messages = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let delivery = message.delivery;
            messages.push(Message {
                routing_key: delivery.routing_key.to_string(),
                properties: delivery.properties.clone(),
                body: String::from_utf8(delivery.data.clone()).unwrap(),
            });
        }
        messages
    }

    /// Drains `queue` until it has yielded `n` messages in all, or panics after 30 s.
    pub async fn read(&self, queue: &str, n: usize) -> Vec<Message> {
        let mut messages = Vec::new();
        let what = format!("{n} messages read from {queue}");
        eventually(&what, Duration::from_secs(30), async || {
            messages.extend(self.drain(queue).await);
            if messages.len() >= n {
                Ok(())
            } else {
                Err(messages.len())
            }
        })
        .await;
        messages
    }

    /// How many messages `queue` holds.
    pub async fn depth(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let exchanges = std::mem::take(&mut self.exchanges);
        let queues = std::mem::take(&mut self.queues);
        let url = self.url.clone();
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                let attempt = async {
                    let connection =
                        Connection::connect(&url, ConnectionProperties::default()).await?;
                    let channel = connection.create_channel().await?;
                    for queue in queues {
                        let _ = channel
                            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                    for exchange in exchanges {
                        let _ = channel
                            .exchange_delete(
                                exchange.as_str().into(),
                                ExchangeDeleteOptions::default(),
                            )
                            .await;
                    }
                    let _ = connection.close(200, "OK".into()).await;
                    Ok::<_, handoff_amqp::lapin::Error>(())
                };
                let _ = tokio::time::timeout(Duration::from_secs(10), attempt).await;
            });
        })
        .join();
    }
}

/// An event of `aggregate_id` at `sequence`, with a traceparent header.
pub fn event(aggregate_id: &str, sequence: i64) -> OutboxEvent {
    OutboxEvent {
        event_id: uuid::Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        aggregate_sequence: sequence,
        global_sequence: None,
        event_type: "OrderPlaced".into(),
        schema_version: 2,
        payload: format!(r#"{{"aggregate":"{aggregate_id}","sequence":{sequence}}}"#),
        headers: vec![("traceparent".into(), "00-abc-def-01".into())],
        occurred_at: SystemTime::now(),
        attempt_count: 0,
    }
}

/// Closes the broker side of every connection named `name` (`rabbitmqctl close_connection`),
/// as a broker restart or a network cut would. Returns how many were closed.
pub fn close_connections_named(name: &str) -> usize {
    let output = std::process::Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "pid",
            "client_properties",
            "--quiet",
            "--no-table-headers",
        ])
        .output()
        .expect("rabbitmqctl runs");
    assert!(output.status.success(), "{output:?}");
    let listing = String::from_utf8_lossy(&output.stdout);
    let needle = format!("{{\"connection_name\",\"{name}\"}}");
    let mut closed = 0;
    for line in listing.lines().filter(|line| line.contains(&needle)) {
        let pid = line.split_whitespace().next().unwrap();
        let status = std::process::Command::new("rabbitmqctl")
            .args(["close_connection", pid, "closed by a handoff test"])
            .status()
            .expect("rabbitmqctl runs");
        assert!(status.success());
        closed += 1;
    }
    closed
}
