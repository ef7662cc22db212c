//! `inventory`: the reference consumer that reserves stock for orders, exactly once per event
//! (see [`reference_consumers::inventory`]).

use std::process::ExitCode;

use reference_consumers::common;
use reference_consumers::inventory::{self, InventoryArgs};

fn main() -> ExitCode {
    // `<VAR>_FILE` (DATABASE_URL_FILE, ...) before anything reads the environment; then the
    // runtime.
    handoff_telemetry::secrets::run_main(async_main)
}

async fn async_main() -> ExitCode {
    // Test builds only: reads FAILPOINTS (see handoff_consumer::failpoints).
    #[cfg(feature = "failpoints")]
    let _scenario = fail::FailScenario::setup();
    let args = match common::parse_args::<InventoryArgs>(inventory::DEFAULT_NAME) {
        Ok(args) => args,
        Err(code) => return code,
    };
    // Kept until the consumer stops: dropping it sends the spans still buffered.
    let _telemetry = match common::init_telemetry("inventory", &args.common.otlp) {
        Ok(telemetry) => telemetry,
        Err(code) => return code,
    };
    common::exit_code(inventory::run(args).await)
}
