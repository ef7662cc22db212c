//! `payments`: the reference consumer that charges each created order once at the payment
//! provider, through Idempotency-Key (see [`reference_consumers::payments`]).

use std::process::ExitCode;

use reference_consumers::common;
use reference_consumers::payments::{self, PaymentsArgs};

fn main() -> ExitCode {
    // `<VAR>_FILE` (DATABASE_URL_FILE, ...) before anything reads the environment; then the
    // runtime.
    handoff_telemetry::secrets::run_main(async_main)
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
