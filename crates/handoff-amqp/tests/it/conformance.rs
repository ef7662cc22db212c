//! The transport conformance suite (`handoff_test::conformance`) on RabbitMQ: the shared
//! broker (`AMQP_URL`), each case with its own exchange and a queue bound to it with `#`,
//! reached through a fault proxy so the case can take the broker down (the proxy dropped) or
//! make it silent (the proxy's black hole). The oversize case runs on a private node whose
//! `max_message_size` is 4 KiB (the shared broker's is 128 MiB).
//!
//! RabbitMQ has no deduplication: a republish is a second message with the same `ce-id` and
//! `message_id`, which consumers drop in their inbox.

use crate::common;

use crate::common::{config_at, url, Broker};
use handoff_amqp::lapin::types::AMQPValue;
use handoff_amqp::{AmqpConfig, AmqpTransport};
use handoff_test::conformance::{
    Case, Dedup, Destination, Link, Received, CE_SOURCE, PUBLISH_TIMEOUT,
};
use handoff_test::rabbitmq::RabbitMqNode;
use tokio::task::block_in_place;

/// The private node's message size limit, for the oversize case.
const MAX_MESSAGE_SIZE: usize = 4096;

struct Rabbit {
    transport: AmqpTransport,
    exchange: String,
    /// Reads the queue straight from the broker, not through the proxy; dropped before the
    /// node.
    broker: Broker,
    link: Link,
    /// The private node of the oversize case.
    node: Option<RabbitMqNode>,
}

impl Destination for Rabbit {
    type Transport = AmqpTransport;
    const NAME: &'static str = "amqp";
    const DEDUP: Dedup = Dedup::None;

    async fn start(case: Case) -> Self {
        let node = (case == Case::Oversize).then(|| {
            block_in_place(|| {
                let node = RabbitMqNode::start_with_config(&[&format!(
                    "max_message_size = {MAX_MESSAGE_SIZE}"
                )])
                .expect("a private rabbitmq node starts");
                node
            })
        });
        let server = node.as_ref().map_or_else(url, RabbitMqNode::url);
        let exchange = common::unique_name(&format!("conformance_{}", case.name()));
        let link = Link::to(&server).await;
        let transport = AmqpTransport::connect(AmqpConfig {
            ce_source: CE_SOURCE.to_owned(),
            publish_timeout: PUBLISH_TIMEOUT,
            ..config_at(link.url(), &exchange)
        })
        .await
        .unwrap_or_else(|e| panic!("connect through the proxy: {e}"));
        let mut broker = Broker::at(&server).await;
        broker.owns_exchange(&exchange);
        broker.queue(&exchange, &exchange, "#").await;
        Rabbit {
            transport,
            exchange,
            broker,
            link,
            node,
        }
    }

    fn link(&mut self) -> Option<&mut Link> {
        Some(&mut self.link)
    }

    fn transport(&self) -> &AmqpTransport {
        &self.transport
    }

    async fn received(&self, at_least: usize) -> Vec<Received> {
        // The confirm came after the queue had each message: no waiting beyond the read.
        let mut messages = self.broker.read(&self.exchange, at_least).await;
        // Anything more (a copy) is in the queue by now too.
        messages.extend(self.broker.drain(&self.exchange).await);
        messages
            .into_iter()
            .map(|m| Received {
                position: m.routing_key.clone(),
                headers: m
                    .properties
                    .headers()
                    .iter()
                    .flat_map(|table| table.inner().iter())
                    .map(|(name, value)| (name.to_string(), text(value)))
                    .collect(),
                body: m.body.into_bytes(),
            })
            .collect()
    }

    fn expected_receipt(&self, message: &Received) -> Option<String> {
        Some(format!("amqp {} {}", self.exchange, message.position))
    }

    fn oversize(&self) -> Option<usize> {
        self.node.as_ref().map(|_| MAX_MESSAGE_SIZE)
    }
}

/// A header value as text (the transport sends long strings).
fn text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(value) => value.to_string(),
        AMQPValue::ShortString(value) => value.to_string(),
        other => format!("{other:?}"),
    }
}

handoff_test::conformance_suite!(Rabbit);

/// The intake conformance suite (`handoff_test::intake_conformance`) on RabbitMQ: the shared
/// broker, each case with its own exchange and a classic queue bound to it with `#`, which
/// every intake of the case consumes.
///
/// RabbitMQ has no ack wait: an unsettled delivery stays with its consumer until that
/// consumer's channel closes, then the broker requeues it at once (see `AmqpIntake`'s
/// documentation), so [`IntakeDriver::redelivery_after`] is zero here. A classic queue only
/// flags a redelivery; the intake counts it as delivery 2.
mod intake {
    use std::time::Duration;

    use handoff_amqp::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use handoff_amqp::lapin::types::{AMQPValue, FieldTable, ShortString};
    use handoff_amqp::lapin::{BasicProperties, Channel};
    use handoff_amqp::{AmqpConfig, AmqpIntake, AmqpTransport, IntakeConfig, QueueDeclaration};
    use handoff_test::intake_conformance::{IntakeCase, IntakeDriver, CE_SOURCE};

    use super::common::{config, unique_name, url, Broker};

    struct Rabbit {
        transport: AmqpTransport,
        /// The exchange, and the queue bound to it.
        exchange: String,
        /// Publishes raw messages with confirms, so that each is in the queue before the next
        /// publish.
        raw: Channel,
        /// Deletes the exchange and the queue when dropped.
        _broker: Broker,
    }

    impl Rabbit {
        fn intake_config(&self, instance: &str) -> IntakeConfig {
            IntakeConfig {
                url: url(),
                queue: self.exchange.clone(),
                connection_name: format!("{}-{instance}", self.exchange),
                ..IntakeConfig::default()
            }
        }
    }

    impl IntakeDriver for Rabbit {
        type Transport = AmqpTransport;
        type Intake = AmqpIntake;
        const NAME: &'static str = "amqp";
        /// The redelivered flag: the intake counts a flagged delivery as the second.
        const COUNTS_REDELIVERIES: bool = true;

        async fn start(case: IntakeCase) -> Self {
            let exchange = unique_name(&format!("intake_{}", case.name()));
            let mut broker = Broker::new().await;
            broker.owns_exchange(&exchange);
            broker.owns_queue(&exchange);
            let transport = AmqpTransport::connect(AmqpConfig {
                ce_source: CE_SOURCE.to_owned(),
                ..config(&exchange)
            })
            .await
            .unwrap_or_else(|e| panic!("connect: {e}"));
            let raw = broker.connection.create_channel().await.unwrap();
            raw.confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            let rabbit = Rabbit {
                transport,
                exchange: exchange.clone(),
                raw,
                _broker: broker,
            };
            AmqpIntake::declare_queue(
                &rabbit.intake_config("declare"),
                &QueueDeclaration {
                    exchange,
                    ..QueueDeclaration::default()
                },
            )
            .await
            .unwrap_or_else(|e| panic!("declare the queue: {e}"));
            rabbit
        }

        fn transport(&self) -> &AmqpTransport {
            &self.transport
        }

        async fn publish_raw(&self, headers: &[(String, String)], body: &[u8]) {
            let mut table = FieldTable::default();
            for (name, value) in headers {
                table.insert(
                    ShortString::from(name.as_str()),
                    AMQPValue::LongString(value.as_str().into()),
                );
            }
            self.raw
                .basic_publish(
                    self.exchange.as_str().into(),
                    "raw.x".into(),
                    BasicPublishOptions::default(),
                    body,
                    BasicProperties::default().with_headers(table),
                )
                .await
                .expect("send a raw message")
                .await
                .expect("the broker confirms a raw message");
        }

        async fn open(&self, instance: &str) -> AmqpIntake {
            AmqpIntake::connect(self.intake_config(instance))
                .await
                .unwrap_or_else(|e| panic!("open an intake: {e}"))
        }

        fn redelivery_after(&self) -> Duration {
            Duration::ZERO
        }
    }

    handoff_test::intake_conformance_suite!(Rabbit);
}
