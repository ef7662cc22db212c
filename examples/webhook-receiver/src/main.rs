//! `webhook-receiver`: the reference HTTP receiver of handoff events; see the library
//! documentation of `webhook_receiver` for what it answers.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use handoff_http::SigningSecret;

#[derive(Parser)]
#[command(
    name = "webhook-receiver",
    version,
    about = "Reference receiver of handoff HTTP events: each Idempotency-Key applied once, in order"
)]
struct Args {
    /// Address to listen on; port 0 picks a free one. The bound address is printed on stdout
    /// as `listening on ADDR`.
    #[arg(long, default_value = "127.0.0.1:8095")]
    listen: SocketAddr,
    /// Share (0.0 to 1.0) of first-time requests that are applied and then not answered in time
    /// (held for --ambiguous-hold, or the connection broken).
    #[arg(long, value_name = "R", default_value_t = 0.0)]
    ambiguous_ratio: f64,
    /// How long a held request waits before answering (longer than the sender's timeout).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    ambiguous_hold: Duration,
    /// Seed of the generator picking the ambiguous requests.
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
}

fn main() -> ExitCode {
    // `<VAR>_FILE` (DATABASE_URL_FILE, ...) before anything reads the environment; then the
    // runtime.
    handoff_telemetry::secrets::run_main(async_main)
}

async fn async_main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(error) if !error.use_stderr() => {
            let _ = error.print();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("error: {}", error.to_string().trim());
            return ExitCode::FAILURE;
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    if !(0.0..=1.0).contains(&args.ambiguous_ratio) {
        anyhow::bail!("--ambiguous-ratio must be between 0 and 1");
    }
    let secret = match std::env::var("HANDOFF_WEBHOOK_SECRET") {
        Ok(text) => Some(SigningSecret::parse(&text).context("HANDOFF_WEBHOOK_SECRET")?),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(_)) => {
            anyhow::bail!("HANDOFF_WEBHOOK_SECRET is not UTF-8")
        }
    };
    let signed = secret.is_some();
    let options = webhook_receiver::Options {
        ambiguous_ratio: args.ambiguous_ratio,
        ambiguous_hold: args.ambiguous_hold,
        seed: args.seed,
        secret,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("while binding {}", args.listen))?;
    let address = listener.local_addr()?;
    // Tests read this line to find a port-0 listener.
    println!("listening on {address}");
    tracing::info!(%address, signed, ambiguous_ratio = args.ambiguous_ratio, seed = args.seed,
        "webhook-receiver started");
    webhook_receiver::serve(listener, options, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
    .context("while serving")
}
