//! The CDC source's metrics. The relay's own (`handoff_relay_*`, `handoff_events_published_total`)
//! are exported as with the polling source.

/// Bytes between the server's WAL position and the slot's confirmed position.
pub const LAG_BYTES: &str = "handoff_cdc_lag_bytes";
/// Bytes of WAL the slot may still fall behind before `max_slot_wal_keep_size` invalidates it;
/// -1 when unlimited.
pub const SAFE_WAL_BYTES: &str = "handoff_cdc_safe_wal_bytes";
/// Seconds since the oldest streamed transaction that is not settled yet committed; 0 when
/// everything streamed is settled.
pub const LAG_SECONDS: &str = "handoff_cdc_lag_seconds";
/// 1 for the slot's current `wal_status` (label `wal_status`: reserved, extended, unreserved,
/// lost, or missing when the slot does not exist), 0 for the others.
pub const SLOT_STATUS: &str = "handoff_cdc_slot_status";
/// 1 while the replication connection is streaming.
pub const STREAMING: &str = "handoff_cdc_streaming";
/// Replication connections that ended in an error.
pub const STREAM_ERRORS: &str = "handoff_cdc_stream_errors_total";
/// Outbox events read from the stream.
pub const STREAMED: &str = "handoff_cdc_streamed_events_total";
/// Streamed events not settled yet.
pub const PENDING: &str = "handoff_cdc_pending_events";
/// Aggregates published from the table (held events, the start-up backlog).
pub const TABLE_DRIVEN: &str = "handoff_cdc_table_driven_aggregates";

/// The values `wal_status` takes, plus `missing`.
pub const WAL_STATUSES: &[&str] = &["reserved", "extended", "unreserved", "lost", "missing"];

/// Registers descriptions with the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, Unit};
    describe_gauge!(
        LAG_BYTES,
        Unit::Bytes,
        "WAL bytes between the server and the slot's confirmed position"
    );
    describe_gauge!(
        SAFE_WAL_BYTES,
        Unit::Bytes,
        "WAL bytes the slot may still fall behind before it is invalidated (-1: unlimited)"
    );
    describe_gauge!(
        LAG_SECONDS,
        Unit::Seconds,
        "age of the oldest streamed transaction not settled yet"
    );
    describe_gauge!(SLOT_STATUS, "1 for the slot's current wal_status");
    describe_gauge!(STREAMING, "1 while the replication connection streams");
    describe_counter!(
        STREAM_ERRORS,
        "replication connections that ended in an error"
    );
    describe_counter!(STREAMED, "outbox events read from the stream");
    describe_gauge!(PENDING, "streamed events not settled yet");
    describe_gauge!(TABLE_DRIVEN, "aggregates published from the table");
}
