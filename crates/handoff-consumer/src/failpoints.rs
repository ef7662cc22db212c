//! Named failpoints at the consumer's crash windows (design V1).
//!
//! Built with the `failpoints` feature, a process that set up a `fail::FailScenario` reads them
//! from `FAILPOINTS`, e.g. `FAILPOINTS=consumer.after_commit=return`. A failpoint set to
//! `return` freezes the task applying that event right there (no thread is blocked), so a test
//! can SIGKILL the process in exactly that window. Without the feature every check is a
//! constant `false`.

/// After the handler ran, before the transaction (effect + dedup row + sequence) commits; in
/// batch mode, before the batch's transaction commits.
pub const BEFORE_COMMIT: &str = "consumer.before_commit";
/// After the transaction committed, before the broker is acknowledged; in batch mode, after
/// the batch's commit, before its acknowledgements.
pub const AFTER_COMMIT: &str = "consumer.after_commit";
/// Batch mode: after every handler of a batch ran, before the batch's one transaction (effects,
/// dedup rows, sequences of all its events) commits. `return(NAME)` fires only for the consumer
/// named NAME; plain `return` for every consumer.
pub const BATCH_BEFORE_COMMIT: &str = "consumer.batch_before_commit";

/// Whether the failpoint `name` fired.
fn fired(name: &str) -> bool {
    let _ = name;
    fail::fail_point!(name, |_| true);
    false
}

/// Whether the failpoint `name` fired for consumer `consumer`: set without an argument, or with
/// the consumer's name as its argument.
fn fired_for(name: &str, consumer: &str) -> bool {
    let _ = (name, consumer);
    fail::fail_point!(name, |only: Option<String>| only
        .is_none_or(|only| only == consumer));
    false
}

/// Freezes the calling task forever when the failpoint `name` fired for consumer `consumer`.
pub(crate) async fn freeze_if_fired_for(name: &str, consumer: &str) {
    if fired_for(name, consumer) {
        tracing::warn!(
            failpoint = name,
            consumer,
            "failpoint fired: this task stops here"
        );
        std::future::pending::<()>().await;
    }
}

/// Freezes the calling task forever when the failpoint `name` fired.
pub(crate) async fn freeze_if_fired(name: &str) {
    if fired(name) {
        tracing::warn!(failpoint = name, "failpoint fired: this task stops here");
        std::future::pending::<()>().await;
    }
}
