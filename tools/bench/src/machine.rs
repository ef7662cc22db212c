//! What a report says about the machine it ran on: the figures are only comparable between runs
//! on the same machine in the same state, so every report carries that state.

use std::collections::BTreeMap;

use anyhow::Result;
use serde::Serialize;
use sqlx::PgConnection;

use crate::relay::probe;

/// The machine and server settings at the start of a run.
#[derive(Serialize)]
pub struct Machine {
    pub cores: usize,
    pub memory_gib: Option<f64>,
    pub load_average_at_start: Option<String>,
    pub postgres: BTreeMap<String, String>,
    pub nats_server_version: String,
    /// Median time of a one-row autocommit INSERT, in ms, at the start and at the end of the
    /// run: the disk's flush latency, which bounds every one-event-per-commit figure.
    pub commit_ms_at_start: f64,
    pub commit_ms_at_end: f64,
}

impl Machine {
    /// Reads the machine, PostgreSQL's settings through `admin`, and probes the commit latency;
    /// `commit_ms_at_end` is left for the caller to probe when the run is over.
    pub async fn read(admin: &mut PgConnection, nats_server_version: String) -> Result<Self> {
        let settings: Vec<(String, String)> = sqlx::query_as(
            "SELECT name, setting FROM pg_settings
             WHERE name IN ('server_version', 'fsync', 'synchronous_commit', 'shared_buffers',
                            'max_connections')
             ORDER BY name",
        )
        .fetch_all(&mut *admin)
        .await?;
        Ok(Self {
            cores: cores(),
            memory_gib: memory_gib(),
            load_average_at_start: load_average(),
            postgres: settings.into_iter().collect(),
            nats_server_version,
            commit_ms_at_start: commit_probe(admin).await?,
            commit_ms_at_end: f64::NAN,
        })
    }
}

impl Machine {
    /// One line for a run's header: cores, load, PostgreSQL's settings, the nats-server and
    /// the one-row commit at the start.
    pub fn summary(&self) -> String {
        format!(
            "{} cores, load {}; postgres {}; nats-server {}; one-row commit p50 {:.2} ms",
            self.cores,
            self.load_average_at_start.as_deref().unwrap_or("?"),
            self.postgres
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" "),
            self.nats_server_version,
            self.commit_ms_at_start,
        )
    }
}

/// Cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The three load averages of /proc/loadavg: the machine is shared, so figures carry its noise.
pub fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// MemTotal of /proc/meminfo, in GiB.
fn memory_gib() -> Option<f64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: f64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib / 1024.0 / 1024.0)
}

/// Median of 200 one-row autocommit INSERTs, in ms: one WAL flush each.
pub async fn commit_probe(admin: &mut PgConnection) -> Result<f64> {
    sqlx::query("CREATE TABLE IF NOT EXISTS bench_commit_probe (n int)")
        .execute(&mut *admin)
        .await?;
    let mut times = probe::histogram();
    for n in 0..200 {
        let started = std::time::Instant::now();
        sqlx::query("INSERT INTO bench_commit_probe VALUES ($1)")
            .bind(n)
            .execute(&mut *admin)
            .await?;
        times.saturating_record(started.elapsed().as_micros() as u64);
    }
    sqlx::query("DROP TABLE bench_commit_probe")
        .execute(&mut *admin)
        .await?;
    Ok(probe::quantile_ms(&times, 0.5))
}

/// The port of the first server in a NATS URL; 4222 when it names none.
pub fn nats_port(url: &str) -> u16 {
    let first = url.split(',').next().unwrap_or(url);
    let host_port = first.rsplit('@').next().unwrap_or(first);
    let host_port = host_port.split("://").last().unwrap_or(host_port);
    host_port
        .rsplit_once(':')
        .and_then(|(_, port)| port.trim_end_matches('/').parse().ok())
        .unwrap_or(4222)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nats_port_comes_from_the_first_server() {
        assert_eq!(nats_port("nats://127.0.0.1:4333"), 4333);
        assert_eq!(nats_port("nats://u:p@host:5222,nats://other:6222"), 5222);
        assert_eq!(nats_port("nats://host"), 4222);
    }
}
