//! `handoff-telemetry`: how the handoff binaries (`handoff`, the reference order service and
//! consumers) set up `tracing`.
//!
//! A tool crate, apart from the libraries: the libraries only create spans and, with their
//! `otel` feature, carry the W3C trace context in event headers (`handoff_core::trace`). This
//! crate installs the process's subscriber:
//!
//! - logs on stderr, filtered by `RUST_LOG` (or the binary's default filter);
//! - with an OTLP endpoint ([`OtlpArgs`]: `--otlp-endpoint URL`, env
//!   `OTEL_EXPORTER_OTLP_ENDPOINT`), spans at `INFO` and above exported over OTLP/HTTP
//!   (protobuf) to `URL/v1/traces`, in batches from a background thread. Without one no
//!   exporter is built and no OpenTelemetry layer is installed: nothing is exported, and the
//!   libraries neither capture nor continue a trace.
//!
//! It also serves what those binaries expose over HTTP on their metrics address
//! ([`endpoint`]): `/metrics`, and the `/healthz` and `/readyz` probes of orchestrators, with
//! the readiness checks each binary supplies; and it takes secrets from files for them
//! ([`secrets`]: `DATABASE_URL_FILE` and the like), the other thing every binary does at
//! start-up.
//!
//! # Examples
//!
//! ```no_run
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     otlp: handoff_telemetry::OtlpArgs,
//! }
//!
//! let args = Args::parse();
//! // Keep the guard until the end of main: dropping it sends the spans still buffered.
//! let _telemetry = handoff_telemetry::Telemetry::builder("order-service")
//!     .default_filter("info,sqlx=warn")
//!     .otlp(&args.otlp)
//!     .init()?;
//! # Ok::<(), handoff_telemetry::TelemetryError>(())
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

pub mod endpoint;
pub mod env;
pub mod secrets;

use std::io::IsTerminal;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The path OTLP/HTTP receivers take traces at, appended to the endpoint as the
/// `OTEL_EXPORTER_OTLP_ENDPOINT` convention says.
const TRACES_PATH: &str = "/v1/traces";

/// The modules whose spans carry the trace through each event's hops (publish, handler).
const TRACE_SPAN_TARGETS: [&str; 2] = ["handoff_relay::trace", "handoff_consumer::trace"];

/// The `--otlp-endpoint` flag every handoff binary takes (flatten it into the binary's
/// arguments).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct OtlpArgs {
    /// OTLP/HTTP trace collector [default: off].
    ///
    /// Over OTLP/HTTP (protobuf), such as http://127.0.0.1:4318 (spans go to URL/v1/traces).
    /// Without it nothing is exported. The variable is OpenTelemetry's standard one.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        value_name = "URL",
        global = true,
        help_heading = "Observability"
    )]
    pub otlp_endpoint: Option<String>,
}

/// Why the subscriber could not be installed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    /// The OTLP exporter could not be built (an endpoint that is not a URL, a client that
    /// could not start).
    #[error("while building the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        /// The traces URL the exporter was built for.
        endpoint: String,
        /// The exporter's error.
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// A global subscriber was installed already.
    #[error("while installing the tracing subscriber: {0}")]
    Install(#[source] tracing_subscriber::util::TryInitError),
}

impl TelemetryError {
    /// What kind of error this is.
    pub fn kind(&self) -> TelemetryErrorKind {
        match self {
            Self::Exporter { .. } => TelemetryErrorKind::Exporter,
            Self::Install(_) => TelemetryErrorKind::Install,
        }
    }
}

/// The kinds of [`TelemetryError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TelemetryErrorKind {
    /// See [`TelemetryError::Exporter`].
    Exporter,
    /// See [`TelemetryError::Install`].
    Install,
}

/// The installed telemetry. Keep it for the process's life: dropping it flushes the spans
/// still buffered and stops the exporter.
#[must_use = "dropping the guard stops the span export"]
#[derive(Debug)]
pub struct Telemetry {
    /// `None` without an OTLP endpoint.
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Starts describing the telemetry of the service named `service_name` (the OTLP
    /// `service.name`, unless `OTEL_SERVICE_NAME` says otherwise).
    pub fn builder(service_name: &'static str) -> TelemetryBuilder {
        TelemetryBuilder {
            service_name,
            default_filter: "info",
            otlp_endpoint: None,
        }
    }

    /// Whether spans are exported (an OTLP endpoint was given).
    pub fn exports(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Sends what is buffered; a collector that is down costs the export timeout once.
            if let Err(error) = provider.shutdown() {
                eprintln!("warning: while sending the last trace spans: {error}");
            }
        }
    }
}

/// What [`Telemetry::builder`] installs.
#[derive(Debug, Clone)]
pub struct TelemetryBuilder {
    service_name: &'static str,
    default_filter: &'static str,
    otlp_endpoint: Option<String>,
}

impl TelemetryBuilder {
    /// The log filter when `RUST_LOG` is not set (an `EnvFilter` directive such as
    /// `info,sqlx=warn`); `info` by default. It filters the logs only, not the exported spans;
    /// the per-event spans of the relay's publish and the consumer's handler never go to the
    /// logs.
    pub fn default_filter(mut self, directives: &'static str) -> Self {
        self.default_filter = directives;
        self
    }

    /// Exports spans to the endpoint in `args`, if it has one.
    pub fn otlp(mut self, args: &OtlpArgs) -> Self {
        self.otlp_endpoint = args
            .otlp_endpoint
            .as_deref()
            .map(str::trim)
            .filter(|endpoint| !endpoint.is_empty())
            .map(str::to_owned);
        self
    }

    /// Installs the global `tracing` subscriber.
    ///
    /// # Errors
    ///
    /// [`TelemetryError::Exporter`] when the OTLP exporter cannot be built,
    /// [`TelemetryError::Install`] when a global subscriber is already set.
    pub fn init(self) -> Result<Telemetry, TelemetryError> {
        let mut filter = EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new(self.default_filter));
        // The per-event trace spans are for the exporter, not the log lines: kept out of the
        // logs, so without an exporter no layer wants them and they cost nothing.
        for directive in TRACE_SPAN_TARGETS {
            if let Ok(directive) = format!("{directive}=warn").parse() {
                filter = filter.add_directive(directive);
            }
        }
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(filter);
        let provider = match &self.otlp_endpoint {
            Some(endpoint) => Some(provider(self.service_name, endpoint)?),
            None => None,
        };
        let spans = provider.as_ref().map(|provider| {
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("handoff"))
                .with_filter(LevelFilter::INFO)
        });
        tracing_subscriber::registry()
            .with(logs)
            .with(spans)
            .try_init()
            .map_err(TelemetryError::Install)?;
        if let Some(endpoint) = &self.otlp_endpoint {
            tracing::info!(endpoint = %traces_url(endpoint), "exporting trace spans over OTLP");
        }
        Ok(Telemetry { provider })
    }
}

/// A tracer provider exporting in batches over OTLP/HTTP to `endpoint`'s traces path.
fn provider(service_name: &str, endpoint: &str) -> Result<SdkTracerProvider, TelemetryError> {
    let url = traces_url(endpoint);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url.clone())
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
        .map_err(|source| TelemetryError::Exporter {
            endpoint: url,
            source,
        })?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service_name.to_owned());
    }
    Ok(SdkTracerProvider::builder()
        .with_resource(resource.build())
        .with_batch_exporter(exporter)
        .build())
}

/// `endpoint` with the traces path appended, unless it is there already.
fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with(TRACES_PATH) {
        base.to_owned()
    } else {
        format!("{base}{TRACES_PATH}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_path_is_appended_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }

    #[test]
    fn an_empty_endpoint_exports_nothing() {
        let builder = Telemetry::builder("test").otlp(&OtlpArgs {
            otlp_endpoint: Some("  ".into()),
        });
        assert!(builder.otlp_endpoint.is_none());
    }

    #[test]
    fn without_an_endpoint_no_exporter_is_built() {
        let telemetry = Telemetry::builder("test")
            .otlp(&OtlpArgs::default())
            .init()
            .unwrap();
        assert!(!telemetry.exports());
    }

    #[test]
    fn a_bad_endpoint_is_refused_before_anything_is_installed() {
        let error = provider("test", "not a url").unwrap_err();
        assert_eq!(error.kind(), TelemetryErrorKind::Exporter);
    }
}
