//! `handoff roles`: the SQL of the least-privilege roles (writer, relay, operator) for
//! handoff's tables in one schema, for an operator to review and apply with psql.
//!
//! It prints rather than applies: creating roles and granting privileges is a database
//! administrator's step, run with the owner's rights, and the script is meant to be read (and
//! kept in the deployment's repository) before it runs.

use anyhow::Result;
use handoff_postgres::{roles_sql, RoleNames, DEFAULT_ROLE_PREFIX};

/// Flags of `handoff roles`.
#[derive(clap::Args)]
pub struct RolesArgs {
    /// Print the SQL on stdout: what `handoff roles` does with or without it.
    ///
    /// Kept for scripts written when printing needed it; nothing connects to a database.
    #[arg(long, hide_short_help = true)]
    print: bool,
    /// Schema of handoff's tables.
    #[arg(long, env = "HANDOFF_SCHEMA", default_value = "public")]
    schema: String,
    /// Role names are PREFIX_writer, PREFIX_relay and PREFIX_operator; another prefix keeps
    /// the roles of several schemas in one cluster apart (roles are cluster-wide).
    #[arg(long, value_name = "PREFIX", default_value = DEFAULT_ROLE_PREFIX)]
    role_prefix: String,
}

/// Prints the roles' SQL (printing is the only action, `--print` or not).
pub fn run(args: RolesArgs) -> Result<()> {
    let _ = args.print;
    let names = RoleNames::with_prefix(&args.role_prefix)?;
    print!("{}", roles_sql(&args.schema, &names)?);
    Ok(())
}
