//! Whose fault is a failed publish (docs/relay.md, "Failures"), with `handoff relay` as a real
//! process:
//! - an HTTP endpoint that answers 503, or 429 with `Retry-After`, for longer than the attempt
//!   budget would last: the destination pauses, nothing is charged or quarantined, and after it
//!   recovers every event is delivered once, in order;
//! - an endpoint that refuses one tenant's aggregate (503 `Retry-After: 600`, or a plain 500 in
//!   a quiet system) and accepts everyone else: the others flow unhindered and the refused
//!   event is held after `--max-attempts`;
//! - an endpoint that answers 401 for a while: nothing is held, `/readyz` says why, and
//!   everything is delivered once it accepts again;
//! - a relay cut off from PostgreSQL for longer than its lease while the endpoint fails: its
//!   late outcomes change nothing another lease holds (an audit trigger shows it), and no event
//!   is held by two relays at once;
//! - an event whose publish kills the relay process every time: after `--max-takeovers` it is
//!   held with reason `crash_loop`, and every other aggregate is published.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{
    enqueue_spread, handoff, migrated, stdout_json, wait_drained, RelayProcess, Target,
};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use handoff_test::proxy::FaultProxy;
use handoff_test::{eventually, factory, TestDb, Verbatim};
use sqlx::postgres::PgConnectOptions;

const ACCEPT: u8 = 0;
const UNAVAILABLE: u8 = 1;
const TOO_MANY: u8 = 2;
const UNAUTHORIZED: u8 = 3;
const FAILING: u8 = 4;
const SLOW: u8 = 5;

/// An endpoint whose answer the test switches: 200 (applying each `Idempotency-Key` once), 503,
/// 429 with `Retry-After: 2`, or 401; and which may refuse one aggregate's events (a tenant)
/// while it accepts the others.
#[derive(Default)]
struct Endpoint {
    mode: AtomicU8,
    /// The aggregate refused whatever the mode, with the status and `Retry-After` it gets.
    refuse_aggregate: Mutex<Option<(String, StatusCode, Option<&'static str>)>>,
    /// Effects applied, in arrival order: (aggregate id, sequence, event id).
    applied: Mutex<Vec<(String, i64, String)>>,
    seen: Mutex<HashSet<String>>,
    /// When each event was first applied, by event id.
    applied_at: Mutex<HashMap<String, Instant>>,
    /// When each refusal was answered.
    refused: Mutex<Vec<Instant>>,
    /// Run once, at the first refusal, before it is answered.
    on_first_refusal: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

async fn receive(State(endpoint): State<Arc<Endpoint>>, headers: HeaderMap) -> Response {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let refused = endpoint.refuse_aggregate.lock().unwrap().clone();
    if let Some((aggregate, status, retry_after)) = refused {
        if header("handoff-aggregate-id") == aggregate {
            endpoint.refused.lock().unwrap().push(Instant::now());
            return match retry_after {
                Some(delay) => (status, [("retry-after", delay)]).into_response(),
                None => status.into_response(),
            };
        }
    }
    match endpoint.mode.load(Ordering::SeqCst) {
        UNAVAILABLE => {
            endpoint.refused.lock().unwrap().push(Instant::now());
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
        TOO_MANY => {
            endpoint.refused.lock().unwrap().push(Instant::now());
            return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "2")]).into_response();
        }
        UNAUTHORIZED => {
            endpoint.refused.lock().unwrap().push(Instant::now());
            return (StatusCode::UNAUTHORIZED, "token expired").into_response();
        }
        SLOW => tokio::time::sleep(Duration::from_secs(10)).await,
        FAILING => {
            endpoint.refused.lock().unwrap().push(Instant::now());
            if let Some(hook) = endpoint.on_first_refusal.lock().unwrap().take() {
                hook();
            }
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
        _ => {}
    }
    let key = header("idempotency-key");
    if endpoint.seen.lock().unwrap().insert(key.clone()) {
        endpoint
            .applied_at
            .lock()
            .unwrap()
            .insert(key.clone(), Instant::now());
        let sequence = header("handoff-sequence").parse().unwrap_or(-1);
        endpoint
            .applied
            .lock()
            .unwrap()
            .push((header("handoff-aggregate-id"), sequence, key));
    }
    StatusCode::OK.into_response()
}

async fn endpoint() -> (Arc<Endpoint>, String) {
    let endpoint = Arc::new(Endpoint::default());
    let app = axum::Router::new()
        .route("/events", axum::routing::post(receive))
        .with_state(endpoint.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (endpoint, format!("http://{addr}/events"))
}

/// Rows held for an operator.
async fn held(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND available_at = 'infinity'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Waits until the outbox is drained, stops the relay (exit 0), and checks that nothing is held
/// and every event was applied once, in order; returns the most attempts charged to an event.
async fn drain_and_check(db: &TestDb, endpoint: &Endpoint, relay: &mut RelayProcess) -> i64 {
    wait_drained(&db.pool, Duration::from_secs(60), || relay.log()).await;
    assert!(relay.terminate().success(), "exit 0:\n{}", relay.log());
    assert_eq!(held(db).await, 0);
    assert_applied_once_in_order(db, endpoint).await;
    sqlx::query_scalar("SELECT coalesce(max(attempt_count), 0)::int8 FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Every committed event applied exactly once, and per aggregate in sequence order.
async fn assert_applied_once_in_order(db: &TestDb, endpoint: &Endpoint) {
    assert_applied_once_in_order_but(db, endpoint, "").await;
}

/// As [`assert_applied_once_in_order`], for every aggregate but `refused` (none of whose
/// events may be applied).
async fn assert_applied_once_in_order_but(db: &TestDb, endpoint: &Endpoint, refused: &str) {
    let committed: Vec<(uuid::Uuid,)> =
        sqlx::query_as("SELECT event_id FROM outbox WHERE aggregate_id <> $1")
            .bind(refused)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let applied = endpoint.applied.lock().unwrap().clone();
    let ids: HashSet<String> = applied.iter().map(|a| a.2.clone()).collect();
    let expected: HashSet<String> = committed.iter().map(|c| c.0.to_string()).collect();
    assert_eq!(ids, expected, "applied effects = committed events");
    let mut next: HashMap<&str, i64> = HashMap::new();
    for (aggregate, sequence, id) in &applied {
        let want = next.entry(aggregate).or_insert(1);
        assert_eq!(
            *sequence, *want,
            "{aggregate} #{sequence} ({id}) out of order"
        );
        *want += 1;
    }
}

/// Runs one outage of the endpoint in `mode`, lasting `outage`, under a relay with
/// `--max-attempts 3`, and checks that it cost no event anything. Returns the refusals the
/// endpoint answered during the outage.
async fn outage_costs_nothing(name: &str, mode: u8, outage: Duration) -> usize {
    const AGGREGATES: u64 = 20;
    let (db, outbox) = migrated(name).await;
    let (endpoint, url) = endpoint().await;
    let flags = [
        "--destination",
        "http",
        "--endpoint",
        &url,
        "--http-timeout",
        "1s",
        "--max-attempts",
        "3",
    ];
    let env = [("HANDOFF_HTTP_SECRET", "")];
    let mut relay = RelayProcess::spawn(&db.url(), name, &flags, &env);

    // The endpoint works: one event per aggregate gets through.
    enqueue_spread(&db.pool, &outbox, 0, AGGREGATES, AGGREGATES).await;
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;

    // Then it refuses everything for longer than three attempts' backoff (0.5 s + 1 s + 2 s)
    // would last, while writers go on.
    endpoint.mode.store(mode, Ordering::SeqCst);
    enqueue_spread(&db.pool, &outbox, AGGREGATES, 3 * AGGREGATES, AGGREGATES).await;
    tokio::time::sleep(outage).await;
    assert_eq!(
        held(&db).await,
        0,
        "held during the outage:\n{}",
        relay.log()
    );
    endpoint.mode.store(ACCEPT, Ordering::SeqCst);
    let refusals = endpoint.refused.lock().unwrap().len();

    let charged = drain_and_check(&db, &endpoint, &mut relay).await;
    // The first refusal after a success may still look like the event's; nothing after it.
    assert!(charged <= 1, "an event was charged {charged} attempts");
    let log = relay.log();
    assert!(log.contains("destination paused"), "{log}");
    // The outage was met (and then, mostly, not tried against).
    assert!(refusals >= 2, "{refusals} refusals");
    refusals
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_answering_503_longer_than_the_attempt_budget_quarantines_nothing() {
    let refusals = outage_costs_nothing("policy_503", UNAVAILABLE, Duration::from_secs(10)).await;
    // The pause keeps the load down: the lanes in flight when it began, then one probe per
    // round of the backoff (100 ms doubling up to 10 s), not a retry per event per backoff.
    assert!(
        refusals <= 20 + 15,
        "{refusals} requests refused during the outage"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_pauses_the_whole_destination_and_charges_nothing() {
    let refusals = outage_costs_nothing("policy_429", TOO_MANY, Duration::from_secs(7)).await;
    // Retry-After: 2 holds every lane: the burst in flight, then a probe at most every 2 s.
    assert!(
        refusals <= 20 + 5,
        "{refusals} requests refused during the throttle"
    );
}

/// The relay's flags for the test endpoint at `url`, with `extra` ones.
fn http_relay(db: &TestDb, name: &str, url: &str, extra: &[&str]) -> RelayProcess {
    let mut flags = vec![
        "--destination",
        "http",
        "--endpoint",
        url,
        "--http-timeout",
        "1s",
    ];
    flags.extend_from_slice(extra);
    RelayProcess::spawn(&db.url(), name, &flags, &[("HANDOFF_HTTP_SECRET", "")])
}

/// Commits one event every `every` for `aggregate` (counting from `first`) until `stop`, each in
/// a transaction of its own; returns when each was committed, by event id.
fn write_every(
    db: &TestDb,
    outbox: &handoff_postgres::Outbox,
    aggregates: Vec<String>,
    every: Duration,
    stop: Instant,
) -> tokio::task::JoinHandle<HashMap<String, Instant>> {
    let pool = db.pool.clone();
    let outbox = outbox.clone();
    tokio::spawn(async move {
        let mut committed = HashMap::new();
        let mut ticks = tokio::time::interval(every);
        let mut n = 0u64;
        while Instant::now() < stop {
            ticks.tick().await;
            let aggregate = &aggregates[n as usize % aggregates.len()];
            let mut tx = pool.begin().await.unwrap();
            let id = outbox
                .enqueue(&mut tx, &[factory::event(aggregate, n)])
                .await
                .unwrap()[0]
                .event_id;
            tx.commit().await.unwrap();
            committed.insert(id.to_string(), Instant::now());
            n += 1;
        }
        committed
    })
}

/// The refused aggregate's first event, once it is held: its hold reason and attempts.
async fn wait_held(
    db: &TestDb,
    aggregate: &str,
    within: Duration,
    relay: &RelayProcess,
) -> (String, i32) {
    eventually(
        &format!("{aggregate}'s first event held"),
        within,
        async || {
            let row: Option<(Option<String>, i32)> = sqlx::query_as(
                "SELECT hold_reason, attempt_count FROM outbox \
                 WHERE aggregate_id = $1 AND aggregate_sequence = 1 \
                   AND available_at = 'infinity'",
            )
            .bind(aggregate)
            .fetch_optional(&db.pool)
            .await
            .unwrap();
            match row {
                Some((Some(reason), attempts)) => Ok((reason, attempts)),
                _ => Err(Verbatim(relay.log())),
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_refused_with_503_retry_after_600_delays_only_itself_and_is_held() {
    let (db, outbox) = migrated("policy_tenant_503").await;
    let (endpoint, url) = endpoint().await;
    *endpoint.refuse_aggregate.lock().unwrap() = Some((
        "tenant-x".into(),
        StatusCode::SERVICE_UNAVAILABLE,
        Some("600"),
    ));
    let mut relay = http_relay(
        &db,
        "tenant-503",
        &url,
        &["--max-attempts", "3", "--max-retry-after", "2s"],
    );

    // Twenty healthy aggregates at 50 events/s, and the refused tenant's at one a second,
    // for 20 s.
    let stop = Instant::now() + Duration::from_secs(20);
    let healthy: Vec<String> = (0..20).map(|n| format!("agg-{n}")).collect();
    let writers = write_every(&db, &outbox, healthy, Duration::from_millis(20), stop);
    let tenant = write_every(
        &db,
        &outbox,
        vec!["tenant-x".into()],
        Duration::from_secs(1),
        stop,
    );
    let committed = writers.await.unwrap();
    tenant.await.unwrap();

    let (reason, attempts) = wait_held(&db, "tenant-x", Duration::from_secs(30), &relay).await;
    assert_eq!(
        (reason.as_str(), attempts),
        ("attempts", 3),
        "{}",
        relay.log()
    );
    eventually(
        "healthy events all applied",
        Duration::from_secs(30),
        async || {
            let applied = endpoint.applied_at.lock().unwrap().len();
            if applied >= committed.len() {
                Ok(())
            } else {
                Err(Verbatim(format!(
                    "{applied} of {} applied\n{}",
                    committed.len(),
                    relay.log()
                )))
            }
        },
    )
    .await;
    assert!(relay.terminate().success(), "exit 0:\n{}", relay.log());
    assert_applied_once_in_order_but(&db, &endpoint, "tenant-x").await;

    // Commit to the endpoint, for every healthy event: the tenant's Retry-After held nobody.
    let applied_at = endpoint.applied_at.lock().unwrap().clone();
    let mut lags: Vec<Duration> = committed
        .iter()
        .map(|(id, at)| applied_at[id].saturating_duration_since(*at))
        .collect();
    lags.sort();
    let p99 = lags[lags.len() * 99 / 100];
    assert!(
        p99 < Duration::from_secs(5),
        "healthy commit -> endpoint p99 {p99:?} (max {:?}) over {} events\n{}",
        lags.last(),
        lags.len(),
        relay.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_500_on_one_event_in_a_quiet_system_is_held_within_90s() {
    let (db, outbox) = migrated("policy_quiet_500").await;
    let (endpoint, url) = endpoint().await;
    *endpoint.refuse_aggregate.lock().unwrap() =
        Some(("poison".into(), StatusCode::INTERNAL_SERVER_ERROR, None));
    let mut relay = http_relay(&db, "quiet-500", &url, &["--max-attempts", "4"]);

    // The poison event, then a quiet system: one healthy event every 2 s.
    let started = Instant::now();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event("poison", 0)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let stop = started + Duration::from_secs(90);
    let healthy: Vec<String> = (0..5).map(|n| format!("agg-{n}")).collect();
    let writers = write_every(&db, &outbox, healthy, Duration::from_secs(2), stop);

    let remaining = Duration::from_secs(90).saturating_sub(started.elapsed());
    let (reason, attempts) = wait_held(&db, "poison", remaining, &relay).await;
    assert_eq!(
        (reason.as_str(), attempts),
        ("attempts", 4),
        "{}",
        relay.log()
    );
    writers.abort();
    wait_drained_but_poison(&db, &relay).await;
    assert!(relay.terminate().success(), "exit 0:\n{}", relay.log());
    assert_applied_once_in_order_but(&db, &endpoint, "poison").await;
    // Meanwhile the healthy events were not held up: the poison event was never the probe of
    // a pause its own failures started while they waited.
    let committed: Vec<(uuid::Uuid, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT event_id, occurred_at FROM outbox WHERE aggregate_id <> 'poison'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let applied_at = endpoint.applied_at.lock().unwrap().clone();
    let now = (Instant::now(), chrono::Utc::now());
    let slowest = committed
        .iter()
        .map(|(id, occurred)| {
            let occurred = now.0 - (now.1 - *occurred).to_std().unwrap_or_default();
            applied_at[&id.to_string()].saturating_duration_since(occurred)
        })
        .max()
        .unwrap_or_default();
    assert!(
        slowest < Duration::from_secs(3),
        "a healthy event took {slowest:?} to reach the endpoint\n{}",
        relay.log()
    );
}

/// Waits until nothing but the held `poison` event is pending.
async fn wait_drained_but_poison(db: &TestDb, relay: &RelayProcess) {
    eventually(
        "all but poison published",
        Duration::from_secs(30),
        async || {
            let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND aggregate_id <> 'poison'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
            if left == 0 {
                Ok(())
            } else {
                Err(Verbatim(format!("{left} left\n{}", relay.log())))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_answering_401_for_20s_holds_nothing_and_readyz_says_why() {
    const AGGREGATES: u64 = 10;
    let (db, outbox) = migrated("policy_401").await;
    let (endpoint, url) = endpoint().await;
    endpoint.mode.store(UNAUTHORIZED, Ordering::SeqCst);
    let metrics = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let metrics_addr = metrics.to_string();
    let mut relay = http_relay(
        &db,
        "unauthorized",
        &url,
        &["--max-attempts", "3", "--metrics-addr", &metrics_addr],
    );
    let token_renewed = Instant::now() + Duration::from_secs(20);
    enqueue_spread(&db.pool, &outbox, 0, 6 * AGGREGATES, AGGREGATES).await;

    // Meanwhile /readyz says why, and the gauge names the reason.
    let http = reqwest::Client::new();
    let said = eventually(
        "/readyz names the pause",
        Duration::from_secs(15),
        async || {
            let Ok(response) = http.get(format!("http://{metrics}/readyz")).send().await else {
                return Err(Verbatim(relay.log()));
            };
            let status = response.status().as_u16();
            let body = response.text().await.unwrap_or_default();
            if status == 503 && body.contains("destination paused (misconfigured)") {
                Ok(body)
            } else {
                Err(Verbatim(format!("{status} {body}\n{}", relay.log())))
            }
        },
    )
    .await;
    assert!(said.contains("401"), "{said}");
    let exposition = http
        .get(format!("http://{metrics}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        exposition.contains(r#"handoff_destination_paused{reason="misconfigured"} 1"#),
        "{exposition}"
    );
    // ... and so does `handoff status`, beside the live relay, from its heartbeat.
    let status = eventually(
        "handoff status names the pause",
        Duration::from_secs(15),
        async || {
            let output = handoff(&db, &["status", "--json"]);
            let json = stdout_json(&output);
            let relay = json["relays"]
                .as_array()
                .and_then(|relays| relays.iter().find(|r| r["relay_id"] == "unauthorized"))
                .cloned();
            match relay {
                Some(r) if r["alive"] == true && r["paused_reason"] == "misconfigured" => {
                    Ok((output.status.code(), json))
                }
                _ => Err(Verbatim(json.to_string())),
            }
        },
    )
    .await;
    assert_eq!(status.0, Some(2), "needs attention: {}", status.1);
    assert!(
        status.1["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["name"] == "destination_paused"),
        "{}",
        status.1
    );
    tokio::time::sleep_until(token_renewed.into()).await;
    assert_eq!(held(&db).await, 0, "held while refused:\n{}", relay.log());
    endpoint.mode.store(ACCEPT, Ordering::SeqCst);

    let charged = drain_and_check(&db, &endpoint, &mut relay).await;
    assert_eq!(charged, 0, "a refused setup is no event's fault");
    assert!(
        relay.log().contains("refuses the relay's credentials"),
        "{}",
        relay.log()
    );
}

/// Every update of an outbox row, with who made it (the connection's `application_name`) and
/// the row's lease before and after.
const LEASE_AUDIT: &str = r#"
CREATE TABLE lease_audit (
    id        bigserial PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    writer    text NOT NULL DEFAULT current_setting('application_name'),
    event_id  uuid NOT NULL,
    old_until timestamptz,
    new_until timestamptz,
    new_by    text,
    published boolean NOT NULL,
    held      boolean NOT NULL
);
CREATE FUNCTION lease_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease_audit (event_id, old_until, new_until, new_by, published, held)
    VALUES (NEW.event_id, OLD.claim_until, NEW.claim_until, NEW.claimed_by,
            NEW.published_at IS NOT NULL, NEW.available_at = 'infinity');
    RETURN NEW;
END $$;
CREATE TRIGGER lease_audit AFTER UPDATE ON outbox FOR EACH ROW EXECUTE FUNCTION lease_audit();
"#;

/// One row of `lease_audit`.
#[derive(sqlx::FromRow, Debug)]
struct LeaseChange {
    at: chrono::DateTime<chrono::Utc>,
    writer: String,
    event_id: uuid::Uuid,
    old_until: Option<chrono::DateTime<chrono::Utc>>,
    new_until: Option<chrono::DateTime<chrono::Utc>>,
    new_by: Option<String>,
    published: bool,
    held: bool,
}

/// Walks each event's lease changes in order and returns what broke fencing: a lease ended
/// (without a publish) by another writer than the one it was granted to (a stale outcome took
/// effect), and a lease granted while another writer's was live (two relays held the event).
fn fencing_violations(changes: &[LeaseChange]) -> Vec<String> {
    let mut violations = Vec::new();
    let mut lease: HashMap<uuid::Uuid, (&str, chrono::DateTime<chrono::Utc>)> = HashMap::new();
    for change in changes {
        let granted = change.new_by.is_some()
            && change.new_until.is_some()
            && change.new_until != change.old_until
            && !change.published;
        let ended = change.old_until.is_some() && change.new_until.is_none();
        if granted {
            if let Some((holder, until)) = lease.get(&change.event_id) {
                if *holder != change.writer && *until > change.at {
                    violations.push(format!(
                        "{} leased {} while {holder}'s lease ran until {until}: {change:?}",
                        change.writer, change.event_id
                    ));
                }
            }
            lease.insert(
                change.event_id,
                (&change.writer, change.new_until.expect("granted")),
            );
        } else if ended && !change.published && !change.held {
            if let Some((holder, _)) = lease.get(&change.event_id) {
                if *holder != change.writer {
                    violations.push(format!(
                        "{} ended {holder}'s lease on {}: {change:?}",
                        change.writer, change.event_id
                    ));
                }
            }
            lease.remove(&change.event_id);
        } else if change.published {
            lease.remove(&change.event_id);
        }
    }
    violations
}

/// Relay A loses PostgreSQL (a silent partition) just as the endpoint refuses the events it
/// publishes, for longer than its lease; relay B, under the same relay id (so nothing but the
/// lease tells their writes apart), takes the events over and publishes them slowly. When A's
/// database comes back, its failures (decided under leases long gone) are written: they must
/// change nothing B holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_written_after_a_database_outage_longer_than_the_lease_change_nothing() {
    const AGGREGATES: u64 = 20;
    let (db, outbox) = migrated("lease_lag").await;
    sqlx::raw_sql(LEASE_AUDIT).execute(&db.pool).await.unwrap();
    let (endpoint, url) = endpoint().await;
    enqueue_spread(&db.pool, &outbox, 0, 5 * AGGREGATES, AGGREGATES).await;

    // A reaches PostgreSQL through a proxy, which goes silent at the endpoint's first refusal:
    // the failures A then decides cannot be written until the partition heals.
    let options = PgConnectOptions::from_str(&handoff_test::database_url()).unwrap();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = Arc::new(FaultProxy::start(upstream.parse().unwrap()).await.unwrap());
    let proxied = db.url().replacen(&upstream, &proxy.addr().to_string(), 1);
    assert_ne!(proxied, db.url(), "the test URL names {upstream}");
    let partitioned_at = Arc::new(Mutex::new(None));
    {
        let proxy = proxy.clone();
        let partitioned_at = partitioned_at.clone();
        let endpoint_for_hook = Arc::downgrade(&endpoint);
        *endpoint.on_first_refusal.lock().unwrap() = Some(Box::new(move || {
            proxy.black_hole();
            *partitioned_at.lock().unwrap() = Some(Instant::now());
            // From now on every publish is accepted, slowly: B's leases stay live while its
            // publishes wait, which is when a stale failure would take them away.
            if let Some(endpoint) = endpoint_for_hook.upgrade() {
                endpoint.mode.store(SLOW, Ordering::SeqCst);
            }
        }));
    }
    endpoint.mode.store(FAILING, Ordering::SeqCst);
    let http = [
        "--destination",
        "http",
        "--endpoint",
        url.as_str(),
        "--query-timeout",
        "2s",
    ];
    let a_url = format!("{proxied}&application_name=relay-a");
    let mut a_flags = http.to_vec();
    a_flags.extend(["--http-timeout", "1s"]);
    let mut a = RelayProcess::spawn(
        &a_url,
        "shared-id",
        &a_flags,
        &[("HANDOFF_HTTP_SECRET", "")],
    );
    let partitioned = eventually(
        "relay A refused and cut off",
        Duration::from_secs(30),
        async || match *partitioned_at.lock().unwrap() {
            Some(at) => Ok(at),
            None => Err(Verbatim(a.log())),
        },
    )
    .await;

    let b_url = format!("{}&application_name=relay-b", db.url());
    let mut b_flags = http.to_vec();
    b_flags.extend([
        "--http-timeout",
        "15s",
        "--publish-timeout",
        "15s",
        "--lease",
        "60s",
    ]);
    let mut b = RelayProcess::spawn(
        &b_url,
        "shared-id",
        &b_flags,
        &[("HANDOFF_HTTP_SECRET", "")],
    );
    // A's leases (4 s) run out, B takes the events over and waits on the slow endpoint; then
    // A's database comes back, while B still holds them.
    eventually(
        "relay B took relay A's events over",
        Duration::from_secs(60),
        async || {
            let taken: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM lease_audit \
                 WHERE writer = 'relay-b' AND new_by IS NOT NULL AND old_until IS NOT NULL",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            match taken {
                0 => Err(Verbatim(b.log())),
                _ => Ok(()),
            }
        },
    )
    .await;
    eprintln!("taken over {:?} after the partition", partitioned.elapsed());
    proxy.heal();
    eventually(
        "relay A's late failures written, changing nothing",
        Duration::from_secs(30),
        async || {
            let log = a.log();
            match log.contains("changed nothing") {
                true => Ok(()),
                false => Err(Verbatim(format!("relay A:\n{log}\nrelay B:\n{}", b.log()))),
            }
        },
    )
    .await;
    endpoint.mode.store(ACCEPT, Ordering::SeqCst);

    wait_drained(&db.pool, Duration::from_secs(90), || {
        format!("relay B:\n{}\nrelay A:\n{}", b.log(), a.log())
    })
    .await;
    assert!(a.terminate().success(), "{}", a.log());
    assert!(b.terminate().success(), "{}", b.log());
    assert_eq!(held(&db).await, 0);
    assert_applied_once_in_order(&db, &endpoint).await;
    let changes: Vec<LeaseChange> = sqlx::query_as(
        "SELECT at, writer, event_id, old_until, new_until, new_by, published, held \
         FROM lease_audit ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let taken_over = changes
        .iter()
        .filter(|c| c.writer == "relay-b" && c.new_by.is_some() && c.old_until.is_some())
        .count();
    assert!(taken_over > 0, "B took nothing over from A: {changes:#?}");
    let violations = fencing_violations(&changes);
    assert!(
        violations.is_empty(),
        "{}\nrelay A:\n{}",
        violations.join("\n"),
        a.log()
    );
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_that_kills_every_relay_is_held_as_a_crash_loop_and_others_flow() {
    let (db, outbox) = migrated("policy_crash_loop").await;
    let client = prepare_shared_server().await;
    let stream = unique_name("crashloop");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: stream.clone(),
        prefix: stream.clone(),
    };

    // The killer is the first event of `poison`; its second event waits behind it.
    let mut tx = db.pool.begin().await.unwrap();
    let killer = outbox
        .enqueue(
            &mut tx,
            &[factory::event("poison", 1), factory::event("poison", 2)],
        )
        .await
        .unwrap()[0]
        .event_id;
    tx.commit().await.unwrap();
    enqueue_spread(&db.pool, &outbox, 0, 30, 10).await;

    let failpoint = format!("relay.abort_on_event=return({killer})");
    let env = [("FAILPOINTS", failpoint.as_str())];
    let extra = ["--max-takeovers", "2"];
    let mut aborts = 0;
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut relay = RelayProcess::start(&target, "crash-loop", &extra, &env);
    loop {
        let hold: Option<String> =
            sqlx::query_scalar("SELECT hold_reason FROM outbox WHERE event_id = $1")
                .bind(killer)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        if hold.is_some() {
            break;
        }
        if let Some(status) = relay.try_status() {
            assert!(
                !status.success(),
                "the relay died by abort:\n{}",
                relay.log()
            );
            assert!(
                relay.log().contains("failpoint fired: aborting"),
                "{}",
                relay.log()
            );
            aborts += 1;
            relay = RelayProcess::start(&target, "crash-loop", &extra, &env);
        }
        assert!(Instant::now() < deadline, "never held:\n{}", relay.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Claimed fresh, then taken over twice (the bound), each time killing its relay; the
    // fourth claim holds it instead.
    assert_eq!(aborts, 3, "{}", relay.log());

    // Every other aggregate flows: only `poison` waits.
    wait_drained_but_poison(&db, &relay).await;
    assert!(relay.terminate().success(), "{}", relay.log());
    let row: (Option<String>, i32, i32, Option<String>) = sqlx::query_as(
        "SELECT hold_reason, takeover_count, attempt_count, last_error FROM outbox \
         WHERE event_id = $1 AND published_at IS NULL AND available_at = 'infinity'",
    )
    .bind(killer)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(row.0.as_deref(), Some("crash_loop"));
    assert_eq!((row.1, row.2), (3, 0), "three takeovers, no failed attempt");
    assert!(row.3.unwrap_or_default().starts_with("crash_loop:"));
    let second: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
        "SELECT published_at FROM outbox WHERE aggregate_id = 'poison' AND aggregate_sequence = 2",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(second, None, "the killer's successor never overtakes it");
    let messages = read_stream(&client, &stream).await;
    assert!(messages.iter().all(|m| !m.subject.ends_with(".poison")));
    let ids: HashSet<&str> = messages
        .iter()
        .filter_map(|m| m.header("Nats-Msg-Id"))
        .collect();
    assert_eq!(ids.len(), 30, "every other event in the stream");

    // The operator sees why, and a retry gives it a fresh budget.
    let listed = handoff(&db, &["quarantine", "list", "--json"]);
    let listed = stdout_json(&listed);
    let entry = &listed[0];
    assert_eq!(entry["hold_reason"], "crash_loop", "{listed}");
    assert_eq!(entry["takeovers"], 3, "{listed}");
    let retried = handoff(&db, &["quarantine", "retry", &killer.to_string()]);
    assert!(retried.status.success(), "{retried:?}");
    let reset: (i32, Option<String>) =
        sqlx::query_as("SELECT takeover_count, hold_reason FROM outbox WHERE event_id = $1")
            .bind(killer)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reset, (0, None));
}
