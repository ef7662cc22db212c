//! Named failpoints at the relay's crash windows (design V1).
//!
//! Built with the `failpoints` feature, a process that set up a `fail::FailScenario` (the
//! `handoff` binary does) reads them from `FAILPOINTS`, e.g.
//! `FAILPOINTS=relay.after_ack=return`. A failpoint set to `return` freezes the relay right
//! there: the task stops for good without blocking a thread, so a test can SIGKILL the process
//! in exactly that window. The fail crate's other actions (`panic`, `sleep(ms)`, `1*return`,
//! ...) work as documented there. Without the feature every check is a constant `false`.

/// After a claim statement returned its leased events, before any of them is published.
pub const CLAIM: &str = "relay.claim";
/// Before an event's publish is sent to the broker.
pub const BEFORE_PUBLISH: &str = "relay.before_publish";
/// After the broker acknowledged an event, before `published_at` is written.
pub const AFTER_ACK: &str = "relay.after_ack";
/// Before an event's publish: set to `return(EVENT_ID)`, it aborts the whole process when that
/// event is about to be published, as a panic in a transport or an out-of-memory kill on a huge
/// payload would, every time (the crash loop that `--max-takeovers` bounds).
pub const ABORT_ON_EVENT: &str = "relay.abort_on_event";

/// Whether the failpoint `name` fired.
pub(crate) fn fired(name: &str) -> bool {
    let _ = name;
    fail::fail_point!(name, |_| true);
    false
}

/// Aborts the process when the failpoint [`ABORT_ON_EVENT`] names `event_id`.
pub(crate) fn abort_if_named(event_id: &handoff_core::EventId) {
    let _ = event_id;
    fail::fail_point!(ABORT_ON_EVENT, |named: Option<String>| {
        if named.as_deref().map(str::trim) == Some(event_id.to_string().as_str()) {
            tracing::error!(%event_id, failpoint = ABORT_ON_EVENT, "failpoint fired: aborting");
            std::process::abort();
        }
    });
}

/// Freezes the calling task forever when the failpoint `name` fired.
pub(crate) async fn freeze_if_fired(name: &str) {
    if fired(name) {
        tracing::warn!(failpoint = name, "failpoint fired: this task stops here");
        std::future::pending::<()>().await;
    }
}
