//! Named failpoints at the write path's crash windows (design V1).
//!
//! Built with the `failpoints` feature, the `order-service` binary reads them from `FAILPOINTS`,
//! e.g. `FAILPOINTS=order_service.after_commit=return`. A failpoint set to `return` freezes the
//! request right there (the task waits forever, no thread is blocked), so a test can SIGKILL the
//! process in exactly that window. Without the feature every check is a constant `false`.

/// The command's writes (business rows, idempotency record, outbox event) are done, the
/// transaction is not committed yet.
pub const BEFORE_COMMIT: &str = "order_service.before_commit";
/// The transaction committed; the HTTP response is not sent yet.
pub const AFTER_COMMIT: &str = "order_service.after_commit";

/// Whether the failpoint `name` fired.
fn fired(name: &str) -> bool {
    let _ = name;
    #[cfg(feature = "failpoints")]
    fail::fail_point!(name, |_| true);
    false
}

/// Freezes the calling task forever when the failpoint `name` fired.
pub(crate) async fn freeze_if_fired(name: &str) {
    if fired(name) {
        tracing::warn!(failpoint = name, "failpoint fired: this request stops here");
        std::future::pending::<()>().await;
    }
}
