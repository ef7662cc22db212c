//! The order service as a child process, on a port of its choosing.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::process::{shown, sibling_binary, Stderr};

/// How long the service may take to migrate and bind before the demo gives up.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The line the service prints once it serves requests.
const READY_PREFIX: &str = "listening on ";

/// Starts `order-service` on `database_url`, stores the child in `slot` (so it is killed at exit
/// whatever happens next) and returns the address it listens on.
pub async fn start(database_url: &str, slot: &mut Option<Child>) -> Result<SocketAddr> {
    let exe = sibling_binary("order-service", "order service")?;
    let mut child = Command::new(&exe)
        .args(["--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("while starting {}", exe.display()))?;
    let (stdout, stderr) = match (child.stdout.take(), child.stderr.take()) {
        (Some(out), Some(err)) => (out, err),
        _ => bail!("order-service started without its output pipes"),
    };
    let child = slot.insert(child);

    // Its warnings go to our stderr as they come; the last lines are kept for error messages.
    let mut stderr = Stderr::forward(stderr, "order-service");

    let mut stdout = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(READY_TIMEOUT, async {
        while let Some(line) = stdout.next_line().await? {
            if let Some(addr) = line.trim().strip_prefix(READY_PREFIX) {
                return Ok(Some(addr.to_owned()));
            }
        }
        Ok::<_, std::io::Error>(None)
    })
    .await;

    let addr = match ready {
        Ok(Ok(Some(addr))) => addr,
        outcome => {
            let why = match outcome {
                Err(_) => format!(
                    "did not print \"{READY_PREFIX}ADDR\" within {}s",
                    READY_TIMEOUT.as_secs()
                ),
                Ok(Err(error)) => format!("could not be read from ({error})"),
                _ => match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
                    Ok(Ok(status)) => format!("exited ({status}) before it was ready"),
                    _ => "closed its stdout before it was ready".to_owned(),
                },
            };
            let _ = child.kill().await;
            return Err(stderr.explain(format!("order-service {why}")).await);
        }
    };
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("order-service printed an unexpected address {addr:?}"))?;

    // Keep reading, so that a chatty service can never block on a full pipe.
    tokio::spawn(async move {
        while let Ok(Some(line)) = stdout.next_line().await {
            tracing::debug!(%line, "order-service stdout");
        }
    });
    println!(
        "   started {} (pid {}), listening on {addr}",
        shown(&exe),
        child.id().unwrap_or(0)
    );
    Ok(addr)
}
