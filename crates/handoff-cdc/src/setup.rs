//! Deploy-time setup of the CDC source: the publication, the slot and the rows mode, and the
//! slot's health as the metrics and `handoff cdc status` report it.
//!
//! The slot is created here, at deploy time, and never by the relay: a slot created once rows
//! exist misses every row committed before it, so creating one must be a decision an operator
//! takes (and `handoff cdc setup` says what the relay will backfill from the table).

use serde::Serialize;
use sqlx::{PgConnection, Row};

use handoff_postgres::Schema;

use crate::SetupError;

/// What becomes of an outbox row once the event is in the WAL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RowMode {
    /// Rows stay and are marked published after the broker's ack: `handoff replay`,
    /// `handoff reconcile`, `handoff status` and the backfill after a lost slot all work.
    #[default]
    Keep,
    /// Rows are deleted in the transaction that wrote them (a trigger); the WAL alone carries
    /// the event. The table stays empty, but a lost slot loses the events it had not confirmed
    /// for good, and there is nothing to replay from.
    Delete,
}

/// The slot and publication a CDC relay follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdcNames {
    /// Replication slot name.
    pub slot: String,
    /// Publication name.
    pub publication: String,
}

impl CdcNames {
    /// Checks both names: plain lowercase identifiers, at most 63 bytes.
    ///
    /// ```
    /// use handoff_cdc::CdcNames;
    /// assert!(CdcNames::new("handoff_slot", "handoff_outbox").is_ok());
    /// assert!(CdcNames::new("Slot; DROP", "p").is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// [`SetupError::Name`] for a name that is not a plain identifier.
    pub fn new(
        slot: impl Into<String>,
        publication: impl Into<String>,
    ) -> Result<Self, SetupError> {
        let names = CdcNames {
            slot: slot.into(),
            publication: publication.into(),
        };
        for name in [&names.slot, &names.publication] {
            if Schema::named(name.clone()).is_err() {
                return Err(SetupError::Name(name.clone()));
            }
        }
        Ok(names)
    }
}

/// What [`setup`] did.
#[derive(Debug, Clone, Serialize)]
pub struct SetupReport {
    /// The schema holding the outbox the publication covers.
    pub schema: String,
    /// Whether the publication was created now (false: it existed).
    pub publication_created: bool,
    /// Whether the slot was created now.
    pub slot_created: bool,
    /// Whether a lost slot was dropped and created again.
    pub slot_recreated: bool,
    /// The rows mode now in force.
    pub rows: RowMode,
    /// Unpublished rows in the outbox: the relay publishes them from the table at its next
    /// start, before their aggregates follow the stream.
    pub unpublished_rows: i64,
}

/// The slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SlotHealth {
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Bytes of WAL the slot may still fall behind before `max_slot_wal_keep_size` invalidates
    /// it; `None` when unlimited.
    pub safe_wal_bytes: Option<i64>,
    /// Whether a relay is streaming from it now.
    pub active: bool,
    /// Bytes between the server's WAL position and the slot's confirmed position.
    pub lag_bytes: Option<i64>,
    /// The confirmed position, as PostgreSQL writes it (`0/16B3748`).
    pub confirmed_flush_lsn: Option<String>,
}

impl SlotHealth {
    /// Whether PostgreSQL invalidated the slot: its WAL is gone and it can never stream again.
    pub fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost")
    }
}

const SLOT_SQL: &str = include_str!("../queries/slot.sql");

/// The slot's health, or `None` when it does not exist.
///
/// # Errors
///
/// The query failed.
pub async fn slot_health(
    conn: &mut PgConnection,
    slot: &str,
) -> Result<Option<SlotHealth>, sqlx::Error> {
    let Some(row) = sqlx::query(SLOT_SQL)
        .bind(slot)
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(None);
    };
    Ok(Some(SlotHealth {
        wal_status: row.try_get("wal_status")?,
        safe_wal_bytes: row.try_get("safe_wal_size")?,
        active: row.try_get("active")?,
        lag_bytes: row.try_get("lag_bytes")?,
        confirmed_flush_lsn: row.try_get("confirmed_flush_lsn")?,
    }))
}

/// The schema `schema` resolves to on this connection (the `search_path`'s first for the
/// default).
///
/// # Errors
///
/// The query failed.
pub async fn resolve_schema(
    conn: &mut PgConnection,
    schema: &Schema,
) -> Result<String, sqlx::Error> {
    match schema.name() {
        Some(name) => Ok(name.to_owned()),
        None => {
            sqlx::query_scalar("SELECT current_schema()::text")
                .fetch_one(conn)
                .await
        }
    }
}

/// The rows mode the outbox in `schema` is set to (whether the delete trigger is installed).
///
/// # Errors
///
/// The query failed (the outbox is missing, for one).
pub async fn rows_mode(conn: &mut PgConnection, schema: &str) -> Result<RowMode, sqlx::Error> {
    let installed: bool = sqlx::query_scalar(
        "SELECT EXISTS (
             SELECT 1 FROM pg_trigger t
             JOIN pg_class c ON c.oid = t.tgrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = 'outbox' AND t.tgname = 'outbox_discard')",
    )
    .bind(schema)
    .fetch_one(conn)
    .await?;
    Ok(if installed {
        RowMode::Delete
    } else {
        RowMode::Keep
    })
}

/// Creates what a CDC relay needs, idempotently: checks `wal_level`, creates the publication
/// (inserts on the outbox only) and the permanent `pgoutput` slot when missing, and sets the
/// rows mode. With `recreate_lost`, a slot PostgreSQL invalidated is dropped and created again
/// (the recovery runbook in docs/cdc.md); without it, a lost slot is an error.
///
/// # Errors
///
/// See [`SetupError`]; statements that ran before the error stay (each is idempotent, so the
/// command can simply run again).
pub async fn setup(
    conn: &mut PgConnection,
    schema: &Schema,
    names: &CdcNames,
    rows: RowMode,
    recreate_lost: bool,
) -> Result<SetupReport, SetupError> {
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(&mut *conn)
        .await?;
    if wal_level != "logical" {
        return Err(SetupError::WalLevel(wal_level));
    }
    let schema_name = resolve_schema(conn, schema).await?;
    let outbox = format!("\"{schema_name}\".outbox");

    let publication_exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(&names.publication)
            .fetch_one(&mut *conn)
            .await?;
    if publication_exists {
        let covers: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                            WHERE pubname = $1 AND schemaname = $2 AND tablename = 'outbox')",
        )
        .bind(&names.publication)
        .bind(&schema_name)
        .fetch_one(&mut *conn)
        .await?;
        if !covers {
            return Err(SetupError::PublicationMismatch {
                publication: names.publication.clone(),
                table: outbox,
            });
        }
    } else {
        // Identifiers cannot be bound; both were checked to be plain identifiers.
        sqlx::query(&format!(
            "CREATE PUBLICATION \"{}\" FOR TABLE {outbox} WITH (publish = 'insert')",
            names.publication
        ))
        .execute(&mut *conn)
        .await?;
    }

    let mut slot_recreated = false;
    let slot_created = match slot_health(conn, &names.slot).await? {
        Some(health) if health.is_lost() => {
            if !recreate_lost {
                return Err(SetupError::SlotLost(names.slot.clone()));
            }
            sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&names.slot)
                .execute(&mut *conn)
                .await?;
            create_slot(conn, &names.slot).await?;
            slot_recreated = true;
            false
        }
        Some(_) => false,
        None => {
            create_slot(conn, &names.slot).await?;
            true
        }
    };

    set_rows_mode(conn, &schema_name, rows).await?;
    let unpublished_rows: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {outbox} WHERE published_at IS NULL"
    ))
    .fetch_one(&mut *conn)
    .await?;
    Ok(SetupReport {
        schema: schema_name,
        publication_created: !publication_exists,
        slot_created,
        slot_recreated,
        rows,
        unpublished_rows,
    })
}

async fn create_slot(conn: &mut PgConnection, slot: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(slot)
        .execute(conn)
        .await
        .map(|_| ())
}

/// Installs or removes the trigger that deletes each outbox row in the transaction that wrote
/// it. Rows handoff itself writes back (held events and those behind them) carry a
/// `last_error` and are kept.
async fn set_rows_mode(
    conn: &mut PgConnection,
    schema: &str,
    rows: RowMode,
) -> Result<(), sqlx::Error> {
    let outbox = format!("\"{schema}\".outbox");
    let function = format!("\"{schema}\".handoff_outbox_discard");
    match rows {
        RowMode::Keep => {
            sqlx::query(&format!(
                "DROP TRIGGER IF EXISTS outbox_discard ON {outbox}"
            ))
            .execute(&mut *conn)
            .await?;
        }
        RowMode::Delete => {
            sqlx::query(&format!(
                "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger
                 LANGUAGE plpgsql VOLATILE AS $$
                 BEGIN
                     IF NEW.last_error IS NULL THEN
                         DELETE FROM {outbox} WHERE event_id = NEW.event_id;
                     END IF;
                     RETURN NULL;
                 END
                 $$"
            ))
            .execute(&mut *conn)
            .await?;
            sqlx::query(&format!(
                "CREATE OR REPLACE TRIGGER outbox_discard AFTER INSERT ON {outbox}
                 FOR EACH ROW EXECUTE FUNCTION {function}()"
            ))
            .execute(&mut *conn)
            .await?;
        }
    }
    Ok(())
}
