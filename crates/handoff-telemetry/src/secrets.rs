//! Secrets from files: `<VAR>_FILE` names a file whose content becomes `VAR`, the convention of
//! container secrets (Docker and Kubernetes mount each secret as a file, for instance
//! `DATABASE_URL_FILE=/run/secrets/database_url`).
//!
//! It lives here, in the crate of the binaries' process set-up (logging, tracing), which
//! `handoff`, the reference consumers and the order service already use (`saga-shop` and
//! `webhook-receiver` depend on it for this alone): `handoff-core`, the other crate every
//! binary has, does no I/O, and reading files is I/O. Each
//! binary calls [`init`] first thing in `main`, before the tokio runtime starts: setting
//! environment variables is only sound while the process has one thread. The value then reaches
//! clap's `env = "VAR"` fallbacks (and any other reader of `VAR`) as if it had been set directly.
//!
//! Rules, for each name in [`SECRET_VARS`]:
//! - `VAR_FILE` set (not empty): the file's content, without its trailing newlines, becomes
//!   `VAR`;
//! - `VAR` and `VAR_FILE` both set: an error, since which one wins would be a guess;
//! - a file that cannot be read, or is not UTF-8: an error naming the variable and the file,
//!   never its content.
//!
//! A command-line flag still wins over both, as it wins over `VAR`.
//!
//! # Examples
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     if let Err(code) = handoff_telemetry::secrets::init() {
//!         return code;
//!     }
//!     // ... parse arguments, build the tokio runtime, run.
//!     std::process::ExitCode::SUCCESS
//! }
//! ```

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The variables whose value may come from `<VAR>_FILE`: every URL or credential a handoff
/// binary reads from the environment. A binary that does not read one of them is not affected
/// by it.
pub const SECRET_VARS: &[&str] = &[
    "DATABASE_URL",
    "HANDOFF_DATABASE_URL",
    "HANDOFF_LISTEN_DATABASE_URL",
    "NATS_URL",
    "HANDOFF_NATS_URL",
    "AMQP_URL",
    "HANDOFF_AMQP_URL",
    "HANDOFF_REDIS_URL",
    "HANDOFF_ENDPOINT",
    "HANDOFF_HTTP_SECRET",
    "HANDOFF_WEBHOOK_SECRET",
    "PAYMENT_PROVIDER_URL",
];

/// Why a secret could not be taken from its file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecretFileError {
    /// Both `VAR` and `VAR_FILE` are set.
    #[error("both {var} and {var}_FILE are set; set only one of them")]
    Ambiguous {
        /// The variable, without `_FILE`.
        var: String,
    },
    /// The file named by `VAR_FILE` cannot be read.
    #[error("cannot read {var}_FILE ({}): {source}", path.display())]
    Read {
        /// The variable, without `_FILE`.
        var: String,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file named by `VAR_FILE` is not UTF-8 text.
    #[error("{var}_FILE ({}) is not UTF-8 text", path.display())]
    NotUtf8 {
        /// The variable, without `_FILE`.
        var: String,
        /// The file.
        path: PathBuf,
    },
}

/// Applies `<VAR>_FILE` for every name in [`SECRET_VARS`]; on failure prints one
/// `error: ...` line on stderr and returns the exit code to leave with.
///
/// Call it first in `main`, before any thread is started (see the module's documentation).
///
/// # Errors
///
/// [`ExitCode::FAILURE`] after printing the [`SecretFileError`].
pub fn init() -> Result<(), ExitCode> {
    load_files(SECRET_VARS).map_err(|error| {
        eprintln!("error: {error}");
        ExitCode::FAILURE
    })
}

/// Runs a binary's `async_main` as every handoff binary starts: [`init`] first, while the
/// process has one thread, then `async_main` on a multi-threaded tokio runtime built after it
/// (so no `#[tokio::main]`, whose threads would exist before the variables are set).
///
/// # Examples
///
/// ```no_run
/// use std::process::ExitCode;
///
/// fn main() -> ExitCode {
///     handoff_telemetry::secrets::run_main(async_main)
/// }
///
/// async fn async_main() -> ExitCode {
///     // DATABASE_URL is set here when only DATABASE_URL_FILE was.
///     ExitCode::SUCCESS
/// }
/// ```
pub fn run_main<F>(async_main: impl FnOnce() -> F) -> ExitCode
where
    F: std::future::Future<Output = ExitCode>,
{
    if let Err(code) = init() {
        return code;
    }
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(async_main()),
        Err(error) => {
            eprintln!("error: cannot start the tokio runtime: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Sets each `VAR` in `names` from the file `VAR_FILE` names, where `VAR_FILE` is set.
///
/// Nothing is set unless every file could be read. Only call it while the process has a
/// single thread: it sets environment variables.
///
/// # Errors
///
/// [`SecretFileError`] for the first variable set twice or file that cannot be read.
pub fn load_files(names: &[&str]) -> Result<(), SecretFileError> {
    let values = resolve(
        names,
        |name| std::env::var_os(name),
        |path| std::fs::read(path),
    )?;
    for (name, value) in values {
        std::env::set_var(name, value);
    }
    Ok(())
}

/// The `(VAR, value)` pairs to set, read through `get` (the environment) and `read` (files).
fn resolve(
    names: &[&str],
    get: impl Fn(&str) -> Option<OsString>,
    read: impl Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Vec<(String, String)>, SecretFileError> {
    let is_set = |name: &str| get(name).is_some_and(|value| !value.is_empty());
    let mut values = Vec::new();
    for &var in names {
        let Some(path) = get(&format!("{var}_FILE")).filter(|path| !path.is_empty()) else {
            continue;
        };
        if is_set(var) {
            return Err(SecretFileError::Ambiguous {
                var: var.to_owned(),
            });
        }
        let path = PathBuf::from(path);
        let bytes = read(&path).map_err(|source| SecretFileError::Read {
            var: var.to_owned(),
            path: path.clone(),
            source,
        })?;
        let text = String::from_utf8(bytes).map_err(|_| SecretFileError::NotUtf8 {
            var: var.to_owned(),
            path,
        })?;
        // Files written by `echo` or an editor end with a newline that is no part of the
        // secret; nothing else is trimmed (a password may end with a space).
        let value = text.trim_end_matches(['\n', '\r']).to_owned();
        values.push((var.to_owned(), value));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn run(
        env: &[(&str, &str)],
        files: &[(&str, &[u8])],
    ) -> Result<Vec<(String, String)>, SecretFileError> {
        let env: HashMap<String, OsString> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
            .collect();
        let files: HashMap<PathBuf, Vec<u8>> = files
            .iter()
            .map(|(k, v)| (PathBuf::from(k), v.to_vec()))
            .collect();
        resolve(
            &["DATABASE_URL", "NATS_URL"],
            |name| env.get(name).cloned(),
            |path| {
                files.get(path).cloned().ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory")
                })
            },
        )
    }

    #[test]
    fn the_file_content_becomes_the_variable_without_its_trailing_newline() {
        let values = run(
            &[("DATABASE_URL_FILE", "/run/secrets/db")],
            &[("/run/secrets/db", b"postgres://u:p@db/app\r\n\n")],
        )
        .unwrap();
        assert_eq!(
            values,
            [(
                "DATABASE_URL".to_owned(),
                "postgres://u:p@db/app".to_owned()
            )]
        );
    }

    #[test]
    fn inner_and_trailing_spaces_are_kept() {
        let values = run(
            &[("NATS_URL_FILE", "/s")],
            &[("/s", b"nats://u:pa ss @h \n")],
        )
        .unwrap();
        assert_eq!(values[0].1, "nats://u:pa ss @h ");
    }

    #[test]
    fn nothing_is_set_without_a_file_variable() {
        assert!(run(&[("DATABASE_URL", "postgres://x")], &[])
            .unwrap()
            .is_empty());
        assert!(run(&[("DATABASE_URL_FILE", "")], &[]).unwrap().is_empty());
    }

    #[test]
    fn both_set_is_refused() {
        let error = run(
            &[
                ("DATABASE_URL", "postgres://x"),
                ("DATABASE_URL_FILE", "/s"),
            ],
            &[("/s", b"postgres://y")],
        )
        .unwrap_err();
        assert!(matches!(error, SecretFileError::Ambiguous { .. }));
        assert_eq!(
            error.to_string(),
            "both DATABASE_URL and DATABASE_URL_FILE are set; set only one of them"
        );
    }

    #[test]
    fn an_unreadable_file_is_named_and_its_content_never_shown() {
        let error = run(&[("NATS_URL_FILE", "/missing")], &[]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "cannot read NATS_URL_FILE (/missing): No such file or directory"
        );
        let error = run(
            &[("NATS_URL_FILE", "/bin")],
            &[("/bin", &[0xff, 0xfe, b's', b'e', b'c'])],
        )
        .unwrap_err();
        assert_eq!(error.to_string(), "NATS_URL_FILE (/bin) is not UTF-8 text");
    }

    #[test]
    fn a_real_file_is_read() {
        let dir = std::env::temp_dir().join(format!("handoff-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("db");
        std::fs::write(&path, "postgres://from-file\n").unwrap();
        let path_text = path.to_str().unwrap().to_owned();
        let values = resolve(
            &["DATABASE_URL"],
            |name| (name == "DATABASE_URL_FILE").then(|| OsString::from(&path_text)),
            |path| std::fs::read(path),
        )
        .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(values[0].1, "postgres://from-file");
    }
}
