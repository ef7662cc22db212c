//! `handoff quarantine`: the events the relay held for an operator (design P8). `list` and
//! `show` read; `retry`, `repair` and `skip` release one event each, resuming its aggregate in
//! order; `hold` holds a pending event the relay has not held. Each records who did what in
//! `outbox_quarantine_actions`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use handoff_postgres::{EventDetail, Quarantine, QuarantinedEvent};
use uuid::Uuid;

use crate::args::DatabaseArgs;
use crate::format::{self, printable, since};

#[derive(clap::Args)]
pub struct QuarantineArgs {
    #[command(subcommand)]
    command: QuarantineCommand,
}

#[derive(clap::Subcommand)]
enum QuarantineCommand {
    /// Held events, the longest held first.
    List {
        #[command(flatten)]
        database: DatabaseArgs,
        /// Most events shown.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One event in full: state, payload, headers, and every action taken on it.
    Show {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The event id.
        event_id: Uuid,
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Publish a held event as it is (its cause is fixed), with a fresh attempt budget.
    Retry {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The event id.
        event_id: Uuid,
        #[command(flatten)]
        actor: ActorArgs,
    },
    /// Replace a held event's payload from a file (checked like any enqueue), then publish it.
    Repair {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The event id.
        event_id: Uuid,
        /// The corrected payload: a JSON file.
        #[arg(long)]
        payload_file: PathBuf,
        /// The payload limit of the application's outbox, in bytes [default: NATS's 1 MiB
        /// minus the header room].
        #[arg(long)]
        max_payload_bytes: Option<usize>,
        #[command(flatten)]
        actor: ActorArgs,
    },
    /// Never apply a held event: a skip marker (no payload, header Handoff-Skipped) goes out
    /// in its place, so consumers record it and its aggregate moves on.
    ///
    /// A hole (a sequence that was never written, so every later event of its aggregate
    /// waits: `holes` in `handoff status`) is skipped by its place instead of an event id:
    /// `--aggregate-type T --aggregate-id I --sequence N` writes a skip marker row there.
    Skip {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The event id.
        #[arg(required_unless_present = "sequence")]
        event_id: Option<Uuid>,
        /// A missing sequence to skip (a hole), with --aggregate-type and --aggregate-id.
        #[arg(
            long,
            conflicts_with = "event_id",
            requires_all = ["aggregate_type", "aggregate_id"]
        )]
        sequence: Option<i64>,
        /// The hole's aggregate type (with --sequence).
        #[arg(long, requires = "sequence")]
        aggregate_type: Option<String>,
        /// The hole's aggregate id (with --sequence).
        #[arg(long, requires = "sequence")]
        aggregate_id: Option<String>,
        /// Why; kept in the audit and sent to consumers in the marker. Required.
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        actor: ActorArgs,
    },
    /// Hold a pending event the relay has not held (it keeps failing, or keeps killing
    /// relays): it is not published and its aggregate waits behind it, as behind any held
    /// event, until you retry, repair or skip it.
    ///
    /// Refused for a published event, an event already held, or one a relay holds a live
    /// lease on right now.
    Hold {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The event id.
        event_id: Uuid,
        /// Why; kept in the audit. Required.
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        actor: ActorArgs,
    },
}

/// Who acts, for the audit trails of `quarantine` and `saga`.
#[derive(clap::Args)]
pub struct ActorArgs {
    /// Who acts, for the audit [default: $USER@<host>].
    #[arg(long, env = "HANDOFF_ACTOR")]
    actor: Option<String>,
}

impl ActorArgs {
    pub fn name(&self) -> String {
        self.actor.clone().unwrap_or_else(|| {
            let user = std::env::var("USER")
                .or_else(|_| std::env::var("LOGNAME"))
                .unwrap_or_else(|_| "unknown".to_owned());
            format!("{user}@{}", gethostname::gethostname().to_string_lossy())
        })
    }
}

pub async fn run(args: QuarantineArgs) -> Result<()> {
    match args.command {
        QuarantineCommand::List {
            database,
            limit,
            json,
        } => {
            let mut conn = database.connect_migrated("handoff-quarantine").await?;
            let held = Quarantine::new(&database.schema()?)
                .list(&mut conn, limit)
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&held)?);
            } else {
                print_list(&held);
            }
        }
        QuarantineCommand::Show {
            database,
            event_id,
            json,
        } => {
            let mut conn = database.connect_migrated("handoff-quarantine").await?;
            let detail = Quarantine::new(&database.schema()?)
                .show(&mut conn, event_id)
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&detail_json(&detail)?)?);
            } else {
                print_detail(event_id, &detail)?;
            }
        }
        QuarantineCommand::Retry {
            database,
            event_id,
            actor,
        } => {
            let mut conn = database.connect_migrated("handoff-quarantine").await?;
            let record = Quarantine::new(&database.schema()?)
                .retry(&mut conn, event_id, &actor.name())
                .await?;
            println!(
                "released {event_id} for publishing as it is (action {})",
                record.action_id
            );
        }
        QuarantineCommand::Repair {
            database,
            event_id,
            payload_file,
            max_payload_bytes,
            actor,
        } => {
            let payload = std::fs::read_to_string(&payload_file)
                .with_context(|| format!("while reading {}", payload_file.display()))?;
            let mut quarantine = Quarantine::new(&database.schema()?);
            if let Some(max) = max_payload_bytes {
                quarantine = quarantine.with_limits(handoff_core::Limits {
                    max_payload_bytes: max,
                    ..handoff_core::Limits::default()
                });
            }
            let mut conn = database.connect_migrated("handoff-quarantine").await?;
            let record = quarantine
                .repair(&mut conn, event_id, &payload, &actor.name())
                .await?;
            println!(
                "repaired {event_id} and released it for publishing (action {})",
                record.action_id
            );
        }
        QuarantineCommand::Skip {
            database,
            event_id,
            sequence,
            aggregate_type,
            aggregate_id,
            reason,
            actor,
        } => {
            let mut conn = database.connect_migrated("handoff-quarantine").await?;
            let quarantine = Quarantine::new(&database.schema()?);
            match (event_id, sequence, aggregate_type, aggregate_id) {
                (_, Some(sequence), Some(aggregate_type), Some(aggregate_id)) => {
                    let record = quarantine
                        .skip_missing(
                            &mut conn,
                            &aggregate_type,
                            &aggregate_id,
                            sequence,
                            &reason,
                            &actor.name(),
                        )
                        .await?;
                    println!(
                        "skipped missing sequence {sequence} of {aggregate_type}/{aggregate_id}: \
                         a skip marker goes out in its place (action {})",
                        record.action_id
                    );
                }
                (Some(event_id), ..) => {
                    let record = quarantine
                        .skip(&mut conn, event_id, &reason, &actor.name())
                        .await?;
                    println!(
                        "skipped {event_id}: a skip marker goes out in its place (action {})",
                        record.action_id
                    );
                }
                // clap requires an event id or all three of the hole's arguments.
                _ => anyhow::bail!(
                    "give an event id, or --aggregate-type, --aggregate-id and --sequence"
                ),
            }
        }
        QuarantineCommand::Hold {
            database,
            event_id,
            reason,
            actor,
        } => {
            let mut conn = database.connect_migrated("handoff-quarantine").await?;
            let record = Quarantine::new(&database.schema()?)
                .hold(&mut conn, event_id, &reason, &actor.name())
                .await?;
            println!(
                "held {event_id}: its aggregate waits behind it until it is retried, repaired \
                 or skipped (action {})",
                record.action_id
            );
        }
    }
    Ok(())
}

fn print_list(held: &[QuarantinedEvent]) {
    if held.is_empty() {
        println!("no quarantined events");
        return;
    }
    println!(
        "{:<36}  {:<28}  {:>5}  {:<20}  {:>8}  {:>9}  {:>6}  REASON",
        "EVENT ID", "AGGREGATE", "SEQ", "TYPE", "ATTEMPTS", "HELD FOR", "BEHIND"
    );
    for event in held {
        println!(
            "{:<36}  {:<28}  {:>5}  {:<20}  {:>8}  {:>9}  {:>6}  {}",
            event.event_id,
            format!("{}/{}", event.aggregate_type, event.aggregate_id),
            event.aggregate_sequence,
            event.event_type,
            event.attempts,
            event.quarantined_at.map_or("?".to_owned(), since),
            event.held_behind,
            event.reason.as_deref().unwrap_or("-"),
        );
    }
}

/// `show --json`: the event's detail as the console's API answers it (with
/// `delivery_response`, the receipt as a JSON object when it is one).
fn detail_json(detail: &EventDetail) -> Result<serde_json::Value> {
    Ok(handoff_console::event_json(detail)?)
}

/// Indent of the values in `show`'s text.
const VALUE_INDENT: &str = "             ";

/// The receipt as `show` prints it: an HTTP answer recorded by `handoff-http` as its status,
/// headers and body on lines of their own; any other receipt as it is stored.
fn receipt_lines(receipt: &str) -> Vec<String> {
    let Some(response) = handoff_http::RecordedResponse::parse(receipt) else {
        return vec![format!("receipt      {}", printable(receipt))];
    };
    let mut lines = vec![format!(
        "receipt      http {} ({} byte body, sha256:{})",
        response.status, response.body_bytes, response.sha256
    )];
    for (name, value) in &response.headers {
        lines.push(format!("{VALUE_INDENT}{name}: {}", printable(value)));
    }
    let (label, body) = match (&response.body, &response.body_base64) {
        (Some(text), _) => ("body", text.as_str()),
        (None, Some(base64)) => ("body (base64)", base64.as_str()),
        (None, None) => ("body", ""),
    };
    if !body.is_empty() {
        lines.push(format!("{VALUE_INDENT}{label}:"));
        for line in body.lines() {
            lines.push(format!("{VALUE_INDENT}  {}", printable(line)));
        }
    }
    if response.body_truncated {
        lines.push(format!(
            "{VALUE_INDENT}(body cut to its first {} of {} bytes)",
            handoff_http::RECORDED_BODY_BYTES,
            response.body_bytes
        ));
    }
    lines
}

fn print_detail(event_id: Uuid, detail: &EventDetail) -> Result<()> {
    println!("event        {event_id}");
    println!("state        {}", detail.state.as_str());
    if let Some(event) = &detail.event {
        println!(
            "aggregate    {}/{} #{}",
            event.aggregate_type, event.aggregate_id, event.aggregate_sequence
        );
        println!(
            "type         {} v{}",
            event.event_type, event.schema_version
        );
        println!(
            "occurred     {} ({})",
            event.occurred_at.to_rfc3339(),
            since(event.occurred_at)
        );
        if let Some(at) = event.quarantined_at {
            println!("held since   {} ({})", at.to_rfc3339(), since(at));
        }
        println!("attempts     {}", event.attempts);
        if let Some(held_by) = &event.hold_reason {
            println!("held by      {held_by}");
        }
        if event.takeovers > 0 {
            println!("takeovers    {}", event.takeovers);
        }
        println!("last error   {}", event.reason.as_deref().unwrap_or("-"));
        println!(
            "held behind  {} later event(s) of its aggregate",
            event.held_behind
        );
    }
    if let Some(at) = detail.published_at {
        println!("published    {}", at.to_rfc3339());
    }
    if let Some(receipt) = &detail.delivery_receipt {
        for line in receipt_lines(receipt) {
            println!("{line}");
        }
    }
    if let Some(reason) = &detail.skip_reason {
        println!("skipped      {reason}");
    }
    if let Some(headers) = &detail.headers {
        println!("headers      {headers}");
    }
    if let Some(payload) = &detail.payload {
        println!("payload");
        println!("{}", serde_json::to_string_pretty(payload)?);
    }
    format::print_actions(&detail.actions, str::to_owned);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HTTP_RECEIPT: &str = r#"{"status":201,"headers":{"content-type":"application/json","x-request-id":"req-\u001b[31m42"},"body":"{\"id\":\"pay_1\"}\nsecond line","body_truncated":true,"body_bytes":5000,"sha256":"ab12"}"#;

    #[test]
    fn a_recorded_http_answer_prints_status_headers_and_body_on_lines_of_their_own() {
        let lines = receipt_lines(HTTP_RECEIPT);
        assert_eq!(
            lines,
            [
                "receipt      http 201 (5000 byte body, sha256:ab12)",
                "             content-type: application/json",
                "             x-request-id: req- [31m42",
                "             body:",
                "               {\"id\":\"pay_1\"}",
                "               second line",
                "             (body cut to its first 4096 of 5000 bytes)",
            ]
        );
    }

    #[test]
    fn other_receipts_print_as_stored() {
        assert_eq!(
            receipt_lines("jetstream OUTBOX 42"),
            ["receipt      jetstream OUTBOX 42"]
        );
        assert_eq!(
            receipt_lines("http 200 sha256:e3b0"),
            ["receipt      http 200 sha256:e3b0"]
        );
    }

    fn detail(receipt: Option<&str>) -> EventDetail {
        EventDetail {
            state: handoff_postgres::EventState::Published,
            event: None,
            payload: None,
            headers: None,
            published_at: None,
            delivery_receipt: receipt.map(str::to_owned),
            skip_reason: None,
            actions: Vec::new(),
        }
    }

    #[test]
    fn json_adds_the_recorded_answer_as_an_object_and_keeps_the_text() {
        let value = detail_json(&detail(Some(HTTP_RECEIPT))).unwrap();
        assert_eq!(value["delivery_receipt"], HTTP_RECEIPT);
        assert_eq!(value["delivery_response"]["status"], 201);
        assert_eq!(
            value["delivery_response"]["headers"]["content-type"],
            "application/json"
        );
        let value = detail_json(&detail(Some("kafka outbox/3@1207"))).unwrap();
        assert_eq!(value["delivery_receipt"], "kafka outbox/3@1207");
        assert!(value.get("delivery_response").is_none());
        assert!(detail_json(&detail(None))
            .unwrap()
            .get("delivery_response")
            .is_none());
    }
}
