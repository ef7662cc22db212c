//! `handoff reconcile`: find published events the stream lost, republish them. Being built.

use anyhow::{bail, Result};

use crate::args::{BrokerArgs, DatabaseArgs};

#[derive(clap::Args, Debug)]
pub struct ReconcileArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    broker: BrokerArgs,
}

pub async fn run(_args: ReconcileArgs) -> Result<std::process::ExitCode> {
    bail!("not built yet")
}
