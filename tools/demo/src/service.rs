//! The order service as a child process, on a port of its choosing.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use tokio::process::{Child, Command};

use crate::process::{shown, sibling_binary, spawn_ready};

/// Starts `order-service` on `database_url`, writing `OrderCreated` in schema version
/// `order_created_version`, stores the child in `slot` (so it is killed at exit whatever happens
/// next) and returns the address it listens on. `role` names the instance in what is printed.
pub async fn start(
    database_url: &str,
    order_created_version: i32,
    role: &str,
    slot: &mut Option<Child>,
) -> Result<SocketAddr> {
    let exe = sibling_binary("order-service", "order service")?;
    let mut command = Command::new(&exe);
    command
        .args(["--listen", "127.0.0.1:0"])
        .args([
            "--order-created-version",
            &order_created_version.to_string(),
        ])
        .env("DATABASE_URL", database_url)
        // The user's own HANDOFF_ settings (which win over DATABASE_URL) are not the demo's.
        .env_remove("HANDOFF_DATABASE_URL")
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1");
    // Its warnings go to our stderr as they come; the last lines are kept for error messages.
    let ready = spawn_ready(command, "order-service", "listening on ", slot).await?;
    let addr: SocketAddr = ready.rest.parse().with_context(|| {
        format!(
            "order-service printed an unexpected address {:?}",
            ready.rest
        )
    })?;
    println!(
        "   started {} (pid {}), listening on {addr}:\n   {role}, writes OrderCreated \
         v{order_created_version}",
        shown(&exe),
        ready.pid
    );
    Ok(addr)
}
