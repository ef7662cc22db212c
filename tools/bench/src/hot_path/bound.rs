//! `handoff-bench drain-bound`: one relay's drain of a preloaded backlog against baselines on
//! the same backlog in the same run: the shared specification's plain loop (`plain_bound`,
//! [`super::plain`]: the baseline of every drain goal), the relay's own claim and mark
//! statements in a loop (`sql_bound`, 500 per claim, no broker) and JetStream async publish
//! (the same events from memory, as fast as acks allow, no database). The relay bench's drain variants
//! (`sql_bound`, `jetstream_bound`, `relay_1`), alone and with the goal; and the peer,
//! oxide-outbox at its best tuning (`oxide_outbox_8x1000`, [`super::peer`]), draining the same
//! backlog to the same stream, for the second goal.

use std::time::Duration;

use anyhow::Result;
use serde::Serialize;

use super::candidates::{self, Candidate};
use super::{peer, plain, ratio, setup, BrokerArgs};
use crate::harness::{median_run, ReportArgs, ScratchArgs, ScratchDatabase};
use crate::machine::{commit_probe, Machine};
use crate::relay::drain::{self, DrainRun, DrainVariant};
use crate::relay::workload::Workload;
use crate::relay::{met, Goal, OUTSTANDING};

/// Goal of the issue: the relay at least this share of the slower of its two bounds.
const GOAL_VS_BOUND: f64 = 0.8;

/// Goal of the issue: the relay at least this many times the peer's best tuning.
const GOAL_VS_PEER: f64 = 1.2;

/// Flags of `handoff-bench drain-bound`.
#[derive(clap::Args)]
pub struct BoundArgs {
    #[command(flatten)]
    scratch: ScratchArgs,
    #[command(flatten)]
    broker: BrokerArgs,
    /// Events in the preloaded backlog.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Aggregates the backlog is spread over (the events must be a multiple of it).
    #[arg(long, default_value_t = 10_000)]
    aggregates: usize,
    /// Rounds (the variants' order alternates); the median per variant is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// A relay drain that takes longer than this is stopped and reported incomplete.
    #[arg(long, default_value_t = 300)]
    drain_timeout_seconds: u64,
    /// Leave out the peer (oxide-outbox, 8 managers with batches of 1,000).
    #[arg(long)]
    no_peer: bool,
    /// Also drain with the lease candidates' SQL (`sql_row_lease`, `sql_async_claim`,
    /// `sql_lock_lease`, and the row and lock leases with two claim loops, `sql_row_lease_x2`,
    /// `sql_lock_lease_x2`; see docs/relay.md, What was weighed), and report each against the
    /// control and the peer.
    #[arg(long)]
    candidates: bool,
    /// Run only these variants (names as in the table, comma-separated), e.g. `sql_bound` to
    /// measure a change of the claim or mark SQL alone; no ratio, goal or JSON is written then.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    #[command(flatten)]
    report: ReportArgs,
}

/// The whole run, as written to `--json`.
#[derive(Serialize)]
struct Results {
    machine: Machine,
    workload: Workload,
    rounds: usize,
    outstanding: usize,
    /// Per variant, the round with the median rate.
    drain: Vec<DrainRun>,
    /// Every round of every variant.
    drain_rounds: Vec<DrainRun>,
    min_bound: DrainVariant,
    /// relay_1 / plain_bound: the relay against the shared specification's plain loop on the
    /// same rows, the baseline every drain goal is measured against.
    relay_1_over_plain_bound: f64,
    /// The peer against the same plain loop (none with `--no-peer`).
    peer_over_plain_bound: Option<f64>,
    /// relay_1 / sql_bound: the relay against its own claim and mark in a loop.
    relay_1_over_sql_bound: f64,
    relay_1_over_jetstream_bound: f64,
    goal: Goal,
    /// relay_1 / oxide_outbox_8x1000, the peer's best tuning in the same run (none with
    /// `--no-peer`).
    peer: Option<f64>,
    /// The goal against the peer (none with `--no-peer`).
    peer_goal: Option<Goal>,
    /// With `--candidates`: each lease candidate's median rate against the control's
    /// (`sql_row_lease`) and the peer's.
    candidates: Vec<CandidateFigure>,
    /// The log source (`relay_log`) against the same baselines: the goals of the log source.
    log: LogFigures,
}

/// The log source's drain, `relay_log`, as ratios to the baselines of the same run, with its
/// goals: at least 1.0x the shared plain loop, 0.8x the JetStream async publish bound, and 2x
/// the peer's best tuning, order kept and every event once.
#[derive(Serialize)]
struct LogFigures {
    over_plain_bound: f64,
    over_jetstream_bound: f64,
    over_peer: Option<f64>,
    over_relay_1: f64,
    goals: Vec<Goal>,
}

/// A lease candidate's median drain, as ratios.
#[derive(Serialize)]
struct CandidateFigure {
    variant: DrainVariant,
    rows_per_second: f64,
    /// Over `sql_row_lease`, today's SQL in the same loop.
    over_row_lease: f64,
    /// Over the peer's best tuning (none with `--no-peer`).
    over_peer: Option<f64>,
}

/// Runs the variants (the peer too, unless `--no-peer`) `--rounds` times, prints the table,
/// writes the JSON.
pub async fn drain_bound(args: BoundArgs) -> Result<()> {
    let workload = Workload::new(args.events, args.aggregates)?;
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    ScratchDatabase::run_in(&args.scratch.database_url, async |scratch| {
        let timeout = Duration::from_secs(args.drain_timeout_seconds);
        let (bench, mut admin, mut machine) =
            setup(scratch, &args.broker, Some(workload), false, timeout).await?;
        eprintln!(
            "drain-bound: {} events over {} aggregates, {} round(s)",
            workload.events, workload.aggregates, args.rounds
        );
        let mut rounds = Vec::new();
        for round in 1..=args.rounds {
            let mut order = vec![
                DrainVariant::PlainBound,
                DrainVariant::SqlBound,
                DrainVariant::JetStreamBound,
                DrainVariant::Relay1,
                DrainVariant::RelayLog,
            ];
            if !args.no_peer {
                order.push(DrainVariant::Peer);
            }
            let named = |v: &DrainVariant| args.only.iter().any(|name| name == v.name());
            order.extend(
                Candidate::MEASURED
                    .into_iter()
                    .map(|(candidate, loops)| candidate.variant(loops))
                    .filter(|v| args.candidates || named(v)),
            );
            if !args.only.is_empty() {
                order.retain(|v| args.only.iter().any(|name| name == v.name()));
            }
            if round % 2 == 0 {
                order.reverse();
            }
            for variant in order {
                let run = if let Some((candidate, loops)) = Candidate::of(variant) {
                    candidates::drain(&bench, &mut admin, round, candidate, loops).await?
                } else {
                    match variant {
                        DrainVariant::SqlBound => {
                            drain::sql_bound(&bench, &mut admin, round).await?
                        }
                        DrainVariant::PlainBound => plain::drain(&bench, &mut admin, round).await?,
                        DrainVariant::JetStreamBound => {
                            drain::jetstream(&bench, &mut admin, round, OUTSTANDING, None).await?
                        }
                        DrainVariant::Peer => peer::drain(&bench, &mut admin, round).await?,
                        DrainVariant::RelayLog => {
                            drain::relay_log(&bench, &mut admin, round).await?
                        }
                        _ => drain::relays(&bench, &mut admin, round, 1).await?,
                    }
                };
                eprintln!(
                    "  round {round} {}: {} events in {:.2} s = {:.0} rows/s{}",
                    variant.name(),
                    run.events,
                    run.seconds,
                    run.rows_per_second,
                    run.check
                        .as_ref()
                        .map(|c| format!(
                            " ({} messages, missing {}, duplicates {}, order ok {})",
                            c.messages, c.missing, c.duplicates, c.order_ok
                        ))
                        .unwrap_or_default()
                );
                rounds.push(run);
            }
        }
        bench.delete_stream().await?;
        if !args.only.is_empty() {
            // The ratios and goals need every variant: a partial run reports its rounds only.
            return Ok(());
        }
        machine.commit_ms_at_end = commit_probe(&mut admin).await?;

        let median = |variant| {
            median_run(rounds.iter().filter(|r| r.variant == variant), |r| {
                r.rows_per_second
            })
        };
        let plain = median(DrainVariant::PlainBound);
        let sql = median(DrainVariant::SqlBound);
        let js = median(DrainVariant::JetStreamBound);
        let relay = median(DrainVariant::Relay1);
        let log = median(DrainVariant::RelayLog);
        let peer = (!args.no_peer).then(|| median(DrainVariant::Peer));
        let log_ok = log.complete
            && log
                .check
                .as_ref()
                .is_some_and(|c| c.order_ok && c.missing == 0);
        let log_goal = |name: &str, value: f64, goal: f64| Goal {
            goal: format!("relay_log / {name} >= {goal}"),
            value,
            met: value >= goal && log_ok,
        };
        let log_figures = LogFigures {
            over_plain_bound: ratio(log.rows_per_second, plain.rows_per_second),
            over_jetstream_bound: ratio(log.rows_per_second, js.rows_per_second),
            over_peer: peer
                .as_ref()
                .map(|p| ratio(log.rows_per_second, p.rows_per_second)),
            over_relay_1: ratio(log.rows_per_second, relay.rows_per_second),
            goals: [
                Some(log_goal(
                    "plain_bound",
                    ratio(log.rows_per_second, plain.rows_per_second),
                    1.0,
                )),
                Some(log_goal(
                    "jetstream_bound",
                    ratio(log.rows_per_second, js.rows_per_second),
                    0.8,
                )),
                peer.as_ref().map(|p| {
                    log_goal(
                        DrainVariant::Peer.name(),
                        ratio(log.rows_per_second, p.rows_per_second),
                        2.0,
                    )
                }),
            ]
            .into_iter()
            .flatten()
            .collect(),
        };
        let min = if sql.rows_per_second <= js.rows_per_second {
            &sql
        } else {
            &js
        };
        let value = ratio(relay.rows_per_second, min.rows_per_second);
        let order_ok = relay
            .check
            .as_ref()
            .is_some_and(|c| c.order_ok && c.missing == 0);
        let goal = Goal {
            goal: format!("relay_1 / min(sql_bound, jetstream_bound) >= {GOAL_VS_BOUND}"),
            value,
            met: value >= GOAL_VS_BOUND && relay.complete && order_ok,
        };
        let peer_goal = peer.as_ref().map(|peer| {
            let value = ratio(relay.rows_per_second, peer.rows_per_second);
            Goal {
                goal: format!("relay_1 / {} >= {GOAL_VS_PEER}", DrainVariant::Peer.name()),
                value,
                // An incomplete peer drain has no rate to hold the relay against.
                met: value >= GOAL_VS_PEER && relay.complete && order_ok && peer.complete,
            }
        });
        let peer_check = peer.as_ref().and_then(|p| p.check.clone());
        let mut candidate_runs = Vec::new();
        let mut candidate_figures = Vec::new();
        if args.candidates {
            let control = median(DrainVariant::SqlRowLease);
            for (candidate, loops) in Candidate::MEASURED {
                candidate_runs.push(median(candidate.variant(loops)));
            }
            for run in &candidate_runs {
                candidate_figures.push(CandidateFigure {
                    variant: run.variant,
                    rows_per_second: run.rows_per_second,
                    over_row_lease: ratio(run.rows_per_second, control.rows_per_second),
                    over_peer: peer
                        .as_ref()
                        .map(|p| ratio(run.rows_per_second, p.rows_per_second)),
                });
            }
        }
        let results = Results {
            machine,
            workload,
            rounds: args.rounds,
            outstanding: OUTSTANDING,
            min_bound: min.variant,
            relay_1_over_plain_bound: ratio(relay.rows_per_second, plain.rows_per_second),
            peer_over_plain_bound: peer
                .as_ref()
                .map(|p| ratio(p.rows_per_second, plain.rows_per_second)),
            relay_1_over_sql_bound: ratio(relay.rows_per_second, sql.rows_per_second),
            relay_1_over_jetstream_bound: ratio(relay.rows_per_second, js.rows_per_second),
            goal,
            peer: peer_goal.as_ref().map(|g| g.value),
            peer_goal,
            candidates: candidate_figures,
            log: log_figures,
            drain: [
                Some(sql),
                Some(js),
                Some(relay),
                peer,
                Some(plain),
                Some(log),
            ]
            .into_iter()
            .flatten()
            .chain(candidate_runs)
            .collect(),
            drain_rounds: rounds,
        };
        println!();
        println!("| variant | events | seconds | rows/s | relay_1 / it |");
        println!("|---------|-------:|--------:|-------:|-------------:|");
        for run in &results.drain {
            println!(
                "| {} | {} | {:.2} | {:.0} | {:.2} |",
                run.variant.name(),
                run.events,
                run.seconds,
                run.rows_per_second,
                ratio(results.drain[2].rows_per_second, run.rows_per_second)
            );
        }
        println!();
        println!(
            "relay_1 / plain_bound (the shared plain loop, same rows): {:.2}{}",
            results.relay_1_over_plain_bound,
            results
                .peer_over_plain_bound
                .map(|p| format!("; oxide_outbox_8x1000 / plain_bound: {p:.2}"))
                .unwrap_or_default()
        );
        println!(
            "{}: {:.2} (min is {}, relay order ok {order_ok}), {}",
            results.goal.goal,
            results.goal.value,
            results.min_bound.name(),
            met(results.goal.met)
        );
        match (&results.peer_goal, &peer_check) {
            (Some(goal), Some(check)) => println!(
                "{}: {:.2} (peer: {} messages for {} events, missing {}, duplicates {}, \
                 per-aggregate order ok {} with {} violations), {}",
                goal.goal,
                goal.value,
                check.messages,
                workload.events,
                check.missing,
                check.duplicates,
                check.order_ok,
                check.order_violations,
                met(goal.met)
            ),
            _ => println!("oxide-outbox's best tuning: not measured (--no-peer)"),
        }
        println!(
            "relay_log: {:.2}x relay_1, {:.2}x plain_bound, {:.2}x jetstream_bound{}",
            results.log.over_relay_1,
            results.log.over_plain_bound,
            results.log.over_jetstream_bound,
            results
                .log
                .over_peer
                .map(|p| format!(", {p:.2}x oxide_outbox_8x1000"))
                .unwrap_or_default()
        );
        for goal in &results.log.goals {
            println!("{}: {:.2}, {}", goal.goal, goal.value, met(goal.met));
        }
        for figure in &results.candidates {
            println!(
                "lease candidate {}: {:.0} rows/s, {:.2}x sql_row_lease{}",
                figure.variant.name(),
                figure.rows_per_second,
                figure.over_row_lease,
                figure
                    .over_peer
                    .map(|p| format!(", {p:.2}x the peer"))
                    .unwrap_or_default()
            );
        }
        args.report.write(&results)
    })
    .await
}
