//! `--destination kafka`: a Kafka topic, keyed by aggregate id.

use anyhow::{bail, Context, Result};
use handoff_core::delivery::{OutboxEvent, PublishError};
use handoff_core::readback::{ReadBack, ReadBackError, ReadFrom};
use handoff_kafka::{
    KafkaConfig, KafkaMessageScan, KafkaOption, KafkaOptionParser, KafkaOptions, KafkaReadBack,
    KafkaTransport,
};
use serde::Deserialize;
use serde_json::json;
use tracing::info;

use super::{connect_with_retry, Common, Destination, DestinationKind, ReplayAck, Store};

/// The Kafka flags (and config-file keys).
#[derive(clap::Args, Deserialize, Default, Clone)]
#[command(next_help_heading = "Kafka")]
pub struct KafkaFlags {
    /// Kafka bootstrap brokers (required with kafka).
    ///
    /// HOST:PORT[,HOST:PORT...], required with --destination kafka.
    #[arg(
        long,
        alias = "brokers",
        env = "HANDOFF_KAFKA_BROKERS",
        value_name = "HOST:PORT,..."
    )]
    #[serde(alias = "brokers")]
    pub kafka_brokers: Option<String>,
    /// Kafka topic [default: outbox].
    ///
    /// The relay's Kafka topic; the relay creates it when missing (replay and reconcile never
    /// do).
    #[arg(long, env = "HANDOFF_TOPIC")]
    pub topic: Option<String>,
    /// Partitions of a topic this relay creates [default: 12].
    #[arg(long, env = "HANDOFF_PARTITIONS", value_name = "N")]
    pub partitions: Option<i32>,
    /// A librdkafka setting, KEY=VALUE (repeatable).
    ///
    /// With --destination kafka: such as security.protocol=SASL_SSL or
    /// sasl.mechanism=SCRAM-SHA-512; wins over the same key in the config file's [kafka]
    /// table. Flags show in process listings: put secrets (sasl.password) in the file. Secret
    /// values are never logged.
    // Its id is the config file's key for the same settings (the `[kafka]` table below).
    #[arg(id = "kafka", long = "kafka-option", value_name = "KEY=VALUE", value_parser = KafkaOptionParser)]
    #[serde(skip)]
    pub kafka_option: Vec<KafkaOption>,
    /// `[kafka]` in the config file: librdkafka settings; dotted keys may be written bare
    /// (`security.protocol = "SASL_SSL"`, a nested table to TOML) or quoted.
    #[arg(skip)]
    #[serde(rename = "kafka")]
    pub kafka_table: Option<toml::Table>,
}

impl KafkaFlags {
    /// The librdkafka options: the file's `[kafka]` table, then the flags (a flag wins over
    /// the file's value of the same key).
    fn options(&self) -> Result<KafkaOptions> {
        let mut options = KafkaOptions::default();
        if let Some(table) = &self.kafka_table {
            let mut flat = Vec::new();
            flatten_kafka_table("", table.clone(), &mut flat)?;
            for (key, value) in flat {
                options
                    .set(key, value)
                    .context("in the [kafka] table of the config file")?;
            }
        }
        for option in &self.kafka_option {
            options.insert(option.clone());
        }
        options.validate()?;
        Ok(options)
    }
}

impl Destination for KafkaFlags {
    const KIND: DestinationKind = DestinationKind::Kafka;
    type Config = KafkaConfig;
    type Transport = KafkaTransport;
    type Store = KafkaStore;

    fn resolve(&self, common: &Common) -> Result<KafkaConfig> {
        let Some(brokers) = self.kafka_brokers.clone() else {
            bail!(
                "no kafka brokers: set --kafka-brokers, HANDOFF_KAFKA_BROKERS or kafka_brokers \
                 in the config"
            );
        };
        let defaults = KafkaConfig::default();
        let config = KafkaConfig {
            brokers,
            topic: self.topic.clone().unwrap_or(defaults.topic),
            partitions: self.partitions.unwrap_or(defaults.partitions),
            publish_timeout: common.publish_timeout,
            ce_source: common.ce_source.clone().unwrap_or(defaults.ce_source),
            client_id: common.client_id.clone(),
            options: self.options()?,
        };
        config.validate()?;
        Ok(config)
    }

    fn stray(&self) -> Option<&'static str> {
        (!self.kafka_option.is_empty() || self.kafka_table.is_some()).then_some(
            "kafka options (--kafka-option or [kafka] in the config) need --destination kafka",
        )
    }

    async fn connect(config: KafkaConfig) -> Result<KafkaTransport> {
        // Keys only: values may be secrets.
        info!(
            librdkafka = %handoff_kafka::rdkafka::util::get_rdkafka_version().1,
            options = ?config.options.keys().collect::<Vec<_>>(),
            "connecting to kafka"
        );
        let transport = connect_with_retry(
            "Kafka",
            || KafkaTransport::connect(config.clone()),
            |e: &handoff_kafka::ConnectError| {
                e.kind() == handoff_kafka::ConnectErrorKind::Unreachable
            },
        )
        .await?;
        let topic = transport
            .ensure_topic()
            .await
            .context("while ensuring the topic")?;
        info!(topic = ?topic, "destination ready");
        Ok(transport)
    }

    fn names(config: &KafkaConfig) -> serde_json::Map<String, serde_json::Value> {
        let names = json!({ "topic": config.topic });
        names.as_object().cloned().unwrap_or_default()
    }

    fn place(config: &KafkaConfig) -> String {
        format!("topic {}", config.topic)
    }

    async fn open_store(config: KafkaConfig) -> Result<KafkaStore> {
        let topic = KafkaReadBack::new(&config);
        let transport = KafkaTransport::connect(config)
            .await
            .context("while connecting to Kafka (check --kafka-brokers / HANDOFF_KAFKA_BROKERS)")?;
        if transport.topic_partitions().await?.is_none() {
            bail!("topic {:?} does not exist (check --topic)", topic.topic());
        }
        Ok(KafkaStore { transport, topic })
    }
}

/// A topic as `replay` and `reconcile` see it: read back whole, and produced replayed copies.
#[derive(Debug)]
pub struct KafkaStore {
    transport: KafkaTransport,
    topic: KafkaReadBack,
}

impl ReadBack for KafkaStore {
    type Scan = KafkaMessageScan;

    async fn read_back(&self, from: ReadFrom) -> Result<KafkaMessageScan, ReadBackError> {
        self.topic.read_back(from).await
    }
}

impl Store for KafkaStore {
    fn location(&self, _event: &OutboxEvent) -> String {
        self.topic.topic().to_owned()
    }

    /// Kafka keeps every copy (no broker-side deduplication); consumers deduplicate by
    /// `ce-id`.
    async fn send_replay(
        &self,
        event: &OutboxEvent,
        marker: &str,
    ) -> Result<ReplayAck<'_>, PublishError> {
        let ack = self.transport.send_replay(event, marker).await?;
        Ok(Box::pin(
            async move { ack.wait().await.map(|_delivered| ()) },
        ))
    }
}

/// `[kafka]`'s entries as `(dotted.key, value)`: TOML reads a bare `security.protocol = ...`
/// as a nested table, which is joined back into librdkafka's key.
fn flatten_kafka_table(
    prefix: &str,
    table: toml::Table,
    out: &mut Vec<(String, String)>,
) -> Result<()> {
    for (key, value) in table {
        let key = if prefix.is_empty() {
            key
        } else {
            format!("{prefix}.{key}")
        };
        let value = match value {
            toml::Value::String(text) => text,
            toml::Value::Integer(n) => n.to_string(),
            toml::Value::Float(x) => x.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Table(inner) => {
                flatten_kafka_table(&key, inner, out)?;
                continue;
            }
            toml::Value::Array(_) | toml::Value::Datetime(_) => bail!(
                "in the [kafka] table of the config file: {key:?} must be a string, a number \
                 or a boolean"
            ),
        };
        out.push((key, value));
    }
    Ok(())
}
