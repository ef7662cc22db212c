//! The AMQP transport against the real RabbitMQ: confirms, the message contract as properties
//! and headers, unroutable events, connect errors, and reconnecting after the broker closed the
//! connection.

use std::time::Duration;

use crate::common::{close_connections_named, config, event, unique_name, url, Broker};
use handoff_amqp::{AmqpConfig, AmqpTransport, ConnectErrorKind};
use handoff_core::delivery::{PublishErrorKind, Transport};

#[tokio::test]
async fn a_confirmed_publish_carries_the_contract_as_properties_and_headers() {
    let exchange = unique_name("contract");
    let mut broker = Broker::new().await;
    broker.owns_exchange(&exchange);
    let transport = AmqpTransport::connect(config(&exchange)).await.unwrap();
    broker.queue(&exchange, &exchange, "order.*").await;

    let mut e = event("eu.west 42", 3);
    e.headers.push(("tracestate".into(), "k=v".into()));
    let receipt = transport.publish(&e).await.unwrap();
    let expected = format!("amqp {exchange} order.eu%2Ewest%2042");
    assert_eq!(receipt.detail(), Some(expected.as_str()));

    // The confirm came after the queue had the message: it is there without waiting.
    let messages = broker.drain(&exchange).await;
    assert_eq!(messages.len(), 1);
    let m = &messages[0];
    assert_eq!(m.routing_key, "order.eu%2Ewest%2042");
    assert_eq!(m.body, e.payload);
    let id = e.event_id.to_string();
    assert_eq!(
        m.properties.message_id().as_ref().map(|s| s.as_str()),
        Some(id.as_str())
    );
    assert_eq!(
        m.properties.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(*m.properties.delivery_mode(), Some(2));
    assert_eq!(m.header("ce-id").as_deref(), Some(id.as_str()));
    assert_eq!(m.header("ce-specversion").as_deref(), Some("1.0"));
    assert_eq!(m.header("ce-type").as_deref(), Some("OrderPlaced"));
    assert_eq!(m.header("ce-source").as_deref(), Some("handoff"));
    assert!(m.header("ce-time").is_some());
    assert_eq!(
        m.header("Content-Type").as_deref(),
        Some("application/json")
    );
    assert_eq!(m.header("Handoff-Aggregate-Type").as_deref(), Some("order"));
    assert_eq!(m.aggregate_id(), "eu.west 42");
    assert_eq!(m.sequence(), 3);
    assert_eq!(m.header("Handoff-Schema-Version").as_deref(), Some("2"));
    assert_eq!(m.header("traceparent").as_deref(), Some("00-abc-def-01"));
    assert_eq!(m.header("tracestate").as_deref(), Some("k=v"));
    assert_eq!(m.header("Nats-Msg-Id"), None);
}

#[tokio::test]
async fn a_missing_exchange_is_declared_durable_topic_or_refused() {
    let exchange = unique_name("declare");
    let mut broker = Broker::new().await;
    broker.owns_exchange(&exchange);
    let refused = AmqpTransport::connect(AmqpConfig {
        declare_exchange: false,
        ..config(&exchange)
    })
    .await
    .unwrap_err();
    assert_eq!(refused.kind(), ConnectErrorKind::Topology, "{refused}");
    assert!(refused.to_string().contains("does not exist"), "{refused}");

    AmqpTransport::connect(config(&exchange)).await.unwrap();
    // It exists now, as a durable topic exchange: a passive declare finds it and a durable topic
    // declare with the same settings is accepted (another type or durability would close the
    // channel with PRECONDITION_FAILED).
    broker
        .channel
        .exchange_declare(
            exchange.as_str().into(),
            handoff_amqp::lapin::ExchangeKind::Topic,
            handoff_amqp::lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .unwrap();
    // And with declaring off, an existing exchange is used as it is.
    AmqpTransport::connect(AmqpConfig {
        declare_exchange: false,
        ..config(&exchange)
    })
    .await
    .unwrap();

    // An operator's exchange of another type and durability is used as it is too.
    let direct = unique_name("declare_direct");
    broker.owns_exchange(&direct);
    broker
        .channel
        .exchange_declare(
            direct.as_str().into(),
            handoff_amqp::lapin::ExchangeKind::Direct,
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    AmqpTransport::connect(config(&direct)).await.unwrap();
}

#[tokio::test]
async fn an_unroutable_event_is_rejected_and_the_channel_keeps_working() {
    let exchange = unique_name("unroutable");
    let mut broker = Broker::new().await;
    broker.owns_exchange(&exchange);
    let transport = AmqpTransport::connect(config(&exchange)).await.unwrap();
    broker.queue(&exchange, &exchange, "order.bound").await;

    let error = transport.publish(&event("unbound", 1)).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Rejected, "{error}");
    assert!(error.to_string().contains("unroutable"), "{error}");
    assert!(error.to_string().contains("order.unbound"), "{error}");

    transport.publish(&event("bound", 1)).await.unwrap();
    let messages = broker.drain(&exchange).await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].aggregate_id(), "bound");
}

#[tokio::test]
async fn connect_errors_tell_unreachable_from_refused_and_hide_the_password() {
    // Nothing listens on port 1.
    let error = AmqpTransport::connect(AmqpConfig {
        url: "amqp://guest:hunter2@127.0.0.1:1/%2f".into(),
        ..AmqpConfig::default()
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unreachable, "{error}");
    assert!(
        !format!("{error} {error:?}").contains("hunter2"),
        "{error:?}"
    );

    let error = AmqpTransport::connect(AmqpConfig {
        url: "amqp://guest:hunter2@127.0.0.1:5672/%2f".into(),
        ..AmqpConfig::default()
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unauthorized, "{error}");
    assert!(
        !format!("{error} {error:?}").contains("hunter2"),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("amqp://127.0.0.1:5672/%2f"),
        "{error}"
    );

    let mut no_vhost = url::Url::parse(&url()).unwrap();
    no_vhost.set_path("/no-such-vhost");
    let error = AmqpTransport::connect(AmqpConfig {
        url: no_vhost.to_string(),
        ..AmqpConfig::default()
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::Unauthorized, "{error}");

    let error = AmqpTransport::connect(AmqpConfig {
        url: "amqp://guest:hunter2@127.0.0.1:5672/%2f".into(),
        exchange: String::new(),
        ..AmqpConfig::default()
    })
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ConnectErrorKind::InvalidConfig, "{error}");
}

#[tokio::test]
async fn publishes_resume_after_the_broker_closes_the_connection() {
    let exchange = unique_name("reconnect");
    let mut broker = Broker::new().await;
    broker.owns_exchange(&exchange);
    let transport = AmqpTransport::connect(config(&exchange)).await.unwrap();
    broker.queue(&exchange, &exchange, "#").await;
    transport.publish(&event("before", 1)).await.unwrap();

    assert_eq!(close_connections_named(&exchange), 1);
    // The client learns of the close asynchronously; until then a publish may still be sent
    // on the dying channel and fail there. Either way it fails as Unavailable.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match transport.publish(&event("during", 1)).await {
            Err(error) if error.kind() == PublishErrorKind::Unavailable => break,
            other => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "still publishing: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert!(transport.wait_until_ready(Duration::from_secs(10)).await);
    transport.publish(&event("after", 1)).await.unwrap();

    // A client-side close is recovered the same way.
    transport.disconnect().await;
    let error = transport.publish(&event("closed", 1)).await.unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::Unavailable, "{error}");
    assert!(transport.wait_until_ready(Duration::from_secs(10)).await);
    transport.publish(&event("again", 1)).await.unwrap();

    let ids: Vec<String> = broker
        .drain(&exchange)
        .await
        .iter()
        .map(|m| m.aggregate_id())
        .collect();
    assert!(ids.contains(&"before".to_owned()) && ids.contains(&"after".to_owned()));
    assert!(ids.contains(&"again".to_owned()), "{ids:?}");
}
