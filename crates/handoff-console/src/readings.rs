//! [`Readings`]: the console's latest status reading, shared by the overview, `/api/v1/status`
//! and the sampler behind the charts.
//!
//! A status reading costs what `handoff status` costs: on a large backlog, seconds of database
//! work. Read per request, every open overview (it reloads itself) and every polling script
//! would each pay it, and the database with them. So there is one reading at a time, single
//! flight (a request arriving while one runs waits for it), and it is kept until the sampler's
//! next one is due: the sampler takes a reading every sample interval, or, when a reading takes
//! long, only after ten times its duration, so the console keeps its share of the database
//! under a tenth of one connection's time whatever the outbox's size. Pages say how old the
//! figures are. The relays alone are read on every request (`AppState::status`): a small table,
//! and whether a relay is alive must not wait for the next reading.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use handoff_postgres::Schema;
use sqlx::PgPool;

use crate::{ConsoleError, StatusDocument, StatusOptions};

/// How many times a reading's own duration the sampler waits before the next one.
pub(crate) const PACE: u32 = 10;

/// One status reading and when it was taken.
#[derive(Clone)]
pub(crate) struct Reading {
    /// The document.
    pub document: Arc<StatusDocument>,
    /// When it was read.
    pub at: DateTime<Utc>,
    /// How long it took.
    pub took: Duration,
    /// Until when it serves requests without a new reading.
    fresh_until: Instant,
}

/// The latest reading. tokio Mutex: held across the reading on purpose, so that concurrent
/// requests share one reading instead of each starting their own.
#[derive(Default)]
pub(crate) struct Readings {
    latest: tokio::sync::Mutex<Option<Reading>>,
}

impl Readings {
    /// The latest reading while it is fresh, else a new one (shared with whoever asks
    /// meanwhile), fresh for `interval` or [`PACE`] times its duration, whichever is longer.
    pub async fn get(
        &self,
        pool: &PgPool,
        schema: &Schema,
        options: StatusOptions,
        interval: Duration,
    ) -> Result<Reading, ConsoleError> {
        let mut latest = self.latest.lock().await;
        if let Some(reading) = latest.as_ref().filter(|r| Instant::now() < r.fresh_until) {
            return Ok(reading.clone());
        }
        let reading = read(pool, schema, options, interval).await?;
        *latest = Some(reading.clone());
        Ok(reading)
    }

    /// A new reading whatever the age of the latest (the sampler's).
    pub async fn refresh(
        &self,
        pool: &PgPool,
        schema: &Schema,
        options: StatusOptions,
        interval: Duration,
    ) -> Result<Reading, ConsoleError> {
        let mut latest = self.latest.lock().await;
        let reading = read(pool, schema, options, interval).await?;
        *latest = Some(reading.clone());
        Ok(reading)
    }
}

/// How long after a reading that took `took` the next one is due.
pub(crate) fn next_after(took: Duration, interval: Duration) -> Duration {
    interval.max(took * PACE)
}

async fn read(
    pool: &PgPool,
    schema: &Schema,
    options: StatusOptions,
    interval: Duration,
) -> Result<Reading, ConsoleError> {
    let began = Instant::now();
    let at = Utc::now();
    let mut conn = pool.acquire().await?;
    let document = StatusDocument::read(&mut conn, schema, options).await?;
    let took = began.elapsed();
    Ok(Reading {
        document: Arc::new(document),
        at,
        took,
        // Fresh until the sampler's next reading is due, and a little past it, so that a page
        // asked for just before the sampler's reading lands does not start one of its own.
        fresh_until: Instant::now() + next_after(took, interval) + interval,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_reading_spaces_the_next_one_out() {
        let interval = Duration::from_secs(10);
        assert_eq!(next_after(Duration::from_millis(50), interval), interval);
        assert_eq!(
            next_after(Duration::from_secs(3), interval),
            Duration::from_secs(30)
        );
    }
}
