//! Named failpoints at the consumer's crash windows (brief V1).
//!
//! Built with the `failpoints` feature, a process that set up a `fail::FailScenario` reads them
//! from `FAILPOINTS`, e.g. `FAILPOINTS=consumer.after_commit=return`. A failpoint set to
//! `return` freezes the task applying that event right there (no thread is blocked), so a test
//! can SIGKILL the process in exactly that window. Without the feature every check is a
//! constant `false`.

/// After the handler ran, before the transaction (effect + dedup row + sequence) commits.
pub const BEFORE_COMMIT: &str = "consumer.before_commit";
/// After the transaction committed, before the broker is acknowledged.
pub const AFTER_COMMIT: &str = "consumer.after_commit";

/// Whether the failpoint `name` fired.
fn fired(name: &str) -> bool {
    let _ = name;
    fail::fail_point!(name, |_| true);
    false
}

/// Freezes the calling task forever when the failpoint `name` fired.
pub(crate) async fn freeze_if_fired(name: &str) {
    if fired(name) {
        tracing::warn!(failpoint = name, "failpoint fired: this task stops here");
        std::future::pending::<()>().await;
    }
}
