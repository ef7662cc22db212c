//! `handoff replay`: republish retained, published events (design O3) with a replay marker.
//!
//! Rows are read page by page in per-aggregate order (`handoff_postgres::RetainedEvents`) and
//! published through `republish::Republisher` into the destination (`--destination`, as the
//! relay's): the relay's subject or topic and headers, and the header `Handoff-Replay: <replay
//! id>` (on JetStream also a `Nats-Msg-Id` of their own so the stream's duplicate window does
//! not drop them). Consumers deduplicate them by `ce-id` in their inbox. A destination that
//! cannot be read back (amqp, http) is refused.

use std::time::Instant as Clock;

use anyhow::{bail, Context, Result};
use handoff_postgres::{RetainedCursor, RetainedEvents, RetainedFilter};
use serde_json::json;
use uuid::Uuid;

use crate::args::{DatabaseArgs, Instant};
use crate::destination::{cannot_read_back, Common, Destination, DestinationArgs, Visit};
use crate::republish::{self, Republisher};

/// Rows read per query.
const PAGE: u32 = 500;

/// Most events a `--dry-run --json` lists (the count is always exact).
const LIST_LIMIT: usize = 1000;

#[derive(clap::Args)]
#[command(
    after_help = "At least one filter, or --all, is required. Times are RFC 3339 \
    (2026-12-04T10:00:00Z) or a duration back from now (15m, 2h, 7d); both bounds are \
    inclusive and apply to occurred_at.\n\nExample: handoff replay --aggregate-type order \
    --aggregate-id o-42 --since 2d"
)]
pub struct ReplayArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    /// `--destination` (default nats) and its flags, as the relay's.
    #[command(flatten)]
    destination: DestinationArgs,
    /// Only events of this aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only events of this aggregate (needs --aggregate-type).
    #[arg(long, requires = "aggregate_type")]
    aggregate_id: Option<String>,
    /// Only events of this type.
    #[arg(long)]
    event_type: Option<String>,
    /// Only events that occurred at or after this instant.
    #[arg(long)]
    since: Option<Instant>,
    /// Only events that occurred at or before this instant.
    #[arg(long)]
    until: Option<Instant>,
    /// Replay every retained published event (required when no filter is given).
    #[arg(long)]
    all: bool,
    /// Events published per second.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
    rate: u32,
    /// Count and list what would be replayed; publish nothing (needs no broker).
    #[arg(long)]
    dry_run: bool,
    /// Print one JSON object (the summary) on stdout instead of text.
    #[arg(long)]
    json: bool,
}

impl ReplayArgs {
    fn filter(&self) -> RetainedFilter {
        RetainedFilter {
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            event_type: self.event_type.clone(),
            occurred_since: self.since.map(|i| i.0),
            occurred_until: self.until.map(|i| i.0),
            ..RetainedFilter::default()
        }
    }
}

pub async fn run(args: ReplayArgs) -> Result<()> {
    let destination = args.destination.clone();
    destination.dispatch(Replay(args)).await
}

/// The replay, into the chosen destination.
struct Replay(ReplayArgs);

impl Visit for Replay {
    type Output = ();

    async fn visit<D: Destination>(self, destination: &D) -> Result<()> {
        if !D::KIND.can_read_back() {
            return Err(cannot_read_back(D::KIND.as_str()));
        }
        let config = destination.resolve(&Common::operator("handoff-replay"))?;
        replay::<D>(self.0, config).await
    }
}

async fn replay<D: Destination>(args: ReplayArgs, config: D::Config) -> Result<()> {
    let filter = args.filter();
    filter.validate()?;
    if filter.is_unfiltered() && !args.all {
        bail!(
            "no filter given: pass --aggregate-type/--aggregate-id, --event-type, --since or \
             --until, or --all to replay every retained event"
        );
    }
    let schema = args.database.schema()?;
    let mut conn = args.database.connect_migrated("handoff-replay").await?;
    let retained = RetainedEvents::new(&schema);
    let replay_id = Uuid::now_v7();
    let (names, place) = (D::names(&config), D::place(&config));
    let store = if args.dry_run {
        None
    } else {
        Some(D::open_store(config).await?)
    };
    let mut publisher = store.as_ref().map(|t| {
        Republisher::new(
            t,
            replay_id.to_string(),
            args.rate,
            republish::progress("events replayed"),
        )
    });
    tracing::info!(%replay_id, dry_run = args.dry_run, "replay started");

    let started = Clock::now();
    let mut matched: u64 = 0;
    let mut listed = Vec::new();
    let mut after: Option<RetainedCursor> = None;
    loop {
        let page = retained
            .page(&mut conn, &filter, after.as_ref(), PAGE, !args.dry_run)
            .await?;
        let Some(last) = page.last() else { break };
        after = Some(last.cursor());
        for row in &page {
            matched += 1;
            let event = &row.event;
            match publisher.as_mut() {
                Some(publisher) => publisher.publish(event).await?,
                None if args.json => {
                    if listed.len() < LIST_LIMIT {
                        listed.push(json!({
                            "event_id": event.event_id,
                            "aggregate_type": event.aggregate_type,
                            "aggregate_id": event.aggregate_id,
                            "aggregate_sequence": event.aggregate_sequence,
                            "event_type": event.event_type,
                        }));
                    }
                }
                None => println!(
                    "{} {}/{} #{} {}",
                    event.event_id,
                    event.aggregate_type,
                    event.aggregate_id,
                    event.aggregate_sequence,
                    event.event_type
                ),
            }
        }
    }
    let published = match publisher {
        Some(publisher) => publisher
            .finish()
            .await
            .with_context(|| format!("replay {replay_id} stopped"))?,
        None => 0,
    };
    let elapsed = started.elapsed().as_secs_f64();
    tracing::info!(%replay_id, matched, published, "replay finished");
    if args.json {
        let mut summary = json!({
            "replay_id": replay_id,
            "dry_run": args.dry_run,
            "matched": matched,
            "published": published,
            "destination": D::KIND.as_str(),
            "rate": args.rate,
            "elapsed_seconds": elapsed,
            "filter": {
                "aggregate_type": filter.aggregate_type,
                "aggregate_id": filter.aggregate_id,
                "event_type": filter.event_type,
                "since": filter.occurred_since,
                "until": filter.occurred_until,
                "all": args.all,
            },
        });
        if let Some(object) = summary.as_object_mut() {
            object.extend(names);
        }
        if args.dry_run {
            summary["events"] = listed.into();
            summary["events_truncated"] = (matched > LIST_LIMIT as u64).into();
        }
        println!("{summary}");
    } else if args.dry_run {
        println!("dry run: {matched} event(s) would be replayed; nothing published");
    } else {
        println!(
            "replay {replay_id}: {matched} matched, {published} published to {place} in \
             {elapsed:.1}s"
        );
    }
    Ok(())
}
