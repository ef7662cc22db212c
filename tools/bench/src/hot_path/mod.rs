//! The relay hot path benchmarks of issue 21: the conditions every production PostgreSQL has,
//! each measured against a baseline of the same run on the relay as it is, so a redesign can be
//! held against today's relay with the same commands.
//!
//! - [`blocked`] (`handoff-bench blocked-backlog`): healthy drain and claim p99 with a long run
//!   of events behind one held aggregate, against the same drain with nothing blocked.
//! - [`xmin`] (`handoff-bench held-xmin`): commit → broker p99, backlog and dead tuples while an
//!   idle-in-transaction session holds an XID, against the clean phase before it.
//! - [`writers`] (`handoff-bench writers`): the order write's throughput with a relay running
//!   against none, and commit → broker p99 at fixed rates.
//! - [`bound`] (`handoff-bench drain-bound`): one relay's drain against the plain loop of the
//!   shared bench specification ([`plain`]), handoff's own claim+mark SQL in a loop, the
//!   JetStream async-publish bound, and the peer, oxide-outbox ([`peer`]), at its best tuning.
//!   With `--candidates`, also the lease designs weighed for the relay ([`candidates`]).
//!
//! Every piece is the relay bench's ([`crate::relay`]): its backlog, drains, probes, paced writer
//! and running relay; these modules only arrange them.

use std::time::Duration;

use anyhow::{Context, Result};
use handoff_postgres::{Migrator, Schema};
use sqlx::{Connection, PgConnection};

use crate::harness::ScratchDatabase;
use crate::machine::Machine;
use crate::relay::workload::{self, Backlog, Workload};
use crate::relay::Bench;

pub(crate) mod blocked;
pub(crate) mod bound;
pub(crate) mod candidates;
pub(crate) mod peer;
pub(crate) mod plain;
pub(crate) mod writers;
pub(crate) mod xmin;

/// The JetStream server a hot path bench publishes to: flattened into its arguments.
#[derive(clap::Args)]
pub struct BrokerArgs {
    /// JetStream server; the benchmark creates and deletes its own stream, BENCH_RELAY.
    #[arg(
        long,
        env = "HANDOFF_NATS_URL",
        value_name = "URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    /// Run the relay with its commits waiting for their WAL flush (`handoff relay
    /// --synchronous-commit`), to measure what that costs.
    #[arg(long)]
    pub synchronous_commit: bool,
}

/// A bench on the scratch database: migrated (handoff's tables; with `order_service`, the order
/// service's too), `backlog` preloaded when given, and the machine read. The admin connection
/// comes with it.
pub async fn setup(
    scratch: &ScratchDatabase,
    broker: &BrokerArgs,
    backlog: Option<Workload>,
    order_service: bool,
    drain_timeout: Duration,
) -> Result<(Bench, PgConnection, Machine)> {
    let mut admin = PgConnection::connect_with(&scratch.options).await?;
    if order_service {
        order_service::migrate(&mut admin)
            .await
            .context("while migrating the scratch database")?;
    } else {
        Migrator::handoff(Schema::default())
            .run(&mut admin)
            .await
            .context("while migrating the scratch database")?;
    }
    let (workload, events) = match backlog {
        Some(workload) => {
            let Backlog { events, .. } = workload::preload(&mut admin, workload).await?;
            (workload, events)
        }
        // Nothing preloaded: the writers fill the outbox (reset only truncates).
        None => (Workload::new(1, 1)?, Vec::new()),
    };
    let mut bench = Bench::new(
        scratch.options.clone(),
        &broker.nats_url,
        workload,
        events,
        drain_timeout,
    );
    bench.synchronous_commit = broker.synchronous_commit;
    let nats_server_version = bench.transport().await?.client().server_info().version;
    let machine = Machine::read(&mut admin, nats_server_version).await?;
    eprintln!(
        "{}; relay commits {}",
        machine.summary(),
        if bench.synchronous_commit {
            "synchronous"
        } else {
            "asynchronous (the default)"
        }
    );
    Ok((bench, admin, machine))
}

/// `value / baseline`, NaN when the baseline is zero or missing.
pub fn ratio(value: f64, baseline: f64) -> f64 {
    if baseline > 0.0 {
        value / baseline
    } else {
        f64::NAN
    }
}
