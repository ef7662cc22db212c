//! `handoff-bench blocked-backlog`: a long run of events behind one held aggregate, and the
//! drain of every other aggregate beside it.
//!
//! Both variants start from the same preloaded healthy backlog (default 20,000 events over 2,000
//! aggregates, the relay bench's [`workload`](crate::relay::workload)) and one relay with its
//! defaults drains it: `clear` with nothing else in the outbox, `blocked` with `--blocked` more
//! events of one aggregate whose head is held as the claim holds a crash-looped event
//! (`available_at` 'infinity', `hold_reason` 'crash_loop', no lease). The blocked events are older than every
//! healthy one, so they sit at the front of the claim's index. Claim durations come from the
//! probe around the relay's source (the claim statement as the relay calls it, round trip
//! included).
//!
//! A relay that runs while the blocked events are written parks each one as it arrives
//! (migration 0012): `blocked` has them so, but for the newest `--unparked`, which arrived since
//! the relay's last claim. `first_pass` has none of them parked yet, as after a relay outage
//! or the upgrade to 0012: the drain then includes parking the whole run once. The goals are
//! `blocked` against `clear`; `first_pass` is reported beside them.

use std::time::Duration;

use anyhow::Result;
use serde::Serialize;
use sqlx::{Executor, PgConnection};

use super::{ratio, setup, BrokerArgs};
use crate::harness::{median_run, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::machine::{commit_probe, Machine};
use crate::relay::drain::{self, DrainRun};
use crate::relay::workload::Workload;
use crate::relay::{met, Bench, Goal};

/// Goal of the issue: the healthy drain beside the blocked run at least this share of the clear
/// drain.
const GOAL_DRAIN: f64 = 0.8;

/// Goal of the issue: claim p99 "unchanged", read as at most this multiple of the clear one.
const GOAL_CLAIM_P99: f64 = 1.5;

/// The aggregate type of the blocked events: not the backlog's, so the drain's checks (every
/// backlog event published, in order) see only the healthy ones.
const BLOCKED_TYPE: &str = "blocked";

/// Flags of `handoff-bench blocked-backlog`.
#[derive(clap::Args)]
pub struct BlockedArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    #[command(flatten)]
    broker: BrokerArgs,
    /// Events written behind the held head of the one blocked aggregate.
    #[arg(long, default_value_t = 1_000_000)]
    blocked: u32,
    /// Of those, the newest ones not parked yet (written since the relay's last claim).
    #[arg(long, default_value_t = 1_000)]
    unparked: u32,
    /// Also drain beside a blocked run of which nothing is parked yet (`first_pass`).
    #[arg(long)]
    first_pass: bool,
    /// Healthy events, drained in both variants.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Aggregates the healthy events are spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 2_000)]
    aggregates: usize,
    /// Rounds of both variants (their order alternates); the median per variant is reported.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// A drain that takes longer than this is stopped and reported incomplete.
    #[arg(long, default_value_t = 900)]
    drain_timeout_seconds: u64,
    /// The relay's source. `log`: the blocked run is written first, before the healthy
    /// backlog, with nothing held or parked, and the destination refuses its head when the
    /// relay publishes it (a poison aggregate discovered after an outage); the cursor stands
    /// before both, as for a relay that was down.
    #[arg(long, value_enum, default_value = "polling")]
    source: BlockedSource,
    #[command(flatten)]
    report: ReportArgs,
}

/// The relay's source in `handoff-bench blocked-backlog`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum BlockedSource {
    Polling,
    Log,
}

/// The blocked run behind one held head, older than every backlog event. Ids share no prefix
/// with the backlog's; payloads are about the backlog's size, so the heap pages a scan reads are
/// as full as in production.
/// For the log source: the same run, nothing held and nothing parked; the destination refuses
/// its head.
const POISON_SQL: &str = r#"
INSERT INTO outbox
    (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version,
     payload, headers, occurred_at, available_at)
SELECT ('018e0000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid,
       $2, 'o-blocked', s, 'OrderCreated', 1,
       jsonb_build_object('order_id', 'o-blocked', 'sequence', s, 'pad', repeat('x', 200)),
       '{}'::jsonb,
       timestamptz '2025-12-01 00:00:00+00' + s * interval '1 microsecond',
       timestamptz '2025-12-01 00:00:00+00' + s * interval '1 microsecond'
FROM generate_series(1, $1::bigint + 1) AS s
"#;

const BLOCKED_SQL: &str = r#"
INSERT INTO outbox
    (event_id, aggregate_type, aggregate_id, aggregate_sequence, event_type, schema_version,
     payload, headers, occurred_at, available_at, quarantined_at, hold_reason, last_error,
     blocked)
SELECT ('018e0000-0000-7000-8000-' || lpad(to_hex(s), 12, '0'))::uuid,
       $2, 'o-blocked', s, 'OrderCreated', 1,
       jsonb_build_object('order_id', 'o-blocked', 'sequence', s, 'pad', repeat('x', 200)),
       '{}'::jsonb,
       timestamptz '2025-12-01 00:00:00+00' + s * interval '1 microsecond',
       CASE WHEN s = 1 THEN 'infinity'::timestamptz
            ELSE timestamptz '2025-12-01 00:00:00+00' + s * interval '1 microsecond' END,
       CASE WHEN s = 1 THEN now() END,
       CASE WHEN s = 1 THEN 'crash_loop' END,
       CASE WHEN s = 1 THEN 'crash_loop: held by handoff-bench blocked-backlog' END,
       s > 1 AND s <= $1::bigint + 1 - $3::bigint
FROM generate_series(1, $1::bigint + 1) AS s
"#;

/// The variants: the baseline, and the same drain beside the blocked run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Variant {
    Clear,
    Blocked,
    FirstPass,
}

impl Variant {
    /// The name in tables and JSON.
    fn name(self) -> &'static str {
        match self {
            Variant::Clear => "clear",
            Variant::Blocked => "blocked",
            Variant::FirstPass => "first_pass",
        }
    }
}

/// One variant's drain in one round.
#[derive(Debug, Clone, Serialize)]
struct Run {
    variant: Variant,
    /// Events behind the held head (0 for `clear`).
    blocked: u32,
    /// Of those, the ones not parked when the drain starts.
    unparked: u32,
    /// Seconds to write the blocked run (and vacuum, analyse, checkpoint).
    prepare_seconds: f64,
    drain: DrainRun,
}

/// The whole run, as written to `--json`.
#[derive(Serialize)]
struct Results {
    machine: Machine,
    workload: Workload,
    blocked: u32,
    rounds: usize,
    /// Per variant, the round with the median drain rate.
    runs: Vec<Run>,
    /// Every round of both variants.
    all_rounds: Vec<Run>,
    drain_ratio: Goal,
    claim_p99_ratio: Goal,
}

/// Runs both variants `--rounds` times, prints the table, writes the JSON.
pub async fn blocked_backlog(args: BlockedArgs) -> Result<()> {
    let workload = Workload::new(args.events, args.aggregates)?;
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        let timeout = Duration::from_secs(args.drain_timeout_seconds);
        let (bench, mut admin, mut machine) =
            setup(scratch, &args.broker, Some(workload), false, timeout).await?;
        eprintln!(
            "blocked-backlog: {} healthy events over {} aggregates, {} blocked behind one held \
             head, {} round(s)",
            workload.events, workload.aggregates, args.blocked, args.rounds
        );
        let mut rounds = Vec::new();
        for round in 1..=args.rounds {
            let mut order = vec![Variant::Clear, Variant::Blocked];
            if round % 2 == 0 {
                order.reverse();
            }
            if args.first_pass {
                order.push(Variant::FirstPass);
            }
            for variant in order {
                let (blocked, unparked) = match variant {
                    Variant::Clear => (0, 0),
                    Variant::Blocked => (args.blocked, args.unparked.min(args.blocked)),
                    Variant::FirstPass => (args.blocked, args.blocked),
                };
                let run = match args.source {
                    BlockedSource::Polling => {
                        drain_beside(&bench, &mut admin, round, variant, blocked, unparked).await?
                    }
                    BlockedSource::Log => {
                        log_drain_beside(&bench, &mut admin, round, variant, blocked, &workload)
                            .await?
                    }
                };
                eprintln!(
                    "  round {round} {}: {} events in {:.2} s = {:.0} rows/s; claims {} \
                     p50 {:.1} ms p99 {:.1} ms (blocked run written in {:.1} s)",
                    variant.name(),
                    run.drain.events,
                    run.drain.seconds,
                    run.drain.rows_per_second,
                    run.drain.sources[0].claims.calls,
                    run.drain.sources[0].claims.p50_ms,
                    run.drain.sources[0].claims.p99_ms,
                    run.prepare_seconds,
                );
                rounds.push(run);
            }
        }
        bench.delete_stream().await?;
        machine.commit_ms_at_end = commit_probe(&mut admin).await?;

        let median = |variant| {
            median_run(rounds.iter().filter(|r| r.variant == variant), |r| {
                r.drain.rows_per_second
            })
        };
        let (clear, blocked) = (median(Variant::Clear), median(Variant::Blocked));
        let first_pass = args.first_pass.then(|| median(Variant::FirstPass));
        let drain_value = ratio(blocked.drain.rows_per_second, clear.drain.rows_per_second);
        let claim_p99 = |r: &Run| r.drain.sources[0].claims.p99_ms;
        let claim_value = ratio(claim_p99(&blocked), claim_p99(&clear));
        let drain_ratio = Goal {
            goal: format!("blocked drain / clear drain >= {GOAL_DRAIN}"),
            value: drain_value,
            met: drain_value >= GOAL_DRAIN && blocked.drain.complete,
        };
        let claim_p99_ratio = Goal {
            goal: format!("blocked claim p99 / clear claim p99 <= {GOAL_CLAIM_P99}"),
            value: claim_value,
            met: claim_value <= GOAL_CLAIM_P99,
        };

        println!();
        println!("| variant | blocked events (unparked) | healthy events | seconds | rows/s | order ok | claims | claim p50 / p99 / max ms |");
        println!("|---------|--------------------------:|---------------:|--------:|-------:|----------|-------:|-------------------------:|");
        for run in [Some(&clear), Some(&blocked), first_pass.as_ref()]
            .into_iter()
            .flatten()
        {
            let claims = &run.drain.sources[0].claims;
            let order_ok = run
                .drain
                .check
                .as_ref()
                .is_some_and(|c| c.order_ok && c.missing == 0);
            println!(
                "| {} | {} ({}) | {} | {:.2} | {:.0} | {} | {} | {:.1} / {:.1} / {:.1} |",
                run.variant.name(),
                run.blocked,
                run.unparked,
                run.drain.events,
                run.drain.seconds,
                run.drain.rows_per_second,
                if order_ok { "yes" } else { "NO" },
                claims.calls,
                claims.p50_ms,
                claims.p99_ms,
                claims.max_ms,
            );
        }
        println!();
        for goal in [&drain_ratio, &claim_p99_ratio] {
            println!("{}: {:.2}, {}", goal.goal, goal.value, met(goal.met));
        }
        args.report.write(&Results {
            machine,
            workload,
            blocked: args.blocked,
            rounds: args.rounds,
            runs: [Some(clear), Some(blocked), first_pass]
                .into_iter()
                .flatten()
                .collect(),
            all_rounds: rounds,
            drain_ratio,
            claim_p99_ratio,
        })
    })
    .await
}

/// For the log source: `blocked` events of one aggregate written first, then the healthy
/// backlog, nothing held or parked; then one relay with the log source drains the backlog while
/// the destination refuses the blocked aggregate's head.
async fn log_drain_beside(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    variant: Variant,
    blocked: u32,
    workload: &Workload,
) -> Result<Run> {
    let parts = drain::relay_parts(bench, 1).await?;
    bench.reset(admin, &parts[0].1, false).await?;
    let started = std::time::Instant::now();
    if blocked > 0 {
        sqlx::query(POISON_SQL)
            .bind(i64::from(blocked))
            .bind(BLOCKED_TYPE)
            .execute(&mut *admin)
            .await?;
    }
    crate::relay::workload::preload_into(admin, "outbox", *workload).await?;
    admin.execute("VACUUM ANALYZE outbox").await?;
    admin.execute("CHECKPOINT").await?;
    let prepare_seconds = started.elapsed().as_secs_f64();
    let refused = (blocked > 0).then_some(BLOCKED_TYPE);
    let drain = drain::relay_log_on_loaded(bench, admin, round, parts, refused).await?;
    Ok(Run {
        variant,
        blocked,
        unparked: blocked,
        prepare_seconds,
        drain,
    })
}

/// The backlog preloaded, `blocked` events behind a held head written beside it, then one relay
/// drains the backlog.
async fn drain_beside(
    bench: &Bench,
    admin: &mut PgConnection,
    round: usize,
    variant: Variant,
    blocked: u32,
    unparked: u32,
) -> Result<Run> {
    let parts = drain::relay_parts(bench, 1).await?;
    bench.reset(admin, &parts[0].1, true).await?;
    let started = std::time::Instant::now();
    if blocked > 0 {
        sqlx::query(BLOCKED_SQL)
            .bind(i64::from(blocked))
            .bind(BLOCKED_TYPE)
            .bind(i64::from(unparked))
            .execute(&mut *admin)
            .await?;
    }
    // Both variants leave the table in the same state: vacuumed, analysed, checkpointed.
    admin.execute("VACUUM ANALYZE outbox").await?;
    admin.execute("CHECKPOINT").await?;
    let prepare_seconds = started.elapsed().as_secs_f64();
    let drain = drain::relays_on_loaded(bench, admin, round, parts).await?;
    Ok(Run {
        variant,
        blocked,
        unparked,
        prepare_seconds,
        drain,
    })
}
