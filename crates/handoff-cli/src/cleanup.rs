//! `handoff cleanup`: delete or archive published rows past retention (brief O2). Being built.

use anyhow::{bail, Result};

use crate::args::DatabaseArgs;

#[derive(clap::Args, Debug)]
pub struct CleanupArgs {
    #[command(flatten)]
    database: DatabaseArgs,
}

pub async fn run(_args: CleanupArgs) -> Result<()> {
    bail!("not built yet")
}
