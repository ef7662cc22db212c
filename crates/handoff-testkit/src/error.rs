//! [`TestkitError`]: why a check could not run (as opposed to a check that ran and failed,
//! which is a [`Failure`](crate::Failure) in its report).

/// What could not be done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TestkitErrorKind {
    /// The database URL is not valid, the database is unreachable, or creating or dropping a
    /// run's schema failed.
    Database,
    /// handoff's migrations failed in a run's schema.
    Migrate,
    /// The consumer configuration is not valid.
    Config,
    /// The scenario's `setup` failed.
    Setup,
    /// The scenario's `observe` failed.
    Observe,
}

/// Why a check could not run.
///
/// # Examples
///
/// ```
/// use handoff_testkit::{TestkitError, TestkitErrorKind};
///
/// let error = TestkitError::setup("table stock already exists");
/// assert_eq!(error.kind(), TestkitErrorKind::Setup);
/// assert_eq!(error.to_string(), "the scenario's setup failed: table stock already exists");
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{context}: {message}")]
pub struct TestkitError {
    kind: TestkitErrorKind,
    context: &'static str,
    message: String,
    #[source]
    source: Option<crate::BoxError>,
}

impl TestkitError {
    pub(crate) fn new(kind: TestkitErrorKind, source: impl Into<crate::BoxError>) -> Self {
        let source = source.into();
        Self {
            kind,
            context: context(kind),
            message: source.to_string(),
            source: Some(source),
        }
    }

    /// A [`Setup`](TestkitErrorKind::Setup) error with `message`, for a scenario whose setup
    /// finds something wrong without an underlying error.
    pub fn setup(message: impl Into<String>) -> Self {
        Self {
            kind: TestkitErrorKind::Setup,
            context: context(TestkitErrorKind::Setup),
            message: message.into(),
            source: None,
        }
    }

    /// What could not be done.
    pub fn kind(&self) -> TestkitErrorKind {
        self.kind
    }
}

fn context(kind: TestkitErrorKind) -> &'static str {
    match kind {
        TestkitErrorKind::Database => "the check's database",
        TestkitErrorKind::Migrate => "handoff's migrations",
        TestkitErrorKind::Config => "the consumer configuration",
        TestkitErrorKind::Setup => "the scenario's setup failed",
        TestkitErrorKind::Observe => "the scenario's observe failed",
    }
}
