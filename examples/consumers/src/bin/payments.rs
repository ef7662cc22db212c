//! `payments`: the reference consumer that charges each created order once at the payment
//! provider, through Idempotency-Key (see [`reference_consumers::payments`]).

use std::process::ExitCode;

use reference_consumers::common;
use reference_consumers::payments::{self, PaymentsArgs};

fn main() -> ExitCode {
    // `<VAR>_FILE` (DATABASE_URL_FILE, ...) before clap reads the environment, and before the
    // runtime starts threads: setting environment variables is only sound single-threaded.
    if let Err(code) = handoff_telemetry::secrets::init() {
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

async fn async_main() -> ExitCode {
    // Test builds only: reads FAILPOINTS (see handoff_consumer::failpoints).
    #[cfg(feature = "failpoints")]
    let _scenario = fail::FailScenario::setup();
    let args = match common::parse_args::<PaymentsArgs>(payments::DEFAULT_NAME) {
        Ok(args) => args,
        Err(code) => return code,
    };
    // Kept until the consumer stops: dropping it sends the spans still buffered.
    let _telemetry = match common::init_telemetry("payments", &args.common.otlp) {
        Ok(telemetry) => telemetry,
        Err(code) => return code,
    };
    common::exit_code(payments::run(args).await)
}
