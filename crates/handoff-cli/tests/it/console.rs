//! `handoff console` as a real process over PostgreSQL, with a real relay and nats-server: the
//! API and the pages refuse anyone without a token, answer what the CLI's `--json` prints,
//! refuse actions on a read-only console and form posts without their anti-forgery token; and
//! in a real browser (headless chromium through WebDriver) an operator sees a relay alive and
//! then stopped, a held event first with its reason, hostile payload text shown as text, a
//! skip without a reason refused, and a retry from the page published and audited under the
//! token's name.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use fantoccini::Locator;
use handoff_core::NewEvent;
use handoff_test::browser::Browser;
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use handoff_test::{eventually, factory, TestDb};
use reqwest::StatusCode;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::common::{handoff, migrated, stderr, stdout_json, RelayProcess, Target};

const TOKEN: &str = "t0ken-for-alice";

/// A `handoff console` child process on a port of its own choosing; killed on drop.
struct ConsoleProcess {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl ConsoleProcess {
    /// Starts the console on `db` with a token file naming `alice`, plus `extra` flags.
    fn start(db: &TestDb, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let tokens = dir.path().join("tokens");
        std::fs::write(&tokens, format!("# operators\nalice:{TOKEN}\n")).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
            .args([
                "console",
                "--listen",
                "127.0.0.1:0",
                "--sample-interval",
                "1s",
            ])
            .arg("--auth-token-file")
            .arg(&tokens)
            .args(extra)
            .env("DATABASE_URL", db.url())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn handoff console");
        // The first line names the address it bound; a console that fails to start closes
        // stdout instead, and the test stops here.
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("console listening on ")
            .unwrap_or_else(|| panic!("the console did not start: {line:?}"))
            .to_owned();
        ConsoleProcess {
            child,
            url,
            _dir: dir,
        }
    }
}

impl ConsoleProcess {
    /// `GET path` with the token: the page's text.
    async fn page(&self, path: &str) -> String {
        let answer = client()
            .get(format!("{}{path}", self.url))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK, "GET {path}");
        answer.text().await.unwrap()
    }

    /// `GET path` of the API with the token, as JSON; an error to wait on rather than a panic.
    async fn json(&self, path: &str) -> Result<Value, String> {
        client()
            .get(format!("{}{path}", self.url))
            .bearer_auth(TOKEN)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json::<Value>()
            .await
            .map_err(|e| e.to_string())
    }
}

/// The table row of `page` whose opening tag holds `marker` (such as `data-cursor="audit"`),
/// up to its end.
fn row<'a>(page: &'a str, marker: &str) -> &'a str {
    let after = page
        .split(marker)
        .nth(1)
        .unwrap_or_else(|| panic!("no row with {marker}:\n{page}"));
    &after[..after.find("</tr>").unwrap()]
}

impl Drop for ConsoleProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// Commits one event of aggregate `aggregate` and holds it as an operator would, so it stays
/// put without a relay; returns its id.
async fn held_event(db: &TestDb, aggregate: &str) -> Uuid {
    let outbox = factory::outbox(handoff_core::OrderMode::Aggregate);
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &[factory::event(aggregate, 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let id: Uuid = sqlx::query_scalar("SELECT event_id FROM outbox WHERE aggregate_id = $1")
        .bind(aggregate)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let hold = handoff(
        db,
        &[
            "quarantine",
            "hold",
            &id.to_string(),
            "--reason",
            "checking it",
        ],
    );
    assert!(hold.status.success(), "{}", stderr(&hold));
    id
}

/// `status --json` without what moves between two readings: ages and table sizes.
fn steady(mut status: Value) -> Value {
    let object = status.as_object_mut().unwrap();
    object.remove("oldest_pending_age_seconds");
    object.remove("tables");
    for stuck in object["stuck_aggregates"].as_array_mut().unwrap() {
        stuck
            .as_object_mut()
            .unwrap()
            .remove("oldest_pending_age_seconds");
    }
    status
}

#[tokio::test]
async fn the_api_refuses_strangers_and_answers_what_the_cli_prints() {
    let (db, _) = migrated("console_api").await;
    let id = held_event(&db, "api-held").await;
    let console = ConsoleProcess::start(&db, &[]);
    let http = client();
    let url = |path: &str| format!("{}{path}", console.url);

    // Without a token, every page and call is refused.
    for path in [
        "/",
        "/held",
        &format!("/events/{id}"),
        "/api/v1/status",
        "/api/v1/quarantine",
        "/api/v1/openapi.json",
    ] {
        let answer = http.get(url(path)).send().await.unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "GET {path}");
        let wrong = http
            .get(url(path))
            .bearer_auth("nope")
            .send()
            .await
            .unwrap();
        assert_eq!(
            wrong.status(),
            StatusCode::UNAUTHORIZED,
            "GET {path} with a wrong token"
        );
    }
    for path in [
        format!("/events/{id}/retry"),
        format!("/api/v1/events/{id}/retry"),
    ] {
        let answer = http.post(url(&path)).send().await.unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "POST {path}");
    }

    // The API's JSON is the CLI's.
    let api_status: Value = http
        .get(url("/api/v1/status"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cli_status = stdout_json(&handoff(&db, &["status", "--json"]));
    assert_eq!(steady(api_status), steady(cli_status));
    let api_list: Value = http
        .get(url("/api/v1/quarantine"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cli_list = stdout_json(&handoff(&db, &["quarantine", "list", "--json"]));
    assert_eq!(api_list, cli_list);
    assert_eq!(api_list[0]["event_id"], id.to_string());
    let openapi: Value = http
        .get(url("/api/v1/openapi.json"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(openapi["paths"]["/api/v1/events/{id}/skip"]["post"].is_object());

    // A skip needs a reason.
    let skip = http
        .post(url(&format!("/api/v1/events/{id}/skip")))
        .bearer_auth(TOKEN)
        .json(&json!({"reason": " "}))
        .send()
        .await
        .unwrap();
    assert_eq!(skip.status(), StatusCode::BAD_REQUEST);
    assert_eq!(skip.json::<Value>().await.unwrap()["kind"], "bad_request");

    // A session cookie from the sign-in form: HttpOnly, SameSite=Strict.
    let login = http
        .post(url("/login"))
        .form(&[("token", TOKEN)])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), StatusCode::SEE_OTHER);
    let cookie = login.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_owned();
    // A form post without the anti-forgery token (what another site's form would send) is
    // refused, with a wrong one too, and the event stays held.
    for form in [vec![], vec![("csrf", "forged")]] {
        let post = http
            .post(url(&format!("/events/{id}/retry")))
            .header("cookie", &session)
            .form(&form)
            .send()
            .await
            .unwrap();
        assert_eq!(post.status(), StatusCode::FORBIDDEN);
    }
    let still: Value = http
        .get(url(&format!("/api/v1/events/{id}")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(still["state"], "quarantined");
    // The page's own token works, and the audit names the token's actor as the CLI would.
    let page = http
        .get(url(&format!("/events/{id}")))
        .header("cookie", &session)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .to_owned();
    let skip = http
        .post(url(&format!("/events/{id}/skip")))
        .header("cookie", &session)
        .form(&[("csrf", csrf.as_str()), ("reason", "")])
        .send()
        .await
        .unwrap();
    assert_eq!(
        skip.status(),
        StatusCode::BAD_REQUEST,
        "a skip without a reason"
    );
    let skip = http
        .post(url(&format!("/events/{id}/skip")))
        .header("cookie", &session)
        .form(&[("csrf", csrf.as_str()), ("reason", "duplicate order")])
        .send()
        .await
        .unwrap();
    assert_eq!(skip.status(), StatusCode::SEE_OTHER);
    let audit: (String, String, Option<String>) = sqlx::query_as(
        "SELECT action, actor, reason FROM outbox_quarantine_actions WHERE event_id = $1 ORDER BY action_id DESC LIMIT 1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        (
            "skip".to_owned(),
            "alice".to_owned(),
            Some("duplicate order".to_owned())
        )
    );
}

#[tokio::test]
async fn a_read_only_console_hides_and_refuses_actions() {
    let (db, _) = migrated("console_read_only").await;
    let id = held_event(&db, "ro-held").await;
    let console = ConsoleProcess::start(&db, &["--read-only"]);
    let http = client();
    let page = http
        .get(format!("{}/events/{id}", console.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let page = page.text().await.unwrap();
    assert!(
        page.contains("quarantined")
            && !page.contains("id=\"retry\"")
            && !page.contains("id=\"skip\""),
        "{page}"
    );
    let retry = http
        .post(format!("{}/api/v1/events/{id}/retry", console.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::FORBIDDEN);
    assert_eq!(retry.json::<Value>().await.unwrap()["kind"], "read_only");
    let retry = http
        .post(format!("{}/events/{id}/retry", console.url))
        .bearer_auth(TOKEN)
        .form(&[("csrf", "")])
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::FORBIDDEN);
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE event_id = $1 AND published_at IS NULL",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(held, 1);
}

/// A relay's heartbeat carries what it did: the overview and the API show its published count,
/// last claim and last mark, and the console's samples turn the counts into events per second.
#[tokio::test]
async fn the_overview_shows_what_each_relay_published_and_the_rate() {
    let (db, outbox) = migrated("console_rate").await;
    let _client = prepare_shared_server().await;
    let name = unique_name("console_rate");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &name);
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: name.clone(),
        prefix: name.clone(),
    };
    let console = ConsoleProcess::start(&db, &[]);
    let relay = RelayProcess::start(&target, "rate-relay", &["--lease", "4s"], &[]);
    for n in 1..=5 {
        db.enqueue_alone(&outbox, factory::event("rate", n)).await;
    }
    // The heartbeat after the marks (every second with a 4 s lease) carries the count.
    let seen = eventually(
        "the relay's five events in its session",
        Duration::from_secs(30),
        async || {
            let status = console.json("/api/v1/status").await?;
            let relay_row = status["relays"]
                .as_array()
                .and_then(|r| r.iter().find(|r| r["relay_id"] == "rate-relay").cloned())
                .ok_or_else(|| format!("no relay yet: {status}\n{}", relay.log()))?;
            if relay_row["published"] == 5 {
                Ok(relay_row)
            } else {
                Err(format!("{relay_row}\n{}", relay.log()))
            }
        },
    )
    .await;
    assert!(seen["last_claim_at"].is_string(), "{seen}");
    assert!(seen["last_mark_at"].is_string(), "{seen}");
    // A sample taken after that heartbeat, against one before it, has the rate.
    eventually(
        "a sample with events published per second",
        Duration::from_secs(30),
        async || {
            let samples = console.json("/api/v1/samples").await?;
            let rates: Vec<f64> = samples
                .as_array()
                .map(|s| {
                    s.iter()
                        .filter_map(|s| s["published_per_second"].as_f64())
                        .collect()
                })
                .unwrap_or_default();
            if rates.iter().any(|r| *r > 0.0) {
                Ok(())
            } else {
                Err(format!("{samples}"))
            }
        },
    )
    .await;
    let page = console.page("/").await;
    assert!(page.contains("Events published per second"), "{page}");
    let relay_row = row(&page, "data-relay-id=\"rate-relay\"");
    assert!(
        relay_row.contains("<td class=\"published\">5</td>"),
        "{relay_row}"
    );
}

/// A log-source cursor shows on the overview with what it has not passed yet, as the API (and
/// so `handoff status --json`) reports it.
#[tokio::test]
async fn the_overview_shows_each_cursor_and_the_events_behind_it() {
    use handoff_core::delivery::Source;
    use handoff_postgres::{LogConfig, LogSource, PollingConfig, Schema};

    let (db, outbox) = migrated("console_cursors").await;
    let config = LogConfig {
        polling: PollingConfig {
            schema: Schema::named(db.schema()).unwrap(),
            relay_id: "relay-log".into(),
            listen: false,
            ..PollingConfig::default()
        },
        cursor: "audit".into(),
        ..LogConfig::default()
    };
    // Its first claim, of an empty outbox, creates the cursor; the three events after it are
    // its to read, and nothing reads them.
    let source = LogSource::new(db.pool.clone(), config).unwrap();
    assert!(source
        .claim(100, usize::MAX)
        .await
        .unwrap()
        .events
        .is_empty());
    for n in 1..=3 {
        db.enqueue_alone(&outbox, factory::event("behind", n)).await;
    }

    let console = ConsoleProcess::start(&db, &[]);
    let status = console.json("/api/v1/status").await.unwrap();
    let cursors = status["cursors"].as_array().unwrap();
    assert_eq!(cursors.len(), 1, "{status}");
    assert_eq!(cursors[0]["cursor"], "audit");
    assert_eq!(cursors[0]["lag_events"], 3);
    assert_eq!(cursors[0]["owner_relay"], "relay-log");

    let page = console.page("/").await;
    let cursor_row = row(&page, "<tr data-cursor=\"audit\">");
    assert!(
        cursor_row.contains("<td class=\"lag-events\">3</td>") && cursor_row.contains("relay-log"),
        "{cursor_row}"
    );
}

/// Text of the element `css`, or an error naming it.
async fn text(browser: &Browser, css: &str) -> Result<String, String> {
    match browser.client.find(Locator::Css(css)).await {
        Ok(element) => element.text().await.map_err(|e| e.to_string()),
        Err(error) => Err(format!("{css}: {error}")),
    }
}

#[tokio::test]
async fn an_operator_sees_relays_and_held_events_and_retries_from_the_browser() {
    let (db, outbox) = migrated("console_browser").await;
    let client = prepare_shared_server().await;
    let name = unique_name("console");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &name);
    let js = jetstream::new(client.clone());
    // Messages over 4 KiB are refused: the relay holds the big hostile event as `rejected`.
    let config = stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        max_message_size: 4096,
        ..Default::default()
    };
    js.create_stream(config.clone()).await.unwrap();
    let hostile = json!({
        "note": "<script>window.__pwned = 1</script>",
        "img": "<img src=x onerror=\"window.__pwned = 2\">",
        "link": "javascript:window.__pwned = 3",
        "blob": "x".repeat(6 * 1024),
    });
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut tx,
            &[
                NewEvent::new(
                    factory::AGGREGATE_TYPE,
                    "hostile",
                    factory::EVENT_TYPE,
                    1,
                    hostile.to_string(),
                )
                .with_header("x-note", "<b onmouseover=\"window.__pwned = 4\">hi</b>"),
                factory::event("hostile", 2),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: name.clone(),
        prefix: name.clone(),
    };
    let mut relay = RelayProcess::start(&target, "console-relay", &[], &[]);
    let console = ConsoleProcess::start(&db, &[]);
    let browser = Browser::start().await;
    let go = async |path: &str| {
        browser
            .client
            .goto(&format!("{}{path}", console.url))
            .await
            .unwrap()
    };

    // Signed out: the sign-in page, nothing else.
    go("/").await;
    assert!(text(&browser, "h1").await.unwrap().contains("Sign in"));
    browser
        .client
        .find(Locator::Id("token"))
        .await
        .unwrap()
        .send_keys(TOKEN)
        .await
        .unwrap();
    browser
        .client
        .find(Locator::Id("sign-in"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();

    // The relay is alive, and the hostile event is held first with its reason.
    let event_id: String = eventually(
        "the overview shows the relay alive and the held event",
        Duration::from_secs(30),
        async || {
            go("/").await;
            let relay_state = text(
                &browser,
                "#relays tr[data-relay-id='console-relay'] td:nth-child(2)",
            )
            .await?;
            let reason = text(&browser, "#held tbody tr:first-child .hold-reason").await?;
            let row = browser
                .client
                .find(Locator::Css("#held tbody tr:first-child"))
                .await
                .map_err(|e| e.to_string())?;
            let id = row
                .attr("data-event-id")
                .await
                .map_err(|e| e.to_string())?
                .unwrap_or_default();
            if relay_state.starts_with("alive") && reason == "rejected" {
                Ok(id)
            } else {
                Err(format!("{relay_state} / {reason}\n{}", relay.log()))
            }
        },
    )
    .await;
    browser.screenshot("console-overview").await;

    // The held event: its hostile payload and header as text; nothing ran.
    browser
        .client
        .find(Locator::Css(&format!("#held a[href='/events/{event_id}']")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert_eq!(shown(&browser, "#hold-reason").await, "rejected");
    let payload = text(&browser, "#payload").await.unwrap();
    assert!(
        payload.contains("<script>window.__pwned = 1</script>"),
        "{payload}"
    );
    assert!(payload.contains("<img src=x onerror="), "{payload}");
    assert!(
        payload.contains("javascript:window.__pwned = 3"),
        "{payload}"
    );
    assert!(text(&browser, "#headers")
        .await
        .unwrap()
        .contains("<b onmouseover="));
    let pwned = browser
        .client
        .execute("return typeof window.__pwned;", vec![])
        .await
        .unwrap();
    assert_eq!(pwned, json!("undefined"), "a script from the payload ran");
    assert_eq!(
        browser
            .client
            .find_all(Locator::Css("main script, main img"))
            .await
            .unwrap()
            .len(),
        0
    );
    browser.screenshot("console-held-event").await;

    // A skip without a reason is refused.
    browser
        .client
        .find(Locator::Id("skip"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert!(shown(&browser, "#error").await.contains("needs a reason"));

    // The stream takes big messages now; retry from the page gets the event published.
    js.update_stream(stream::Config {
        max_message_size: 64 * 1024,
        ..config
    })
    .await
    .unwrap();
    go(&format!("/events/{event_id}")).await;
    browser
        .client
        .find(Locator::Id("retry"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert!(shown(&browser, "#flash").await.contains("retried"));
    let event_uuid: Uuid = event_id.parse().unwrap();
    eventually(
        "the retried event is published",
        Duration::from_secs(30),
        async || {
            let published: bool = sqlx::query_scalar(
                "SELECT published_at IS NOT NULL FROM outbox WHERE event_id = $1",
            )
            .bind(event_uuid)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            relay.log_unless(published)
        },
    )
    .await;
    let actor: String = sqlx::query_scalar(
        "SELECT actor FROM outbox_quarantine_actions WHERE event_id = $1 AND action = 'retry'",
    )
    .bind(event_uuid)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(actor, "alice");

    // SIGKILL: the relay shows as stopped once its heartbeat's bound (the lease, 4 s) passes.
    relay.kill();
    eventually(
        "the overview shows the relay stopped",
        Duration::from_secs(20),
        async || {
            go("/").await;
            let state = text(
                &browser,
                "#relays tr[data-relay-id='console-relay'] td:nth-child(2)",
            )
            .await?;
            if state == "stopped" {
                Ok(())
            } else {
                Err(state)
            }
        },
    )
    .await;
    browser.close().await;
}

/// The page's anti-forgery token, read from a page's first form.
fn csrf_of(page: &str) -> String {
    page.split("name=\"csrf\" value=\"")
        .nth(1)
        .expect("a form with an anti-forgery token")
        .split('"')
        .next()
        .unwrap()
        .to_owned()
}

/// A session cookie for `TOKEN`, from the sign-in form.
async fn session(http: &reqwest::Client, console: &ConsoleProcess) -> String {
    let login = http
        .post(format!("{}/login", console.url))
        .form(&[("token", TOKEN)])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), StatusCode::SEE_OTHER);
    let cookie = login.headers()["set-cookie"].to_str().unwrap().to_owned();
    cookie.split(';').next().unwrap().to_owned()
}

/// The payload, state and repair audit rows of event `id`: what a refused repair must leave
/// as it was.
async fn repair_state(db: &TestDb, id: Uuid) -> (Value, bool, i64) {
    let (payload, held): (Value, bool) =
        sqlx::query_as("SELECT payload, available_at = 'infinity' FROM outbox WHERE event_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let repairs: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_quarantine_actions WHERE event_id = $1 AND action = 'repair'",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    (payload, held, repairs)
}

#[tokio::test]
async fn a_repair_from_the_page_is_checked_as_an_enqueue_reviewed_then_saved_once() {
    let (db, _) = migrated("console_repair_checks").await;
    let id = held_event(&db, "repair-checks").await;
    let console = ConsoleProcess::start(&db, &["--max-payload-bytes", "256"]);
    let http = client();
    let cookie = session(&http, &console).await;
    let event_page = http
        .get(format!("{}/events/{id}", console.url))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(event_page.contains("id=\"repair-payload\""), "{event_page}");
    let csrf = csrf_of(&event_page);
    let before = repair_state(&db, id).await;
    assert!(before.1, "the event is held");
    let post = async |form: &[(&str, &str)]| {
        http.post(format!("{}/events/{id}/repair", console.url))
            .header("cookie", &cookie)
            .form(form)
            .send()
            .await
            .unwrap()
    };

    // Refused payloads, with the library's reason on the page and nothing written, whether
    // reviewed or posted straight to the save step.
    let big = json!({ "blob": "x".repeat(300) }).to_string();
    for (payload, why) in [
        ("{\"total\": 12,", "not valid JSON"),
        (big.as_str(), "the limit is 256"),
        ("{\"note\": \"a\\u0000b\"}", "\\u0000"),
    ] {
        for confirm in [None, Some("1")] {
            let mut form = vec![("csrf", csrf.as_str()), ("payload", payload)];
            if let Some(confirm) = confirm {
                form.push(("confirm", confirm));
            }
            let answer = post(&form).await;
            assert_eq!(answer.status(), StatusCode::BAD_REQUEST, "{payload}");
            let page = answer.text().await.unwrap();
            assert!(page.contains(why), "{why} not in {page}");
            assert!(page.contains("Nothing was written"), "{page}");
            assert_eq!(repair_state(&db, id).await, before, "{payload}");
        }
    }

    // Without the anti-forgery token: refused, and nothing written.
    let forged = post(&[("payload", "{\"total\": 1}"), ("confirm", "1")]).await;
    assert_eq!(forged.status(), StatusCode::FORBIDDEN);
    assert_eq!(repair_state(&db, id).await, before);

    // The review writes nothing; its diff is text, its fingerprint binds the save to it.
    let new = r#"{"total": 1250, "note": "<b>fixed</b>"}"#;
    let review = post(&[("csrf", csrf.as_str()), ("payload", new)]).await;
    assert_eq!(review.status(), StatusCode::OK);
    let review = review.text().await.unwrap();
    assert!(review.contains("id=\"repair-diff\""), "{review}");
    assert!(review.contains("&lt;b&gt;fixed&lt;/b&gt;"), "{review}");
    assert!(!review.contains("<b>fixed</b>"), "{review}");
    assert_eq!(repair_state(&db, id).await, before);
    let base = review
        .split("name=\"base\" value=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .to_owned();
    // A save against another review's fingerprint is refused as stale.
    let stale = post(&[
        ("csrf", csrf.as_str()),
        ("payload", new),
        ("base", "not-the-reviewed-one"),
        ("confirm", "1"),
    ])
    .await;
    assert_eq!(stale.status(), StatusCode::CONFLICT);
    assert_eq!(repair_state(&db, id).await, before);
    let saved = post(&[
        ("csrf", csrf.as_str()),
        ("payload", new),
        ("base", base.as_str()),
        ("confirm", "1"),
    ])
    .await;
    assert_eq!(saved.status(), StatusCode::SEE_OTHER);
    let (payload, held, repairs) = repair_state(&db, id).await;
    assert_eq!(payload, json!({"total": 1250, "note": "<b>fixed</b>"}));
    assert!(!held, "the repaired event is released");
    assert_eq!(repairs, 1);
    // The same save again: the event is no longer held, nothing more is written.
    let again = post(&[
        ("csrf", csrf.as_str()),
        ("payload", new),
        ("base", base.as_str()),
        ("confirm", "1"),
    ])
    .await;
    assert_eq!(again.status(), StatusCode::CONFLICT);
    assert_eq!(repair_state(&db, id).await.2, 1);
}

#[tokio::test]
async fn the_console_acts_on_consumer_quarantines_and_stuck_sagas_audited_under_the_token() {
    let (db, _) = migrated("console_ops").await;
    let (consumer_db, _) = migrated("console_ops_consumer").await;
    let first = crate::consumer_quarantine::received("c-1", 1);
    let second = crate::consumer_quarantine::received("c-2", 1);
    let kind = handoff_postgres::QuarantineKind::HandlerPermanent;
    let first_row =
        crate::consumer_quarantine::quarantine(&consumer_db, "inventory", &first, kind).await;
    let second_row =
        crate::consumer_quarantine::quarantine(&consumer_db, "inventory", &second, kind).await;
    let orchestrator = crate::saga::orchestrator();
    let resumed = crate::saga::stuck_saga(&db, &orchestrator).await;
    let resolved = crate::saga::stuck_saga(&db, &orchestrator).await;
    let consumer_arg = format!("inventory={}", consumer_db.url());
    let console = ConsoleProcess::start(&db, &["--consumer", &consumer_arg]);
    let http = client();
    let get = async |path: &str| {
        http.get(format!("{}{path}", console.url))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
    };
    let post = async |path: &str, body: Value| {
        http.post(format!("{}{path}", console.url))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap()
    };

    // Strangers are refused here too.
    for path in ["/consumers", "/sagas", "/api/v1/consumers", "/api/v1/sagas"] {
        let answer = http
            .get(format!("{}{path}", console.url))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED, "{path}");
    }

    // Consumers: the list is the CLI's, the URL is never shown.
    let summary: Value = get("/api/v1/consumers").await.json().await.unwrap();
    assert_eq!(
        summary,
        json!([{"name": "inventory", "quarantined": 2, "retry_requested": 0}])
    );
    let api_rows: Value = get("/api/v1/consumers/inventory/quarantine")
        .await
        .json()
        .await
        .unwrap();
    let cli_rows = stdout_json(&handoff(
        &consumer_db,
        &[
            "consumer",
            "quarantine",
            "list",
            "--consumer-name",
            "inventory",
            "--json",
        ],
    ));
    assert_eq!(api_rows, cli_rows);
    let unknown = get("/api/v1/consumers/payments/quarantine").await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    let page = get("/consumers").await.text().await.unwrap();
    assert!(
        page.contains("Consumer inventory") && page.contains(&format!("data-row=\"{first_row}\"")),
        "{page}"
    );
    assert!(
        !page.contains(&consumer_db.url()),
        "the consumer's URL is shown"
    );
    let row_page = get(&format!("/consumers/inventory/rows/{first_row}"))
        .await
        .text()
        .await
        .unwrap();
    assert!(row_page.contains("id=\"consumer-retry\""), "{row_page}");

    // Retry, and skip (a reason required), audited under the token's name.
    let retry = post(
        &format!("/api/v1/consumers/inventory/quarantine/{first_row}/retry"),
        json!({}),
    )
    .await;
    assert_eq!(retry.status(), StatusCode::OK);
    let again = post(
        &format!("/api/v1/consumers/inventory/quarantine/{first_row}/retry"),
        json!({}),
    )
    .await;
    assert_eq!(again.status(), StatusCode::CONFLICT, "already requested");
    let no_reason = post(
        &format!("/api/v1/consumers/inventory/quarantine/{second_row}/skip"),
        json!({"reason": ""}),
    )
    .await;
    assert_eq!(no_reason.status(), StatusCode::BAD_REQUEST);
    // Skipped through the page's form, by event id.
    let skip = http
        .post(format!(
            "{}/consumers/inventory/rows/{}/skip",
            console.url, second.event_id
        ))
        .bearer_auth(TOKEN)
        .form(&[("reason", "stock was corrected by hand")])
        .send()
        .await
        .unwrap();
    assert_eq!(skip.status(), StatusCode::SEE_OTHER);
    let audit: Vec<(i64, String, String, Option<String>)> = sqlx::query_as(
        "SELECT quarantine_id, action, actor, reason FROM consumer_quarantine_actions \
         ORDER BY action_id",
    )
    .fetch_all(&consumer_db.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![
            (first_row, "retry".to_owned(), "alice".to_owned(), None),
            (
                second_row,
                "skip".to_owned(),
                "alice".to_owned(),
                Some("stock was corrected by hand".to_owned())
            ),
        ]
    );
    let statuses: Vec<String> =
        sqlx::query_scalar("SELECT status FROM consumer_quarantine ORDER BY quarantine_id")
            .fetch_all(&consumer_db.pool)
            .await
            .unwrap();
    assert_eq!(statuses, ["retry_requested", "resolved"]);

    // Sagas: the stuck list is the CLI's; resume and resolve, audited.
    let api_sagas: Value = get("/api/v1/sagas?state=stuck").await.json().await.unwrap();
    let cli_sagas = stdout_json(&handoff(
        &db,
        &["saga", "list", "--state", "stuck", "--json"],
    ));
    assert_eq!(api_sagas, cli_sagas);
    assert_eq!(api_sagas.as_array().unwrap().len(), 2);
    let page = get(&format!("/sagas/{resolved}"))
        .await
        .text()
        .await
        .unwrap();
    assert!(page.contains("id=\"saga-resolve\""), "{page}");
    let no_reason = post(&format!("/api/v1/sagas/{resolved}/resolve"), json!({})).await;
    assert_eq!(no_reason.status(), StatusCode::BAD_REQUEST);
    let resume = post(&format!("/api/v1/sagas/{resumed}/resume"), json!({})).await;
    assert_eq!(resume.status(), StatusCode::OK);
    assert_eq!(
        resume.json::<Value>().await.unwrap()["state"],
        "compensating"
    );
    let resolve = http
        .post(format!("{}/sagas/{resolved}/resolve", console.url))
        .bearer_auth(TOKEN)
        .form(&[("reason", "stock released by hand")])
        .send()
        .await
        .unwrap();
    assert_eq!(resolve.status(), StatusCode::SEE_OTHER);
    let not_stuck = post(&format!("/api/v1/sagas/{resolved}/resume"), json!({})).await;
    assert_eq!(not_stuck.status(), StatusCode::CONFLICT);
    let audit: Vec<(Uuid, String, String, String)> = sqlx::query_as(
        "SELECT saga_id, action, actor, reason FROM saga_operator_actions ORDER BY action_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        vec![
            (
                resumed,
                "resume".to_owned(),
                "alice".to_owned(),
                "resumed by an operator".to_owned()
            ),
            (
                resolved,
                "resolve".to_owned(),
                "alice".to_owned(),
                "stock released by hand".to_owned()
            ),
        ]
    );
}

#[tokio::test]
async fn a_read_only_console_hides_and_refuses_repair_consumer_and_saga_actions() {
    let (db, _) = migrated("console_read_only_ops").await;
    let id = held_event(&db, "ro-ops").await;
    let event = crate::consumer_quarantine::received("ro-c", 1);
    let row = crate::consumer_quarantine::quarantine(
        &db,
        "inventory",
        &event,
        handoff_postgres::QuarantineKind::HandlerPermanent,
    )
    .await;
    let saga = crate::saga::stuck_saga(&db, &crate::saga::orchestrator()).await;
    let consumer_arg = format!("inventory={}", db.url());
    let console = ConsoleProcess::start(&db, &["--read-only", "--consumer", &consumer_arg]);
    let http = client();
    for (path, hidden) in [
        (format!("/events/{id}"), "repair-payload"),
        (format!("/consumers/inventory/rows/{row}"), "consumer-retry"),
        (format!("/sagas/{saga}"), "saga-resume"),
    ] {
        let page = http
            .get(format!("{}{path}", console.url))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(page.status(), StatusCode::OK, "{path}");
        let page = page.text().await.unwrap();
        assert!(!page.contains(hidden), "{path} shows {hidden}");
    }
    for (path, body) in [
        (
            format!("/api/v1/events/{id}/repair"),
            json!({"payload": {"a": 1}}),
        ),
        (
            format!("/api/v1/consumers/inventory/quarantine/{row}/retry"),
            json!({}),
        ),
        (
            format!("/api/v1/consumers/inventory/quarantine/{row}/skip"),
            json!({"reason": "no"}),
        ),
        (format!("/api/v1/sagas/{saga}/resume"), json!({})),
        (
            format!("/api/v1/sagas/{saga}/resolve"),
            json!({"reason": "no"}),
        ),
    ] {
        let answer = http
            .post(format!("{}{path}", console.url))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::FORBIDDEN, "{path}");
        assert_eq!(answer.json::<Value>().await.unwrap()["kind"], "read_only");
    }
    for (path, form) in [
        (format!("/events/{id}/repair"), vec![("payload", "{}")]),
        (format!("/consumers/inventory/rows/{row}/retry"), vec![]),
        (format!("/sagas/{saga}/resolve"), vec![("reason", "no")]),
    ] {
        let answer = http
            .post(format!("{}{path}", console.url))
            .bearer_auth(TOKEN)
            .form(&form)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::FORBIDDEN, "{path}");
    }
    let (_, held, repairs) = repair_state(&db, id).await;
    assert!(held && repairs == 0);
    let actions: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM consumer_quarantine_actions) \
              + (SELECT count(*) FROM saga_operator_actions)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(actions, 0);
}

/// Text of the element `css` once the page that has it is loaded: a click on a form's button
/// may return before the browser has navigated to the answer.
async fn shown(browser: &Browser, css: &str) -> String {
    let element = browser
        .client
        .wait()
        .at_most(Duration::from_secs(15))
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css} never appeared: {e}"));
    element.text().await.unwrap()
}

#[tokio::test]
async fn an_operator_repairs_a_held_payload_in_the_browser_and_the_broker_gets_the_new_one() {
    let (db, _) = migrated("console_repair_browser").await;
    let client = prepare_shared_server().await;
    let name = unique_name("console_repair");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &name);
    jetstream::new(client.clone())
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    let id = held_event(&db, "repair-browser").await;
    let before = repair_state(&db, id).await;
    assert_eq!(before.0, json!({"n": 1}));
    let target = Target {
        database_url: db.url(),
        nats_url: shared_url(),
        stream: name.clone(),
        prefix: name.clone(),
    };
    let relay = RelayProcess::start(&target, "console-repair-relay", &[], &[]);
    let console = ConsoleProcess::start(&db, &[]);
    let browser = Browser::start().await;
    let go = async |path: &str| {
        browser
            .client
            .goto(&format!("{}{path}", console.url))
            .await
            .unwrap()
    };
    let click = async |id: &str| {
        browser
            .client
            .find(Locator::Id(id))
            .await
            .unwrap()
            .click()
            .await
            .unwrap()
    };
    let edit = async |text: &str| {
        browser
            .client
            .execute(
                "document.getElementById('repair-payload').value = arguments[0];",
                vec![json!(text)],
            )
            .await
            .unwrap();
    };
    go("/login").await;
    browser
        .client
        .find(Locator::Id("token"))
        .await
        .unwrap()
        .send_keys(TOKEN)
        .await
        .unwrap();
    click("sign-in").await;

    // A payload that is not JSON: refused with the reason on the page, nothing written.
    go(&format!("/events/{id}")).await;
    edit("{\"n\": 2,").await;
    click("repair-review").await;
    let error = shown(&browser, "#error").await;
    assert!(error.contains("not valid JSON"), "{error}");
    assert_eq!(repair_state(&db, id).await, before);

    // A good one: the review shows the change as text (the hostile part included), writes
    // nothing, and the save releases the event under the signed-in name.
    let new = json!({
        "n": 2,
        "note": "<img src=x onerror=\"window.__pwned = 7\">",
    });
    go(&format!("/events/{id}")).await;
    edit(&serde_json::to_string_pretty(&new).unwrap()).await;
    click("repair-review").await;
    let diff = shown(&browser, "#repair-diff").await;
    assert!(diff.contains("-   \"n\": 1"), "{diff}");
    assert!(diff.contains("+   \"n\": 2"), "{diff}");
    assert!(
        diff.contains("+   \"note\": \"<img src=x onerror=\\\"window.__pwned = 7\\\">\""),
        "{diff}"
    );
    assert_eq!(
        browser
            .client
            .find_all(Locator::Css("main script, main img"))
            .await
            .unwrap()
            .len(),
        0
    );
    assert_eq!(repair_state(&db, id).await, before, "the review wrote");
    browser.screenshot("console-repair-review").await;
    click("repair-save").await;
    assert!(shown(&browser, "#flash").await.contains("repaired"));
    let pwned = browser
        .client
        .execute("return typeof window.__pwned;", vec![])
        .await
        .unwrap();
    assert_eq!(pwned, json!("undefined"), "a script from the payload ran");

    // The broker holds the new payload under the same event id.
    let message = eventually(
        "the repaired event reaches the stream",
        Duration::from_secs(30),
        async || {
            let messages = read_stream(&client, &name).await;
            let found = messages
                .into_iter()
                .find(|m| m.header("ce-id") == Some(id.to_string().as_str()));
            found.ok_or_else(|| relay.log())
        },
    )
    .await;
    let published: Value = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(published, new);
    let audit: (String, String) = sqlx::query_as(
        "SELECT action, actor FROM outbox_quarantine_actions WHERE event_id = $1 \
         ORDER BY action_id DESC LIMIT 1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(audit, ("repair".to_owned(), "alice".to_owned()));
    browser.close().await;
}
