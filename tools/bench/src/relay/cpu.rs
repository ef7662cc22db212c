//! Who used the CPU during a variant, from `/proc`: the whole machine, this process (relay,
//! writer and bench code), the nats-server, and the PostgreSQL backends connected to the scratch
//! database. What is left of the machine's busy time is PostgreSQL's background processes (WAL
//! writer, checkpointer) and anything else running on the host.
//!
//! Linux only; on other systems, or when a file cannot be read, the figures are `None`.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::Result;
use serde::Serialize;
use sqlx::PgConnection;

/// `/proc` counts CPU time in USER_HZ ticks, which is 100 on every Linux ABI.
const TICKS_PER_SECOND: f64 = 100.0;

/// The application name of the sessions of [`super::Bench::pool`]: relays and bounds.
pub const RELAY_APPLICATION: &str = "handoff-bench-relay";

/// CPU counters at one instant.
pub struct Snapshot {
    at: Instant,
    machine: Option<(u64, u64)>,
    own: Option<u64>,
    nats: Option<u64>,
    /// Per backend: its ticks, and whether it serves a relay's pool.
    backends: HashMap<i32, (u64, bool)>,
}

/// CPU used during an interval, in cores (CPU seconds per wall second).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CpuShare {
    /// Cores the machine had.
    pub machine_cores: Option<f64>,
    /// Busy cores, all processes together.
    pub machine_busy: Option<f64>,
    /// This process: relay(s), writer, bench bookkeeping.
    pub bench: Option<f64>,
    /// The nats-server.
    pub nats_server: Option<f64>,
    /// PostgreSQL backends serving the scratch database (not the admin connection).
    pub postgres_backends: f64,
    /// Those of them serving a relay's pool ([`RELAY_APPLICATION`]): its claims, marks and
    /// wake-up queries.
    pub relay_backends: f64,
    /// The machine's busy cores minus the three above: PostgreSQL's background processes, and
    /// anything else running on the host (a build, other tests) that disturbs the figures.
    pub others: Option<f64>,
}

/// Reads the counters. `nats_pid` is the server's process, when found.
pub async fn snapshot(admin: &mut PgConnection, nats_pid: Option<u32>) -> Result<Snapshot> {
    let pids: Vec<(i32, bool)> = sqlx::query_as(
        "SELECT pid, application_name = $1 FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .bind(RELAY_APPLICATION)
    .fetch_all(&mut *admin)
    .await?;
    Ok(Snapshot {
        at: Instant::now(),
        machine: machine_ticks(),
        own: process_ticks("self"),
        nats: nats_pid.and_then(|pid| process_ticks(&pid.to_string())),
        backends: pids
            .into_iter()
            .filter_map(|(pid, relay)| Some((pid, (process_ticks(&pid.to_string())?, relay))))
            .collect(),
    })
}

/// The CPU used between two snapshots. A backend that connected in between counts from zero.
pub fn share(start: &Snapshot, end: &Snapshot) -> CpuShare {
    let wall = end.at.duration_since(start.at).as_secs_f64().max(1e-9);
    let cores = |ticks: u64| ticks as f64 / TICKS_PER_SECOND / wall;
    let diff = |a: Option<u64>, b: Option<u64>| Some(cores(b?.saturating_sub(a?)));
    let used = |relay_only: bool| -> u64 {
        end.backends
            .iter()
            .filter(|(_, (_, relay))| *relay || !relay_only)
            .map(|(pid, (ticks, _))| {
                ticks.saturating_sub(start.backends.get(pid).map_or(0, |(t, _)| *t))
            })
            .sum()
    };
    let backends = used(false);
    let (machine_cores, machine_busy) = match (start.machine, end.machine) {
        (Some((busy_a, total_a)), Some((busy_b, total_b))) if total_b > total_a => {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
            let busy = (busy_b - busy_a) as f64 / (total_b - total_a) as f64 * cpus;
            (Some(cpus), Some(busy))
        }
        _ => (None, None),
    };
    let bench = diff(start.own, end.own);
    let nats_server = diff(start.nats, end.nats);
    let postgres_backends = cores(backends);
    CpuShare {
        machine_cores,
        machine_busy,
        bench,
        nats_server,
        postgres_backends,
        relay_backends: cores(used(true)),
        others: machine_busy.map(|busy| {
            (busy - bench.unwrap_or(0.0) - nats_server.unwrap_or(0.0) - postgres_backends).max(0.0)
        }),
    }
}

/// (busy, total) ticks of all CPUs, from `/proc/stat`; idle and iowait are not busy.
fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3)? + fields.get(4).unwrap_or(&0);
    Some((total - idle, total))
}

/// utime + stime of a process, from `/proc/<pid>/stat`.
fn process_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: count fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the file; the first one after ')' is field 3.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The nats-server process listening on `port`: its command line names the port after `-p` or
/// `--port`, or names none and the port is the default 4222.
pub fn find_nats_server(port: u16) -> Option<u32> {
    let port = port.to_string();
    for entry in std::fs::read_dir("/proc").ok()? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        if comm.trim() != "nats-server" {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let named = args
            .windows(2)
            .find(|w| w[0] == "-p" || w[0] == "--port")
            .map(|w| w[1].clone());
        match named {
            Some(named) if named == port => return Some(pid),
            None if port == "4222" => return Some(pid),
            _ => {}
        }
    }
    None
}
