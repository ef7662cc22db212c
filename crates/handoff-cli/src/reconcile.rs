//! `handoff reconcile`: find published events the destination does not hold, and republish
//! them.
//!
//! It works on any destination that can be read back (`--destination nats` or `kafka`, through
//! the read-back seam `handoff_core::readback`); amqp and http are refused on one line.
//!
//! JetStream acknowledges a publish before its write reaches the disk (by default it syncs
//! every two minutes), so a power loss can lose events the outbox already marks published. The
//! outbox is the source of truth: this command reads the published rows of a time range (keys
//! only, in memory: one entry per event of the range), reads the stream's headers from a little
//! before the oldest of them, strikes off every event found (subject and `ce-id`; a replayed
//! copy counts), and reports the rest. With `--republish` it sends the rest again through the
//! replay path, in per-aggregate order.
//!
//! Exit status: 0 nothing missing (or everything missing republished), 2 events missing and not
//! republished, 1 an error.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant as Clock, SystemTime};

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use handoff_core::readback::{MessageScan, ReadBack, ReadFrom};
use handoff_core::EventId;
use handoff_postgres::{RetainedCursor, RetainedEvents, RetainedFilter};
use serde_json::json;
use uuid::Uuid;

use crate::args::{duration, DatabaseArgs, Instant};
use crate::destination::{cannot_read_back, Common, Destination, DestinationArgs, Store, Visit};
use crate::republish::{self, Republisher};

/// Rows read per query.
const PAGE: u32 = 500;

/// Event ids looked up per query when republishing.
const REPUBLISH_CHUNK: usize = 500;

/// The exit status when events are missing and were not republished.
const EXIT_MISSING: u8 = 2;

#[derive(clap::Args)]
#[command(
    after_help = "Exit status: 0 nothing missing (or all of it republished), 2 events \
    missing and --republish not given, 1 an error.\n\nExample (cron, every hour): handoff \
    reconcile --since 2h --until 5m --json"
)]
pub struct ReconcileArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    /// `--destination` (default nats) and its flags, as the relay's.
    #[command(flatten)]
    destination: DestinationArgs,
    /// Check events marked published at or after this instant (RFC 3339 or a duration back
    /// from now, such as 2h).
    #[arg(long)]
    since: Instant,
    /// ... and at or before this one [default: now].
    #[arg(long)]
    until: Option<Instant>,
    /// Republish the missing events (per-aggregate order, header Handoff-Replay:
    /// reconcile-<run id>).
    #[arg(long)]
    republish: bool,
    /// Events republished per second.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
    rate: u32,
    /// How far before the oldest checked event's occurred_at the stream is read: covers the
    /// clock difference between the database and the NATS server.
    #[arg(long, default_value = "1m", value_parser = duration)]
    clock_margin: Duration,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// What the outbox says the stream must hold, for one event.
struct Expected {
    subject: String,
    aggregate_type: String,
    aggregate_id: String,
    aggregate_sequence: i64,
    published_at: DateTime<Utc>,
}

pub async fn run(args: ReconcileArgs) -> Result<ExitCode> {
    let destination = args.destination.clone();
    destination.dispatch(Reconcile(args)).await
}

/// The check (and repair) of the chosen destination.
struct Reconcile(ReconcileArgs);

impl Visit for Reconcile {
    type Output = ExitCode;

    async fn visit<D: Destination>(self, destination: &D) -> Result<ExitCode> {
        if !D::KIND.can_read_back() {
            return Err(cannot_read_back(D::KIND.as_str()));
        }
        let config = destination.resolve(&Common::operator("handoff-reconcile"))?;
        reconcile::<D>(self.0, config).await
    }
}

async fn reconcile<D: Destination>(args: ReconcileArgs, config: D::Config) -> Result<ExitCode> {
    let schema = args.database.schema()?;
    let mut conn = args.database.connect_migrated("handoff-reconcile").await?;
    let retained = RetainedEvents::new(&schema);
    let (names, place) = (D::names(&config), D::place(&config));
    let transport = D::open_store(config).await?;
    let run_id = Uuid::now_v7();
    let started = Clock::now();

    // Taken before the stream's last sequence is: a row marked published by now was
    // acknowledged by now, so its message is at or below the sequence the scan reads up to.
    let now = retained.database_now(&mut conn).await?;
    let until = args.until.map_or(now, |u| u.0.min(now));
    let filter = RetainedFilter {
        published_since: Some(args.since.0),
        published_until: Some(until),
        ..RetainedFilter::default()
    };
    filter.validate()?;

    let mut expected: HashMap<EventId, Expected> = HashMap::new();
    let mut oldest: Option<SystemTime> = None;
    let mut after: Option<RetainedCursor> = None;
    loop {
        let page = retained
            .page(&mut conn, &filter, after.as_ref(), PAGE, false)
            .await?;
        let Some(last) = page.last() else { break };
        after = Some(last.cursor());
        for row in page {
            let event = row.event;
            oldest = Some(oldest.map_or(event.occurred_at, |o| o.min(event.occurred_at)));
            expected.insert(
                event.event_id,
                Expected {
                    subject: transport.location(&event),
                    aggregate_type: event.aggregate_type,
                    aggregate_id: event.aggregate_id,
                    aggregate_sequence: event.aggregate_sequence,
                    published_at: row.published_at,
                },
            );
        }
    }
    let checked = expected.len();

    // Events reach the stream after they occur, so the oldest occurred_at (less the clock
    // margin) is early enough even for an event whose published_at was written long after
    // its acknowledgement.
    let mut scanned: u64 = 0;
    let mut replayed_copies: u64 = 0;
    let mut scan_from = None;
    if let Some(oldest) = oldest {
        let from = oldest
            .checked_sub(args.clock_margin)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        scan_from = Some(DateTime::<Utc>::from(from));
        let mut scan = transport
            .read_back(ReadFrom::Time(from))
            .await
            .with_context(|| format!("while reading {place}"))?;
        let progress = republish::progress("stream messages read");
        while let Some(message) = scan
            .next()
            .await
            .with_context(|| format!("while reading {place}"))?
        {
            scanned += 1;
            progress.inc(1);
            let Some(event_id) = message.event_id else {
                continue;
            };
            if expected
                .get(&event_id)
                .is_some_and(|e| e.subject == message.subject)
            {
                expected.remove(&event_id);
                if message.replay.is_some() {
                    replayed_copies += 1;
                }
            }
        }
        progress.finish_and_clear();
    }

    let mut missing: Vec<(EventId, Expected)> = expected.into_iter().collect();
    missing.sort_by(|(_, a), (_, b)| {
        (&a.aggregate_type, &a.aggregate_id, a.aggregate_sequence).cmp(&(
            &b.aggregate_type,
            &b.aggregate_id,
            b.aggregate_sequence,
        ))
    });
    let marker = format!("reconcile-{run_id}");
    let mut republished: u64 = 0;
    if args.republish && !missing.is_empty() {
        let mut publisher = Republisher::new(
            &transport,
            marker.clone(),
            args.rate,
            republish::progress("missing events republished"),
        );
        // Chunks of the sorted list, each read back in the same order: every aggregate's
        // missing events go out in sequence order.
        for chunk in missing.chunks(REPUBLISH_CHUNK) {
            let ids: Vec<EventId> = chunk.iter().map(|(id, _)| *id).collect();
            let by_id = RetainedFilter {
                event_ids: Some(ids),
                ..RetainedFilter::default()
            };
            let rows = retained
                .page(&mut conn, &by_id, None, REPUBLISH_CHUNK as u32, true)
                .await?;
            for row in &rows {
                publisher.publish(&row.event).await?;
            }
        }
        republished = publisher
            .finish()
            .await
            .with_context(|| format!("reconcile {run_id} stopped while republishing"))?;
    }

    let elapsed = started.elapsed().as_secs_f64();
    tracing::info!(%run_id, checked, missing = missing.len(), republished, "reconcile finished");
    if args.json {
        let events: Vec<_> = missing
            .iter()
            .map(|(id, e)| {
                json!({
                    "event_id": id,
                    "subject": e.subject,
                    "aggregate_type": e.aggregate_type,
                    "aggregate_id": e.aggregate_id,
                    "aggregate_sequence": e.aggregate_sequence,
                    "published_at": e.published_at,
                })
            })
            .collect();
        let summary = json!({
            "run_id": run_id,
            "since": args.since.0,
            "until": until,
            "destination": D::KIND.as_str(),
            "checked": checked,
            "present": checked - missing.len(),
            "present_as_replayed_copy": replayed_copies,
            "missing": missing.len(),
            "missing_events": events,
            "republished": republished,
            "replay_marker": (args.republish && !missing.is_empty()).then_some(&marker),
            "stream_messages_read": scanned,
            "stream_read_from": scan_from,
            "elapsed_seconds": elapsed,
        });
        let mut summary = summary;
        if let Some(object) = summary.as_object_mut() {
            object.extend(names);
        }
        println!("{summary}");
    } else {
        for (id, e) in &missing {
            println!(
                "missing {id} {}/{} #{} published_at {}",
                e.aggregate_type,
                e.aggregate_id,
                e.aggregate_sequence,
                e.published_at.to_rfc3339()
            );
        }
        println!(
            "reconcile {run_id}: {checked} published event(s) checked from {} to {}, {} \
             missing from {place}, {republished} republished{}",
            args.since.0.to_rfc3339(),
            until.to_rfc3339(),
            missing.len(),
            if republished > 0 {
                format!(" (Handoff-Replay: {marker})")
            } else {
                String::new()
            }
        );
    }
    // A row cleaned up between the check and the republish is not republished: still missing.
    if republished < missing.len() as u64 {
        // The one outcome that is neither success nor error; main maps errors to 1.
        return Ok(ExitCode::from(EXIT_MISSING));
    }
    Ok(ExitCode::SUCCESS)
}
