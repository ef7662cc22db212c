//! The `--destination` a reference consumer takes its events from: each broker's flags
//! ([`BrokerArgs`]) and one arm per destination that has an intake, each subscribing, offering
//! its readiness probe and consuming. A new destination with an intake adds its flags and its
//! arm here, and nowhere else in the reference consumers.

use std::io::Write;
use std::time::Duration;

use handoff_consumer::{Consumer, Handler};
use handoff_core::destination::DestinationKind;
use handoff_core::intake::Intake;
use handoff_nats::JetStreamIntake;
use handoff_telemetry::endpoint::NotReady;
use tracing::info;

use super::observe::{offer_broker_probe, READY_TIMEOUT};
use super::{CommonArgs, RunError, AGGREGATE_TYPE};

/// `--destination` and each broker's flags, flattened into [`CommonArgs`]. Each also comes from the
/// environment variable named in its help.
#[derive(clap::Args, Debug, Clone)]
pub struct BrokerArgs {
    /// The destination the relay publishes to, consumed here.
    ///
    /// `nats` (--nats-url, --stream, --subject-prefix), `kafka` (--kafka-brokers, --topic; the
    /// consumer name is the group), `amqp` (--amqp-url, --exchange; --queue, by default the
    /// consumer name, declared bound to `order.*`) or `redis` (--redis-url, --redis-stream;
    /// the consumer name is the consumer group). Named as the relay's flag.
    #[arg(long, alias = "broker", env = "HANDOFF_DESTINATION", value_enum,
        default_value_t = DestinationKind::Nats, help_heading = "Destination")]
    pub destination: DestinationKind,
    /// Kafka bootstrap brokers, HOST:PORT[,HOST:PORT...].
    ///
    /// With --destination kafka.
    #[arg(
        long,
        alias = "brokers",
        env = "HANDOFF_KAFKA_BROKERS",
        default_value = "127.0.0.1:9092",
        value_name = "HOST:PORT,...",
        help_heading = "Kafka"
    )]
    pub kafka_brokers: String,
    /// Kafka topic the relay produces to (with --destination kafka).
    #[arg(
        long,
        env = "HANDOFF_TOPIC",
        default_value = "outbox",
        help_heading = "Kafka"
    )]
    pub topic: String,
    /// AMQP broker URL (with --destination amqp); the password is never logged.
    #[arg(
        long,
        env = "HANDOFF_AMQP_URL",
        default_value = "amqp://127.0.0.1:5672/%2f",
        hide_env_values = true,
        value_name = "URL",
        help_heading = "AMQP"
    )]
    pub amqp_url: String,
    /// The relay's AMQP exchange (with --destination amqp).
    #[arg(
        long,
        env = "HANDOFF_EXCHANGE",
        default_value = "outbox",
        help_heading = "AMQP"
    )]
    pub exchange: String,
    /// The AMQP queue to consume [default: the consumer name].
    ///
    /// With --destination amqp; declared bound to the exchange with `order.*`. Another name lets two deployments that share a
    /// broker (such as a demo run next to a real consumer) keep their queues apart.
    #[arg(long, env = "HANDOFF_QUEUE", help_heading = "AMQP")]
    pub queue: Option<String>,
    /// Redis URL (with --destination redis); the password is never logged.
    #[arg(
        long,
        env = "HANDOFF_REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true,
        value_name = "URL",
        help_heading = "Redis"
    )]
    pub redis_url: String,
    /// The Redis stream the relay appends to.
    ///
    /// With --destination redis; the consumer reads it through a consumer group named after
    /// the consumer, created when missing.
    #[arg(long, env = "HANDOFF_REDIS_STREAM", default_value = handoff_redis::DEFAULT_STREAM,
        value_name = "KEY", help_heading = "Redis")]
    pub redis_stream: String,
    /// NATS URL.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true,
        value_name = "URL",
        help_heading = "NATS"
    )]
    pub nats_url: String,
    /// JetStream stream the relay publishes into; created when missing.
    #[arg(
        long,
        env = "HANDOFF_STREAM",
        default_value = "OUTBOX",
        help_heading = "NATS"
    )]
    pub stream: String,
    /// The relay's subject prefix: order events arrive on PREFIX.order.ORDER_ID.
    #[arg(
        long,
        env = "HANDOFF_SUBJECT_PREFIX",
        default_value = "outbox",
        value_name = "PREFIX",
        help_heading = "NATS"
    )]
    pub subject_prefix: String,
    /// How often the NATS client pings the server.
    ///
    /// A connection that leaves two pings in a row unanswered is dropped and reconnected, so a
    /// silent one is found within about three intervals (e.g. 10s).
    #[arg(long, env = "HANDOFF_NATS_PING_INTERVAL", default_value = "10s",
        value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = "NATS")]
    pub nats_ping_interval: Duration,
    // NATS credentials and TLS (issue 23).
    /// `--nats-creds`, `--nats-nkey`, `--nats-tls-ca`, `--nats-tls-cert`, `--nats-tls-key`.
    #[command(flatten, next_help_heading = "NATS")]
    pub nats_security: handoff_nats::NatsSecurityArgs,
    // Kafka options and AMQP over TLS (issue 23).
    /// A librdkafka setting, KEY=VALUE (repeatable).
    ///
    /// With --destination kafka: such as security.protocol=SASL_SSL or
    /// sasl.mechanism=SCRAM-SHA-512. Secret values (passwords, secrets, private keys) are never
    /// logged; flags show in process listings.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE",
        value_parser = handoff_kafka::KafkaOptionParser, help_heading = "Kafka")]
    pub kafka_option: Vec<handoff_kafka::KafkaOption>,
    /// CA certificate (PEM) for an amqps:// URL.
    ///
    /// With an amqps:// --amqp-url: a CA certificate file (PEM) trusted besides the public
    /// roots, for a broker whose certificate a private CA signed.
    #[arg(
        long,
        env = "HANDOFF_AMQP_TLS_CA",
        value_name = "FILE",
        help_heading = "AMQP"
    )]
    pub amqp_tls_ca: Option<std::path::PathBuf>,
}

/// Subscribes at `args.from.destination` and runs `consumer` over it until SIGTERM or SIGINT.
pub(super) async fn consume<H: Handler>(
    args: &CommonArgs,
    consumer: &Consumer<H>,
) -> Result<(), RunError> {
    match args.from.destination {
        DestinationKind::Nats => {
            let intake_config = args.intake_config();
            let filter = intake_config.filter();
            let intake = JetStreamIntake::connect(&args.from.nats_url, intake_config).await?;
            let client = intake.client().clone();
            offer_broker_probe(move || {
                let client = client.clone();
                async move { nats_ready(&client).await }
            });
            info!(stream = %args.from.stream, consumer = %args.consumer_name, %filter, "consuming");
            run(consumer, intake, &args.from.stream, &args.consumer_name).await
        }
        DestinationKind::Kafka => {
            let intake_config = handoff_kafka::IntakeConfig {
                brokers: args.from.kafka_brokers.clone(),
                topic: args.from.topic.clone(),
                group_id: args.consumer_name.clone(),
                redeliver_after: args.ack_wait,
                options: args.from.kafka_option.iter().cloned().collect(),
                ..handoff_kafka::IntakeConfig::default()
            };
            let intake = handoff_kafka::KafkaIntake::connect(intake_config)
                .await
                .map_err(|e| RunError::Broker(e.to_string()))?;
            let brokers = args.from.kafka_brokers.clone();
            offer_broker_probe(move || tcp_ready(brokers.clone()));
            let options: Vec<&str> = args.from.kafka_option.iter().map(|o| o.key()).collect();
            info!(topic = %args.from.topic, group = %args.consumer_name, ?options, "consuming");
            run(consumer, intake, &args.from.topic, &args.consumer_name).await
        }
        DestinationKind::Amqp => {
            let queue = args.amqp_queue();
            let intake_config = handoff_amqp::IntakeConfig {
                url: args.from.amqp_url.clone(),
                queue: queue.to_owned(),
                tls_ca: args.from.amqp_tls_ca.clone(),
                ..handoff_amqp::IntakeConfig::default()
            };
            let declaration = handoff_amqp::QueueDeclaration {
                exchange: args.from.exchange.clone(),
                binding_key: format!("{AGGREGATE_TYPE}.*"),
                quorum: true,
                single_active_consumer: true,
            };
            let broker = |e: handoff_amqp::ConnectError| RunError::Broker(e.to_string());
            handoff_amqp::AmqpIntake::declare_queue(&intake_config, &declaration)
                .await
                .map_err(broker)?;
            let intake = handoff_amqp::AmqpIntake::connect(intake_config)
                .await
                .map_err(broker)?;
            let address = amqp_address(&args.from.amqp_url);
            offer_broker_probe(move || tcp_ready(address.clone()));
            info!(exchange = %args.from.exchange, %queue, "consuming");
            run(consumer, intake, queue, &args.consumer_name).await
        }
        DestinationKind::Redis => {
            let intake_config = handoff_redis::IntakeConfig {
                url: args.from.redis_url.clone(),
                stream: args.from.redis_stream.clone(),
                group: args.consumer_name.clone(),
                consumer: args.consumer_name.clone(),
                claim_idle: args.ack_wait,
                ..handoff_redis::IntakeConfig::default()
            };
            let intake = handoff_redis::RedisIntake::connect(intake_config)
                .await
                .map_err(|e| RunError::Broker(e.to_string()))?;
            let address = redis_address(&args.from.redis_url);
            offer_broker_probe(move || tcp_ready(address.clone()));
            info!(stream = %args.from.redis_stream, group = %args.consumer_name, "consuming");
            run(
                consumer,
                intake,
                &args.from.redis_stream,
                &args.consumer_name,
            )
            .await
        }
        DestinationKind::Http => Err(RunError::Broker(
            "an HTTP endpoint has no intake: it pushes each event to its receiver (see \
             examples/webhook-receiver)"
                .to_owned(),
        )),
    }
}

/// Announces readiness on stdout and runs `consumer` over `intake` until SIGTERM or SIGINT.
async fn run<H: Handler, I: Intake>(
    consumer: &Consumer<H>,
    intake: I,
    from: &str,
    name: &str,
) -> Result<(), RunError> {
    // Installed before the ready line, so a signal sent as soon as it is read stops the
    // consumer gracefully instead of killing it.
    let shutdown = shutdown_signal()?;
    // The one line on stdout: scripts and tests wait for it to know the consumer is ready.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "consuming {from} as {name}")
        .and_then(|()| stdout.flush())
        .map_err(|source| RunError::Io {
            context: "while writing the ready line",
            source,
        })?;
    drop(stdout);

    consumer.run(intake, shutdown).await;
    info!("consumer stopped");
    Ok(())
}

/// A future that completes on SIGTERM or SIGINT, with its handlers installed now.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()> + Send, RunError> {
    use tokio::signal::unix::{signal, SignalKind};
    let io = |source| RunError::Io {
        context: "while installing signal handlers",
        source,
    };
    let mut term = signal(SignalKind::terminate()).map_err(io)?;
    let mut int = signal(SignalKind::interrupt()).map_err(io)?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM received; stopping"),
            _ = int.recv() => info!("SIGINT received; stopping"),
        }
    })
}

/// NATS is ready when the client is connected and the server answers a ping (a flush).
async fn nats_ready(client: &async_nats::Client) -> Result<(), NotReady> {
    let state = client.connection_state();
    if state != async_nats::connection::State::Connected {
        return Err(NotReady::new(format!("broker unreachable: NATS {state}")));
    }
    match tokio::time::timeout(READY_TIMEOUT, client.flush()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(NotReady::new(format!("broker unreachable: NATS {error}"))),
        Err(_) => Err(NotReady::new(format!(
            "broker unreachable: NATS did not answer within {READY_TIMEOUT:?}"
        ))),
    }
}

/// Kafka, RabbitMQ and Redis: ready when one of `addresses` (`HOST:PORT[,HOST:PORT...]`) accepts a
/// TCP connection. Their clients reconnect by themselves and expose no connection state to
/// ask, so reachability is what can be checked cheaply.
async fn tcp_ready(addresses: String) -> Result<(), NotReady> {
    let mut last = String::from("no address");
    for address in addresses
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
    {
        match tokio::time::timeout(READY_TIMEOUT, tokio::net::TcpStream::connect(address)).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(error)) => last = format!("{address}: {error}"),
            Err(_) => last = format!("{address}: no answer within {READY_TIMEOUT:?}"),
        }
    }
    Err(NotReady::new(format!("broker unreachable: {last}")))
}

/// `HOST:PORT` of an AMQP URL (5672, or 5671 for amqps), without its credentials.
fn amqp_address(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) => {
            let port = parsed.port().unwrap_or(if parsed.scheme() == "amqps" {
                5671
            } else {
                5672
            });
            format!("{}:{port}", parsed.host_str().unwrap_or("127.0.0.1"))
        }
        Err(_) => String::new(),
    }
}

/// `HOST:PORT` of a Redis URL (6379 by default), without its credentials.
fn redis_address(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) => format!(
            "{}:{}",
            parsed.host_str().unwrap_or("127.0.0.1"),
            parsed.port().unwrap_or(6379)
        ),
        Err(_) => String::new(),
    }
}
