//! [`KafkaOptions`]: librdkafka settings an operator passes through (`--kafka-option KEY=VALUE`,
//! a `[kafka]` table in the relay's file), for security (TLS, SASL) and tuning.
//!
//! handoff sets the client settings its guarantees rest on itself (`acks=all`, idempotence,
//! manual offset commits, the bootstrap list, the publish timeout); those keys are refused here
//! with a message that says which flag sets them. Every other key goes to librdkafka as it is,
//! and librdkafka's own checks run when the configuration is validated, so an unknown key or a
//! value it refuses ends the start with the key named. Values of secret keys (passwords,
//! secrets, private keys, OAUTHBEARER configuration) never appear in `Debug` output or error
//! messages.

use std::collections::BTreeMap;
use std::str::FromStr;

use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::KafkaError;
use rdkafka::producer::BaseProducer;
use rdkafka::types::RDKafkaConfRes;

/// What stands in for a secret value in `Debug` output.
const HIDDEN: &str = "***";

/// Keys handoff sets itself, and why an operator may not: the flag or rule that sets them.
const RESERVED: &[(&str, &str)] = &[
    ("bootstrap.servers", "set the brokers with --brokers"),
    ("metadata.broker.list", "set the brokers with --brokers"),
    (
        "acks",
        "handoff produces with acks=all, which at-least-once delivery needs",
    ),
    (
        "request.required.acks",
        "handoff produces with acks=all, which at-least-once delivery needs",
    ),
    (
        "enable.idempotence",
        "handoff's producer is idempotent, so its own retries never duplicate or reorder",
    ),
    ("message.timeout.ms", "set it with --publish-timeout"),
    ("delivery.timeout.ms", "set it with --publish-timeout"),
    (
        "partitioner",
        "handoff keys by aggregate id with the Java client's hash (murmur2_random)",
    ),
    ("group.id", "the consumer group is the consumer's name"),
    (
        "enable.auto.commit",
        "handoff commits offsets only up to what the consumer settled",
    ),
    (
        "enable.auto.offset.store",
        "handoff commits offsets only up to what the consumer settled",
    ),
    ("enable.partition.eof", "handoff's topic reader sets it"),
];

/// Whether the value of `key` is a secret: a password, a secret, a passphrase, a private key,
/// or OAUTHBEARER's configuration and extensions (which may carry tokens). Compared without
/// regard to case.
///
/// # Examples
///
/// ```
/// use handoff_kafka::is_secret_option;
///
/// assert!(is_secret_option("sasl.password"));
/// assert!(is_secret_option("sasl.oauthbearer.client.secret"));
/// assert!(is_secret_option("ssl.key.pem"));
/// assert!(!is_secret_option("sasl.username"));
/// assert!(!is_secret_option("ssl.ca.location"));
/// ```
pub fn is_secret_option(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.contains("password")
        || key.contains("secret")
        || key.contains("passphrase")
        || key.contains("private.key")
        || key.ends_with("key.pem")
        || key == "ssl_key"
        || key.starts_with("sasl.oauthbearer.config")
        || key.starts_with("sasl.oauthbearer.extensions")
}

/// Why a Kafka option is unusable. No message ever holds an option's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OptionError {
    /// The text is not `KEY=VALUE`.
    #[error("a kafka option is KEY=VALUE, and this one has no '='")]
    NoEquals,
    /// The key is empty or holds characters no librdkafka key has.
    #[error("invalid kafka option key {key:?}: a key is non-empty, without spaces or '='")]
    InvalidKey {
        /// The key as given (never a value).
        key: String,
    },
    /// The key is one handoff sets itself.
    #[error("kafka option {key:?} is set by handoff and cannot be overridden: {reason}")]
    Reserved {
        /// The key.
        key: String,
        /// Why, and which flag sets it instead.
        reason: &'static str,
    },
    /// librdkafka refused to make a client from the options together (a SASL mechanism this
    /// build lacks, an `ssl.*` file it cannot read or parse).
    #[error("librdkafka refused the kafka options: {reason}")]
    Unusable {
        /// librdkafka's reason (it names settings and files, not secret values).
        reason: String,
    },
    /// librdkafka refused the key or its value.
    #[error("kafka option {key:?} was refused by librdkafka: {reason}")]
    Refused {
        /// The key.
        key: String,
        /// librdkafka's reason; for a secret key only whether the key or the value is wrong.
        reason: String,
    },
}

/// One `KEY=VALUE` librdkafka setting, as `--kafka-option` takes it. Its `Debug` hides the
/// value of a [secret key](is_secret_option).
///
/// # Examples
///
/// ```
/// use handoff_kafka::KafkaOption;
///
/// let option: KafkaOption = "sasl.password=hunter2".parse().unwrap();
/// assert_eq!(option.key(), "sasl.password");
/// assert!(!format!("{option:?}").contains("hunter2"));
/// assert!("no-equals-sign".parse::<KafkaOption>().is_err());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaOption {
    key: String,
    value: String,
}

impl KafkaOption {
    /// The option `key` = `value`.
    ///
    /// # Errors
    ///
    /// [`OptionError::InvalidKey`] for an empty key or one with whitespace, `=` or control
    /// characters; [`OptionError::Reserved`] for a key handoff sets itself.
    pub fn new(key: impl Into<String>, value: impl Into<String>) -> Result<Self, OptionError> {
        let key = key.into();
        check_key(&key)?;
        Ok(Self {
            key,
            value: value.into(),
        })
    }

    /// The librdkafka key, such as `security.protocol`.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The value, as librdkafka receives it. May be a secret: never log it.
    pub fn value(&self) -> &str {
        &self.value
    }
}

impl std::fmt::Debug for KafkaOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = if is_secret_option(&self.key) {
            HIDDEN
        } else {
            &self.value
        };
        write!(f, "{}={value:?}", self.key)
    }
}

impl FromStr for KafkaOption {
    type Err = OptionError;

    /// Splits at the first `=`: the key is before it, the value (which may hold `=`) after.
    fn from_str(text: &str) -> Result<Self, OptionError> {
        let (key, value) = text.split_once('=').ok_or(OptionError::NoEquals)?;
        Self::new(key.trim(), value)
    }
}

fn check_key(key: &str) -> Result<(), OptionError> {
    if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic() && b != b'=') {
        return Err(OptionError::InvalidKey {
            // A key with a space in it may be a whole `KEY VALUE` pasted in: keep it out.
            key: if key.contains(char::is_whitespace) {
                "<not shown>".to_owned()
            } else {
                key.to_owned()
            },
        });
    }
    let lower = key.to_ascii_lowercase();
    if let Some((_, reason)) = RESERVED.iter().find(|(reserved, _)| *reserved == lower) {
        return Err(OptionError::Reserved {
            key: key.to_owned(),
            reason,
        });
    }
    Ok(())
}

/// librdkafka settings applied to every client handoff opens for one destination (producer,
/// admin, consumer), after handoff's own. A later [`set`](Self::set) of a key replaces the
/// earlier value, so a caller merging a file and flags sets the file's first. The `Debug`
/// output hides the values of [secret keys](is_secret_option).
///
/// # Examples
///
/// ```
/// use handoff_kafka::KafkaOptions;
///
/// let mut options = KafkaOptions::default();
/// options.set("security.protocol", "SASL_SSL")?;
/// options.set("sasl.mechanism", "SCRAM-SHA-512")?;
/// options.set("sasl.username", "relay")?;
/// options.set("sasl.password", "hunter2")?;
/// options.validate()?;
/// assert!(!format!("{options:?}").contains("hunter2"));
/// assert!(options.set("acks", "1").is_err(), "handoff's guarantees need acks=all");
/// # Ok::<(), handoff_kafka::OptionError>(())
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KafkaOptions {
    options: BTreeMap<String, String>,
}

impl KafkaOptions {
    /// Sets `key` to `value`, replacing an earlier value of the key.
    ///
    /// # Errors
    ///
    /// As [`KafkaOption::new`]; librdkafka's own checks run in [`validate`](Self::validate).
    pub fn set(
        &mut self,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<&mut Self, OptionError> {
        let option = KafkaOption::new(key, value)?;
        self.insert(option);
        Ok(self)
    }

    /// Sets one parsed option, replacing an earlier value of its key.
    pub fn insert(&mut self, option: KafkaOption) -> &mut Self {
        self.options.insert(option.key, option.value);
        self
    }

    /// The value of `key`, if set. May be a secret: never log it.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.options.get(key).map(String::as_str)
    }

    /// Whether no option is set.
    pub fn is_empty(&self) -> bool {
        self.options.is_empty()
    }

    /// The keys set, in order (values left out, so the result may be logged).
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.options.keys().map(String::as_str)
    }

    /// Runs librdkafka's own checks: every key must be a librdkafka property this build
    /// supports, and every value one it accepts (a SASL mechanism this build has, a known
    /// `security.protocol`, a number where a number goes). Files named by `ssl.*.location` are
    /// read only when a client is created.
    ///
    /// # Errors
    ///
    /// [`OptionError::Refused`] naming the first key refused; for a secret key the message
    /// says only whether librdkafka does not know the key or refuses the value.
    pub fn validate(&self) -> Result<(), OptionError> {
        let mut config = ClientConfig::new();
        self.apply(&mut config);
        config.create_native_config().map_err(refused_option)?;
        if self.is_empty() {
            return Ok(());
        }
        // Some values are only checked when a client is made from them (the SASL mechanism,
        // the files and PEM texts of `ssl.*`): make one, with no brokers so it connects
        // nowhere, and silent, since it would only warn that it has no brokers.
        config.set_log_level(RDKafkaLogLevel::Emerg);
        config
            .create::<BaseProducer>()
            .map(drop)
            .map_err(|error| match error {
                KafkaError::ClientCreation(reason) => OptionError::Unusable { reason },
                other => refused_option(other),
            })
    }

    /// Copies every option into `config`, over what is already set there.
    pub(crate) fn apply(&self, config: &mut ClientConfig) {
        for (key, value) in &self.options {
            config.set(key, value);
        }
        // librdkafka's `debug` contexts log at debug level; without this its log lines at
        // that level are dropped before they reach `tracing`.
        if self.options.contains_key("debug") {
            config.set_log_level(RDKafkaLogLevel::Debug);
        }
    }
}

impl std::fmt::Debug for KafkaOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut map = f.debug_map();
        for (key, value) in &self.options {
            let shown = if is_secret_option(key) { HIDDEN } else { value };
            map.entry(key, &shown);
        }
        map.finish()
    }
}

impl FromIterator<KafkaOption> for KafkaOptions {
    fn from_iter<I: IntoIterator<Item = KafkaOption>>(options: I) -> Self {
        let mut all = Self::default();
        for option in options {
            all.insert(option);
        }
        all
    }
}

/// A librdkafka configuration error without the value rdkafka's own message carries.
pub(crate) fn refused_option(error: KafkaError) -> OptionError {
    match error {
        KafkaError::ClientConfig(result, description, key, _value) => {
            let reason = match result {
                RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN => "no such configuration property".into(),
                _ if is_secret_option(&key) => "invalid value".into(),
                _ => description,
            };
            OptionError::Refused { key, reason }
        }
        other => OptionError::Refused {
            key: "?".into(),
            reason: other.to_string(),
        },
    }
}

/// The features this build of librdkafka has (its `builtin.features`), such as `ssl`,
/// `sasl_plain`, `sasl_scram`, `sasl_oauthbearer`, `oidc`, `gzip`.
///
/// # Examples
///
/// ```
/// let features = handoff_kafka::librdkafka_features();
/// assert!(features.iter().any(|f| f == "ssl"));
/// assert!(features.iter().any(|f| f == "sasl_scram"));
/// assert!(features.iter().any(|f| f == "oidc"));
/// ```
pub fn librdkafka_features() -> Vec<String> {
    ClientConfig::new()
        .create_native_config()
        .and_then(|config| config.get("builtin.features"))
        .map(|features| features.split(',').map(str::to_owned).collect())
        .unwrap_or_default()
}

#[cfg(feature = "clap")]
mod clap_parser {
    use super::KafkaOption;

    /// Parses `--kafka-option KEY=VALUE` without the value in any error (clap's own messages
    /// quote the whole argument, which may hold a password).
    #[derive(Clone, Copy, Debug, Default)]
    pub struct KafkaOptionParser;

    impl clap::builder::TypedValueParser for KafkaOptionParser {
        type Value = KafkaOption;

        fn parse_ref(
            &self,
            _cmd: &clap::Command,
            arg: Option<&clap::Arg>,
            value: &std::ffi::OsStr,
        ) -> Result<KafkaOption, clap::Error> {
            let name = arg
                .and_then(|a| a.get_long())
                .map_or_else(|| "kafka-option".to_owned(), |long| format!("--{long}"));
            let text = value.to_str().ok_or_else(|| {
                clap::Error::raw(
                    clap::error::ErrorKind::InvalidUtf8,
                    format!("{name} is not UTF-8\n"),
                )
            })?;
            text.parse().map_err(|error| {
                clap::Error::raw(
                    clap::error::ErrorKind::ValueValidation,
                    format!("invalid {name}: {error}\n"),
                )
            })
        }
    }
}

#[cfg(feature = "clap")]
#[cfg_attr(docsrs, doc(cfg(feature = "clap")))]
pub use clap_parser::KafkaOptionParser;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_at_the_first_equals_sign() {
        let option: KafkaOption = "sasl.oauthbearer.config=principal=relay scope=a"
            .parse()
            .unwrap();
        assert_eq!(option.key(), "sasl.oauthbearer.config");
        assert_eq!(option.value(), "principal=relay scope=a");
        let empty: KafkaOption = "client.rack=".parse().unwrap();
        assert_eq!(empty.value(), "");
    }

    #[test]
    fn malformed_options_are_typed_errors_without_the_value() {
        assert_eq!(
            "sasl.password:hunter2".parse::<KafkaOption>(),
            Err(OptionError::NoEquals)
        );
        assert!(matches!(
            "=x".parse::<KafkaOption>(),
            Err(OptionError::InvalidKey { .. })
        ));
        let error = "sasl password hunter2=x"
            .parse::<KafkaOption>()
            .unwrap_err();
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }

    #[test]
    fn reserved_keys_say_which_flag_sets_them() {
        for key in [
            "acks",
            "ACKS",
            "enable.idempotence",
            "bootstrap.servers",
            "group.id",
        ] {
            let error = KafkaOptions::default().set(key, "x").map(drop).unwrap_err();
            assert!(matches!(error, OptionError::Reserved { .. }), "{key}");
        }
        let error = "message.timeout.ms=1".parse::<KafkaOption>().unwrap_err();
        assert!(error.to_string().contains("--publish-timeout"), "{error}");
    }

    #[test]
    fn secret_values_never_show_in_debug() {
        let mut options = KafkaOptions::default();
        for key in [
            "sasl.password",
            "sasl.oauthbearer.client.secret",
            "ssl.key.password",
            "ssl.key.pem",
            "ssl.keystore.password",
            "sasl.oauthbearer.config",
            "some.future.secret.thing",
            "Some.PASSWORD",
        ] {
            options.set(key, "hunter2").unwrap();
        }
        options.set("sasl.username", "relay").unwrap();
        let shown = format!("{options:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains(r#""sasl.username": "relay""#), "{shown}");
        assert!(shown.contains(r#""sasl.password": "***""#), "{shown}");
    }

    #[test]
    fn librdkafka_refuses_unknown_keys_and_bad_values_naming_the_key_only() {
        let mut options = KafkaOptions::default();
        options.set("no.such.property", "1").unwrap();
        let error = options.validate().unwrap_err();
        assert_eq!(
            error,
            OptionError::Refused {
                key: "no.such.property".into(),
                reason: "no such configuration property".into()
            }
        );

        let mut options = KafkaOptions::default();
        options.set("security.protocol", "CARRIER_PIGEON").unwrap();
        let error = options.validate().unwrap_err().to_string();
        assert!(error.contains("security.protocol"), "{error}");

        // A secret key's refused value stays out of the message, whatever librdkafka says.
        let mut options = KafkaOptions::default();
        options.set("ssl.key.password", "hunter2").unwrap();
        options.validate().unwrap();
        let error = refused_option(KafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
            "Invalid value \"hunter2\" for configuration property \"ssl.key.password\"".into(),
            "ssl.key.password".into(),
            "hunter2".into(),
        ));
        for shown in [error.to_string(), format!("{error:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("ssl.key.password"), "{shown}");
        }
    }

    #[test]
    fn this_build_has_tls_every_sasl_mechanism_but_gssapi_and_oidc() {
        let features = librdkafka_features();
        for wanted in [
            "ssl",
            "sasl",
            "sasl_plain",
            "sasl_scram",
            "sasl_oauthbearer",
            "http",
            "oidc",
        ] {
            assert!(
                features.iter().any(|f| f == wanted),
                "{wanted}: {features:?}"
            );
        }
        let mut options = KafkaOptions::default();
        for (key, value) in [
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "relay"),
            ("sasl.password", "hunter2"),
            ("ssl.endpoint.identification.algorithm", "https"),
        ] {
            options.set(key, value).unwrap();
        }
        options.validate().unwrap();
        for mechanism in ["PLAIN", "SCRAM-SHA-256"] {
            options.set("sasl.mechanism", mechanism).unwrap();
            options.validate().unwrap();
        }
        // OAUTHBEARER with librdkafka's own OIDC token fetch (client credentials), which needs
        // the libcurl this build links.
        let mut oauth = KafkaOptions::default();
        for (key, value) in [
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "OAUTHBEARER"),
            ("sasl.oauthbearer.method", "oidc"),
            ("sasl.oauthbearer.client.id", "relay"),
            ("sasl.oauthbearer.client.secret", "hunter2"),
            (
                "sasl.oauthbearer.token.endpoint.url",
                "https://login.example.com/oauth2/token",
            ),
            ("sasl.oauthbearer.scope", "kafka"),
        ] {
            oauth.set(key, value).unwrap();
        }
        oauth.validate().unwrap();
        assert!(!format!("{oauth:?}").contains("hunter2"));
    }
}
