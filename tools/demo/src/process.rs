//! What the demo's child processes (`order-service`, `handoff relay`, `payment-provider`,
//! `inventory`, `payments`) share: where their binaries are, how they are started and seen to
//! be ready, how their stderr reaches ours, and how they are stopped.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStderr, Command};
use tokio::task::JoinHandle;

/// How many of a child's last stderr lines an error shows.
const STDERR_TAIL: usize = 20;

/// How long a child may take to print its ready line (after migrating, binding, connecting)
/// before the demo gives up.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a child may take to exit after SIGTERM before it counts as hung.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// The command that builds the demo and every binary it starts (the README's first command),
/// and nothing else: no benchmarks, no chaos tooling.
pub const BUILD_COMMAND: &str = "cargo build --release -p handoff-cli -p order-service \
     -p reference-consumers -p saga-shop -p handoff-demo";

/// The binary `name` next to our own executable: [`BUILD_COMMAND`] puts the demo's binaries in
/// `target/release`.
pub fn sibling_binary(name: &str, what: &str) -> Result<PathBuf> {
    let own = std::env::current_exe().context("while locating the demo's own executable")?;
    let dir = own
        .parent()
        .context("the demo's executable has no directory")?;
    let exe = dir.join(name);
    if !exe.is_file() {
        bail!(
            "the {what} binary is missing at {}; build the demo's binaries first: {BUILD_COMMAND}",
            exe.display()
        );
    }
    Ok(exe)
}

/// A path relative to the working directory when it is below it: shorter to read.
pub fn shown(path: &Path) -> String {
    std::env::current_dir()
        .ok()
        .and_then(|cwd| path.strip_prefix(cwd).ok().map(|p| p.display().to_string()))
        .unwrap_or_else(|| path.display().to_string())
}

/// A child started by [`spawn_ready`], which stored the child itself in the caller's slot.
pub struct Ready {
    /// The rest of its ready line, after the prefix: an address, a stream name.
    pub rest: String,
    /// Its process id, for the output.
    pub pid: u32,
    /// Its stderr, for error messages.
    pub stderr: Stderr,
}

/// Starts `command` as the child `label`, stores it in `slot` (so it is killed at exit whatever
/// happens next) and waits until it prints a stdout line starting with `prefix`. Its stdout is
/// read to the end afterwards, so a chatty child never blocks on a full pipe; its stderr goes to
/// ours as [`Stderr::forward`] says.
pub async fn spawn_ready(
    mut command: Command,
    label: &'static str,
    prefix: &str,
    slot: &mut Option<Child>,
) -> Result<Ready> {
    let exe = command.as_std().get_program().to_owned();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("while starting {}", Path::new(&exe).display()))?;
    let (stdout, stderr) = match (child.stdout.take(), child.stderr.take()) {
        (Some(out), Some(err)) => (out, err),
        _ => bail!("{label} started without its output pipes"),
    };
    let child = slot.insert(child);
    let mut stderr = Stderr::forward(stderr, label);

    let mut stdout = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(READY_TIMEOUT, async {
        while let Some(line) = stdout.next_line().await? {
            if let Some(rest) = line.trim().strip_prefix(prefix) {
                return Ok(Some(rest.to_owned()));
            }
        }
        Ok::<_, std::io::Error>(None)
    })
    .await;
    let rest = match ready {
        Ok(Ok(Some(rest))) => rest,
        outcome => {
            let why = match outcome {
                Err(_) => format!(
                    "did not print \"{prefix}...\" within {}s",
                    READY_TIMEOUT.as_secs()
                ),
                Ok(Err(error)) => format!("could not be read from ({error})"),
                _ => match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
                    Ok(Ok(status)) => format!("exited ({status}) before it was ready"),
                    _ => "closed its stdout before it was ready".to_owned(),
                },
            };
            let _ = child.kill().await;
            return Err(stderr.explain(format!("{label} {why}")).await);
        }
    };
    tokio::spawn(async move {
        while let Ok(Some(line)) = stdout.next_line().await {
            tracing::debug!(%line, "{label} stdout");
        }
    });
    Ok(Ready {
        rest,
        pid: child.id().unwrap_or(0),
        stderr,
    })
}

/// A child's stderr, copied to ours line by line as `   [label] line` while it runs, with the
/// last lines kept for error messages.
pub struct Stderr {
    /// The last lines, oldest first. std Mutex: never held across an `.await`.
    tail: Arc<Mutex<VecDeque<String>>>,
    /// The task copying the lines, until it is waited for; it ends when the child closes its
    /// stderr.
    task: Option<JoinHandle<()>>,
}

impl Stderr {
    /// Starts copying `stderr`, prefixing each line with `label`.
    pub fn forward(stderr: ChildStderr, label: &'static str) -> Self {
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL)));
        let task = tokio::spawn({
            let tail = Arc::clone(&tail);
            async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    eprintln!("   [{label}] {line}");
                    if let Ok(mut tail) = tail.lock() {
                        if tail.len() == STDERR_TAIL {
                            tail.pop_front();
                        }
                        tail.push_back(line);
                    }
                }
            }
        });
        Self {
            tail,
            task: Some(task),
        }
    }

    /// No child's stderr yet: a placeholder until one is started.
    pub fn none() -> Self {
        Self {
            tail: Arc::new(Mutex::new(VecDeque::new())),
            task: None,
        }
    }

    /// `message`, followed by the child's last stderr lines when it wrote any. Call it once the
    /// child is gone: it waits (briefly) for the last lines to be read.
    pub async fn explain(&mut self, message: String) -> anyhow::Error {
        if let Some(task) = self.task.take() {
            // The pipe is closed once the child is gone, so this ends promptly.
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
        self.explain_now(message)
    }

    /// As [`explain`](Self::explain), with the lines read so far, for a child still running.
    pub fn explain_now(&self, message: String) -> anyhow::Error {
        let last: Vec<String> = self
            .tail
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        if last.is_empty() {
            anyhow::anyhow!("{message}")
        } else {
            anyhow::anyhow!("{message}; its last messages:\n{}", last.join("\n"))
        }
    }
}

/// Sends SIGTERM to `child` and waits until it has exited; kills it when it has not within
/// [`STOP_TIMEOUT`].
pub async fn terminate(child: &mut Child, what: &str) -> Result<ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    let pid = child
        .id()
        .with_context(|| format!("{what} has no process id"))?;
    // `kill` rather than a libc binding: the only signal the demo sends, and no unsafe code.
    let output = tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .output()
        .await
        .context("while running kill -TERM")?;
    if !output.status.success() {
        bail!(
            "kill -TERM {pid} ({what}) failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    match tokio::time::timeout(STOP_TIMEOUT, child.wait()).await {
        Ok(status) => Ok(status?),
        Err(_) => {
            let _ = child.kill().await;
            bail!(
                "{what} did not exit within {}s of SIGTERM; killed it",
                STOP_TIMEOUT.as_secs()
            )
        }
    }
}
