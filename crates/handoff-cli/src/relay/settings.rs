//! What `handoff relay` runs with: [`Settings`], resolved from [`RelayArgs`] over the defaults
//! and checked, the relay's timing against the destination's publish timeout included.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::FromArgMatches;
use handoff_cdc::CdcNames;
use handoff_postgres::{OrderMode, PollingConfig, Schema};
use handoff_relay::{RelayConfig, RelayConfigError};
use sqlx::postgres::PgConnectOptions;

use super::args::{read_file, RelayArgs, SourceKind};
use crate::args::redact;
use crate::destination::{Common, Destination, DestinationArgs};

/// Everything the relay runs with, checked, but for the destination's own settings (resolved
/// with [`Settings::destination`]). Its `Debug` hides the database password.
pub(super) struct Settings {
    pub(super) database: PgConnectOptions,
    /// The URL as given, for the replication connection (which libpq opens, not sqlx).
    pub(super) database_url: String,
    /// The slot and publication, when the source is logical.
    pub(super) logical: Option<CdcNames>,
    /// The cursor, when the source is the log.
    pub(super) cursor: Option<String>,
    pub(super) destination: DestinationArgs,
    /// Time to wait for the destination's acknowledgement, unless it has a flag of its own.
    pub(super) publish_timeout: Duration,
    pub(super) ce_source: Option<String>,
    pub(super) metrics_addr: Option<SocketAddr>,
    pub(super) polling: PollingConfig,
    pub(super) relay: RelayConfig,
    // Transaction poolers.
    /// The direct connection for LISTEN, when `database` may go through a pooler.
    pub(super) listen_database: Option<PgConnectOptions>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // PgConnectOptions' own Debug prints the password.
        f.debug_struct("Settings")
            .field(
                "database_url",
                &handoff_core::redact::url(&self.database_url),
            )
            .field("logical", &self.logical)
            .field("cursor", &self.cursor)
            .field("destination", &self.destination.kind())
            .field("metrics_addr", &self.metrics_addr)
            .field("polling", &self.polling)
            .field("relay", &self.relay)
            .field("listen_database", &self.listen_database.is_some())
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// The flags (and their variables) in `matches` over the config file they name, over the
    /// defaults.
    pub(super) fn from_matches(matches: &clap::ArgMatches) -> Result<Settings> {
        let flags = RelayArgs::from_arg_matches(matches)?;
        let args = match &flags.config {
            Some(path) => {
                let mut args = read_file(path)?;
                args.update_from_arg_matches(matches)?;
                args
            }
            None => flags,
        };
        Settings::resolve(args)
    }

    fn resolve(args: RelayArgs) -> Result<Settings> {
        let Some(database_url) = args.database_url else {
            bail!(
                "no database: set --database-url, HANDOFF_DATABASE_URL or database_url in the \
                 config"
            );
        };
        let order = args.order.unwrap_or_default();
        let source_kind = args.source.unwrap_or_default();
        if order == OrderMode::Global && source_kind == SourceKind::Logical {
            bail!(
                "--order global needs --source polling: the logical source does not read the \
                 global sequence"
            );
        }
        if order == OrderMode::Global && source_kind == SourceKind::Log {
            bail!(
                "--order global needs --source polling: the log source publishes in aggregate \
                 order only"
            );
        }
        if args.cursor.is_some() && source_kind != SourceKind::Log {
            bail!("--cursor is for --source log");
        }
        let cursor = (source_kind == SourceKind::Log).then(|| {
            args.cursor
                .clone()
                .unwrap_or_else(|| handoff_postgres::DEFAULT_CURSOR.to_owned())
        });
        let logical = match source_kind {
            SourceKind::Polling | SourceKind::Log => None,
            SourceKind::Logical => Some(CdcNames::new(
                args.slot.unwrap_or_else(|| "handoff".into()),
                args.publication.unwrap_or_else(|| "handoff_outbox".into()),
            )?),
        };
        let database = handoff_postgres::connect_options(&database_url)
            .map_err(|e| anyhow::anyhow!("invalid database url: {}", redact(&e.to_string())))?;
        // `handoff-relay` in pg_stat_activity, unless the URL names the relay itself
        // (`?application_name=relay-eu-1`), which tells several relays apart there.
        let database = match database.get_application_name() {
            Some(_) => database,
            None => database.application_name("handoff-relay"),
        };
        let schema = match args.schema {
            Some(name) => Schema::named(name)?,
            None => Schema::default(),
        };
        let base = RelayConfig::default();
        let relay = RelayConfig {
            batch_size: args.batch_size.unwrap_or(base.batch_size),
            max_in_flight: args.max_in_flight.unwrap_or(base.max_in_flight),
            max_in_flight_bytes: args.max_in_flight_bytes.unwrap_or(base.max_in_flight_bytes),
            poll_interval: args.poll_interval.unwrap_or(base.poll_interval),
            mark_interval: args.mark_interval.unwrap_or(base.mark_interval),
            max_attempts: args.max_attempts.unwrap_or(base.max_attempts),
            max_retry_after: args.max_retry_after.unwrap_or(base.max_retry_after),
            order,
            ..base
        };
        let defaults = PollingConfig::default();
        let polling = PollingConfig {
            schema,
            relay_id: args
                .relay_id
                .unwrap_or_else(handoff_postgres::default_relay_id),
            lease: args.lease.unwrap_or(Duration::from_secs(30)),
            stuck_after: args.stuck_after.unwrap_or(Duration::from_secs(60)),
            query_timeout: args.query_timeout.unwrap_or(Duration::from_secs(10)),
            order,
            max_takeovers: args.max_takeovers.unwrap_or(defaults.max_takeovers),
            synchronous_commit: args
                .synchronous_commit
                .unwrap_or(defaults.synchronous_commit),
            ..defaults
        };
        polling.validate()?;
        let listen_database = args
            .listen_database_url
            .map(|url| {
                handoff_postgres::connect_options(&url)
                    .map(|options| options.application_name("handoff-relay-listen"))
                    .map_err(|e| {
                        anyhow::anyhow!("invalid listen database url: {}", redact(&e.to_string()))
                    })
            })
            .transpose()?;
        Ok(Settings {
            database,
            database_url,
            logical,
            cursor,
            destination: args.destination,
            publish_timeout: args
                .publish_timeout
                .unwrap_or(handoff_nats::JetStreamConfig::default().publish_timeout),
            ce_source: args.ce_source,
            metrics_addr: args.metrics_addr,
            polling,
            relay,
            listen_database,
        })
    }

    /// The chosen destination's settings, checked, and the relay's timing checked against the
    /// destination's publish timeout.
    pub(super) fn destination<D: Destination>(&mut self, destination: &D) -> Result<D::Config> {
        let publish_timeout = destination.publish_timeout(self.publish_timeout);
        // A publish must be able to time out and be recorded before the lease ends.
        self.relay.lease_margin = publish_timeout * 2;
        match self.relay.validate() {
            // The relay says "half the lease margin", a figure this command derives from the
            // publish timeout: say it in the flags' terms.
            Err(RelayConfigError::MarkIntervalTooLong { mark_interval, .. }) => bail!(
                "mark interval of {} is too long for a publish timeout of {}: it must be at \
                 most the timeout",
                humantime::format_duration(mark_interval),
                humantime::format_duration(publish_timeout)
            ),
            checked => checked?,
        }
        let lease = self.polling.lease;
        if lease <= self.relay.lease_margin + Duration::from_secs(1) {
            bail!(
                "lease of {} is too short for a publish timeout of {}: it must exceed twice \
                 the timeout plus 1s",
                humantime::format_duration(lease),
                humantime::format_duration(publish_timeout)
            );
        }
        destination.resolve(&Common {
            client_id: "handoff-relay".into(),
            connection_name: format!("handoff relay {}", self.polling.relay_id),
            publish_timeout,
            ce_source: self.ce_source.clone(),
            lease: Some(lease),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Args as _;

    use std::path::Path;

    use handoff_postgres::default_relay_id;

    use super::*;
    use crate::destination::Visit;
    use crate::destination::{amqp::AmqpFlags, http::HttpFlags, kafka::KafkaFlags};
    use crate::destination::{nats::NatsConfig, nats::NatsFlags, DestinationKind};

    /// A relay config file holding `text`, in a directory that lives as long as the guard.
    fn config_file(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    /// The settings `handoff relay <flags>` runs with, over `file` (a config file's text) when
    /// given: the command's own path from flags to settings.
    fn settings(flags: &[&str], file: Option<&str>) -> Result<Settings> {
        let (_dir, path) = config_file(file.unwrap_or_default());
        let config = path.to_string_lossy().into_owned();
        let mut argv = vec!["relay"];
        if file.is_some() {
            argv.extend(["--config", &config]);
        }
        argv.extend(flags);
        let matches =
            RelayArgs::augment_args(clap::Command::new("relay")).try_get_matches_from(argv)?;
        Settings::from_matches(&matches)
    }

    /// The chosen destination's settings, as the relay resolves them at start (`Debug`).
    struct Check<'a>(&'a mut Settings);

    impl Visit for Check<'_> {
        type Output = String;

        async fn visit<D: Destination>(self, destination: &D) -> Result<String> {
            Ok(format!("{:?}", self.0.destination(destination)?))
        }
    }

    async fn check(settings: &mut Settings) -> Result<String> {
        let destination = settings.destination.clone();
        destination.dispatch(Check(settings)).await
    }

    fn nats(settings: &mut Settings) -> Result<NatsConfig> {
        let flags: NatsFlags = settings.destination.nats.clone();
        settings.destination(&flags)
    }

    fn kafka(settings: &mut Settings) -> Result<handoff_kafka::KafkaConfig> {
        let flags: KafkaFlags = settings.destination.kafka.clone();
        settings.destination(&flags)
    }

    fn amqp(settings: &mut Settings) -> Result<handoff_amqp::AmqpConfig> {
        let flags: AmqpFlags = settings.destination.amqp.clone();
        settings.destination(&flags)
    }

    const DB: [&str; 2] = ["--database-url", "postgres://localhost/db"];

    #[test]
    fn defaults_resolve() {
        let mut settings = settings(&DB, None).unwrap();
        assert_eq!(settings.destination.kind(), DestinationKind::Nats);
        assert_eq!(nats(&mut settings).unwrap().jetstream.stream, "OUTBOX");
        assert_eq!(settings.polling.lease, Duration::from_secs(30));
    }

    #[test]
    fn settings_debug_shows_no_password_and_relay_ids_differ() {
        let mut settings = settings(
            &[
                "--database-url",
                "postgres://u:pgs3cret@localhost/db",
                "--nats-url",
                "nats://n:nats3cret@localhost:4222",
                "--max-takeovers",
                "3",
            ],
            None,
        )
        .unwrap();
        let shown = format!("{settings:?} {:?}", nats(&mut settings).unwrap());
        assert!(
            !shown.contains("pgs3cret") && !shown.contains("nats3cret"),
            "{shown}"
        );
        assert!(shown.contains("localhost"), "{shown}");
        assert_eq!(settings.polling.max_takeovers, 3);
        assert_ne!(settings.polling.relay_id, default_relay_id());
    }

    #[test]
    fn relay_commits_wait_for_the_flush_only_when_asked() {
        let default = settings(&DB, None).unwrap();
        assert!(!default.polling.synchronous_commit);
        let flag = settings(&[&DB[..], &["--synchronous-commit"]].concat(), None).unwrap();
        assert!(flag.polling.synchronous_commit);
        let file = Some("database_url = \"postgres://localhost/db\"\nsynchronous_commit = true\n");
        assert!(settings(&[], file).unwrap().polling.synchronous_commit);
        let overridden = settings(&["--synchronous-commit=false"], file).unwrap();
        assert!(
            !overridden.polling.synchronous_commit,
            "the flag wins over the file"
        );
    }

    #[test]
    fn a_lease_inside_the_duplicate_window_is_required() {
        let mut settings = settings(&[&DB[..], &["--lease", "10m"]].concat(), None).unwrap();
        let error = nats(&mut settings).unwrap_err().to_string();
        assert!(error.contains("duplicate window"), "{error}");
    }

    #[test]
    fn the_file_fills_what_flags_leave_open_and_flags_win() {
        let mut settings = settings(
            &["--subject-prefix", "flag"],
            Some(
                "database_url = \"postgres://localhost/db\"\nstream = \"FROM_FILE\"\n\
                 subject_prefix = \"file\"\nlease = \"40s\"\n",
            ),
        )
        .unwrap();
        let config = nats(&mut settings).unwrap().jetstream;
        assert_eq!(config.stream, "FROM_FILE");
        assert_eq!(config.subject_prefix, "flag");
        assert_eq!(settings.polling.lease, Duration::from_secs(40));
    }

    #[test]
    fn kafka_takes_brokers_and_topic_from_flags_or_the_file() {
        let mut no_brokers =
            settings(&[&DB[..], &["--destination", "kafka"]].concat(), None).unwrap();
        let error = kafka(&mut no_brokers).unwrap_err().to_string();
        assert!(error.contains("no kafka brokers"), "{error}");

        let mut settings = settings(
            &["--topic", "from_flag"],
            Some(
                "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
                 brokers = \"k1:9092,k2:9092\"\ntopic = \"from_file\"\npartitions = 3\n",
            ),
        )
        .unwrap();
        assert_eq!(settings.destination.kind(), DestinationKind::Kafka);
        let config = kafka(&mut settings).unwrap();
        assert_eq!(config.brokers, "k1:9092,k2:9092");
        assert_eq!(config.topic, "from_flag");
        assert_eq!(config.partitions, 3);
        assert_eq!(config.client_id, "handoff-relay");

        let flags = [&DB[..], &["--destination", "kafka", "--brokers", "no-port"]].concat();
        assert!(kafka(&mut self::settings(&flags, None).unwrap()).is_err());
    }

    #[test]
    fn the_http_destination_needs_an_endpoint_and_takes_its_own_timeout() {
        let mut http = settings(&[&DB[..], &["--destination", "http"]].concat(), None).unwrap();
        let flags: HttpFlags = http.destination.http.clone();
        let error = http.destination(&flags).unwrap_err().to_string();
        assert!(error.contains("--endpoint"), "{error}");
        let mut http = settings(
            &[
                &DB[..],
                &[
                    "--destination",
                    "http",
                    "--endpoint",
                    "https://hooks.example.com/in",
                ],
                &["--http-mode", "structured", "--http-timeout", "2s"],
            ]
            .concat(),
            None,
        )
        .unwrap();
        let flags: HttpFlags = http.destination.http.clone();
        let config = http.destination(&flags).unwrap();
        assert_eq!(config.mode, handoff_http::HttpMode::Structured);
        assert_eq!(config.request_timeout, Duration::from_secs(2));
        assert_eq!(config.concurrency, 64);
        assert_eq!(http.relay.lease_margin, Duration::from_secs(4));
    }

    #[test]
    fn the_amqp_destination_resolves_from_file_and_flags_and_hides_its_password() {
        let file = "database_url = \"postgres://localhost/db\"\ndestination = \"amqp\"\n\
                    url = \"amqp://relay:s3cret@rabbit:5672/%2f\"\nexchange = \"from_file\"\n";
        let mut settings = settings(&["--relay-id", "r1"], Some(file)).unwrap();
        let config = amqp(&mut settings).unwrap();
        assert_eq!(config.exchange, "from_file");
        assert_eq!(config.url, "amqp://relay:s3cret@rabbit:5672/%2f");
        assert_eq!(config.connection_name, "handoff relay r1");
        assert_eq!(config.publish_timeout, Duration::from_secs(5));
        assert!(!format!("{settings:?} {config:?}").contains("s3cret"));

        let mut flag = self::settings(&["--exchange", "flag"], Some(file)).unwrap();
        assert_eq!(amqp(&mut flag).unwrap().exchange, "flag");

        let flags = [&DB[..], &["--destination", "amqp", "--exchange", ""]].concat();
        let error = amqp(&mut self::settings(&flags, None).unwrap())
            .unwrap_err()
            .to_string();
        assert!(error.contains("exchange"), "{error}");
    }

    #[test]
    fn the_order_mode_comes_from_flag_or_file_and_global_needs_the_polling_source() {
        let settings = self::settings(&DB, None).unwrap();
        assert_eq!(settings.relay.order, OrderMode::Aggregate);
        assert_eq!(settings.polling.order, OrderMode::Aggregate);

        let file = "database_url = \"postgres://localhost/db\"\norder = \"global\"\n";
        let settings = self::settings(&[], Some(file)).unwrap();
        assert_eq!(
            (settings.relay.order, settings.polling.order),
            (OrderMode::Global, OrderMode::Global)
        );
        let settings = self::settings(&["--order", "aggregate"], Some(file)).unwrap();
        assert_eq!(settings.relay.order, OrderMode::Aggregate);

        let flags = [&DB[..], &["--order", "global", "--source", "logical"]].concat();
        let error = self::settings(&flags, None).unwrap_err().to_string();
        assert!(error.contains("--order global"), "{error}");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("bad url postgres://u:pw@h/db"),
            "bad url postgres://***@h/db"
        );
        assert_eq!(redact("no url here"), "no url here");
    }

    // NATS credentials, TLS and replicas (issue 23).
    #[test]
    fn nats_files_and_replicas_come_from_the_file_and_flags_win() {
        let file =
            "database_url = \"postgres://localhost/db\"\nnats_creds = \"/file/relay.creds\"\n\
                    nats_tls_ca = \"/file/ca.pem\"\nnats_tls_cert = \"/file/c.pem\"\n\
                    nats_tls_key = \"/file/c.key\"\nstream_replicas = 3\n";
        let mut settings = settings(&["--nats-tls-ca", "/flag/ca.pem"], Some(file)).unwrap();
        let config = nats(&mut settings).unwrap().jetstream;
        assert_eq!(config.replicas, 3);
        let security = &config.security;
        assert_eq!(
            security.creds.as_deref(),
            Some(Path::new("/file/relay.creds"))
        );
        assert_eq!(security.tls_ca.as_deref(), Some(Path::new("/flag/ca.pem")));
        assert_eq!(security.tls_key.as_deref(), Some(Path::new("/file/c.key")));
        assert_eq!(security.nkey, None);

        let mut seven = self::settings(&["--stream-replicas", "7"], Some(file)).unwrap();
        let error = nats(&mut seven).unwrap_err().to_string();
        assert!(error.contains("replicas must be 1 to 5"), "{error}");
    }

    #[tokio::test]
    async fn kafka_options_come_from_the_file_table_and_flags_win_per_key() {
        let file = "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
                    brokers = \"k1:9093\"\n\
                    [kafka]\n\
                    security.protocol = \"SASL_SSL\"\n\
                    sasl.mechanism = \"PLAIN\"\n\
                    \"sasl.username\" = \"relay\"\n\
                    sasl.password = \"fil3secret\"\n\
                    linger.ms = 5\n";
        let flags = [
            "--kafka-option",
            "sasl.mechanism=SCRAM-SHA-512",
            "--kafka-option",
            "sasl.password=fl4gsecret",
        ];
        let mut settings = settings(&flags, Some(file)).unwrap();
        let config = kafka(&mut settings).unwrap();
        let options = &config.options;
        assert_eq!(options.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(options.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
        assert_eq!(options.get("sasl.username"), Some("relay"));
        assert_eq!(options.get("sasl.password"), Some("fl4gsecret"));
        assert_eq!(options.get("linger.ms"), Some("5"));
        let shown = format!("{settings:?} {config:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("SCRAM-SHA-512"), "{shown}");

        // librdkafka's own checks run at resolve time and name the key only.
        let mut unknown = self::settings(&["--kafka-option", "no.such.key=1"], Some(file)).unwrap();
        let shown = format!("{:#}", kafka(&mut unknown).unwrap_err());
        assert!(shown.contains("\"no.such.key\""), "{shown}");
        let mut bad =
            self::settings(&["--kafka-option", "sasl.mechanism=NOPE"], Some(file)).unwrap();
        let shown = format!("{:#}", kafka(&mut bad).unwrap_err());
        assert!(shown.contains("Unsupported SASL mechanism"), "{shown}");

        // Options for a destination that takes none are a mistake, not a no-op.
        let flags = [&DB[..], &["--kafka-option", "linger.ms=5"]].concat();
        let error = check(&mut self::settings(&flags, None).unwrap())
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("--destination kafka"), "{error}");
    }

    #[test]
    fn a_reserved_or_unusable_kafka_key_in_the_file_is_refused() {
        for (table, wanted) in [
            ("acks = \"1\"", "acks=all"),
            ("ssl.ca.location = [\"a\", \"b\"]", "must be a string"),
        ] {
            let file = format!(
                "database_url = \"postgres://localhost/db\"\ndestination = \"kafka\"\n\
                 brokers = \"k1:9093\"\n[kafka]\n{table}\n"
            );
            let mut settings = settings(&[], Some(&file)).unwrap();
            let error = kafka(&mut settings).unwrap_err();
            assert!(format!("{error:#}").contains(wanted), "{error:#}");
        }
    }

    #[tokio::test]
    async fn the_amqp_tls_ca_comes_from_the_flag_or_the_file() {
        let file = "database_url = \"postgres://localhost/db\"\ndestination = \"amqp\"\n\
                    url = \"amqps://rabbit:5671/%2f\"\namqp_tls_ca = \"/etc/ca/file.pem\"\n";
        let mut settings = settings(&[], Some(file)).unwrap();
        assert_eq!(
            amqp(&mut settings).unwrap().tls_ca.as_deref(),
            Some(Path::new("/etc/ca/file.pem"))
        );
        let mut flag = self::settings(&["--amqp-tls-ca", "/etc/ca/flag.pem"], Some(file)).unwrap();
        assert_eq!(
            amqp(&mut flag).unwrap().tls_ca.as_deref(),
            Some(Path::new("/etc/ca/flag.pem"))
        );

        let flags = [&DB[..], &["--amqp-tls-ca", "/etc/ca/flag.pem"]].concat();
        assert!(check(&mut self::settings(&flags, None).unwrap())
            .await
            .is_err());
    }

    #[test]
    fn a_malformed_config_file_is_reported_without_its_text() {
        let file = "destination = \"kafka\"\n[kafka]\nsasl.password = hunter2\n";
        let error = format!("{:#}", settings(&[], Some(file)).unwrap_err());
        assert!(!error.contains("hunter2"), "{error}");
        assert!(error.contains("line 3"), "{error}");
    }

    #[test]
    fn an_unknown_key_in_the_config_file_is_refused_with_its_line() {
        let file = "database_url = \"postgres://localhost/db\"\nstraem = \"OUTBOX\"\n";
        let error = format!("{:#}", settings(&[], Some(file)).unwrap_err());
        assert!(error.contains("unknown key `straem`"), "{error}");
        assert!(error.contains("line 2"), "{error}");
        // Flags that are not settings are not keys either.
        let file = "database_url = \"postgres://localhost/db\"\nconfig = \"other.toml\"\n";
        assert!(settings(&[], Some(file)).is_err());
        let file = "database_url = \"postgres://localhost/db\"\nkafka_option = \"a=b\"\n";
        assert!(settings(&[], Some(file)).is_err());
    }

    #[tokio::test]
    async fn every_destination_is_dispatched_by_its_name() {
        for (flags, wanted) in [
            (&["--destination", "nats"][..], "Nats"),
            (
                &["--destination", "kafka", "--brokers", "k:9092"][..],
                "KafkaConfig",
            ),
            (&["--destination", "amqp"][..], "AmqpConfig"),
            (
                &["--destination", "http", "--endpoint", "http://h/in"][..],
                "HttpConfig",
            ),
        ] {
            let mut settings = settings(&[&DB[..], flags].concat(), None).unwrap();
            let shown = check(&mut settings).await.unwrap();
            assert!(shown.starts_with(wanted), "{flags:?}: {shown}");
        }
    }
}
