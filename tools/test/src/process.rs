//! Stopping a child process as an operator would: SIGTERM, sent once the process handles it.
//!
//! A process that gets SIGTERM before it installed its handler dies by the signal's default
//! action, with no clean shutdown and no exit status. A test that starts a relay or a consumer
//! and stops it soon after (one that had nothing left to do) would then fail on that race
//! alone, not on anything the process did. Linux lists the signals a process catches in
//! `/proc/PID/status` (`SigCgt`), so the test can wait for the handler instead of guessing a
//! start-up time.

use std::time::{Duration, Instant};

/// How long a process may take from its start to installing its SIGTERM handler. Far more
/// than it takes (milliseconds); a process that never installs one gets the signal when this
/// runs out, and its caller sees the exit by signal.
const HANDLER_DEADLINE: Duration = Duration::from_secs(30);

/// How often the process's status is read while its handler is not installed yet.
const POLL: Duration = Duration::from_millis(5);

/// Sends SIGTERM to `pid` once the process catches it (or has exited, or 30 s passed). The
/// caller waits for the exit and checks its status.
///
/// Synchronous, so that the callers' own synchronous `terminate` can use it; the wait is the
/// few milliseconds between a process's start and its handler, and only when it is that young.
///
/// # Panics
///
/// When `pid` is not a process this test may signal.
///
/// # Examples
///
/// ```no_run
/// let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
/// handoff_test::process::sigterm(child.id() as i32);
/// let status = child.wait().unwrap();
/// ```
pub fn sigterm(pid: i32) {
    let deadline = Instant::now() + HANDLER_DEADLINE;
    while handles_sigterm(pid) == Some(false) && Instant::now() < deadline {
        std::thread::sleep(POLL);
    }
    // SAFETY: kill(2) on a pid the test spawned and has not reaped has no memory-safety
    // preconditions.
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(
        sent,
        0,
        "SIGTERM to {pid}: {}",
        std::io::Error::last_os_error()
    );
}

/// Whether process `pid` catches SIGTERM; `None` once it is gone or a zombie (exited, not
/// reaped yet), as there is then no handler left to wait for.
fn handles_sigterm(pid: i32) -> Option<bool> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .map(str::trim)
    };
    if field("State:")?.starts_with('Z') {
        return None;
    }
    let caught = u64::from_str_radix(field("SigCgt:")?, 16).ok()?;
    Some(caught & (1 << (libc::SIGTERM - 1)) != 0)
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn a_process_that_traps_sigterm_gets_it_only_once_its_trap_is_set() {
        // The shell sets its trap a moment after it starts; SIGTERM sent at once would kill
        // it by the default action instead (an exit by signal, not status 0).
        let mut shell = Command::new("sh")
            .args(["-c", "trap 'exit 0' TERM; while :; do sleep 0.05; done"])
            .spawn()
            .unwrap();
        sigterm(shell.id() as i32);
        let status = shell.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{status}");
    }
}
