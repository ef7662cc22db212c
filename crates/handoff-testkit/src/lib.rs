//! `handoff-testkit`: checks your consumer's [`Handler`](handoff_consumer::Handler) against
//! what a broker and a crash do to it.
//!
//! handoff's consumer applies each event's effect exactly once when the handler does all its
//! writes through the transaction it is given (design C1). A handler that also writes through
//! another connection, calls an outside API without [`ExternalCalls`](handoff_consumer::ExternalCalls),
//! or keeps a counter in memory repeats that effect when an event comes again, and events do
//! come again: a crash between the effect and the commit, a lost acknowledgement, a relay's
//! retried publish. [`HandlerCheck`] finds out before production does.
//!
//! It runs your handler in the real [`Consumer`](handoff_consumer::Consumer) (inbox, gap
//! policy, quarantine, batches), in a fresh schema of a real PostgreSQL per run, against a
//! broker whose every choice comes from a seed: aggregates interleaved at random, acknowledged
//! events delivered again, acknowledgements lost, the consumer killed after the handler and
//! before the commit, or after the commit and before the acknowledgement, then restarted. Each
//! seed's end state, as your [`Scenario`] reads it, must equal the state after each event
//! applied once in order; the first seed that differs is reported with the difference and a
//! trace, and runs again the same way with `HANDOFF_TESTKIT_SEED=<seed>`.
//!
//! Place in the layout: a development dependency of a consumer service, above
//! `handoff-consumer`. The guide is docs/consumers.md ("Test your handler").
//!
//! # Examples
//!
//! A handler that sends a welcome mail (here: counts it) outside the transaction fails the
//! check; see [`HandlerCheck`] for a whole scenario.
//!
//! ```no_run
//! # use handoff_testkit::{Events, HandlerCheck, Scenario};
//! # async fn example<S: Scenario>(scenario: S, events: Events) -> Result<(), Box<dyn std::error::Error>> {
//! let report = HandlerCheck::new("postgres://postgres@127.0.0.1/test", scenario, events)
//!     .seeds(0..50)
//!     .run()
//!     .await?;
//! if let Some(failure) = &report.failure {
//!     eprintln!("exactly-once effect broken: {failure}");
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod broker;
mod check;
mod crash;
mod database;
mod error;
mod events;
mod report;

pub use check::{Faults, HandlerCheck, Scenario};
pub use database::Database;
pub use error::{TestkitError, TestkitErrorKind};
pub use events::Events;
pub use report::{Failure, Problem, Report};

/// The error a [`Scenario`]'s `setup` and `observe` may return: anything, `?` converts it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;
