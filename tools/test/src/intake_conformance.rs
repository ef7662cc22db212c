//! The intake conformance suite: the consumer side's counterpart of the transport
//! [`conformance`](crate::conformance) suite. Every intake (the broker-side half of a consumer,
//! [`handoff_core::intake::Intake`]) runs the same cases, so redelivery, settlement, malformed
//! messages, takeover and order are checked the same way on every broker.
//!
//! An intake's crate implements [`IntakeDriver`] in its `tests/it/conformance.rs` — how to make a
//! fresh stream, topic or queue of the case's own, publish onto it what the relay publishes
//! (the crate's own transport) and what it does not (a raw message), and open an intake on it —
//! and invokes [`intake_conformance_suite!`](crate::intake_conformance_suite) inside a module
//! `intake`, which writes one `#[tokio::test]` per case:
//!
//! | test | invariant |
//! |---|---|
//! | `intake::redelivered_after_a_crash` | a delivery taken and never settled (the intake dropped, as a killed process) is delivered again to the next intake of the same durable consumer, group or queue, counted as a redelivery where the broker counts |
//! | `intake::a_nak_comes_back_and_an_ack_never` | a nak'ed delivery comes again (delivery 2); an acked one does not, neither on the live intake nor after a restart |
//! | `intake::malformed_messages_are_handed_over_and_terminated` | a message without the contract headers, and one whose body is not UTF-8, come out as [`MalformedEvent`] with a reason, between the well-formed messages around them; a `term` removes them for good |
//! | `intake::another_instance_takes_over` | of two intakes on one durable consumer, group or queue, the second gets what the first took and left unsettled when it went |
//! | `intake::order_of_one_aggregate` | the events of one aggregate, published in sequence, reach one intake in that order |
//!
//! Where a broker does something else by design, the driver says so through a constant
//! ([`IntakeDriver::COUNTS_REDELIVERIES`]) and the case asserts the intake's documented
//! behaviour instead; every case asserts its invariant otherwise.
//!
//! # Adding an intake
//!
//! In `crates/handoff-<name>/tests/it/conformance.rs`, beside the transport suite's driver:
//!
//! ```ignore
//! mod intake {
//!     use handoff_test::intake_conformance::{IntakeCase, IntakeDriver};
//!
//!     struct Redis { transport: RedisTransport, stream: ScratchStream }
//!
//!     impl IntakeDriver for Redis {
//!         type Transport = RedisTransport;
//!         type Intake = RedisIntake;
//!         const NAME: &'static str = "redis";
//!         const COUNTS_REDELIVERIES: bool = true; // the group's pending list counts
//!
//!         async fn start(case: IntakeCase) -> Self { /* a stream key from case.name() */ }
//!         fn transport(&self) -> &RedisTransport { &self.transport }
//!         async fn publish_raw(&self, headers: &[(String, String)], body: &[u8]) {
//!             /* XADD the fields as given */
//!         }
//!         async fn open(&self, instance: &str) -> RedisIntake {
//!             /* group "svc", consumer `instance`, claim_idle REDELIVER_AFTER */
//!         }
//!         fn redelivery_after(&self) -> Duration { REDELIVER_AFTER }
//!     }
//!
//!     handoff_test::intake_conformance_suite!(Redis);
//! }
//! ```
//!
//! and run it with `cargo nextest run -p handoff-<name> --test conformance`. Each case starts
//! its own driver (its own stream, topic or queue), so the cases run in parallel.
//!
//! The drivers of `handoff-nats`, `handoff-kafka`, `handoff-amqp` and `handoff-redis` (the
//! `intake` module of each `tests/it/conformance.rs`) are the examples to copy.

use std::future::Future;
use std::time::Duration;

use handoff_core::contract;
use handoff_core::delivery::{OutboxEvent, Transport};
use handoff_core::intake::{Delivery, Intake, MalformedEvent, ReceivedEvent, Settle};

use crate::factory;

/// The `ce-source` drivers configure their transport with.
pub const CE_SOURCE: &str = "handoff-intake-conformance";

/// How long a case waits for a delivery that must come: long enough for a consumer group's
/// rebalance after a member left.
pub const DELIVERY_DEADLINE: Duration = Duration::from_secs(30);

/// Slack over twice [`IntakeDriver::redelivery_after`] the suite waits for what must not come.
pub const QUIET_SLACK: Duration = Duration::from_millis(500);

/// How many events the order case publishes.
pub const ORDER_EVENTS: u64 = 20;

/// One case of the suite; [`IntakeDriver::start`] gets it, to name the case's own stream,
/// topic or queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IntakeCase {
    /// [`redelivered_after_a_crash`].
    Crash,
    /// [`a_nak_comes_back_and_an_ack_never`].
    Settle,
    /// [`malformed_messages_are_handed_over_and_terminated`].
    Malformed,
    /// [`another_instance_takes_over`].
    Takeover,
    /// [`order_of_one_aggregate`].
    Order,
}

impl IntakeCase {
    /// A short name, `[a-z]`, for the driver's names: `crash`, `settle`, ...
    pub fn name(self) -> &'static str {
        match self {
            IntakeCase::Crash => "crash",
            IntakeCase::Settle => "settle",
            IntakeCase::Malformed => "malformed",
            IntakeCase::Takeover => "takeover",
            IntakeCase::Order => "order",
        }
    }
}

/// What the suite needs from an intake's crate: implemented once per intake, in the crate's
/// `tests/it/conformance.rs`. See the [module documentation](self).
pub trait IntakeDriver: Sized {
    /// The crate's transport: what the relay publishes with.
    type Transport: Transport;

    /// The intake under test.
    type Intake: Intake;

    /// A short name for failure messages: `nats`, `kafka`, ...
    const NAME: &'static str;

    /// Whether a message delivered again to another intake (after a crash or a takeover)
    /// comes with a `delivery_count` above 1: the broker keeps the count (JetStream's
    /// `num_delivered`, a Redis group's pending list, RabbitMQ's redelivered flag). `false`
    /// where the count starts over in each process (Kafka keeps none); the cases then assert
    /// that it is 1.
    const COUNTS_REDELIVERIES: bool;

    /// A reachable broker with a stream, topic (of one partition) or queue of the case's own,
    /// and the crate's transport onto it with `ce_source` [`CE_SOURCE`]. Nothing has been
    /// published on it yet.
    ///
    /// Panics when it cannot: the case cannot go on.
    fn start(case: IntakeCase) -> impl Future<Output = Self>;

    /// The transport onto the case's channel.
    fn transport(&self) -> &Self::Transport;

    /// Publishes a message with exactly these headers (or properties, or fields) and this body,
    /// outside the contract, behind what was published before (the same partition). Panics
    /// when it cannot.
    fn publish_raw(&self, headers: &[(String, String)], body: &[u8]) -> impl Future<Output = ()>;

    /// A new intake on the case's channel: instance `instance` of the one durable consumer,
    /// consumer group or queue every intake of the case shares. The suite opens instance `a`,
    /// `a` again for a restarted process, and `b` for another process; where the broker names
    /// instances (a Redis consumer) `instance` is the name, elsewhere it may only name the
    /// connection. Unsettled deliveries come again after
    /// [`redelivery_after`](Self::redelivery_after).
    fn open(&self, instance: &str) -> impl Future<Output = Self::Intake>;

    /// The longest a live intake's unsettled delivery stays unsettled before it is delivered
    /// again, as the driver configures it (JetStream's ack wait, Redis's `claim_idle`, the
    /// Kafka intake's `redeliver_after`); zero where only a closed connection brings it back
    /// (RabbitMQ). Short, since the suite waits twice this (and [`QUIET_SLACK`]) wherever a
    /// message must not come again.
    fn redelivery_after(&self) -> Duration;
}

/// A delivery from `D`'s intake.
type DeliveryOf<D> = Delivery<<<D as IntakeDriver>::Intake as Intake>::Settle>;

/// Redelivery after a crash: a delivery taken and never settled, its intake then dropped
/// (the process killed: nothing settled, nothing said to the broker), is delivered again to a
/// new intake of the same durable consumer, group or queue; counted as a redelivery where the
/// broker counts ([`IntakeDriver::COUNTS_REDELIVERIES`]).
pub async fn redelivered_after_a_crash<D: IntakeDriver>() {
    let driver = D::start(IntakeCase::Crash).await;
    let event = factory::outbox_event("crash-1", 1);
    publish(&driver, &event).await;
    let mut before = driver.open("a").await;
    let taken = next::<D>(&mut before, "the first delivery").await;
    assert_is::<D>(&taken, &event, "the first delivery");
    assert_eq!(taken.delivery_count, 1, "{}: a first delivery", D::NAME);
    drop(taken);
    drop(before);

    let mut after = driver.open("a").await;
    let again = next::<D>(&mut after, "the delivery after the crash").await;
    assert_is::<D>(&again, &event, "the delivery after the crash");
    assert_redelivery_count::<D>(&again, "after a crash");
    settle::<D>(again, Settlement::Ack).await;
}

/// Ack only after commit: a delivery handed back (`nak`) comes again, counted 2; once acked it
/// never comes again — not on the live intake within twice its redelivery time, not before the
/// next event, and not after a restart.
pub async fn a_nak_comes_back_and_an_ack_never<D: IntakeDriver>() {
    let driver = D::start(IntakeCase::Settle).await;
    let event = factory::outbox_event("settle-1", 1);
    publish(&driver, &event).await;
    let mut intake = driver.open("a").await;
    let first = next::<D>(&mut intake, "the first delivery").await;
    assert_is::<D>(&first, &event, "the first delivery");
    assert_eq!(first.delivery_count, 1, "{}: a first delivery", D::NAME);
    settle::<D>(first, Settlement::Nak).await;

    let again = next::<D>(&mut intake, "the delivery after a nak").await;
    assert_is::<D>(&again, &event, "the delivery after a nak");
    assert_eq!(
        again.delivery_count,
        2,
        "{}: a nak'ed delivery counts once more",
        D::NAME
    );
    settle::<D>(again, Settlement::Ack).await;

    let later = factory::outbox_event("settle-1", 2);
    publish(&driver, &later).await;
    let delivery = next::<D>(&mut intake, "the next event").await;
    assert_is::<D>(&delivery, &later, "the delivery after an ack");
    settle::<D>(delivery, Settlement::Ack).await;
    settled_for_good(&driver, intake, "acked").await;
}

/// Malformed messages: one without the contract headers and one whose body is not UTF-8 come
/// out, in their place between well-formed events, as [`MalformedEvent`]s that say why; no
/// panic, nothing around them lost. Terminated (`term`, as the consumer does once it
/// quarantined them), they never come again.
pub async fn malformed_messages_are_handed_over_and_terminated<D: IntakeDriver>() {
    let driver = D::start(IntakeCase::Malformed).await;
    let before = factory::outbox_event("malformed-1", 1);
    publish(&driver, &before).await;
    driver.publish_raw(&[], b"{}").await;
    // Every contract header, and a body that is not UTF-8.
    let garbled = factory::outbox_event("malformed-1", 2);
    let headers = contract::headers(&garbled, CE_SOURCE)
        .unwrap_or_else(|e| panic!("the contract headers of a test event: {e}"));
    driver
        .publish_raw(&headers, &[0xff, 0xfe, b'{', 0x80])
        .await;
    let after = factory::outbox_event("malformed-1", 3);
    publish(&driver, &after).await;

    let mut intake = driver.open("a").await;
    let first = next::<D>(&mut intake, "the event before the malformed ones").await;
    assert_is::<D>(&first, &before, "the event before the malformed ones");
    settle::<D>(first, Settlement::Ack).await;

    let bare = next::<D>(&mut intake, "a message without headers").await;
    let malformed = malformed_of::<D>(&bare, "a message without headers");
    assert_eq!(
        (malformed.reason.as_str(), malformed.event_id),
        ("header ce-id is missing", None),
        "{}: {malformed:?}",
        D::NAME
    );
    assert!(
        !malformed.location.is_empty(),
        "{}: a malformed message says where it is",
        D::NAME
    );
    settle::<D>(bare, Settlement::Term).await;

    let not_utf8 = next::<D>(&mut intake, "a body that is not UTF-8").await;
    let malformed = malformed_of::<D>(&not_utf8, "a body that is not UTF-8");
    assert_eq!(
        (malformed.reason.as_str(), malformed.event_id),
        ("the body is not UTF-8", Some(garbled.event_id)),
        "{}: {malformed:?}",
        D::NAME
    );
    settle::<D>(not_utf8, Settlement::Term).await;

    let last = next::<D>(&mut intake, "the event after the malformed ones").await;
    assert_is::<D>(&last, &after, "the event after the malformed ones");
    settle::<D>(last, Settlement::Ack).await;
    settled_for_good(&driver, intake, "terminated").await;
}

/// Takeover by another instance: two intakes on one durable consumer, group or queue; the
/// first takes a delivery and goes (dropped, unsettled); the second, already running, gets it.
pub async fn another_instance_takes_over<D: IntakeDriver>() {
    let driver = D::start(IntakeCase::Takeover).await;
    let event = factory::outbox_event("takeover-1", 1);
    publish(&driver, &event).await;
    let mut first = driver.open("a").await;
    let taken = next::<D>(&mut first, "the first instance's delivery").await;
    assert_is::<D>(&taken, &event, "the first instance's delivery");
    let mut second = driver.open("b").await;
    drop(taken);
    drop(first);

    let again = next::<D>(&mut second, "the second instance's delivery").await;
    assert_is::<D>(&again, &event, "the second instance's delivery");
    assert_redelivery_count::<D>(&again, "after a takeover");
    settle::<D>(again, Settlement::Ack).await;
}

/// Order per aggregate: the events of one aggregate, published in sequence order, are
/// delivered to one intake in that order, each once.
pub async fn order_of_one_aggregate<D: IntakeDriver>() {
    let driver = D::start(IntakeCase::Order).await;
    let events: Vec<_> = (1..=ORDER_EVENTS)
        .map(|n| factory::outbox_event("ordered-1", n))
        .collect();
    for event in &events {
        publish(&driver, event).await;
    }
    let mut intake = driver.open("a").await;
    let mut sequences = Vec::new();
    for _ in &events {
        let delivery = next::<D>(&mut intake, "the next event in order").await;
        sequences.push(event_of::<D>(&delivery, "an ordered event").sequence);
        settle::<D>(delivery, Settlement::Ack).await;
    }
    let expected: Vec<i64> = events.iter().map(|e| e.aggregate_sequence).collect();
    assert_eq!(sequences, expected, "{}", D::NAME);
}

/// Asserts that nothing settled on `intake` comes again: nothing within twice the driver's
/// redelivery time (and [`QUIET_SLACK`]), and after a restart (the intake dropped, a new
/// instance `a` opened) the next delivery is a new event. `settled` says how, for messages.
async fn settled_for_good<D: IntakeDriver>(driver: &D, mut intake: D::Intake, settled: &str) {
    let quiet = driver.redelivery_after() * 2 + QUIET_SLACK;
    if let Ok(delivery) = tokio::time::timeout(quiet, intake.next()).await {
        panic!(
            "{}: a delivery after everything was {settled}: {:?}",
            D::NAME,
            delivery.map(|d| (d.event, d.delivery_count))
        );
    }
    drop(intake);
    let mut restarted = driver.open("a").await;
    let marker = factory::outbox_event("marker", 1);
    publish(driver, &marker).await;
    let delivery = next::<D>(&mut restarted, "the first delivery after a restart").await;
    assert_is::<D>(
        &delivery,
        &marker,
        &format!("after a restart, nothing {settled} comes again"),
    );
    settle::<D>(delivery, Settlement::Ack).await;
}

/// Publishes `event` through the driver's transport, panicking on failure.
async fn publish<D: IntakeDriver>(driver: &D, event: &OutboxEvent) {
    driver
        .transport()
        .publish(event)
        .await
        .unwrap_or_else(|e| panic!("{}: publish of {}: {e}", D::NAME, event.event_id));
}

/// The intake's next delivery (`what`, for the failure message), within [`DELIVERY_DEADLINE`].
async fn next<D: IntakeDriver>(intake: &mut D::Intake, what: &str) -> DeliveryOf<D> {
    match tokio::time::timeout(DELIVERY_DEADLINE, intake.next()).await {
        Ok(Ok(delivery)) => delivery,
        Ok(Err(error)) => panic!("{}: {what}: {error}", D::NAME),
        Err(_) => panic!("{}: {what}: nothing within {DELIVERY_DEADLINE:?}", D::NAME),
    }
}

/// The well-formed event of `delivery`, panicking with `what` when it is malformed.
fn event_of<'d, D: IntakeDriver>(delivery: &'d DeliveryOf<D>, what: &str) -> &'d ReceivedEvent {
    delivery
        .event
        .as_ref()
        .unwrap_or_else(|m| panic!("{}: {what} is malformed: {m:?}", D::NAME))
}

/// The [`MalformedEvent`] of `delivery`, panicking with `what` when it reads as an event.
fn malformed_of<'d, D: IntakeDriver>(
    delivery: &'d DeliveryOf<D>,
    what: &str,
) -> &'d MalformedEvent {
    match &delivery.event {
        Err(malformed) => {
            assert!(
                !malformed.reason.is_empty(),
                "{}: {what}: no reason",
                D::NAME
            );
            malformed
        }
        Ok(event) => panic!("{}: {what} read as an event: {event:?}", D::NAME),
    }
}

/// Asserts that `delivery` is `event`, read back whole.
fn assert_is<D: IntakeDriver>(delivery: &DeliveryOf<D>, event: &OutboxEvent, what: &str) {
    let received = event_of::<D>(delivery, what);
    assert_eq!(
        (
            received.event_id,
            received.aggregate_id.as_str(),
            received.sequence,
            received.payload.as_str()
        ),
        (
            event.event_id,
            event.aggregate_id.as_str(),
            event.aggregate_sequence,
            event.payload.as_str()
        ),
        "{}: {what}",
        D::NAME
    );
}

/// Asserts the count of a delivery that came again to another intake: above 1 where the
/// broker counts, 1 where the count starts over in each process.
fn assert_redelivery_count<D: IntakeDriver>(delivery: &DeliveryOf<D>, when: &str) {
    if D::COUNTS_REDELIVERIES {
        assert!(
            delivery.delivery_count > 1,
            "{}: {when} the broker counts a redelivery, got {}",
            D::NAME,
            delivery.delivery_count
        );
    } else {
        assert_eq!(
            delivery.delivery_count,
            1,
            "{}: {when} the count starts over",
            D::NAME
        );
    }
}

/// How a case settles a delivery.
#[derive(Debug, Clone, Copy)]
enum Settlement {
    /// [`Settle::ack`].
    Ack,
    /// [`Settle::nak`] with no delay.
    Nak,
    /// [`Settle::term`].
    Term,
}

/// Settles `delivery` as `how`, panicking on failure, and drops it: a process lets go of a
/// delivery once settled (the Kafka intake's settle handle keeps its consumer alive, and a
/// consumer alive but no longer polled stalls the group's next rebalance).
async fn settle<D: IntakeDriver>(delivery: DeliveryOf<D>, how: Settlement) {
    let settled = match how {
        Settlement::Ack => delivery.settle.ack().await,
        Settlement::Nak => delivery.settle.nak(Duration::ZERO).await,
        Settlement::Term => delivery.settle.term().await,
    };
    if let Err(error) = settled {
        panic!("{}: {how:?}: {error}", D::NAME);
    }
}

/// Writes one `#[tokio::test]` per case of the intake suite for an [`IntakeDriver`]:
/// `redelivered_after_a_crash`, `a_nak_comes_back_and_an_ack_never`, ... (see the
/// [module documentation](crate::intake_conformance)). Invoke it in a module `intake` of the
/// crate's `tests/it/conformance.rs`, beside the transport suite.
///
/// # Examples
///
/// ```ignore
/// mod intake {
///     // struct JetStream ...; impl IntakeDriver for JetStream { ... }
///     handoff_test::intake_conformance_suite!(JetStream);
/// }
/// ```
#[macro_export]
macro_rules! intake_conformance_suite {
    ($driver:ty) => {
        $crate::intake_conformance_suite!(@case $driver,
            redelivered_after_a_crash,
            a_nak_comes_back_and_an_ack_never,
            malformed_messages_are_handed_over_and_terminated,
            another_instance_takes_over,
            order_of_one_aggregate
        );
    };
    (@case $driver:ty, $($case:ident),+) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::intake_conformance::$case::<$driver>().await;
            }
        )+
    };
}

#[cfg(test)]
mod tests {
    //! The suite on an in-memory broker: it passes as written, and each case fails on a copy
    //! broken in the way that case is there to catch.

    use std::collections::{HashMap, VecDeque};
    use std::panic::AssertUnwindSafe;
    use std::sync::{Arc, Mutex};

    use futures::FutureExt as _;
    use handoff_core::delivery::{PublishError, Receipt};
    use handoff_core::intake::IntakeError;
    use tokio::sync::Notify;

    use super::*;

    /// Nothing broken.
    const SOUND: u8 = 0;
    /// Loses what a dropped intake left unsettled.
    const LOSES_UNSETTLED: u8 = 1;
    /// Delivers an acked message again.
    const ACK_REQUEUES: u8 = 2;
    /// Delivers a terminated message again.
    const TERM_REQUEUES: u8 = 3;
    /// Delivers the newest message first.
    const NEWEST_FIRST: u8 = 4;

    /// A message: its headers and body.
    type Message = (Vec<(String, String)>, Vec<u8>);

    #[derive(Default)]
    struct Queue {
        /// Ready to deliver: id, message, deliveries so far.
        ready: VecDeque<(u64, Message, u64)>,
        /// Delivered and unsettled, by id: the message, its deliveries, the holding intake.
        unsettled: HashMap<u64, (Message, u64, u64)>,
        next_id: u64,
        next_intake: u64,
    }

    #[derive(Default)]
    struct Broker {
        /// std Mutex: never held across `.await`.
        queue: Mutex<Queue>,
        arrived: Notify,
    }

    impl Broker {
        fn push(&self, message: Message) {
            let mut queue = self.queue.lock().unwrap();
            let id = queue.next_id;
            queue.next_id += 1;
            queue.ready.push_back((id, message, 0));
            drop(queue);
            self.arrived.notify_waiters();
        }

        /// Puts `id` back at the front, as the broker does with a message handed back.
        fn requeue(&self, id: u64) {
            let mut queue = self.queue.lock().unwrap();
            if let Some((message, count, _)) = queue.unsettled.remove(&id) {
                queue.ready.push_front((id, message, count));
            }
            drop(queue);
            self.arrived.notify_waiters();
        }
    }

    struct MemoryTransport(Arc<Broker>);

    impl Transport for MemoryTransport {
        async fn publish(&self, event: &OutboxEvent) -> Result<Receipt, PublishError> {
            let headers = contract::headers(event, CE_SOURCE)?;
            self.0.push((headers, event.payload.clone().into_bytes()));
            Ok(Receipt::new("memory"))
        }

        async fn wait_until_ready(&self, _at_most: Duration) -> bool {
            true
        }
    }

    struct MemoryIntake<const BROKEN: u8> {
        broker: Arc<Broker>,
        id: u64,
    }

    impl<const BROKEN: u8> Drop for MemoryIntake<BROKEN> {
        fn drop(&mut self) {
            let queue = self.broker.queue.lock().unwrap();
            let mut held: Vec<u64> = queue
                .unsettled
                .iter()
                .filter(|(_, (_, _, intake))| *intake == self.id)
                .map(|(id, _)| *id)
                .collect();
            drop(queue);
            if BROKEN == LOSES_UNSETTLED {
                return;
            }
            held.sort_unstable();
            for id in held.into_iter().rev() {
                self.broker.requeue(id);
            }
        }
    }

    impl<const BROKEN: u8> Intake for MemoryIntake<BROKEN> {
        type Settle = MemorySettle<BROKEN>;

        async fn next(&mut self) -> Result<Delivery<Self::Settle>, IntakeError> {
            loop {
                let arrived = self.broker.arrived.notified();
                tokio::pin!(arrived);
                arrived.as_mut().enable();
                let taken = {
                    let mut queue = self.broker.queue.lock().unwrap();
                    let taken = if BROKEN == NEWEST_FIRST {
                        queue.ready.pop_back()
                    } else {
                        queue.ready.pop_front()
                    };
                    taken.map(|(id, message, count)| {
                        queue
                            .unsettled
                            .insert(id, (message.clone(), count + 1, self.id));
                        (id, message, count + 1)
                    })
                };
                if let Some((id, (headers, body), delivery_count)) = taken {
                    return Ok(Delivery {
                        event: contract::read_event(headers, &body, "memory"),
                        delivery_count,
                        settle: MemorySettle {
                            broker: Arc::clone(&self.broker),
                            id,
                        },
                    });
                }
                arrived.await;
            }
        }
    }

    struct MemorySettle<const BROKEN: u8> {
        broker: Arc<Broker>,
        id: u64,
    }

    impl<const BROKEN: u8> MemorySettle<BROKEN> {
        fn settle(&self, requeue: bool) -> Result<(), IntakeError> {
            if requeue {
                self.broker.requeue(self.id);
            } else {
                self.broker.queue.lock().unwrap().unsettled.remove(&self.id);
            }
            Ok(())
        }
    }

    impl<const BROKEN: u8> Settle for MemorySettle<BROKEN> {
        async fn ack(&self) -> Result<(), IntakeError> {
            self.settle(BROKEN == ACK_REQUEUES)
        }

        async fn nak(&self, _delay: Duration) -> Result<(), IntakeError> {
            self.settle(true)
        }

        async fn term(&self) -> Result<(), IntakeError> {
            self.settle(BROKEN == TERM_REQUEUES)
        }

        async fn in_progress(&self) -> Result<(), IntakeError> {
            Ok(())
        }
    }

    struct Memory<const BROKEN: u8> {
        transport: MemoryTransport,
    }

    impl<const BROKEN: u8> IntakeDriver for Memory<BROKEN> {
        type Transport = MemoryTransport;
        type Intake = MemoryIntake<BROKEN>;
        const NAME: &'static str = "memory";
        const COUNTS_REDELIVERIES: bool = true;

        async fn start(_case: IntakeCase) -> Self {
            Memory {
                transport: MemoryTransport(Arc::default()),
            }
        }

        fn transport(&self) -> &MemoryTransport {
            &self.transport
        }

        async fn publish_raw(&self, headers: &[(String, String)], body: &[u8]) {
            self.transport.0.push((headers.to_vec(), body.to_vec()));
        }

        async fn open(&self, _instance: &str) -> MemoryIntake<BROKEN> {
            let broker = Arc::clone(&self.transport.0);
            let id = {
                let mut queue = broker.queue.lock().unwrap();
                queue.next_intake += 1;
                queue.next_intake
            };
            MemoryIntake { broker, id }
        }

        fn redelivery_after(&self) -> Duration {
            Duration::ZERO
        }
    }

    /// Whether `case` passes within two seconds (a broken intake may withhold a delivery,
    /// which the suite would wait [`DELIVERY_DEADLINE`] for).
    async fn passes(case: impl Future<Output = ()>) -> bool {
        let bounded = tokio::time::timeout(Duration::from_secs(2), case);
        matches!(AssertUnwindSafe(bounded).catch_unwind().await, Ok(Ok(())))
    }

    #[tokio::test]
    async fn a_sound_intake_passes_every_case() {
        type D = Memory<SOUND>;
        redelivered_after_a_crash::<D>().await;
        a_nak_comes_back_and_an_ack_never::<D>().await;
        malformed_messages_are_handed_over_and_terminated::<D>().await;
        another_instance_takes_over::<D>().await;
        order_of_one_aggregate::<D>().await;
    }

    #[tokio::test]
    async fn each_case_fails_on_the_breakage_it_is_there_to_catch() {
        assert!(!passes(redelivered_after_a_crash::<Memory<LOSES_UNSETTLED>>()).await);
        assert!(!passes(a_nak_comes_back_and_an_ack_never::<Memory<ACK_REQUEUES>>()).await);
        type TermRequeues = Memory<TERM_REQUEUES>;
        assert!(
            !passes(malformed_messages_are_handed_over_and_terminated::<
                TermRequeues,
            >())
            .await
        );
        assert!(!passes(another_instance_takes_over::<Memory<LOSES_UNSETTLED>>()).await);
        assert!(!passes(order_of_one_aggregate::<Memory<NEWEST_FIRST>>()).await);
    }
}
