//! Waiting for a condition in a test, and the outbox's pending rows: the one polling helper
//! every test uses instead of a home-made deadline loop or a sleep.

use std::fmt::Debug;
use std::time::Duration;

use handoff_postgres::Schema;
use sqlx::PgExecutor;

/// How often [`eventually`] runs its check: short, so a test ends soon after its condition
/// holds, and long enough not to hammer the database a check usually queries.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// What a check given to [`eventually`] answers: the condition holds (with a value to hand
/// back), or it does not yet (with the state seen, shown by the panic message on timeout).
///
/// Implemented for `bool`, `Option<T>` and `Result<T, E>` (the `Err` is the state seen; it is
/// formatted only when the deadline passes, so its `Debug` may do work, such as reading a log).
pub trait Outcome {
    /// What [`eventually`] returns once the condition holds.
    type Value;
    /// The state seen while the condition does not hold.
    type State: Debug;

    /// `Ok` with the value when the condition holds, else `Err` with the state seen.
    fn into_outcome(self) -> Result<Self::Value, Self::State>;
}

impl Outcome for bool {
    type Value = ();
    type State = Verbatim;

    fn into_outcome(self) -> Result<(), Verbatim> {
        if self {
            Ok(())
        } else {
            Err(Verbatim("false".to_owned()))
        }
    }
}

impl<T> Outcome for Option<T> {
    type Value = T;
    type State = Verbatim;

    fn into_outcome(self) -> Result<T, Verbatim> {
        self.ok_or_else(|| Verbatim("None".to_owned()))
    }
}

impl<T, E: Debug> Outcome for Result<T, E> {
    type Value = T;
    type State = E;

    fn into_outcome(self) -> Result<T, E> {
        self
    }
}

/// Text shown as is in [`eventually`]'s panic message: the `Err` of a check whose last state
/// has line breaks (a log), which `Debug` of a `String` would escape onto one line.
pub struct Verbatim(pub String);

impl Debug for Verbatim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A state made only when [`eventually`]'s panic shows it: `OnTimeout(|| relay.log())` reads
/// the log once, at the timeout, not at every poll. The text is shown as is.
pub struct OnTimeout<F>(pub F);

impl<F: Fn() -> String> Debug for OnTimeout<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&(self.0)())
    }
}

/// Runs `check` every [`POLL_INTERVAL`] until it holds (`true`, `Some`, `Ok`) and returns its
/// value; panics naming `what` and the last state seen when `deadline` (from now) passes first.
///
/// `check` runs at least once, also with a zero deadline. The clock is tokio's, so a test with
/// paused time advances through the polls.
///
/// # Panics
///
/// When the condition does not hold within `deadline`: the message names `what`, the deadline
/// and the last state `check` returned (the `Err` of a `Result`).
///
/// # Examples
///
/// ```no_run
/// # async fn example(db: handoff_test::TestDb) {
/// use std::time::Duration;
/// use handoff_test::eventually;
///
/// // A bool: the outbox drained.
/// eventually("the outbox drained", Duration::from_secs(30), async || {
///     db.pending_rows().await == 0
/// })
/// .await;
/// // A Result: the value once it holds, the last Err in the panic message otherwise.
/// let published: i64 = eventually("ten rows published", Duration::from_secs(30), async || {
///     let n = db.count("outbox WHERE published_at IS NOT NULL").await;
///     if n >= 10 { Ok(n) } else { Err(n) }
/// })
/// .await;
/// # }
/// ```
pub async fn eventually<O: Outcome>(
    what: &str,
    deadline: Duration,
    mut check: impl AsyncFnMut() -> O,
) -> O::Value {
    let until = tokio::time::Instant::now() + deadline;
    loop {
        match check().await.into_outcome() {
            Ok(value) => return value,
            Err(last) if tokio::time::Instant::now() >= until => {
                panic!("{what}: not within {deadline:?}; last seen: {last:?}")
            }
            Err(_) => tokio::time::sleep(POLL_INTERVAL).await,
        }
    }
}

/// The count of outbox rows not yet published (`published_at IS NULL`, quarantined rows
/// included) in `schema`'s `outbox` (the connection's `search_path` for [`Schema::default`]).
///
/// # Panics
///
/// When the query fails: a test cannot go on without it.
///
/// # Examples
///
/// ```no_run
/// # async fn example(pool: sqlx::PgPool) {
/// use handoff_postgres::Schema;
///
/// assert_eq!(handoff_test::pending_rows(&pool, &Schema::default()).await, 0);
/// # }
/// ```
pub async fn pending_rows<'c>(executor: impl PgExecutor<'c>, schema: &Schema) -> i64 {
    let outbox = schema.qualify("outbox");
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {outbox} WHERE published_at IS NULL"
    ))
    .fetch_one(executor)
    .await
    .unwrap_or_else(|e| panic!("count the pending rows of {outbox}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn eventually_returns_the_value_once_the_check_holds() {
        let mut calls = 0;
        let value = eventually("the third call", Duration::from_secs(5), async || {
            calls += 1;
            (calls == 3).then_some(calls * 10)
        })
        .await;
        assert_eq!(value, 30);
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "never: not within 1s; last seen: \"still 7\"")]
    async fn eventually_panics_with_what_and_the_last_state() {
        eventually("never", Duration::from_secs(1), async || {
            Err::<(), _>("still 7")
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn eventually_checks_once_with_a_zero_deadline() {
        eventually("at once", Duration::ZERO, async || true).await;
    }
}
