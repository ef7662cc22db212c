//! The in-memory heart of the CDC source: which streamed events may be handed to the relay,
//! and how far the replication position may be confirmed.
//!
//! Pure bookkeeping, no I/O, so the ordering and ack-gating rules can be tested without a
//! server. Two rules carry the guarantees:
//!
//! - **Order (design P5):** an aggregate's events sit in one queue in sequence order; only an
//!   unclaimed run at the front of a queue, and only while none of the queue is claimed, is
//!   handed out, so an event never leaves while another of its aggregate is in flight.
//! - **Redelivery:** after a reconnect the server sends again every transaction after the
//!   position it was last told. A transaction whose `end_lsn` is not past the highest one
//!   already taken in is a copy and is dropped whole (its original is still counted until it
//!   settles). As a second guard, each aggregate keeps the highest sequence handed out until
//!   the position passes it, and no event at or below it is queued again: a copy of an event
//!   already published or in flight never goes out a second time, behind its successor.
//! - **Ack gating (design P4, F4):** transactions are numbered in commit order. The position may
//!   move to a transaction's `end_lsn` only when that transaction and every earlier one are
//!   settled: each of their events is acknowledged by the broker or durably parked in the
//!   table. Never a row's LSN, never `commit_lsn`.
//!
//! An aggregate is *table-driven* while it has unpublished rows the stream cannot be trusted to
//! order: a held (poison) event, events waiting behind one, or rows left from before this
//! process started (a restart, or a slot recreated after it was lost). Its streamed events then
//! settle at once (their rows are in the table) and the sweep publishes the rows in sequence
//! order from the table instead.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Instant;

use handoff_core::delivery::OutboxEvent;
use handoff_core::EventId;

/// An aggregate: `(aggregate_type, aggregate_id)`.
pub(crate) type Key = (String, String);

/// Where an event came from, which decides what settling it means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Streamed in the transaction with this number: settling it counts toward the position.
    Stream(u64),
    /// Read from the table by the sweep: settling it marks its row published.
    Table,
}

/// One aggregate's events in sequence order, and how many of them are claimed (in flight).
#[derive(Debug, Default)]
struct Queue {
    entries: VecDeque<Entry>,
    claimed: usize,
}

/// The highest sequence of an aggregate handed out, and the position past which no copy of it
/// can be streamed again.
#[derive(Debug, Clone, Copy)]
struct Floor {
    sequence: i64,
    end_lsn: u64,
}

#[derive(Debug)]
struct Entry {
    event: OutboxEvent,
    origin: Origin,
    claimed: bool,
    not_before: Option<Instant>,
    /// A position at or past the commit of the event's transaction: its `end_lsn` when
    /// streamed, the server's WAL position after the read when read from the table. Once the
    /// position passes it, no copy of the event can stream in any more.
    commit_bound: u64,
}

/// A delivered transaction that is not settled yet.
#[derive(Debug)]
struct Tx {
    end_lsn: u64,
    commit_micros: i64,
    unsettled: usize,
}

/// What the caller must do after events of a table-driven aggregate streamed in.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Diverted {
    /// Events whose rows must be written back to the table before they count as settled (the
    /// delete-rows mode: the writer's row is gone).
    pub to_write: Vec<(OutboxEvent, u64)>,
    /// Events dropped as copies of events taken in before (a transaction sent again after a
    /// reconnect, or an event at or below its aggregate's highest sequence handed out).
    pub copies: usize,
}

/// The source's state; see the module documentation.
#[derive(Debug, Default)]
pub(crate) struct State {
    queues: HashMap<Key, Queue>,
    /// Aggregates whose front may be claimable, oldest first; may hold stale keys.
    ready: VecDeque<Key>,
    queued: HashSet<Key>,
    index: HashMap<EventId, Key>,
    /// Transactions by number; `first_tx` is the number of the front one.
    txs: VecDeque<Tx>,
    first_tx: u64,
    /// The last position every transaction before which is settled.
    confirmable: u64,
    /// The highest `end_lsn` taken in (or the start position): a transaction at or before it
    /// is a copy the server sent again after a reconnect.
    seen_lsn: u64,
    /// Per aggregate, the highest sequence handed out, kept until the position passes that
    /// event's commit (see the module documentation).
    floors: HashMap<Key, Floor>,
    /// When each floor may go: `(position, aggregate)`, dropped once the position passed it.
    floor_expiry: BTreeMap<u64, Vec<Key>>,
    /// Table-driven aggregates, with a counter bumped whenever one of their rows becomes
    /// durable in the table, so the sweep never frees an aggregate on a stale read.
    table_driven: HashMap<Key, u64>,
    /// Diverted events per table-driven aggregate whose rows are not written yet (deleted-rows
    /// mode). The aggregate must not be freed meanwhile: a sweep that read the table before
    /// such a row landed sees nothing to publish, and freeing the aggregate then would strand
    /// the row, unpublished, until the next restart (tests/it/poison.rs caught it).
    diverting: HashMap<Key, usize>,
    /// Per table-driven aggregate, the highest sequence that streamed in and settled because
    /// its row is kept in the table. A commit is decoded a moment before other sessions see
    /// it, so a sweep may not see that row yet: the aggregate is freed only once a read taken
    /// before the sweep's saw a sequence at least this high.
    diverted_max: HashMap<Key, i64>,
}

impl State {
    /// A state whose position starts at `start_lsn` (the slot's confirmed position).
    pub(crate) fn new(start_lsn: u64) -> State {
        State {
            confirmable: start_lsn,
            seen_lsn: start_lsn,
            ..State::default()
        }
    }

    /// The position that may be confirmed to the server.
    pub(crate) fn confirmable(&self) -> u64 {
        self.confirmable
    }

    /// Whether every delivered transaction is settled (the keepalive position may be
    /// confirmed then).
    pub(crate) fn is_idle(&self) -> bool {
        self.txs.is_empty()
    }

    /// Events handed in and not settled.
    pub(crate) fn pending(&self) -> usize {
        self.index.len()
    }

    /// Commit time (microseconds since the Unix epoch) of the oldest unsettled transaction.
    pub(crate) fn oldest_unsettled_commit(&self) -> Option<i64> {
        self.txs
            .iter()
            .find(|tx| tx.unsettled > 0)
            .map(|tx| tx.commit_micros)
    }

    /// Adds one committed transaction, whole. Returns what must be written to the table for
    /// events of table-driven aggregates when `rows_kept` is false.
    pub(crate) fn commit(
        &mut self,
        events: Vec<OutboxEvent>,
        end_lsn: u64,
        commit_micros: i64,
        rows_kept: bool,
    ) -> Diverted {
        let mut diverted = Diverted::default();
        if end_lsn <= self.seen_lsn {
            // Sent again after a reconnect: this process took it in before, and its original
            // is settled or still counted. Queuing it again would hand out a copy of an event
            // already published (or in flight) in front of its aggregate's successor.
            diverted.copies = events.len();
            return diverted;
        }
        self.seen_lsn = end_lsn;
        let number = self.first_tx + self.txs.len() as u64;
        let mut unsettled = 0;
        for event in events {
            let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
            if self.index.contains_key(&event.event_id) {
                // Already queued (a sweep read its row first): that copy publishes it.
                continue;
            }
            if self.below_floor(&key, event.aggregate_sequence) {
                // Published or in flight already: a second copy would go out after a newer
                // event of its aggregate.
                diverted.copies += 1;
                continue;
            }
            if let Some(counter) = self.table_driven.get_mut(&key) {
                if rows_kept {
                    // The writer's row is in the table: the sweep publishes it in order.
                    *counter += 1;
                    let max = self.diverted_max.entry(key).or_insert(0);
                    *max = (*max).max(event.aggregate_sequence);
                } else {
                    unsettled += 1;
                    *self.diverting.entry(key).or_insert(0) += 1;
                    diverted.to_write.push((event, number));
                }
                continue;
            }
            unsettled += 1;
            self.push(key, event, Origin::Stream(number), end_lsn);
        }
        self.txs.push_back(Tx {
            end_lsn,
            commit_micros,
            unsettled,
        });
        self.advance();
        diverted
    }

    /// Marks the aggregates table-driven (rows the stream will not deliver in order, such as
    /// the backlog found at start-up).
    pub(crate) fn drive_from_table(&mut self, keys: impl IntoIterator<Item = Key>) {
        for key in keys {
            self.table_driven.entry(key).or_insert(0);
        }
    }

    /// The table-driven aggregates, with their counters, for a sweep.
    pub(crate) fn table_driven(&self) -> Vec<(Key, u64)> {
        self.table_driven
            .iter()
            .map(|(key, counter)| (key.clone(), *counter))
            .collect()
    }

    /// The sequence a sweep must see as visible before it may free the aggregate, if any
    /// (see `diverted_max`).
    pub(crate) fn must_see(&self, key: &Key) -> Option<i64> {
        self.diverted_max.get(key).copied()
    }

    /// Whether the aggregate has events queued or in flight.
    pub(crate) fn has_entries(&self, key: &Key) -> bool {
        self.queues.contains_key(key)
    }

    /// A sweep read these unpublished rows of a table-driven aggregate (sequence order), having
    /// seen `counter` before its read, and `visible` (the highest sequence of the aggregate a
    /// read before the sweep's saw in the table). Hands the run out unless the front is held;
    /// frees the aggregate when there are none, nothing became durable meanwhile and every
    /// streamed row was visible to the sweep.
    pub(crate) fn swept(
        &mut self,
        key: &Key,
        counter: u64,
        visible: Option<i64>,
        rows: Vec<SweptRow>,
    ) -> usize {
        let Some(current) = self.table_driven.get(key).copied() else {
            return 0;
        };
        if self.queues.contains_key(key) {
            return 0;
        }
        if rows.is_empty() {
            let seen_all = self
                .diverted_max
                .get(key)
                .is_none_or(|max| visible.is_some_and(|v| v >= *max));
            if current == counter && !self.diverting.contains_key(key) && seen_all {
                self.table_driven.remove(key);
                self.diverted_max.remove(key);
            }
            return 0;
        }
        let mut added = 0;
        for row in rows {
            if row.held {
                break;
            }
            if self.index.contains_key(&row.event.event_id)
                || self.below_floor(key, row.event.aggregate_sequence)
            {
                continue;
            }
            self.push(key.clone(), row.event, Origin::Table, row.read_lsn);
            added += 1;
        }
        added
    }

    /// A row of the table became durable for a diverted event (delete-rows mode): it settles.
    pub(crate) fn written(&mut self, key: &Key, number: u64) {
        if let Some(counter) = self.table_driven.get_mut(key) {
            *counter += 1;
        }
        if let Some(pending) = self.diverting.get_mut(key) {
            *pending -= 1;
            if *pending == 0 {
                self.diverting.remove(key);
            }
        }
        self.settle_tx(number);
        self.advance();
    }

    /// Hands out up to `max` events: unclaimed runs at the front of aggregate queues of which
    /// nothing is in flight.
    #[cfg(test)]
    pub(crate) fn claim(&mut self, max: usize, now: Instant) -> Vec<OutboxEvent> {
        self.claim_within(max, usize::MAX, now).0
    }

    /// As [`claim`](Self::claim), and no more than `max_bytes` of events by
    /// [`OutboxEvent::size_bytes`], the first one whatever its size; a run cut by the budget
    /// keeps its aggregate ready for the next claim. Also says whether the budget cut it.
    pub(crate) fn claim_within(
        &mut self,
        max: usize,
        max_bytes: usize,
        now: Instant,
    ) -> (Vec<OutboxEvent>, bool) {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut bytes_full = false;
        let mut later = Vec::new();
        let mut handed: Vec<(Key, i64, u64)> = Vec::new();
        while out.len() < max {
            let Some(key) = self.ready.pop_front() else {
                break;
            };
            self.queued.remove(&key);
            let Some(queue) = self.queues.get_mut(&key) else {
                continue;
            };
            if queue.claimed > 0 {
                // Another event of the aggregate is in flight: settling or releasing it makes
                // the aggregate ready again.
                continue;
            }
            match queue.entries.front() {
                Some(front) if front.not_before.is_some_and(|t| t > now) => {
                    later.push(key);
                    continue;
                }
                Some(_) => {}
                None => continue,
            }
            let mut top = None;
            for entry in queue.entries.iter_mut() {
                if out.len() >= max || entry.claimed {
                    break;
                }
                let size = entry.event.size_bytes();
                if !out.is_empty() && bytes.saturating_add(size) > max_bytes {
                    bytes_full = true;
                    break;
                }
                if entry.not_before.is_some_and(|t| t > now) {
                    break;
                }
                bytes = bytes.saturating_add(size);
                entry.claimed = true;
                queue.claimed += 1;
                let bound = top.map_or(0, |(_, b)| b);
                top = Some((
                    entry.event.aggregate_sequence,
                    bound.max(entry.commit_bound),
                ));
                out.push(entry.event.clone());
            }
            if let Some((sequence, bound)) = top {
                handed.push((key.clone(), sequence, bound));
            }
            if queue.entries.iter().any(|e| !e.claimed) {
                // The rest of the run waits for room in the next claim.
                later.push(key);
            }
            if bytes_full {
                break;
            }
        }
        for (key, sequence, bound) in handed {
            self.raise_floor(key, sequence, bound);
        }
        for key in later {
            self.enqueue_ready(key);
        }
        (out, bytes_full)
    }

    /// When the earliest delayed event becomes claimable.
    pub(crate) fn next_retry(&self) -> Option<Instant> {
        self.queues
            .values()
            .filter(|q| q.claimed == 0)
            .filter_map(|q| q.entries.front())
            .filter_map(|e| e.not_before)
            .min()
    }

    /// The broker acknowledged the event: it settles. Returns its origin, so a table-sourced
    /// event's row can be marked.
    pub(crate) fn published(&mut self, event_id: &EventId) -> Option<Origin> {
        let entry = self.remove(event_id)?;
        if let Origin::Stream(number) = entry.origin {
            self.settle_tx(number);
        }
        self.advance();
        Some(entry.origin)
    }

    /// The event goes back to its queue, claimable again after `not_before`.
    pub(crate) fn unclaim(&mut self, event_id: &EventId, not_before: Option<Instant>) {
        let Some(key) = self.index.get(event_id).cloned() else {
            return;
        };
        if let Some(queue) = self.queues.get_mut(&key) {
            if let Some(entry) = queue
                .entries
                .iter_mut()
                .find(|e| e.event.event_id == *event_id)
            {
                if entry.claimed {
                    entry.claimed = false;
                    queue.claimed -= 1;
                }
                entry.not_before = not_before;
            }
        }
        self.enqueue_ready(key);
    }

    /// Counts one failed attempt against the event (attempts live in memory: a restart gives
    /// the event a fresh budget, which errs toward retrying).
    pub(crate) fn charge(&mut self, event_id: &EventId) {
        let Some(key) = self.index.get(event_id) else {
            return;
        };
        if let Some(entry) = self
            .queues
            .get_mut(key)
            .and_then(|q| q.entries.iter_mut().find(|e| e.event.event_id == *event_id))
        {
            entry.event.attempt_count = entry.event.attempt_count.saturating_add(1);
        }
    }

    /// Where a handed-in event came from; `None` once settled (or never known).
    pub(crate) fn origin(&self, event_id: &EventId) -> Option<Origin> {
        let key = self.index.get(event_id)?;
        self.queues
            .get(key)?
            .entries
            .iter()
            .find(|e| e.event.event_id == *event_id)
            .map(|e| e.origin)
    }

    /// A copy of the queue of the event's aggregate (what [`State::hold`] would take out).
    pub(crate) fn queue_from(&self, event_id: &EventId) -> Vec<(OutboxEvent, Origin)> {
        self.index
            .get(event_id)
            .and_then(|key| self.queues.get(key))
            .map(|queue| {
                queue
                    .entries
                    .iter()
                    .map(|e| (e.event.clone(), e.origin))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The event is held for an operator: its aggregate turns table-driven and its queue is
    /// taken out. Returns the queue's events (the held one first) with their origins; the
    /// caller makes them durable in the table and then calls [`State::parked`].
    pub(crate) fn hold(&mut self, event_id: &EventId) -> Vec<(OutboxEvent, Origin)> {
        let Some(key) = self.index.get(event_id).cloned() else {
            return Vec::new();
        };
        self.table_driven.entry(key.clone()).or_insert(0);
        // The held event and those behind it were not published: they come back from the table
        // at their own sequences, which the floor must not refuse.
        self.floors.remove(&key);
        let Some(queue) = self.queues.remove(&key) else {
            return Vec::new();
        };
        queue
            .entries
            .into_iter()
            .map(|entry| {
                self.index.remove(&entry.event.event_id);
                (entry.event, entry.origin)
            })
            .collect()
    }

    /// Events taken out by [`State::hold`] are durable in the table now: they settle.
    pub(crate) fn parked(&mut self, key: &Key, origins: &[Origin]) {
        if let Some(counter) = self.table_driven.get_mut(key) {
            *counter += 1;
        }
        for origin in origins {
            if let Origin::Stream(number) = origin {
                self.settle_tx(*number);
            }
        }
        self.advance();
    }

    fn push(&mut self, key: Key, event: OutboxEvent, origin: Origin, commit_bound: u64) {
        self.index.insert(event.event_id, key.clone());
        let queue = &mut self.queues.entry(key.clone()).or_default().entries;
        let at = queue
            .iter()
            .position(|e| e.event.aggregate_sequence > event.aggregate_sequence)
            .unwrap_or(queue.len());
        queue.insert(
            at,
            Entry {
                event,
                origin,
                claimed: false,
                not_before: None,
                commit_bound,
            },
        );
        self.enqueue_ready(key);
    }

    fn remove(&mut self, event_id: &EventId) -> Option<Entry> {
        let key = self.index.remove(event_id)?;
        let queue = self.queues.get_mut(&key)?;
        let at = queue
            .entries
            .iter()
            .position(|e| e.event.event_id == *event_id)?;
        let entry = queue.entries.remove(at)?;
        if entry.claimed {
            queue.claimed -= 1;
        }
        if queue.entries.is_empty() {
            self.queues.remove(&key);
        } else {
            self.enqueue_ready(key);
        }
        Some(entry)
    }

    /// Whether an event of the aggregate at `sequence` was handed out already (the floor).
    fn below_floor(&self, key: &Key, sequence: i64) -> bool {
        self.floors.get(key).is_some_and(|f| sequence <= f.sequence)
    }

    fn raise_floor(&mut self, key: Key, sequence: i64, end_lsn: u64) {
        let floor = self
            .floors
            .entry(key.clone())
            .or_insert(Floor { sequence, end_lsn });
        floor.sequence = floor.sequence.max(sequence);
        floor.end_lsn = floor.end_lsn.max(end_lsn);
        let end_lsn = floor.end_lsn;
        self.floor_expiry.entry(end_lsn).or_default().push(key);
        self.expire_floors();
    }

    /// Drops the floors the position passed: no copy of their events can stream in any more.
    fn expire_floors(&mut self) {
        while let Some(entry) = self.floor_expiry.first_entry() {
            if *entry.key() > self.confirmable {
                break;
            }
            for key in entry.remove() {
                if self
                    .floors
                    .get(&key)
                    .is_some_and(|f| f.end_lsn <= self.confirmable)
                {
                    self.floors.remove(&key);
                }
            }
        }
    }

    fn enqueue_ready(&mut self, key: Key) {
        if self.queued.insert(key.clone()) {
            self.ready.push_back(key);
        }
    }

    fn settle_tx(&mut self, number: u64) {
        if let Some(tx) = number
            .checked_sub(self.first_tx)
            .and_then(|at| self.txs.get_mut(at as usize))
        {
            tx.unsettled = tx.unsettled.saturating_sub(1);
        }
    }

    /// Moves the confirmable position over the settled prefix of transactions.
    fn advance(&mut self) {
        while let Some(front) = self.txs.front() {
            if front.unsettled > 0 {
                break;
            }
            self.confirmable = self.confirmable.max(front.end_lsn);
            self.txs.pop_front();
            self.first_tx += 1;
        }
        self.expire_floors();
    }
}

/// One unpublished row a sweep read from the table.
#[derive(Debug)]
pub(crate) struct SweptRow {
    pub event: OutboxEvent,
    /// Held for an operator (`available_at = 'infinity'`): the aggregate waits.
    pub held: bool,
    /// The server's WAL insert position read after the row (`pg_current_wal_insert_lsn()`):
    /// the row's commit is before it, so the stream may deliver a copy of the row's event
    /// until the position passes it.
    pub read_lsn: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_test::factory::outbox_event;

    fn ids(events: &[OutboxEvent]) -> Vec<(String, i64)> {
        events
            .iter()
            .map(|e| (e.aggregate_id.clone(), e.aggregate_sequence))
            .collect()
    }

    #[test]
    fn the_position_moves_only_over_a_prefix_of_settled_transactions() {
        let mut state = State::new(100);
        let a1 = outbox_event("a", 1);
        let b1 = outbox_event("b", 1);
        state.commit(vec![a1.clone()], 200, 0, true);
        state.commit(vec![b1.clone()], 300, 0, true);
        let claimed = state.claim(10, Instant::now());
        assert_eq!(claimed.len(), 2);
        // The later transaction is acknowledged first: nothing may be confirmed yet.
        state.published(&b1.event_id);
        assert_eq!(state.confirmable(), 100);
        state.published(&a1.event_id);
        assert_eq!(state.confirmable(), 300);
        assert!(state.is_idle());
    }

    #[test]
    fn a_claim_stops_at_its_byte_budget_and_an_event_over_it_goes_alone() {
        let mut state = State::new(0);
        let big = |aggregate: &str, sequence: u64| {
            let mut event = outbox_event(aggregate, sequence);
            event.payload = "x".repeat(100);
            event
        };
        let (a1, a2, b1) = (big("a", 1), big("a", 2), big("b", 1));
        state.commit(vec![a1.clone(), a2.clone(), b1.clone()], 10, 0, true);
        let now = Instant::now();
        // 250 bytes hold two events of 100: a's run; b's would pass the budget and waits.
        let (claimed, bytes_full) = state.claim_within(10, 250, now);
        assert_eq!(ids(&claimed), vec![("a".into(), 1), ("a".into(), 2)]);
        assert!(bytes_full);
        // A budget under one event still hands one out.
        let (claimed, bytes_full) = state.claim_within(10, 1, now);
        assert_eq!(ids(&claimed), vec![("b".into(), 1)]);
        assert!(!bytes_full, "nothing else was ready");
        state.published(&a1.event_id);
        state.published(&a2.event_id);
        state.published(&b1.event_id);
        assert!(state.is_idle());
    }

    #[test]
    fn an_aggregate_never_has_two_claims_out_at_once() {
        let mut state = State::new(0);
        let a1 = outbox_event("a", 1);
        let a2 = outbox_event("a", 2);
        state.commit(vec![a1.clone()], 10, 0, true);
        assert_eq!(ids(&state.claim(10, Instant::now())), vec![("a".into(), 1)]);
        state.commit(vec![a2.clone()], 20, 0, true);
        // a2's predecessor is in flight: it must wait.
        assert!(state.claim(10, Instant::now()).is_empty());
        state.published(&a1.event_id);
        assert_eq!(ids(&state.claim(10, Instant::now())), vec![("a".into(), 2)]);
    }

    #[test]
    fn a_retried_event_waits_out_its_delay_and_keeps_its_successors_behind_it() {
        let mut state = State::new(0);
        let a1 = outbox_event("a", 1);
        let a2 = outbox_event("a", 2);
        state.commit(vec![a1.clone(), a2.clone()], 10, 0, true);
        let now = Instant::now();
        assert_eq!(state.claim(10, now).len(), 2);
        state.unclaim(&a1.event_id, Some(now + std::time::Duration::from_secs(5)));
        state.unclaim(&a2.event_id, None);
        assert!(state.claim(10, now).is_empty());
        let later = now + std::time::Duration::from_secs(6);
        assert_eq!(
            ids(&state.claim(10, later)),
            vec![("a".into(), 1), ("a".into(), 2)]
        );
    }

    #[test]
    fn a_held_event_settles_once_parked_and_its_aggregate_turns_to_the_table() {
        let mut state = State::new(0);
        let a1 = outbox_event("a", 1);
        let a2 = outbox_event("a", 2);
        let b1 = outbox_event("b", 1);
        state.commit(vec![a1.clone(), a2.clone(), b1.clone()], 10, 0, true);
        state.claim(10, Instant::now());
        let taken = state.hold(&a1.event_id);
        assert_eq!(taken.len(), 2);
        assert_eq!(
            state.confirmable(),
            0,
            "not settled before the park is durable"
        );
        let key: Key = ("thing".into(), "a".into());
        state.parked(&key, &taken.iter().map(|(_, o)| *o).collect::<Vec<_>>());
        state.published(&b1.event_id);
        assert_eq!(state.confirmable(), 10);
        // A later streamed event of the held aggregate settles at once (its row is kept).
        let a3 = outbox_event("a", 3);
        state.commit(vec![a3], 20, 0, true);
        assert_eq!(state.confirmable(), 20);
        assert!(state.claim(10, Instant::now()).is_empty());
    }

    #[test]
    fn a_sweep_frees_an_aggregate_only_when_nothing_became_durable_during_its_read() {
        let mut state = State::new(0);
        let key: Key = ("thing".into(), "a".into());
        state.drive_from_table([key.clone()]);
        let seen = state.table_driven()[0].1;
        // While the sweep reads, an event of the aggregate streams in (its row kept).
        state.commit(vec![outbox_event("a", 1)], 10, 0, true);
        state.swept(&key, seen, Some(1), Vec::new());
        assert_eq!(
            state.table_driven().len(),
            1,
            "a stale empty read must not free it"
        );
        let seen = state.table_driven()[0].1;
        let row = outbox_event("a", 1);
        assert_eq!(
            state.swept(
                &key,
                seen,
                Some(1),
                vec![SweptRow {
                    event: row.clone(),
                    held: false,
                    read_lsn: 0,
                }]
            ),
            1
        );
        assert_eq!(state.published(&row.event_id), Some(Origin::Table));
        state.swept(&key, seen, Some(1), Vec::new());
        assert!(state.table_driven().is_empty());
    }

    #[test]
    fn a_sweep_that_cannot_see_a_streamed_row_yet_does_not_free_its_aggregate() {
        let mut state = State::new(0);
        let key: Key = ("thing".into(), "a".into());
        state.drive_from_table([key.clone()]);
        // a3 streams in (row kept) before the sweep reads its counter...
        state.commit(vec![outbox_event("a", 3)], 10, 0, true);
        let seen = state.table_driven()[0].1;
        // ...but its commit is not visible to the sweep's snapshot yet: it sees up to a2.
        state.swept(&key, seen, Some(2), Vec::new());
        assert_eq!(state.table_driven().len(), 1, "a3 would be stranded");
        state.swept(&key, seen, None, Vec::new());
        assert_eq!(state.table_driven().len(), 1, "a3 would be stranded");
        state.swept(&key, seen, Some(3), Vec::new());
        assert!(state.table_driven().is_empty());
    }

    #[test]
    fn a_held_front_row_keeps_the_whole_aggregate_back() {
        let mut state = State::new(0);
        let key: Key = ("thing".into(), "a".into());
        state.drive_from_table([key.clone()]);
        let rows = vec![
            SweptRow {
                event: outbox_event("a", 1),
                held: true,
                read_lsn: 0,
            },
            SweptRow {
                event: outbox_event("a", 2),
                held: false,
                read_lsn: 0,
            },
        ];
        assert_eq!(state.swept(&key, 0, None, rows), 0);
        assert!(state.claim(10, Instant::now()).is_empty());
    }

    #[test]
    fn without_kept_rows_an_aggregate_is_not_freed_while_a_diverted_row_is_being_written() {
        let mut state = State::new(0);
        let key: Key = ("thing".into(), "a".into());
        state.drive_from_table([key.clone()]);
        // The event streams in and is diverted; a sweep reads the table before its row lands.
        let diverted = state.commit(vec![outbox_event("a", 1)], 10, 0, false);
        let seen = state.table_driven()[0].1;
        state.swept(&key, seen, None, Vec::new());
        assert_eq!(
            state.table_driven().len(),
            1,
            "freed with its row still to be written: nobody would publish it"
        );
        state.written(&key, diverted.to_write[0].1);
        assert_eq!(state.table_driven().len(), 1);
    }

    #[test]
    fn without_kept_rows_diverted_events_settle_only_once_written() {
        let mut state = State::new(0);
        let key: Key = ("thing".into(), "a".into());
        state.drive_from_table([key.clone()]);
        let diverted = state.commit(vec![outbox_event("a", 1)], 10, 0, false);
        assert_eq!(diverted.to_write.len(), 1);
        assert_eq!(state.confirmable(), 0);
        state.written(&key, diverted.to_write[0].1);
        assert_eq!(state.confirmable(), 10);
    }

    /// The server sends transactions again from the position it was last told, which lags what
    /// the state settled: here `b1`'s transaction is unsettled, so nothing is confirmable.
    fn reconnect_setup() -> (State, OutboxEvent, OutboxEvent, OutboxEvent) {
        let mut state = State::new(0);
        let b1 = outbox_event("b", 1);
        let a1 = outbox_event("a", 1);
        let a2 = outbox_event("a", 2);
        state.commit(vec![b1.clone()], 10, 0, false);
        state.commit(vec![a1.clone()], 20, 0, false);
        assert_eq!(state.claim(10, Instant::now()).len(), 2);
        state.published(&a1.event_id);
        state.commit(vec![a2.clone()], 30, 0, false);
        assert_eq!(ids(&state.claim(10, Instant::now())), vec![("a".into(), 2)]);
        assert_eq!(state.confirmable(), 0, "b1 is still in flight");
        (state, b1, a1, a2)
    }

    #[test]
    fn after_a_reconnect_a_published_event_is_not_queued_again_in_front_of_its_successor() {
        let (mut state, b1, a1, a2) = reconnect_setup();
        // The connection drops; the server sends all three transactions again.
        let copies: usize = [
            state.commit(vec![b1.clone()], 10, 0, false),
            state.commit(vec![a1.clone()], 20, 0, false),
            state.commit(vec![a2.clone()], 30, 0, false),
        ]
        .iter()
        .map(|d| d.copies)
        .sum();
        assert_eq!(copies, 3, "every redelivered event is recognised as a copy");
        assert!(
            state.claim(10, Instant::now()).is_empty(),
            "a1 was handed out again while a2 is in flight"
        );
        state.published(&a2.event_id);
        assert!(
            state.claim(10, Instant::now()).is_empty(),
            "a stale copy of a1 after a2"
        );
        state.published(&b1.event_id);
        assert_eq!(state.confirmable(), 30);
        assert!(state.is_idle());
        assert_eq!(state.pending(), 0);
    }

    #[test]
    fn after_a_reconnect_an_event_in_flight_is_not_handed_out_twice() {
        let (mut state, b1, _, a2) = reconnect_setup();
        state.commit(vec![b1.clone()], 10, 0, false);
        state.commit(vec![a2.clone()], 30, 0, false);
        assert!(state.claim(10, Instant::now()).is_empty());
        assert_eq!(state.pending(), 2, "b1 and a2, each once");
        state.published(&b1.event_id);
        state.published(&a2.event_id);
        assert_eq!(state.confirmable(), 30);
    }

    #[test]
    fn an_older_sequence_than_one_in_flight_is_never_queued() {
        let (mut state, b1, a1, a2) = reconnect_setup();
        // A copy of a1 in a transaction never seen (no redelivery by position): the floor
        // still refuses it, and its transaction settles at once.
        let mut copy = outbox_event("a", 1);
        copy.event_id = a1.event_id;
        assert_eq!(state.commit(vec![copy], 40, 0, false).copies, 1);
        assert!(state.claim(10, Instant::now()).is_empty());
        state.published(&a2.event_id);
        state.published(&b1.event_id);
        assert_eq!(state.confirmable(), 40);
        assert!(state.claim(10, Instant::now()).is_empty());
        // A newer event of the aggregate still flows.
        let a3 = outbox_event("a", 3);
        state.commit(vec![a3.clone()], 50, 0, false);
        assert_eq!(ids(&state.claim(10, Instant::now())), vec![("a".into(), 3)]);
    }

    #[test]
    fn floors_are_forgotten_once_the_position_passes_them() {
        let (mut state, b1, _, a2) = reconnect_setup();
        state.published(&a2.event_id);
        assert!(!state.floors.is_empty());
        state.published(&b1.event_id);
        assert_eq!(state.confirmable(), 30);
        assert!(state.floors.is_empty(), "{:?}", state.floors);
        assert!(state.floor_expiry.is_empty());
    }

    #[test]
    fn a_released_front_does_not_go_out_while_a_later_event_of_its_aggregate_is_claimed() {
        let mut state = State::new(0);
        let a1 = outbox_event("a", 1);
        let a2 = outbox_event("a", 2);
        state.commit(vec![a1.clone(), a2.clone()], 10, 0, true);
        assert_eq!(state.claim(10, Instant::now()).len(), 2);
        // The lane failed at a1; its outcome is written before a2's release.
        state.unclaim(&a1.event_id, None);
        assert!(
            state.claim(10, Instant::now()).is_empty(),
            "a1 handed out while a2 is still claimed"
        );
        state.unclaim(&a2.event_id, None);
        assert_eq!(
            ids(&state.claim(10, Instant::now())),
            vec![("a".into(), 1), ("a".into(), 2)]
        );
    }

    #[test]
    fn a_held_event_comes_back_from_the_table_past_its_floor() {
        let mut state = State::new(0);
        let a1 = outbox_event("a", 1);
        let a2 = outbox_event("a", 2);
        state.commit(vec![a1.clone(), a2.clone()], 10, 0, true);
        assert_eq!(state.claim(10, Instant::now()).len(), 2);
        let taken = state.hold(&a1.event_id);
        let key: Key = ("thing".into(), "a".into());
        state.parked(&key, &taken.iter().map(|(_, o)| *o).collect::<Vec<_>>());
        // An operator retried it: the sweep reads both rows again.
        let rows = vec![
            SweptRow {
                event: a1.clone(),
                held: false,
                read_lsn: 0,
            },
            SweptRow {
                event: a2.clone(),
                held: false,
                read_lsn: 0,
            },
        ];
        assert_eq!(state.swept(&key, 1, None, rows), 2);
        assert_eq!(
            ids(&state.claim(10, Instant::now())),
            vec![("a".into(), 1), ("a".into(), 2)]
        );
    }

    #[test]
    fn a_row_published_from_the_table_is_not_published_again_when_the_stream_catches_up() {
        // After a (re)start the sweep publishes an aggregate's rows from the table while the
        // stream is still replaying the transactions that wrote them.
        let mut state = State::new(0);
        let key: Key = ("thing".into(), "a".into());
        state.drive_from_table([key.clone()]);
        let rows = (1..=3)
            .map(|n| SweptRow {
                event: outbox_event("a", n),
                held: false,
                read_lsn: 100,
            })
            .collect::<Vec<_>>();
        let a2 = rows[1].event.clone();
        assert_eq!(state.swept(&key, 0, None, rows), 3);
        for event in state.claim(10, Instant::now()) {
            assert_eq!(state.published(&event.event_id), Some(Origin::Table));
        }
        state.swept(&key, 0, None, Vec::new());
        assert!(state.table_driven().is_empty(), "freed: nothing left");
        // a2's transaction streams in only now (its commit is before the read, at 40).
        let b1 = outbox_event("b", 1);
        assert_eq!(state.commit(vec![a2, b1.clone()], 40, 0, true).copies, 1);
        assert_eq!(ids(&state.claim(10, Instant::now())), vec![("b".into(), 1)]);
        state.published(&b1.event_id);
        // The floor lasts until the position passes the read, then is forgotten.
        assert!(!state.floors.is_empty());
        let b2 = outbox_event("b", 2);
        state.commit(vec![b2.clone()], 120, 0, true);
        state.claim(10, Instant::now());
        state.published(&b2.event_id);
        assert_eq!(state.confirmable(), 120);
        assert!(!state.floors.contains_key(&key));
    }
}
