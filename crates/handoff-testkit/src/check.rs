//! [`HandlerCheck`]: a clean run, then seeded runs under faults, each compared with it.

use std::fmt::Debug;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use handoff_consumer::{Consumer, ConsumerConfig, Handler};
use tokio::sync::oneshot;

use crate::broker::{Broker, BrokerIntake};
use crate::crash::Crashing;
use crate::{BoxError, Database, Events, Failure, Problem, Report, TestkitError, TestkitErrorKind};

/// The consumer under test: how to set up its tables and handler in a run's fresh schema, and
/// how to read back what its events did.
///
/// The check compares what [`observe`](Self::observe) returns after each seeded run with what
/// it returns after the clean run, so it must read every effect the handler has, including
/// those outside the transaction (rows written through another connection, calls counted by a
/// fake of the outside service), and return them in an order that does not depend on timing
/// (sorted).
pub trait Scenario: Send + Sync {
    /// The handler under test.
    type Handler: Handler;
    /// What the handler's effects left, as compared between runs.
    type State: PartialEq + Debug + Clone + Send;

    /// Creates the consumer's own tables in `db` (handoff's are there already) and returns the
    /// handler, for one run.
    fn setup(&self, db: &Database) -> impl Future<Output = Result<Self::Handler, BoxError>> + Send;

    /// Reads the effects of the run from `db` (and from `handler`, for what it keeps outside
    /// the database).
    fn observe(
        &self,
        db: &Database,
        handler: &Self::Handler,
    ) -> impl Future<Output = Result<Self::State, BoxError>> + Send;
}

/// How often each fault strikes, per delivery, in a seeded run. Each event suffers at most two
/// injected faults, so none reaches the consumer's delivery cap because of them.
///
/// # Examples
///
/// ```
/// use handoff_testkit::Faults;
///
/// // Only crashes between the effect and the commit, at every other delivery.
/// let faults = Faults { crash_before_commit: 0.5, ..Faults::none() };
/// assert_eq!(faults.lost_ack, 0.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Faults {
    /// The consumer process dies after the handler ran, before its transaction commits: the
    /// transaction rolls back and the event comes again. Default 0.15.
    pub crash_before_commit: f64,
    /// It dies after the commit, before the broker's acknowledgement: the event comes again,
    /// already processed. Default 0.05.
    pub crash_before_ack: f64,
    /// The acknowledgement is lost on the way: the broker delivers the event again later.
    /// Default 0.05.
    pub lost_ack: f64,
    /// The broker delivers an acknowledged event once more (a relay's publish retried past
    /// the destination's dedup window, an operator's replay). Default 0.1, at most a quarter
    /// of the events per run.
    pub duplicate: f64,
}

impl Faults {
    /// No faults: redelivery and reordering across aggregates only.
    pub fn none() -> Self {
        Self {
            crash_before_commit: 0.0,
            crash_before_ack: 0.0,
            lost_ack: 0.0,
            duplicate: 0.0,
        }
    }
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            crash_before_commit: 0.15,
            crash_before_ack: 0.05,
            lost_ack: 0.05,
            duplicate: 0.1,
        }
    }
}

/// Runs a consumer's [`Handler`] through the real [`Consumer`] (inbox, gap policy, quarantine,
/// batches) against a seeded broker, and checks its effect is exactly once.
///
/// First a clean run: every event delivered once, in commit order. Then one run per seed: the
/// events delivered with aggregates interleaved at random (each aggregate's in order, as a
/// broker keeps them), acknowledged events delivered again, acknowledgements lost, and the
/// consumer crashed between the handler and the commit and between the commit and the
/// acknowledgement, then restarted. Each run has a fresh schema; after it the scenario's
/// [`observe`](Scenario::observe) must equal the clean run's, and the same events must be in
/// the consumer quarantine. A seed's run is reproducible: the broker hands out one delivery at
/// a time, so the order and the faults depend on the seed alone.
///
/// The environment can narrow the seeds without a code change: `HANDOFF_TESTKIT_SEED=S` runs
/// seed `S` only (the replay of a failure), `HANDOFF_TESTKIT_SEEDS=N` runs `N` seeds.
///
/// # Examples
///
/// ```no_run
/// use handoff_consumer::{Handler, HandlerError};
/// use handoff_core::intake::ReceivedEvent;
/// use handoff_testkit::{BoxError, Database, Events, HandlerCheck, Scenario};
/// use serde_json::json;
/// use sqlx::PgConnection;
///
/// struct CountOrders;
///
/// impl Handler for CountOrders {
///     async fn handle(&self, tx: &mut PgConnection, e: &ReceivedEvent) -> Result<(), HandlerError> {
///         sqlx::query("UPDATE order_count SET n = n + 1").execute(&mut *tx).await?;
///         Ok(())
///     }
/// }
///
/// struct Orders;
///
/// impl Scenario for Orders {
///     type Handler = CountOrders;
///     type State = i64;
///
///     async fn setup(&self, db: &Database) -> Result<CountOrders, BoxError> {
///         sqlx::raw_sql("CREATE TABLE order_count (n bigint NOT NULL); \
///                        INSERT INTO order_count VALUES (0)")
///             .execute(db.pool())
///             .await?;
///         Ok(CountOrders)
///     }
///
///     async fn observe(&self, db: &Database, _: &CountOrders) -> Result<i64, BoxError> {
///         Ok(sqlx::query_scalar("SELECT n FROM order_count").fetch_one(db.pool()).await?)
///     }
/// }
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let events = (0..20).fold(Events::new(), |events, i| {
///     events.event("order", &format!("o-{}", i % 4), "OrderPlaced", json!({}))
/// });
/// HandlerCheck::new("postgres://postgres@127.0.0.1/test", Orders, events)
///     .run()
///     .await?
///     .assert_exactly_once();
/// # Ok(())
/// # }
/// ```
pub struct HandlerCheck<S> {
    database_url: String,
    scenario: S,
    events: Events,
    config: ConsumerConfig,
    faults: Faults,
    seeds: Range<u64>,
    run_timeout: Duration,
}

impl<S: Scenario> HandlerCheck<S> {
    /// A check of `scenario` on `events`, in fresh schemas of the database at `database_url`,
    /// with the default consumer configuration (named `testkit`), the default [`Faults`] and
    /// seeds `0..20`.
    pub fn new(database_url: impl Into<String>, scenario: S, events: Events) -> Self {
        Self {
            database_url: database_url.into(),
            scenario,
            events,
            config: ConsumerConfig {
                name: "testkit".into(),
                ..ConsumerConfig::default()
            },
            faults: Faults::default(),
            seeds: 0..20,
            run_timeout: Duration::from_secs(60),
        }
    }

    /// Runs the consumer with `config` (as your service does; its `schema` is set to each
    /// run's).
    #[must_use]
    pub fn config(mut self, config: ConsumerConfig) -> Self {
        self.config = config;
        self
    }

    /// Injects `faults` instead of the default rates.
    #[must_use]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// Runs these seeds (unless `HANDOFF_TESTKIT_SEED` or `HANDOFF_TESTKIT_SEEDS` is set).
    #[must_use]
    pub fn seeds(mut self, seeds: Range<u64>) -> Self {
        self.seeds = seeds;
        self
    }

    /// Gives up on a run after `timeout` (default 60 s), reporting what was not acknowledged.
    #[must_use]
    pub fn run_timeout(mut self, timeout: Duration) -> Self {
        self.run_timeout = timeout;
        self
    }

    /// The seeds to run: the builder's, narrowed by the environment.
    fn seeds_to_run(&self) -> Range<u64> {
        let env = |name| std::env::var(name).ok()?.trim().parse::<u64>().ok();
        if let Some(seed) = env("HANDOFF_TESTKIT_SEED") {
            return seed..seed.saturating_add(1);
        }
        if let Some(count) = env("HANDOFF_TESTKIT_SEEDS") {
            return self.seeds.start..self.seeds.start.saturating_add(count);
        }
        self.seeds.clone()
    }

    /// Runs the clean run, then each seed until one fails.
    ///
    /// # Errors
    ///
    /// A [`TestkitError`] when a run could not be made: the database, handoff's migrations,
    /// the consumer configuration, or the scenario's `setup` or `observe` failed. A handler
    /// that breaks exactly-once effect is not an error: it is the report's
    /// [`failure`](Report::failure).
    pub async fn run(&self) -> Result<Report<S::State>, TestkitError> {
        let clean = self.run_once(None, 0).await?;
        let (expected, expected_quarantine) = match clean.outcome {
            Outcome::Finished { state, quarantined } => (state, quarantined),
            Outcome::Unfinished { unsettled } => {
                return Err(TestkitError::setup(format!(
                    "the clean run (each event once, in order, no fault) did not finish in \
                     {:?}; not acknowledged: {unsettled:?}",
                    self.run_timeout
                )))
            }
        };
        clean.database.drop_schema().await?;
        let mut report = Report {
            expected,
            seeds_run: Vec::new(),
            failure: None,
        };
        for seed in self.seeds_to_run() {
            report.seeds_run.push(seed);
            let run = self.run_once(Some(self.faults), seed).await?;
            let problem = match run.outcome {
                Outcome::Unfinished { unsettled } => Some(Problem::Unfinished { unsettled }),
                Outcome::Finished { state, .. } if state != report.expected => {
                    Some(Problem::StateDiffers {
                        expected: report.expected.clone(),
                        found: state,
                    })
                }
                Outcome::Finished { quarantined, .. } if quarantined != expected_quarantine => {
                    Some(Problem::QuarantineDiffers {
                        expected: expected_quarantine.clone(),
                        found: quarantined,
                    })
                }
                Outcome::Finished { .. } => None,
            };
            match problem {
                None => run.database.drop_schema().await?,
                Some(problem) => {
                    report.failure = Some(Failure {
                        seed,
                        problem,
                        trace: run.trace,
                        schema: run.database.name().to_owned(),
                    });
                    break;
                }
            }
        }
        Ok(report)
    }

    /// One run in a fresh schema: clean when `faults` is `None`.
    async fn run_once(
        &self,
        faults: Option<Faults>,
        seed: u64,
    ) -> Result<Run<S::State>, TestkitError> {
        let database = Database::create(&self.database_url).await?;
        let handler = Arc::new(
            self.scenario
                .setup(&database)
                .await
                .map_err(|e| TestkitError::new(TestkitErrorKind::Setup, e))?,
        );
        let config = ConsumerConfig {
            schema: database.schema().clone(),
            ..self.config.clone()
        };
        let broker = Arc::new(Broker::new(self.events.as_slice().to_vec(), faults, seed));
        let deadline = tokio::time::Instant::now() + self.run_timeout;
        let mut generation = 0;
        let finished = loop {
            let consumer = Consumer::new(
                config.clone(),
                database.pool().clone(),
                Crashing {
                    inner: handler.clone(),
                    broker: broker.clone(),
                },
            )
            .map_err(|e| TestkitError::new(TestkitErrorKind::Config, e))?;
            let (stop, stopped) = oneshot::channel::<()>();
            let intake = BrokerIntake {
                broker: broker.clone(),
                generation,
            };
            let run = consumer.run(intake, async move {
                let _ = stopped.await;
            });
            let mut run = std::pin::pin!(run);
            tokio::select! {
                // The consumer only returns once stopped; should it return early, the broker
                // still says what is unfinished.
                () = &mut run => break false,
                () = broker.crashed() => {
                    // Dropping the run aborts the consumer's tasks: the open transaction rolls
                    // back, as the server does for a killed process's connection.
                    generation = broker.restart();
                }
                () = broker.finished() => {
                    let _ = stop.send(());
                    run.await;
                    break true;
                }
                () = tokio::time::sleep_until(deadline) => break false,
            }
        };
        let outcome = if finished {
            let state = self
                .scenario
                .observe(&database, &handler)
                .await
                .map_err(|e| TestkitError::new(TestkitErrorKind::Observe, e))?;
            let quarantined = quarantined(&database, &config.name, &self.events).await?;
            Outcome::Finished { state, quarantined }
        } else {
            Outcome::Unfinished {
                unsettled: broker.unsettled(),
            }
        };
        Ok(Run {
            outcome,
            trace: broker.trace(),
            database,
        })
    }
}

/// The events the consumer quarantined in a run, named as in the trace, in commit order.
async fn quarantined(
    database: &Database,
    consumer: &str,
    events: &Events,
) -> Result<Vec<String>, TestkitError> {
    let ids: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT event_id FROM consumer_quarantine WHERE consumer_name = $1")
            .bind(consumer)
            .fetch_all(database.pool())
            .await
            .map_err(|e| TestkitError::new(TestkitErrorKind::Database, e))?;
    Ok(events
        .as_slice()
        .iter()
        .filter(|e| ids.contains(&e.event_id))
        .map(crate::events::name)
        .collect())
}

struct Run<S> {
    outcome: Outcome<S>,
    trace: Vec<String>,
    database: Database,
}

enum Outcome<S> {
    Finished { state: S, quarantined: Vec<String> },
    Unfinished { unsettled: Vec<String> },
}
