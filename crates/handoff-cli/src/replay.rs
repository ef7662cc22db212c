//! `handoff replay`: republish retained events (brief O3). Being built.

use anyhow::{bail, Result};

use crate::args::{BrokerArgs, DatabaseArgs};

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    broker: BrokerArgs,
}

pub async fn run(_args: ReplayArgs) -> Result<()> {
    bail!("not built yet")
}
