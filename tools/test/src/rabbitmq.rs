//! RabbitMQ for tests: a private node of the test's own, for tests that change the broker
//! itself (a memory alarm that blocks every publishing connection, a message size limit), so
//! that the shared broker the other tests use is never blocked or reconfigured.
//!
//! [`RabbitMqNode::start`] runs Debian's `rabbitmq-server` as a second node next to the machine's
//! own (`rabbit@<host>` on 5672): its own node name (`handoff-<pid>-<n>@localhost`), a free
//! loopback AMQP port and distribution port, its database, logs, pid file, configuration and
//! Erlang cookie in a temporary directory, and no plugins. Starting waits for `rabbitmqctl wait`
//! (the node has booted and accepts connections), never for a fixed time. Dropping the value
//! stops the node (`rabbitmqctl stop`, then `SIGKILL` to what is left of its process group) and
//! removes the directory.
//!
//! The node runs as the current user, straight from RabbitMQ's own scripts
//! (`/usr/lib/rabbitmq/bin`, or `HANDOFF_RABBITMQ_BIN`), not through Debian's `/usr/sbin`
//! wrappers, which switch to the `rabbitmq` user and share its Erlang cookie with the machine's
//! node. `HOME` is the temporary directory, so the node and the `rabbitmqctl` calls made here
//! share a cookie of their own.
//!
//! Every method blocks the calling thread while the node starts or a `rabbitmqctl` command runs
//! (a few seconds at most); async tests call them directly or from `spawn_blocking`.
//!
//! # Examples
//!
//! ```no_run
//! use handoff_test::rabbitmq::RabbitMqNode;
//!
//! # fn example() -> std::io::Result<()> {
//! let node = RabbitMqNode::start()?;
//! let url = node.url(); // amqp://guest:guest@127.0.0.1:PORT/%2f
//! // A memory alarm: the node blocks every connection that publishes.
//! node.set_vm_memory_high_watermark(RabbitMqNode::BLOCKING_WATERMARK)?;
//! node.set_vm_memory_high_watermark(RabbitMqNode::DEFAULT_WATERMARK)?;
//! # let _ = url;
//! # Ok(())
//! # }
//! ```

use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// Where Debian's `rabbitmq-server` package keeps RabbitMQ's own scripts (`rabbitmq-server`,
/// `rabbitmqctl`); `HANDOFF_RABBITMQ_BIN` overrides it.
pub const DEFAULT_RABBITMQ_BIN: &str = "/usr/lib/rabbitmq/bin";

/// How long the node may take to boot, in seconds (`rabbitmqctl wait --timeout`).
const START_TIMEOUT_SECS: u32 = 90;

/// How many times [`RabbitMqNode::start`] picks new ports when one was taken meanwhile.
const PORT_ATTEMPTS: usize = 3;

/// How many lines of the node's output an error carries.
const LOG_TAIL_LINES: usize = 30;

/// How long [`RabbitMqNode::wait_for_memory_alarm`] waits for the alarm to be raised or cleared.
const ALARM_PATIENCE: Duration = Duration::from_secs(30);

/// A RabbitMQ node of the test's own; see the [module documentation](self).
#[derive(Debug)]
pub struct RabbitMqNode {
    /// The `rabbitmq-server` script, leader of its own process group; `None` once stopped.
    child: Option<Child>,
    /// `handoff-<pid>-<n>@localhost`.
    node: String,
    /// Loopback AMQP port.
    port: u16,
    /// Database, logs, pid file, configuration and `HOME` (the Erlang cookie); removed on drop.
    dir: TempDir,
    /// Loopback AMQPS (TLS) port, when started by [`RabbitMqNode::start_with_tls`].
    tls_port: Option<u16>,
}

impl RabbitMqNode {
    /// A memory high watermark no node stays under: setting it raises the memory alarm at once,
    /// and the node blocks every connection that publishes (`connection.blocked`).
    pub const BLOCKING_WATERMARK: f64 = 0.000_000_1;

    /// RabbitMQ's default memory high watermark (0.4 of the machine's memory): setting it back
    /// clears the alarm (`connection.unblocked`).
    pub const DEFAULT_WATERMARK: f64 = 0.4;

    /// Starts a node with RabbitMQ's default settings and waits until it accepts connections.
    ///
    /// # Errors
    ///
    /// When the scripts cannot be run, the temporary directory or the ports cannot be had, or
    /// the node exits or is not booted within 90 seconds (the error carries the tail of its
    /// output).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let node = handoff_test::rabbitmq::RabbitMqNode::start()?;
    /// assert_eq!(node.url(), format!("amqp://guest:guest@127.0.0.1:{}/%2f", node.port()));
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn start() -> io::Result<Self> {
        Self::start_with_config(&[])
    }

    /// As [`start`](Self::start), with more lines for the node's `rabbitmq.conf` (new-style
    /// `key = value`), such as `"max_message_size = 4096"`.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_test::rabbitmq::RabbitMqNode;
    ///
    /// let node = RabbitMqNode::start_with_config(&["max_message_size = 4096"])?;
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn start_with_config(config: &[&str]) -> io::Result<Self> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let node = format!(
            "handoff-{}-{}@localhost",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let dir = tempfile::Builder::new()
            .prefix("handoff-rabbitmq-")
            .tempdir()?;
        // No plugins: the node does not read the machine's enabled_plugins.
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n")?;
        // Nothing from the machine's rabbitmq-env.conf (its node name and port are the shared
        // node's).
        std::fs::write(dir.path().join("rabbitmq-env.conf"), "")?;
        let mut conf = String::from(
            "# A private test node (handoff-test): guest on loopback only, and a disk limit low\n\
             # enough that a full test machine does not raise a disk alarm of its own.\n\
             loopback_users.guest = true\n\
             disk_free_limit.absolute = 1MB\n",
        );
        for line in config {
            conf.push_str(line);
            conf.push('\n');
        }
        std::fs::write(dir.path().join("rabbitmq.conf"), conf)?;
        let mut server = Self {
            child: None,
            node,
            port: 0,
            dir,
            tls_port: None,
        };
        let mut attempt = 1;
        loop {
            match server.spawn() {
                Ok(()) => return Ok(server),
                // Another process took a port between our probe and the node's bind.
                Err(error)
                    if attempt < PORT_ATTEMPTS && error.kind() == io::ErrorKind::AddrInUse =>
                {
                    attempt += 1;
                    // The data of the failed boot would hold the old ports.
                    let _ = std::fs::remove_dir_all(server.dir.path().join("mnesia"));
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// As [`start`](Self::start), with a TLS listener as well, on a second loopback port
    /// ([`amqps_url`](Self::amqps_url)), whose certificate `ca` signs (for `localhost` and
    /// `127.0.0.1`). Clients are not asked for a certificate.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start), and when the certificate cannot be made.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use handoff_test::rabbitmq::RabbitMqNode;
    /// use handoff_test::tls::TestCa;
    ///
    /// let ca = TestCa::new("rabbit").unwrap();
    /// let node = RabbitMqNode::start_with_tls(&ca)?;
    /// let url = node.amqps_url().unwrap(); // amqps://guest:guest@127.0.0.1:PORT/%2f
    /// # let _ = url;
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn start_with_tls(ca: &crate::tls::TestCa) -> io::Result<Self> {
        let server = ca
            .server("rabbitmq")
            .map_err(|e| io::Error::other(e.to_string()))?;
        let tls_port = crate::free_port()?;
        let lines = [
            format!("listeners.ssl.default = 127.0.0.1:{tls_port}"),
            format!("ssl_options.cacertfile = {}", ca.ca_path().display()),
            format!("ssl_options.certfile = {}", server.cert.display()),
            format!("ssl_options.keyfile = {}", server.key.display()),
            "ssl_options.verify = verify_none".to_owned(),
            "ssl_options.fail_if_no_peer_cert = false".to_owned(),
        ];
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        let mut node = Self::start_with_config(&lines)?;
        node.tls_port = Some(tls_port);
        Ok(node)
    }

    /// `amqps://guest:guest@127.0.0.1:PORT/%2f`, when the node has a TLS listener.
    pub fn amqps_url(&self) -> Option<String> {
        self.tls_port
            .map(|port| format!("amqps://guest:guest@127.0.0.1:{port}/%2f"))
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The loopback AMQP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The node's name, for `rabbitmqctl -n`.
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// The temporary directory holding the node's database, logs and configuration.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs `rabbitmqctl -n NODE ARGS...` against this node and returns its standard output.
    ///
    /// # Errors
    ///
    /// When the command cannot be run or fails (the error carries its output).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn example(node: &handoff_test::rabbitmq::RabbitMqNode) -> std::io::Result<()> {
    /// let connections = node.ctl(&["list_connections", "name", "--quiet"])?;
    /// # let _ = connections;
    /// # Ok(())
    /// # }
    /// ```
    pub fn ctl(&self, args: &[&str]) -> io::Result<String> {
        let output = self.ctl_output(args)?;
        if !output.status.success() {
            return Err(io::Error::other(format!(
                "rabbitmqctl -n {} {} failed ({}): {}",
                self.node,
                args.join(" "),
                output.status,
                combined(&output)
            )));
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Sets the node's memory high watermark to `fraction` of the machine's memory
    /// (`rabbitmqctl set_vm_memory_high_watermark`) and waits until the memory alarm is raised
    /// or cleared accordingly. [`BLOCKING_WATERMARK`](Self::BLOCKING_WATERMARK) raises it: the
    /// node then blocks each connection as it publishes (`connection.blocked`) and reads
    /// nothing more from it. [`DEFAULT_WATERMARK`](Self::DEFAULT_WATERMARK) clears it.
    ///
    /// # Errors
    ///
    /// When `rabbitmqctl` fails, or the alarm is not in the expected state within 30 seconds.
    pub fn set_vm_memory_high_watermark(&self, fraction: f64) -> io::Result<()> {
        self.ctl(&["set_vm_memory_high_watermark", &fraction.to_string()])?;
        self.wait_for_memory_alarm(fraction < 0.01)
    }

    /// Whether the node's memory alarm is raised now.
    ///
    /// # Errors
    ///
    /// When `rabbitmqctl` fails.
    pub fn memory_alarm(&self) -> io::Result<bool> {
        let alarms = self.ctl(&["eval", "rabbit_alarm:get_alarms()."])?;
        Ok(alarms.contains("resource_limit,memory"))
    }

    /// Waits until the memory alarm is `raised` (or cleared), for at most 30 seconds.
    ///
    /// # Errors
    ///
    /// When `rabbitmqctl` fails, or the alarm is not in that state in time.
    pub fn wait_for_memory_alarm(&self, raised: bool) -> io::Result<()> {
        let deadline = Instant::now() + ALARM_PATIENCE;
        loop {
            if self.memory_alarm()? == raised {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the memory alarm of {} is not {} after {ALARM_PATIENCE:?}",
                        self.node,
                        if raised { "raised" } else { "cleared" }
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sets the largest message body the node accepts, in bytes (RabbitMQ's
    /// `max_message_size`); a channel that publishes a larger one is closed by the node with
    /// `PRECONDITION_FAILED`. Only channels opened afterwards use the new limit.
    ///
    /// # Errors
    ///
    /// When `rabbitmqctl` fails.
    pub fn set_max_message_size(&self, bytes: u64) -> io::Result<()> {
        let output = self.ctl(&[
            "eval",
            &format!("application:set_env(rabbit, max_message_size, {bytes})."),
        ])?;
        if output.trim() != "ok" {
            return Err(io::Error::other(format!(
                "setting max_message_size on {}: {output}",
                self.node
            )));
        }
        Ok(())
    }

    /// Stops the node (`rabbitmqctl stop`, which waits until it has halted) and kills whatever
    /// is left of its process group. Does nothing when it is not running.
    ///
    /// # Errors
    ///
    /// When the script's process cannot be waited for.
    pub fn stop(&mut self) -> io::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let _ = self.ctl_output(&["stop"]);
        // The script and anything it started are in the group led by the child, created for
        // this node alone.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = child.kill();
        child.wait()?;
        Ok(())
    }

    /// The last lines of the node's console output and log.
    pub fn log_tail(&self) -> String {
        tail(&self.log())
    }

    /// The node's console output followed by its log file.
    fn log(&self) -> String {
        let mut text =
            std::fs::read_to_string(self.dir.path().join("console.log")).unwrap_or_default();
        let log = self
            .dir
            .path()
            .join("log")
            .join(format!("{}.log", self.node));
        text.push_str(&std::fs::read_to_string(log).unwrap_or_default());
        text
    }

    fn spawn(&mut self) -> io::Result<()> {
        self.port = crate::free_port()?;
        let dist_port = crate::free_port()?;
        let dir = self.dir.path();
        let console = std::fs::File::create(dir.join("console.log"))?;
        let bin = bin_dir().join("rabbitmq-server");
        let child = Command::new(&bin)
            .env("HOME", dir)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_PID_FILE", dir.join("rabbitmq.pid"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
            .env("RABBITMQ_CONF_ENV_FILE", dir.join("rabbitmq-env.conf"))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(console.try_clone()?)
            .stderr(console)
            // A group of its own, so that stopping it reaches the Erlang VM the script starts.
            .process_group(0)
            .spawn()
            .map_err(|e| {
                io::Error::new(e.kind(), format!("could not run {}: {e}", bin.display()))
            })?;
        self.child = Some(child);
        let pid_file = dir.join("rabbitmq.pid");
        let waited = self.ctl_output(&[
            "wait",
            &pid_file.to_string_lossy(),
            "--timeout",
            &START_TIMEOUT_SECS.to_string(),
        ]);
        match waited {
            Ok(output) if output.status.success() => Ok(()),
            outcome => {
                let said = outcome
                    .map(|o| combined(&o))
                    .unwrap_or_else(|e| e.to_string());
                let _ = self.stop();
                // The whole output, not its tail: the listener's `eaddrinuse` comes early, and
                // the shutdown that follows it fills the last lines.
                let kind = if self.log().contains("eaddrinuse") {
                    io::ErrorKind::AddrInUse
                } else {
                    io::ErrorKind::Other
                };
                Err(io::Error::new(
                    kind,
                    format!(
                        "rabbitmq node {} did not boot: {said}\nlast lines of its output:\n{}",
                        self.node,
                        self.log_tail()
                    ),
                ))
            }
        }
    }

    fn ctl_output(&self, args: &[&str]) -> io::Result<Output> {
        let bin = bin_dir().join("rabbitmqctl");
        Command::new(&bin)
            .env("HOME", self.dir.path())
            .args(["-n", &self.node])
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| io::Error::new(e.kind(), format!("could not run {}: {e}", bin.display())))
    }
}

impl Drop for RabbitMqNode {
    fn drop(&mut self) {
        let _ = self.stop();
        // Dropping the TempDir removes the node's data.
    }
}

/// `HANDOFF_RABBITMQ_BIN`, else [`DEFAULT_RABBITMQ_BIN`].
fn bin_dir() -> PathBuf {
    std::env::var_os("HANDOFF_RABBITMQ_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_RABBITMQ_BIN))
}

fn combined(output: &Output) -> String {
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    text
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let text: String = (0..100).map(|n| format!("{n}\n")).collect();
        let kept = tail(&text);
        assert!(kept.starts_with("70\n"));
        assert!(kept.ends_with("99"));
    }
}
