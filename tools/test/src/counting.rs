//! [`CountingSource`]: a decorator around a real [`Source`] that counts what the relay asked of
//! it, for tests whose claim is about how often the relay calls its source (marks per claim)
//! or about errors the relay retries and its report alone would not show.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use handoff_core::delivery::{Claim, Failure, Published, Released, Settled, Source, SourceError};

/// A [`Source`] that passes every call to `inner` and counts the calls, the events they
/// carried, and the errors they returned.
///
/// ```no_run
/// # async fn example(pool: sqlx::PgPool) {
/// use handoff_postgres::{PollingConfig, PollingSource};
/// use handoff_test::counting::CountingSource;
///
/// let source = CountingSource::new(PollingSource::new(pool, PollingConfig::default()).unwrap());
/// // ... run a relay over `Arc::new(source)`, then:
/// # let source = std::sync::Arc::new(source);
/// assert_eq!(source.errors(), 0);
/// # }
/// ```
#[derive(Debug)]
pub struct CountingSource<S> {
    inner: S,
    claims: AtomicU64,
    marks: AtomicU64,
    marked: AtomicU64,
    errors: AtomicU64,
}

impl<S> CountingSource<S> {
    /// Counts the calls made to `inner`, from zero.
    pub fn new(inner: S) -> Self {
        CountingSource {
            inner,
            claims: AtomicU64::new(0),
            marks: AtomicU64::new(0),
            marked: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        }
    }

    /// Claims made, empty ones included.
    pub fn claims(&self) -> u64 {
        self.claims.load(Ordering::Relaxed)
    }

    /// Calls to `mark_published`.
    pub fn marks(&self) -> u64 {
        self.marks.load(Ordering::Relaxed)
    }

    /// Events those calls carried.
    pub fn marked(&self) -> u64 {
        self.marked.load(Ordering::Relaxed)
    }

    /// Calls of any kind that returned an error (each is printed to stderr as it happens).
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    fn count<T>(&self, result: Result<T, SourceError>) -> Result<T, SourceError> {
        if let Err(error) = &result {
            eprintln!("source error: {error}");
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        result
    }
}

impl<S: Source> Source for CountingSource<S> {
    async fn claim(&self, max: usize, max_bytes: usize) -> Result<Claim, SourceError> {
        self.claims.fetch_add(1, Ordering::Relaxed);
        self.count(self.inner.claim(max, max_bytes).await)
    }

    async fn mark_published(&self, published: &[Published]) -> Result<(), SourceError> {
        self.marks.fetch_add(1, Ordering::Relaxed);
        self.marked
            .fetch_add(published.len() as u64, Ordering::Relaxed);
        self.count(self.inner.mark_published(published).await)
    }

    async fn record_failures(&self, failures: &[Failure]) -> Result<Settled, SourceError> {
        self.count(self.inner.record_failures(failures).await)
    }

    async fn release(&self, released: &[Released]) -> Result<Settled, SourceError> {
        self.count(self.inner.release(released).await)
    }

    async fn wait_for_work(&self, at_most: Duration) -> Result<(), SourceError> {
        self.count(self.inner.wait_for_work(at_most).await)
    }
}
