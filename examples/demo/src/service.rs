//! The order service as a child process, on a port of its choosing.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long the service may take to migrate and bind before the demo gives up.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How many of the service's last stderr lines an error shows.
const STDERR_TAIL: usize = 20;

/// The line the service prints once it serves requests.
const READY_PREFIX: &str = "listening on ";

/// Starts `order-service` on `database_url`, stores the child in `slot` (so it is killed at exit
/// whatever happens next) and returns the address it listens on.
pub async fn start(database_url: &str, slot: &mut Option<Child>) -> Result<SocketAddr> {
    let exe = binary()?;
    let mut child = Command::new(&exe)
        .args(["--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn")
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
    // std Mutex: never held across an `.await`.
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL)));
    let stderr_task = tokio::spawn({
        let tail = Arc::clone(&tail);
        async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("   [order-service] {line}");
                if let Ok(mut tail) = tail.lock() {
                    if tail.len() == STDERR_TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
        }
    });

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
            // The pipe is closed once the child is gone, so this ends promptly.
            let _ = tokio::time::timeout(Duration::from_secs(2), stderr_task).await;
            let last: Vec<String> = tail
                .lock()
                .map(|t| t.iter().cloned().collect())
                .unwrap_or_default();
            if last.is_empty() {
                bail!("order-service {why}");
            }
            bail!(
                "order-service {why}; its last messages:\n{}",
                last.join("\n")
            );
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

/// `order-service` next to our own executable: `cargo build --release --workspace` puts both in
/// `target/release`.
fn binary() -> Result<PathBuf> {
    let own = std::env::current_exe().context("while locating the demo's own executable")?;
    let dir = own
        .parent()
        .context("the demo's executable has no directory")?;
    let exe = dir.join("order-service");
    if !exe.is_file() {
        bail!(
            "the order service binary is missing at {}; build the whole workspace first: \
             cargo build --release --workspace",
            exe.display()
        );
    }
    Ok(exe)
}

/// A path relative to the working directory when it is below it: shorter to read.
fn shown(path: &std::path::Path) -> String {
    std::env::current_dir()
        .ok()
        .and_then(|cwd| path.strip_prefix(cwd).ok().map(|p| p.display().to_string()))
        .unwrap_or_else(|| path.display().to_string())
}
