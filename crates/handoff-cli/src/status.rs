//! `handoff status`: the outbox at a glance (brief O1, O5). Being built.

use anyhow::{bail, Result};

use crate::args::DatabaseArgs;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    database: DatabaseArgs,
}

pub async fn run(_args: StatusArgs) -> Result<()> {
    bail!("not built yet")
}
