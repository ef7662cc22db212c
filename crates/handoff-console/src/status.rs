//! [`StatusDocument`]: the report `handoff status --json` prints and `GET /api/v1/status`
//! answers, built in one place so the two cannot drift: the outbox's numbers, the sagas not
//! ended, the consumers' quarantines, and the alert conditions that hold.

use std::time::Duration;

use handoff_postgres::{ConsumerQuarantine, ConsumerQuarantineCount, Schema, Status, StatusReport};
use handoff_saga::{SagaAdmin, SagaCount, SagaRecord, SagaState};
use serde::Serialize;

use crate::format::age;
use crate::ConsoleError;

/// What a status reading looks at, with `handoff status`'s defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusOptions {
    /// An aggregate whose first pending event is older than this is listed as stuck.
    pub stuck_after: Duration,
    /// Most stuck aggregates (and stuck sagas) listed.
    pub top: i64,
    /// Alert when the oldest pending event is older than this.
    pub max_pending_age: Duration,
}

impl Default for StatusOptions {
    fn default() -> Self {
        Self {
            stuck_after: Duration::from_secs(60),
            top: 10,
            max_pending_age: Duration::from_secs(300),
        }
    }
}

/// The report as `handoff status --json` prints it: the numbers, the alerts that hold, and the
/// verdict.
#[derive(Debug, Clone, Serialize)]
pub struct StatusDocument {
    /// The outbox's numbers, flattened into the document.
    #[serde(flatten)]
    pub report: StatusReport,
    /// The sagas not ended.
    pub sagas: Sagas,
    /// Open rows of each consumer's quarantine (consumers whose tables live in this database),
    /// by consumer name; consumers with none are absent.
    pub consumer_quarantine: Vec<ConsumerQuarantineCount>,
    /// The alert conditions that hold.
    pub alerts: Vec<Alert>,
    /// Whether none holds.
    pub healthy: bool,
}

/// The sagas not ended, and the stuck ones in full (design F2).
#[derive(Debug, Clone, Serialize)]
pub struct Sagas {
    /// Per type and state, of `running`, `compensating` and `stuck`.
    pub open: Vec<SagaCount>,
    /// How many are stuck.
    pub stuck_count: i64,
    /// The most recently stuck, at most `top`.
    pub stuck: Vec<SagaRecord>,
}

/// One alert condition that holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Alert {
    /// Its name, as `deploy/prometheus/alerts.yml` names it.
    pub name: &'static str,
    /// What holds, for a person.
    pub message: String,
}

impl StatusDocument {
    /// Reads the outbox, sagas and consumer quarantines in `schema`.
    ///
    /// # Errors
    ///
    /// The database failed ([`ConsoleErrorKind::Database`](crate::ConsoleErrorKind)).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads; a dropped future rolls its transaction back.
    pub async fn read(
        conn: &mut sqlx::PgConnection,
        schema: &Schema,
        options: StatusOptions,
    ) -> Result<Self, ConsoleError> {
        let report = Status::new(schema)
            .read(conn, options.stuck_after, options.top)
            .await?;
        // In a transaction: its statements then stay on one server connection behind a pooler.
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let admin = SagaAdmin::new(schema);
        let open = admin.open_counts(&mut *tx).await?;
        let stuck_count = open
            .iter()
            .filter(|c| c.state == SagaState::Stuck.as_str())
            .map(|c| c.count)
            .sum();
        let stuck = admin
            .list(&mut *tx, Some(SagaState::Stuck), options.top)
            .await?;
        tx.commit().await?;
        let sagas = Sagas {
            open,
            stuck_count,
            stuck,
        };
        let consumer_quarantine = ConsumerQuarantine::counts(conn, schema).await?;
        let alerts = alerts(&report, &sagas, &consumer_quarantine, options);
        Ok(Self {
            report,
            sagas,
            consumer_quarantine,
            healthy: alerts.is_empty(),
            alerts,
        })
    }
}

impl StatusDocument {
    /// This document with `relays` read since, and its alerts judged again with them.
    pub(crate) fn with_relays(
        mut self,
        relays: Vec<handoff_postgres::RelaySeen>,
        options: StatusOptions,
    ) -> Self {
        self.report.relays = relays;
        self.alerts = alerts(
            &self.report,
            &self.sagas,
            &self.consumer_quarantine,
            options,
        );
        self.healthy = self.alerts.is_empty();
        self
    }
}

/// The conditions `deploy/prometheus/alerts.yml` also watches, judged from one reading.
fn alerts(
    report: &StatusReport,
    sagas: &Sagas,
    consumers: &[ConsumerQuarantineCount],
    options: StatusOptions,
) -> Vec<Alert> {
    let mut alerts = Vec::new();
    for relay in report.relays.iter().filter(|r| r.alive) {
        if let Some(reason) = &relay.paused_reason {
            alerts.push(Alert {
                name: "destination_paused",
                message: format!(
                    "relay {} has paused its destination ({reason}): {}; it resumes by itself \
                     once a probe event gets through",
                    relay.relay_id,
                    relay.paused_cause.as_deref().unwrap_or("")
                ),
            });
        }
    }
    if sagas.stuck_count > 0 {
        alerts.push(Alert {
            name: "stuck_sagas",
            message: format!(
                "{} saga(s) stuck on a failing compensation; see `handoff saga list --state stuck`",
                sagas.stuck_count
            ),
        });
    }
    if report.quarantined > 0 {
        alerts.push(Alert {
            name: "quarantine_not_empty",
            message: format!(
                "{} event(s) held for an operator; see `handoff quarantine list`",
                report.quarantined
            ),
        });
    }
    for consumer in consumers {
        alerts.push(Alert {
            name: "consumer_quarantine_not_empty",
            message: format!(
                "consumer {} holds {} quarantined deliver(ies) ({} waiting for a retry); see \
                 `handoff consumer quarantine list --consumer-name {}`",
                consumer.consumer_name,
                consumer.quarantined + consumer.retry_requested,
                consumer.retry_requested,
                consumer.consumer_name
            ),
        });
    }
    if report.oldest_pending_age_seconds > options.max_pending_age.as_secs_f64() {
        alerts.push(Alert {
            name: "oldest_pending_too_old",
            message: format!(
                "the oldest pending event is {} old (limit {})",
                age(report.oldest_pending_age_seconds),
                age(options.max_pending_age.as_secs_f64())
            ),
        });
    }
    if report.stuck_aggregate_count > 0 {
        alerts.push(Alert {
            name: "stuck_aggregates",
            message: format!(
                "{} aggregate(s) waiting longer than {}",
                report.stuck_aggregate_count,
                age(options.stuck_after.as_secs_f64())
            ),
        });
    }
    if report.holes > 0 {
        alerts.push(Alert {
            name: "order_holes",
            message: format!(
                "{} pending event(s) wait for a sequence that was never written; find them with \
                 `handoff status` (stuck aggregates) and release each with `handoff quarantine \
                 skip --aggregate-type T --aggregate-id I --sequence N --reason ...`",
                report.holes
            ),
        });
    }
    if report.global_lane_blocked {
        alerts.push(Alert {
            name: "global_lane_blocked",
            message: format!(
                "the global lane is blocked: global sequence {} is held for an operator, or \
                 waits behind a held event of its aggregate, and no later global event is \
                 published until that event is retried or skipped (`handoff quarantine list`)",
                report.global_front.unwrap_or_default()
            ),
        });
    }
    if report.expired_leases > 0 {
        alerts.push(Alert {
            name: "expired_leases",
            message: format!(
                "{} leased event(s) past their lease: is any relay running?",
                report.expired_leases
            ),
        });
    }
    alerts
}
