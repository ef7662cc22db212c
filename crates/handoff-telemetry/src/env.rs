//! One environment variable per setting across the handoff binaries: each setting's variable is
//! `HANDOFF_<FLAG>`, and the names older releases read (`DATABASE_URL`, `NATS_URL`,
//! `AMQP_URL`, ...) are still read when the `HANDOFF_` one is not set. [`with_fallbacks`]
//! applies [`FALLBACKS`] to a binary's `clap::Command` before it parses; nothing is written to
//! the environment, so the child processes a binary starts see the variables it was given.

/// `(variable, older name read when the variable is not set)`. Names are a public contract:
/// a row is never removed.
pub const FALLBACKS: &[(&str, &str)] = &[
    ("HANDOFF_DATABASE_URL", "DATABASE_URL"),
    ("HANDOFF_NATS_URL", "NATS_URL"),
    ("HANDOFF_NATS_CREDS", "NATS_CREDS"),
    ("HANDOFF_NATS_NKEY", "NATS_NKEY"),
    ("HANDOFF_NATS_TLS_CA", "NATS_TLS_CA"),
    ("HANDOFF_NATS_TLS_CERT", "NATS_TLS_CERT"),
    ("HANDOFF_NATS_TLS_KEY", "NATS_TLS_KEY"),
    ("HANDOFF_AMQP_URL", "AMQP_URL"),
    ("HANDOFF_AMQP_TLS_CA", "AMQP_TLS_CA"),
    ("HANDOFF_REDIS_URL", "REDIS_URL"),
    ("HANDOFF_REDIS_STREAM", "REDIS_STREAM"),
    ("HANDOFF_KAFKA_BROKERS", "HANDOFF_BROKERS"),
    ("HANDOFF_DESTINATION", "HANDOFF_BROKER"),
];

/// `(flag, older spelling kept as a hidden alias)`, across the binaries: only the first may
/// show in any binary's help (tests hold every binary to it). A row is never removed.
pub const FLAG_ALIASES: &[(&str, &str)] = &[
    ("--destination", "--broker"),
    ("--amqp-url", "--url"),
    ("--kafka-brokers", "--brokers"),
    ("--consumer-name", "--consumer"),
];

/// The older name of `variable`, if it has one.
pub fn fallback(variable: &str) -> Option<&'static str> {
    FALLBACKS
        .iter()
        .find(|(name, _)| *name == variable)
        .map(|&(_, old)| old)
}

/// The value of `variable`, or of its older name when `variable` is not set: for a binary that
/// reads a variable itself rather than through a clap argument.
pub fn var(variable: &str) -> Option<String> {
    std::env::var(variable)
        .ok()
        .or_else(|| fallback(variable).and_then(|old| std::env::var(old).ok()))
}

/// `command` (and its subcommands) reading each argument's older variable where its
/// `HANDOFF_` variable is not set and the older one is: the `HANDOFF_` one wins when both are.
pub fn with_fallbacks(command: clap::Command) -> clap::Command {
    apply(command, &|name| std::env::var_os(name).is_some())
}

fn apply(command: clap::Command, is_set: &dyn Fn(&str) -> bool) -> clap::Command {
    let mut command = command.mut_args(|arg| {
        let old = arg
            .get_env()
            .and_then(|env| env.to_str())
            .filter(|env| !is_set(env))
            .and_then(fallback)
            .filter(|old| is_set(old));
        match old {
            Some(old) => arg.env(old),
            None => arg,
        }
    });
    let names: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_owned())
        .collect();
    for name in names {
        command = command.mut_subcommand(name, |sub| apply(sub, is_set));
    }
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(set: &[(&str, &str)]) -> Option<String> {
        let command = clap::Command::new("t").subcommand(
            clap::Command::new("sub").arg(
                clap::Arg::new("url")
                    .long("database-url")
                    .env("HANDOFF_DATABASE_URL"),
            ),
        );
        let command = apply(command, &|name| set.iter().any(|(n, _)| *n == name));
        // The environment stays untouched: the values are given as the parsed environment
        // would give them, through the variable the argument now reads.
        let sub = command.find_subcommand("sub").unwrap();
        let arg = sub.get_arguments().next().unwrap();
        let env = arg.get_env()?.to_str()?.to_owned();
        set.iter()
            .find(|(name, _)| *name == env)
            .map(|(_, value)| (*value).to_owned())
    }

    #[test]
    fn the_handoff_variable_wins_over_the_older_name() {
        assert_eq!(parse(&[("DATABASE_URL", "old")]).as_deref(), Some("old"));
        assert_eq!(
            parse(&[("DATABASE_URL", "old"), ("HANDOFF_DATABASE_URL", "new")]).as_deref(),
            Some("new")
        );
        assert_eq!(parse(&[]), None);
    }
}
