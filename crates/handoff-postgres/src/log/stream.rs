//! The cursor's stream in memory: events read from the log, in per-aggregate queues, handed out
//! one claim per aggregate at a time, and settled; where the cursor may move to; and which
//! aggregates left the stream for the lane.
//!
//! Plain data and no I/O, so that every rule here is tested by the unit tests below; the
//! source ([`super::LogSource`]) runs the queries and keeps this behind a mutex, so that what
//! the cursor skips and what the lane releases are decided one at a time.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Instant;

use handoff_core::delivery::OutboxEvent;
use handoff_core::EventId;

/// An aggregate: its type and id.
pub(crate) type Aggregate = (String, String);

/// Where an event stands in the stream: the range it was read in, then (txid, event id), the
/// order the range is read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Key {
    pub range: u64,
    pub txid: u64,
    pub event_id: EventId,
}

/// What the page query says of an event's predecessor (queries/log/page.sql).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pred {
    /// Nothing to wait for.
    None,
    /// Read in an earlier range.
    Passed,
    /// In this range or a later one.
    InStream,
    /// No predecessor row: a hole, or a row the lane has.
    Missing,
}

impl Pred {
    pub(crate) fn parse(text: &str) -> Pred {
        match text {
            "none" => Pred::None,
            "passed" => Pred::Passed,
            "in_stream" => Pred::InStream,
            _ => Pred::Missing,
        }
    }
}

/// One event read from the log.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub key: Key,
    pub event: OutboxEvent,
}

impl Entry {
    fn aggregate(&self) -> Aggregate {
        (
            self.event.aggregate_type.clone(),
            self.event.aggregate_id.clone(),
        )
    }
}

/// An aggregate the cursor left to its lane (outbox_cursor_lanes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lane {
    pub from_sequence: i64,
    /// The lane published it through this sequence and gave it back.
    pub released_through: Option<i64>,
}

/// Why an aggregate leaves the stream (outbox_cursor_lanes.reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParkReason {
    Failed,
    Held,
    Hole,
}

impl ParkReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ParkReason::Failed => "failed",
            ParkReason::Held => "held",
            ParkReason::Hole => "hole",
        }
    }
}

/// An aggregate to write into the lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Park {
    pub aggregate: Aggregate,
    pub from_sequence: i64,
    pub reason: ParkReason,
}

/// A range of the log: what one snapshot sees and the previous did not.
#[derive(Debug, Clone)]
struct Range {
    no: u64,
    /// The snapshot it reads up to.
    to: String,
    /// The last key read in it, if any.
    read_upto: Option<Key>,
    /// Every page of it is read.
    read_done: bool,
    /// Taken over from another relay: the last key that one had settled it through.
    resumed: Option<Key>,
}

/// The range being read, as the next page query needs it.
#[derive(Debug, Clone)]
pub(crate) struct OpenRange {
    pub no: u64,
    /// The snapshot it starts after.
    pub from: String,
    /// The snapshot it reads up to.
    pub to: String,
    /// The last key read in it.
    pub after: Option<Key>,
    /// The key it was taken over at, from another relay.
    pub resumed: Option<Key>,
}

/// Where the cursor may be moved to (queries/log/advance.sql).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Position {
    /// Everything this snapshot sees is settled.
    pub settled: String,
    /// The open range and where to read it again from (inclusive), if any.
    pub range: Option<(String, String, EventId)>,
}

/// The stream. See the module's documentation.
#[derive(Debug)]
pub(crate) struct Stream {
    /// The snapshot every range so far started from: what is settled before the first range
    /// kept in `ranges`.
    base: String,
    ranges: VecDeque<Range>,
    next_range: u64,
    /// Events read and not settled (queued, deferred or in flight).
    unsettled: BTreeSet<Key>,
    /// Events settled so far (published, skipped, left to the lane).
    settled_total: u64,
    /// The last sequence of each aggregate read in the open range, for `Pred::InStream`.
    accepted: HashMap<Aggregate, i64>,
    /// Events waiting for their predecessor, by (aggregate, predecessor's sequence).
    deferred: HashMap<(Aggregate, i64), Entry>,
    queues: HashMap<Aggregate, VecDeque<Entry>>,
    /// Aggregates with queued events and nothing in flight, by their first event's key.
    ready: BTreeMap<Key, Aggregate>,
    /// Events in flight per aggregate.
    busy: HashMap<Aggregate, usize>,
    /// Aggregates not to be handed out before an instant (after an uncounted failure).
    delayed: HashMap<Aggregate, Instant>,
    in_flight: HashMap<EventId, Entry>,
    lanes: HashMap<Aggregate, Lane>,
    /// The highest sequence of each lane aggregate the cursor skipped: the lane may only give
    /// the aggregate back once it has published that far.
    skipped: HashMap<Aggregate, i64>,
}

impl Stream {
    /// A stream from a cursor whose everything `settled` sees is settled.
    pub(crate) fn new(settled: String) -> Stream {
        Stream {
            base: settled,
            ranges: VecDeque::new(),
            next_range: 0,
            unsettled: BTreeSet::new(),
            settled_total: 0,
            accepted: HashMap::new(),
            deferred: HashMap::new(),
            queues: HashMap::new(),
            ready: BTreeMap::new(),
            busy: HashMap::new(),
            delayed: HashMap::new(),
            in_flight: HashMap::new(),
            lanes: HashMap::new(),
            skipped: HashMap::new(),
        }
    }

    /// Loads a lane row.
    pub(crate) fn set_lane(&mut self, aggregate: Aggregate, lane: Lane) {
        self.lanes.insert(aggregate, lane);
    }

    /// Forgets lane rows the database dropped (queries/log/settle_lanes.sql).
    pub(crate) fn drop_lane(&mut self, aggregate: &Aggregate) {
        if self
            .lanes
            .get(aggregate)
            .is_some_and(|lane| lane.released_through.is_some())
        {
            self.lanes.remove(aggregate);
            self.skipped.remove(aggregate);
        }
    }

    /// Aggregates in the lane and not given back.
    pub(crate) fn lane_len(&self) -> usize {
        self.lanes
            .values()
            .filter(|lane| lane.released_through.is_none())
            .count()
    }

    /// Whether the lane may give `aggregate` back after `through`: the cursor skipped none of
    /// its events past it. Marks it released when so.
    pub(crate) fn release(&mut self, aggregate: &Aggregate, through: i64) -> bool {
        let Some(lane) = self.lanes.get_mut(aggregate) else {
            return false;
        };
        if lane.released_through.is_some()
            || self
                .skipped
                .get(aggregate)
                .is_some_and(|&max| max > through)
        {
            return false;
        }
        lane.released_through = Some(through);
        true
    }

    /// The range being read, or None when no range is open.
    pub(crate) fn open_range(&self) -> Option<OpenRange> {
        let open = self.ranges.back().filter(|r| !r.read_done)?;
        let from = self
            .ranges
            .iter()
            .rev()
            .nth(1)
            .map_or_else(|| self.base.clone(), |r| r.to.clone());
        Some(OpenRange {
            no: open.no,
            from,
            to: open.to.clone(),
            after: open.read_upto,
            resumed: open.resumed,
        })
    }

    /// Opens a range up to snapshot `to`, read from after `resume` (a key of a range that an
    /// earlier holder of the cursor had settled up to).
    pub(crate) fn begin_range(&mut self, to: String, resume: Option<(u64, EventId)>) -> u64 {
        let no = self.next_range;
        self.next_range += 1;
        let resumed = resume.map(|(txid, event_id)| Key {
            range: no,
            txid,
            event_id,
        });
        self.ranges.push_back(Range {
            no,
            to,
            read_upto: resumed,
            read_done: false,
            resumed,
        });
        no
    }

    /// Events read and not yet handed out or settled: the source reads no more while this is
    /// large.
    pub(crate) fn backlog(&self) -> usize {
        self.unsettled.len() - self.in_flight.len()
    }

    /// Takes in one event read from the log, in stream order. Returns the aggregate to park
    /// when the event is held.
    pub(crate) fn accept(&mut self, entry: Entry, pred: Pred, held: bool) -> Option<Park> {
        let key = entry.key;
        if let Some(range) = self.ranges.iter_mut().find(|r| r.no == key.range) {
            range.read_upto = Some(key);
        }
        if entry.event.global_sequence.is_some() {
            // The global lane's: a relay in global order publishes it.
            return None;
        }
        self.unsettled.insert(key);
        let aggregate = entry.aggregate();
        let sequence = entry.event.aggregate_sequence;
        if self.skips(&aggregate, sequence) {
            self.settle(&key);
            return None;
        }
        if held {
            self.settle(&key);
            let park = self.park_here(&aggregate, sequence, ParkReason::Held);
            return Some(park);
        }
        let ready = match pred {
            Pred::None | Pred::Passed => true,
            Pred::InStream => self.accepted.get(&aggregate) == Some(&(sequence - 1)),
            Pred::Missing => false,
        };
        if !ready {
            self.deferred.insert((aggregate, sequence - 1), entry);
            return None;
        }
        self.enqueue(entry);
        // Whatever waited on it follows.
        let mut next = sequence;
        while let Some(waiting) = self.deferred.remove(&(aggregate.clone(), next)) {
            next = waiting.event.aggregate_sequence;
            if self.skips(&aggregate, next) {
                self.settle(&waiting.key);
                continue;
            }
            self.enqueue(waiting);
        }
        None
    }

    /// Whether the cursor leaves this event to the lane, or the lane published it already;
    /// remembers the skip.
    fn skips(&mut self, aggregate: &Aggregate, sequence: i64) -> bool {
        let Some(lane) = self.lanes.get(aggregate) else {
            return false;
        };
        match lane.released_through {
            Some(through) => sequence <= through,
            None if sequence >= lane.from_sequence => {
                let max = self.skipped.entry(aggregate.clone()).or_insert(sequence);
                *max = (*max).max(sequence);
                true
            }
            None => false,
        }
    }

    fn enqueue(&mut self, entry: Entry) {
        let aggregate = entry.aggregate();
        self.accepted
            .insert(aggregate.clone(), entry.event.aggregate_sequence);
        let queue = self.queues.entry(aggregate.clone()).or_default();
        let first = queue.is_empty();
        let key = entry.key;
        queue.push_back(entry);
        if first && !self.busy.contains_key(&aggregate) {
            self.ready.insert(key, aggregate);
        }
    }

    /// Ends the open range: every page of it is read. Events still waiting for a predecessor
    /// send their aggregates to the lane (a hole, or a predecessor committed after them).
    pub(crate) fn end_range(&mut self) -> Vec<Park> {
        if let Some(range) = self.ranges.back_mut() {
            range.read_done = true;
        }
        self.accepted.clear();
        let mut lowest: BTreeMap<Aggregate, i64> = BTreeMap::new();
        for ((aggregate, pred), _) in self.deferred.iter() {
            let low = lowest.entry(aggregate.clone()).or_insert(*pred);
            *low = (*low).min(*pred);
        }
        let deferred = std::mem::take(&mut self.deferred);
        for entry in deferred.into_values() {
            self.settle(&entry.key);
        }
        lowest
            .into_iter()
            .map(|(aggregate, from)| self.park_here(&aggregate, from, ParkReason::Hole))
            .collect()
    }

    /// Moves `aggregate` to the lane from `from_sequence`: its queued events are dropped (the
    /// lane publishes them) and count as skipped.
    fn park_here(&mut self, aggregate: &Aggregate, from_sequence: i64, reason: ParkReason) -> Park {
        // The lane starts at the lowest event the stream drops, when that is below the reason's
        // sequence: a hole's missing predecessor can come after queued events of the same
        // range (a#1 queued, a#3 waits on the never-written a#2), and a lane from a#2 would
        // leave a#1 to no one.
        let from_sequence = self
            .queues
            .get(aggregate)
            .into_iter()
            .flatten()
            .map(|entry| entry.event.aggregate_sequence)
            .fold(from_sequence, i64::min);
        self.lanes.insert(
            aggregate.clone(),
            Lane {
                from_sequence,
                released_through: None,
            },
        );
        if let Some(queue) = self.queues.remove(aggregate) {
            if let Some(head) = queue.front() {
                self.ready.remove(&head.key);
            }
            for entry in queue {
                self.settle(&entry.key);
                let max = self
                    .skipped
                    .entry(aggregate.clone())
                    .or_insert(entry.event.aggregate_sequence);
                *max = (*max).max(entry.event.aggregate_sequence);
            }
        }
        self.delayed.remove(aggregate);
        Park {
            aggregate: aggregate.clone(),
            from_sequence,
            reason,
        }
    }

    /// Hands out up to `max` events and `max_bytes` of them (the first whatever its size),
    /// oldest aggregate first, each aggregate's queued events together and in order. Returns
    /// them and whether queued events wait only on events in flight.
    pub(crate) fn claim(
        &mut self,
        max: usize,
        max_bytes: usize,
        now: Instant,
    ) -> (Vec<OutboxEvent>, bool) {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut later = Vec::new();
        while out.len() < max {
            let Some((key, aggregate)) = self.ready.pop_first() else {
                break;
            };
            if self
                .delayed
                .get(&aggregate)
                .is_some_and(|until| *until > now)
            {
                later.push((key, aggregate));
                continue;
            }
            self.delayed.remove(&aggregate);
            let Some(queue) = self.queues.get_mut(&aggregate) else {
                continue;
            };
            let mut taken = 0;
            while out.len() < max {
                let Some(entry) = queue.front() else { break };
                let size = entry.event.size_bytes();
                if !out.is_empty() && bytes.saturating_add(size) > max_bytes {
                    break;
                }
                let entry = queue.pop_front().expect("front was there");
                bytes = bytes.saturating_add(size);
                out.push(entry.event.clone());
                self.in_flight.insert(entry.event.event_id, entry);
                taken += 1;
            }
            if taken > 0 {
                *self.busy.entry(aggregate.clone()).or_default() += taken;
            }
            if queue.is_empty() {
                self.queues.remove(&aggregate);
            } else if taken == 0 {
                // Cut by the byte budget before its first event: still ready.
                later.push((key, aggregate));
                break;
            }
            if bytes >= max_bytes {
                break;
            }
        }
        for (key, aggregate) in later {
            self.ready.insert(key, aggregate);
        }
        let waiting = self.ready.is_empty() && !self.queues.is_empty();
        (out, waiting)
    }

    /// Whether this event was handed out by the cursor (not the lane).
    pub(crate) fn owns(&self, event_id: &EventId) -> bool {
        self.in_flight.contains_key(event_id)
    }

    /// The broker acknowledged the event.
    pub(crate) fn published(&mut self, event_id: &EventId) {
        if let Some(entry) = self.in_flight.remove(event_id) {
            self.settle(&entry.key);
            self.unbusy(&entry.aggregate());
        }
    }

    /// The event's publish failed. `park`: its aggregate leaves the stream from it (returned,
    /// to be written with the failure); otherwise it goes back to the front of its queue, not
    /// to be handed out before `not_before`.
    pub(crate) fn failed(
        &mut self,
        event_id: &EventId,
        park: bool,
        not_before: Instant,
    ) -> Option<Park> {
        let entry = self.in_flight.remove(event_id)?;
        let aggregate = entry.aggregate();
        let sequence = entry.event.aggregate_sequence;
        if park {
            self.settle(&entry.key);
            let park = self.park_here(&aggregate, sequence, ParkReason::Failed);
            self.unbusy(&aggregate);
            return Some(park);
        }
        self.delayed.insert(aggregate.clone(), not_before);
        self.requeue(entry);
        self.unbusy(&aggregate);
        None
    }

    /// The event was not published (shutdown, a pause, the lease's end): back to its queue.
    pub(crate) fn released(&mut self, event_id: &EventId) {
        if let Some(entry) = self.in_flight.remove(event_id) {
            let aggregate = entry.aggregate();
            self.requeue(entry);
            self.unbusy(&aggregate);
        }
    }

    fn requeue(&mut self, entry: Entry) {
        let aggregate = entry.aggregate();
        if self.skips(&aggregate, entry.event.aggregate_sequence) {
            self.settle(&entry.key);
            return;
        }
        let queue = self.queues.entry(aggregate).or_default();
        let at = queue
            .iter()
            .position(|e| e.event.aggregate_sequence > entry.event.aggregate_sequence)
            .unwrap_or(queue.len());
        queue.insert(at, entry);
    }

    fn unbusy(&mut self, aggregate: &Aggregate) {
        let left = match self.busy.get_mut(aggregate) {
            Some(count) => {
                *count = count.saturating_sub(1);
                *count
            }
            None => 0,
        };
        if left == 0 {
            self.busy.remove(aggregate);
            if let Some(head) = self.queues.get(aggregate).and_then(|q| q.front()) {
                self.ready.insert(head.key, aggregate.clone());
            }
        }
    }

    fn settle(&mut self, key: &Key) {
        if self.unsettled.remove(key) {
            self.settled_total += 1;
        }
    }

    /// Events settled so far: the cursor's row is written only when this moved.
    pub(crate) fn settled_total(&self) -> u64 {
        self.settled_total
    }

    /// The events handed out and not settled.
    pub(crate) fn in_flight_ids(&self) -> Vec<EventId> {
        self.in_flight.keys().copied().collect()
    }

    /// Whether some lane aggregate was given back and waits for the cursor to pass it.
    pub(crate) fn has_released(&self) -> bool {
        self.lanes.values().any(|l| l.released_through.is_some())
    }

    /// Where the cursor may move to. Drops the ranges it passes.
    pub(crate) fn position(&mut self) -> Position {
        let first_unsettled = self.unsettled.first().copied();
        while let Some(range) = self.ranges.front() {
            let settled_whole =
                range.read_done && first_unsettled.is_none_or(|key| key.range > range.no);
            if !settled_whole {
                break;
            }
            let range = self.ranges.pop_front().expect("front was there");
            self.base = range.to;
        }
        let range = self.ranges.front().and_then(|range| {
            // From the first event not settled, or else right after the last one read.
            let resume = match first_unsettled {
                Some(key) if key.range == range.no => Some(key),
                _ => range.read_upto.map(|key| Key {
                    event_id: uuid::Uuid::from_u128(key.event_id.as_u128().wrapping_add(1)),
                    ..key
                }),
            }?;
            Some((range.to.clone(), resume.txid.to_string(), resume.event_id))
        });
        Position {
            settled: self.base.clone(),
            range,
        }
    }

    /// Every event the source holds, for a test's or a shutdown's check.
    #[cfg(test)]
    fn settled(&self) -> bool {
        self.unsettled.is_empty()
    }

    /// The aggregates whose events are in flight.
    #[cfg(test)]
    fn busy_aggregates(&self) -> std::collections::HashSet<Aggregate> {
        self.busy.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    fn entry(range: u64, txid: u64, aggregate: &str, sequence: i64) -> Entry {
        let event_id = EventId::from(uuid::Uuid::from_u128(
            u128::from(txid) << 32 | sequence as u128,
        ));
        Entry {
            key: Key {
                range,
                txid,
                event_id,
            },
            event: OutboxEvent {
                event_id,
                aggregate_type: "order".into(),
                aggregate_id: aggregate.into(),
                aggregate_sequence: sequence,
                global_sequence: None,
                event_type: "t".into(),
                schema_version: 1,
                payload: "{}".into(),
                headers: Vec::new(),
                occurred_at: SystemTime::UNIX_EPOCH,
                attempt_count: 0,
            },
        }
    }

    fn agg(id: &str) -> Aggregate {
        ("order".into(), id.into())
    }

    fn seqs(events: &[OutboxEvent]) -> Vec<(String, i64)> {
        events
            .iter()
            .map(|e| (e.aggregate_id.clone(), e.aggregate_sequence))
            .collect()
    }

    #[test]
    fn a_later_sequence_read_first_waits_for_its_predecessor() {
        let mut s = Stream::new("1:1:".into());
        let r = s.begin_range("9:9:".into(), None);
        // Sequence 3 was written by a transaction with a lower id than sequence 2's.
        s.accept(entry(r, 5, "a", 3), Pred::InStream, false);
        s.accept(entry(r, 6, "a", 2), Pred::Passed, false);
        let (events, _) = s.claim(10, usize::MAX, Instant::now());
        assert_eq!(seqs(&events), vec![("a".into(), 2), ("a".into(), 3)]);
    }

    #[test]
    fn one_aggregate_is_never_in_flight_twice() {
        let mut s = Stream::new("1:1:".into());
        let r = s.begin_range("9:9:".into(), None);
        s.accept(entry(r, 5, "a", 1), Pred::None, false);
        s.accept(entry(r, 6, "b", 1), Pred::None, false);
        let (first, _) = s.claim(1, usize::MAX, Instant::now());
        assert_eq!(seqs(&first), vec![("a".into(), 1)]);
        s.accept(entry(r, 7, "a", 2), Pred::InStream, false);
        let (second, _) = s.claim(10, usize::MAX, Instant::now());
        assert_eq!(seqs(&second), vec![("b".into(), 1)], "a:2 waits for a:1");
        assert!(s.busy_aggregates().contains(&agg("a")));
        s.published(&first[0].event_id);
        let (third, _) = s.claim(10, usize::MAX, Instant::now());
        assert_eq!(seqs(&third), vec![("a".into(), 2)]);
    }

    #[test]
    fn the_cursor_moves_only_past_settled_events() {
        let mut s = Stream::new("1:1:".into());
        let r = s.begin_range("9:9:".into(), None);
        s.accept(entry(r, 5, "a", 1), Pred::None, false);
        s.accept(entry(r, 6, "b", 1), Pred::None, false);
        assert!(s.end_range().is_empty());
        let (events, _) = s.claim(10, usize::MAX, Instant::now());
        s.published(&events[1].event_id);
        let position = s.position();
        assert_eq!(position.settled, "1:1:");
        let (_, txid, _) = position.range.expect("open range");
        assert_eq!(
            txid, "5",
            "read again from a:1, the first event not settled"
        );
        s.published(&events[0].event_id);
        let position = s.position();
        assert_eq!(position.settled, "9:9:");
        assert!(position.range.is_none());
        assert!(s.settled());
    }

    #[test]
    fn a_failed_aggregate_leaves_the_stream_with_what_is_queued_behind_it() {
        let mut s = Stream::new("1:1:".into());
        let r = s.begin_range("9:9:".into(), None);
        s.accept(entry(r, 5, "a", 1), Pred::None, false);
        let (events, _) = s.claim(10, usize::MAX, Instant::now());
        s.accept(entry(r, 6, "a", 2), Pred::InStream, false);
        s.accept(entry(r, 7, "b", 1), Pred::None, false);
        let park = s
            .failed(&events[0].event_id, true, Instant::now())
            .expect("parked");
        assert_eq!(park.from_sequence, 1);
        assert_eq!(park.reason, ParkReason::Failed);
        // a:2 went with it; a:3, read later, is skipped too.
        s.accept(entry(r, 8, "a", 3), Pred::InStream, false);
        let (events, _) = s.claim(10, usize::MAX, Instant::now());
        assert_eq!(seqs(&events), vec![("b".into(), 1)]);
        // The lane may not give a back through 2: the cursor skipped 3.
        assert!(!s.release(&agg("a"), 2));
        assert!(s.release(&agg("a"), 3));
        // Given back: 3 and below are the lane's, 4 is the cursor's.
        s.accept(entry(r, 9, "a", 3), Pred::InStream, false);
        s.accept(entry(r, 10, "a", 4), Pred::Passed, false);
        let (events2, _) = s.claim(10, usize::MAX, Instant::now());
        assert_eq!(seqs(&events2), vec![("a".into(), 4)]);
    }

    #[test]
    fn an_uncounted_failure_comes_back_first_after_its_delay() {
        let mut s = Stream::new("1:1:".into());
        let r = s.begin_range("9:9:".into(), None);
        s.accept(entry(r, 5, "a", 1), Pred::None, false);
        s.accept(entry(r, 5, "a", 2), Pred::InStream, false);
        let now = Instant::now();
        let (events, _) = s.claim(10, usize::MAX, now);
        assert_eq!(events.len(), 2);
        assert!(s
            .failed(&events[0].event_id, false, now + Duration::from_secs(1))
            .is_none());
        s.released(&events[1].event_id);
        assert!(s.claim(10, usize::MAX, now).0.is_empty(), "delayed");
        let (again, _) = s.claim(10, usize::MAX, now + Duration::from_secs(2));
        assert_eq!(seqs(&again), vec![("a".into(), 1), ("a".into(), 2)]);
    }

    #[test]
    fn a_missing_predecessor_parks_the_aggregate_at_the_range_end() {
        let mut s = Stream::new("1:1:".into());
        let r = s.begin_range("9:9:".into(), None);
        s.accept(entry(r, 5, "a", 4), Pred::Missing, false);
        s.accept(entry(r, 6, "b", 1), Pred::None, false);
        let parks = s.end_range();
        assert_eq!(
            parks,
            vec![Park {
                aggregate: agg("a"),
                from_sequence: 3,
                reason: ParkReason::Hole
            }]
        );
        let (events, _) = s.claim(10, usize::MAX, Instant::now());
        assert_eq!(seqs(&events), vec![("b".into(), 1)]);
    }

    #[test]
    fn a_hole_parks_the_aggregate_from_its_queued_events_before_the_hole() {
        let mut s = Stream::new("1:1:".into());
        let r = s.begin_range("9:9:".into(), None);
        s.accept(entry(r, 5, "a", 1), Pred::None, false);
        s.accept(entry(r, 6, "a", 3), Pred::Missing, false);
        let parks = s.end_range();
        assert_eq!(
            parks,
            vec![Park {
                aggregate: agg("a"),
                from_sequence: 1,
                reason: ParkReason::Hole
            }],
            "a#1, dropped from the stream, is the lane's"
        );
    }

    #[test]
    fn the_byte_budget_cuts_between_events_and_always_lets_one_through() {
        let mut s = Stream::new("1:1:".into());
        let r = s.begin_range("9:9:".into(), None);
        s.accept(entry(r, 5, "a", 1), Pred::None, false);
        s.accept(entry(r, 6, "b", 1), Pred::None, false);
        let (events, _) = s.claim(10, 1, Instant::now());
        assert_eq!(events.len(), 1);
        let (events, _) = s.claim(10, 1, Instant::now());
        assert_eq!(events.len(), 1);
    }
}
