//! `handoff quarantine`: list, show, retry, repair, skip held events (brief P8). Being built.

use anyhow::{bail, Result};

use crate::args::DatabaseArgs;

#[derive(clap::Args, Debug)]
pub struct QuarantineArgs {
    #[command(flatten)]
    database: DatabaseArgs,
}

pub async fn run(_args: QuarantineArgs) -> Result<()> {
    bail!("not built yet")
}
