//! What a reference consumer prints: its logs and spans, its one `error: ...` line and exit
//! code, and URLs with their credentials hidden.

use std::process::ExitCode;

use super::RunError;

/// Logs to stderr (stdout carries only the ready line), filtered by `RUST_LOG`, by default
/// `info,sqlx=warn,async_nats=warn`; no span is exported (see [`init_telemetry`]).
pub fn init_logging() {
    let _ = init_telemetry("consumer", &handoff_telemetry::OtlpArgs::default());
}

/// As [`init_logging`], and with `--otlp-endpoint` the trace spans (each event's handler span
/// continues the trace the event was written in) exported as `service_name`. Keep the guard
/// until the consumer stops: dropping it sends the spans still buffered. `Err` is the exit
/// code after the error was printed.
pub fn init_telemetry(
    service_name: &'static str,
    otlp: &handoff_telemetry::OtlpArgs,
) -> Result<handoff_telemetry::Telemetry, ExitCode> {
    handoff_telemetry::Telemetry::builder(service_name)
        .default_filter("info,sqlx=warn,async_nats=warn")
        .otlp(otlp)
        .init()
        .map_err(|error| {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        })
}

/// The process's exit code for `result`; a failure is printed as one `error: ...` line.
pub fn exit_code(result: Result<(), RunError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Hides anything between `://` and `@` (user and password) in a message that may quote a URL.
pub(super) fn redact(message: &str) -> String {
    match (message.find("://"), message.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            format!("{}://***{}", &message[..start], &message[at..])
        }
        _ => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(
            redact("bad url postgres://user:secret@host/db"),
            "bad url postgres://***@host/db"
        );
        assert_eq!(redact("no url here"), "no url here");
    }
}
