//! What reached the destination: the demo's stream, topic or audit queue read back in order,
//! printed, and checked against the outbox.

use std::collections::{BTreeMap, HashMap};

use anyhow::{bail, ensure, Context, Result};
use handoff_test::nats::{read_stream, StoredMessage};

use crate::broker::Broker;
use crate::destination::Destination;
use crate::table::{self, Align};
use crate::walkthrough::{short_id, OutboxRow, Report};

/// How many characters of each payload the listing shows.
const PAYLOAD_EXCERPT: usize = 34;

/// What the destination was found to hold, for the summary.
pub struct StreamCheck {
    /// Messages read back.
    pub messages: usize,
}

/// One message as read back from the destination, whatever the broker.
#[derive(Debug, Clone)]
pub struct Record {
    /// Where it is: the stream sequence, `partition@offset`, or its place in the queue (from 1).
    pub position: String,
    /// The Kafka partition it is in; `None` elsewhere.
    pub partition: Option<i32>,
    /// Where it was published: the subject, the Kafka key, or the routing key.
    pub route: String,
    /// Every header as `(name, value)`.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub payload: Vec<u8>,
}

impl Record {
    /// The first value of header `name` (compared without regard to ASCII case: Kafka and
    /// AMQP keep the case handoff wrote, but a reader should not depend on it).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl From<StoredMessage> for Record {
    fn from(message: StoredMessage) -> Self {
        Self {
            position: message.sequence.to_string(),
            partition: None,
            route: message.subject,
            headers: message.headers,
            payload: message.payload,
        }
    }
}

/// Every message of the demo's stream, in stream order.
pub async fn read(broker: &Broker) -> Result<Vec<Record>> {
    let client = broker.client.clone();
    let stream = broker.stream.clone();
    // It panics on failure: in a task of its own, a panic becomes an error we can report.
    let messages = tokio::spawn(async move { read_stream(&client, &stream).await })
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("while reading the stream {}", broker.stream))?;
    Ok(messages.into_iter().map(Record::from).collect())
}

/// The first two columns of the listing: where a message is, and where it was published.
fn columns(destination: Destination) -> [&'static str; 2] {
    match destination {
        Destination::Nats => ["STREAM SEQ", "SUBJECT"],
        Destination::Kafka => ["PARTITION@OFFSET", "KEY"],
        Destination::Amqp => ["QUEUE POS", "ROUTING KEY"],
    }
}

/// What one message is called in the checks' messages.
fn noun(destination: Destination) -> &'static str {
    match destination {
        Destination::Nats => "stream message",
        Destination::Kafka => "record",
        Destination::Amqp => "queued message",
    }
}

/// Where the messages were read from, in the checks' messages.
fn place(destination: Destination) -> &'static str {
    match destination {
        Destination::Nats => "the stream",
        Destination::Kafka => "the topic",
        Destination::Amqp => "the audit queue",
    }
}

/// Prints one line per message: where it is in the stream, where it was published, and what
/// it carries.
pub fn print(destination: Destination, messages: &[Record]) {
    let cells: Vec<Vec<String>> = messages
        .iter()
        .map(|message| {
            vec![
                message.position.clone(),
                short_subject(&message.route),
                message.header("Handoff-Sequence").unwrap_or("-").to_owned(),
                message.header("ce-type").unwrap_or("-").to_owned(),
                message
                    .header("Handoff-Schema-Version")
                    .unwrap_or("-")
                    .to_owned(),
                excerpt(&message.payload),
            ]
        })
        .collect();
    let [position, route] = columns(destination);
    table::print(
        &[
            position,
            route,
            "HANDOFF-SEQUENCE",
            "CE-TYPE",
            "SCHEMA VER",
            "PAYLOAD",
        ],
        &[
            Align::Right,
            Align::Left,
            Align::Right,
            Align::Left,
            Align::Right,
            Align::Left,
        ],
        &cells,
    );
}

/// Checks what was read back against the outbox and prints the result per order: each
/// order's messages carry `Handoff-Sequence` 1, 2, 3 ... in the order read with no gap and no
/// duplicate, each message is one committed outbox event, and every committed event is there.
///
/// The order read is the stream's, the queue's, or for Kafka partition by partition in offset
/// order: all events of one order share a partition (the key is the order id), so each
/// order's events are in their partition's order.
pub fn check(
    destination: Destination,
    messages: &[Record],
    rows: &[OutboxRow],
    report: &Report,
) -> Result<StreamCheck> {
    let (noun, place) = (noun(destination), place(destination));
    let committed: HashMap<(&str, i64), &str> = rows
        .iter()
        .map(|row| {
            (
                (row.aggregate_id.as_str(), row.aggregate_sequence),
                row.event_type.as_str(),
            )
        })
        .collect();
    // Per order, the sequences in the order the stream holds them.
    let mut per_order: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for message in messages {
        let header = |name: &str| {
            message.header(name).with_context(|| {
                format!(
                    "{noun} {} ({}) has no {name} header",
                    message.position, message.route
                )
            })
        };
        let order = header("Handoff-Aggregate-Id")?;
        let sequence: i64 = header("Handoff-Sequence")?.parse().with_context(|| {
            format!(
                "{noun} {} has a Handoff-Sequence that is not a number",
                message.position
            )
        })?;
        let event_type = header("ce-type")?;
        match committed.get(&(order, sequence)) {
            Some(committed_type) if *committed_type == event_type => {}
            Some(committed_type) => bail!(
                "{noun} {} is {event_type} for order {order} sequence {sequence}, but the \
                 outbox committed {committed_type} there",
                message.position
            ),
            None => bail!(
                "{noun} {} ({event_type}, order {order}, sequence {sequence}) is no \
                 committed outbox event",
                message.position
            ),
        }
        per_order.entry(order).or_default().push(sequence);
    }
    for (order, sequences) in &per_order {
        let expected: Vec<i64> = (1..=sequences.len() as i64).collect();
        if *sequences != expected {
            bail!(
                "order {order}: {place} holds Handoff-Sequence {} in this order; expected {}: {}",
                list(sequences),
                list(&expected),
                what_is_wrong(sequences)
            );
        }
    }
    for (order, _) in &report.orders {
        let in_outbox = rows.iter().filter(|r| r.aggregate_id == *order).count();
        let sequences = per_order
            .get(order.as_str())
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        ensure!(
            sequences.len() == in_outbox,
            "order {order}: {} message(s) in {place} for {in_outbox} committed event(s); \
             missing: {}",
            sequences.len(),
            list(&((sequences.len() as i64 + 1)..=in_outbox as i64).collect::<Vec<_>>())
        );
        let plural = if in_outbox == 1 { "" } else { "s" };
        println!(
            "   order {}: Handoff-Sequence {}: its {in_outbox} committed event{plural}, in order, \
             no gap, no duplicate",
            short_id(order),
            list(sequences),
        );
    }
    ensure!(
        messages.len() == rows.len(),
        "{place} holds {} message(s) for {} committed event(s)",
        messages.len(),
        rows.len()
    );
    println!(
        "   nothing else: the replayed retry and the {} refused commands put no message in {place}",
        report.refused
    );
    Ok(StreamCheck {
        messages: messages.len(),
    })
}

/// `1, 2, 3`.
fn list(sequences: &[i64]) -> String {
    if sequences.is_empty() {
        return "(none)".to_owned();
    }
    sequences
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why `sequences` is not 1..n: a duplicate, a gap, or the right numbers out of order.
fn what_is_wrong(sequences: &[i64]) -> String {
    let mut seen: BTreeMap<i64, usize> = BTreeMap::new();
    for sequence in sequences {
        *seen.entry(*sequence).or_default() += 1;
    }
    let duplicates: Vec<i64> = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(s, _)| *s)
        .collect();
    if !duplicates.is_empty() {
        return format!("duplicate {}", list(&duplicates));
    }
    let last = seen.keys().next_back().copied().unwrap_or(0);
    let missing: Vec<i64> = (1..=last).filter(|s| !seen.contains_key(s)).collect();
    if !missing.is_empty() {
        return format!("gap, {} missing", list(&missing));
    }
    "published out of order".to_owned()
}

/// The subject or routing key with its last token (the order id) shortened as everywhere else
/// in the demo; a Kafka key is the order id alone.
fn short_subject(subject: &str) -> String {
    match subject.rsplit_once('.') {
        Some((head, id)) => format!("{head}.{}", short_id(id)),
        None => short_id(subject),
    }
}

/// The payload's first characters, on one line.
fn excerpt(payload: &[u8]) -> String {
    let text = String::from_utf8_lossy(payload);
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= PAYLOAD_EXCERPT {
        return flat;
    }
    let cut: String = flat.chars().take(PAYLOAD_EXCERPT - 1).collect();
    format!("{cut}…")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatches_are_named() {
        assert_eq!(what_is_wrong(&[1, 1, 2]), "duplicate 1");
        assert_eq!(what_is_wrong(&[1, 3]), "gap, 2 missing");
        assert_eq!(what_is_wrong(&[2, 1]), "published out of order");
    }

    #[test]
    fn excerpts_are_cut_by_characters() {
        assert_eq!(excerpt(b"{\"a\": 1}"), "{\"a\": 1}");
        let long = "é".repeat(60);
        assert_eq!(excerpt(long.as_bytes()).chars().count(), PAYLOAD_EXCERPT);
    }
}
