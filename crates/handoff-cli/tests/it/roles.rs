//! `handoff roles --print` applied to a fresh schema, and the system running under those roles:
//! the order service as a writer login, `handoff relay` as a relay login, the operator's
//! commands as an operator login; and what each role must not do, refused by PostgreSQL.
//!
//! Roles are cluster-wide, so each test names its roles after its own schema (`--role-prefix`)
//! and drops them (and the login roles it created) when it ends.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{check_stream, wait_drained, RelayProcess};
use handoff_test::nats::{
    prepare_shared_server, read_stream, shared_url, unique_name, DeleteStreamOnDrop,
};
use handoff_test::{factory, TestDb};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

/// `handoff ARGS` with `DATABASE_URL` set to `database_url`.
fn handoff(database_url: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("HANDOFF_ACTOR", "test-operator")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run handoff")
}

fn text(output: &std::process::Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The roles of one test and the login roles granted them; all dropped on drop.
struct Roles {
    prefix: String,
    admin: PgConnectOptions,
    /// The test's schema, for login URLs.
    db_url: String,
}

impl Roles {
    fn group(&self, part: &str) -> String {
        format!("{}_{part}", self.prefix)
    }

    fn login(&self, part: &str) -> String {
        format!("{}_{part}_login", self.prefix)
    }

    /// `db_url` (the test schema's URL, as `postgres`) as the login role of `part`.
    fn url(&self, part: &str) -> String {
        let login = self.login(part);
        let (scheme, rest) = self.db_url.split_once("://").expect("a URL");
        // The shared server trusts loopback connections: the user name is enough.
        let host = rest.split_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{login}@{host}")
    }
}

impl Drop for Roles {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let names: Vec<String> = ["writer", "relay", "operator"]
            .iter()
            .flat_map(|part| [self.login(part), self.group(part)])
            .collect();
        // Drop runs inside the test's runtime, which cannot be blocked on.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let Ok(mut conn) = PgConnection::connect_with(&admin).await else {
                    return;
                };
                for name in names {
                    // DROP OWNED revokes the role's privileges in this database, which
                    // DROP ROLE requires.
                    let _ = sqlx::raw_sql(&format!(
                        "DROP OWNED BY \"{name}\"; DROP ROLE IF EXISTS \"{name}\""
                    ))
                    .execute(&mut conn)
                    .await;
                }
            });
        })
        .join();
    }
}

/// The `order-service` binary, built beside this test's `handoff` (the workspace build).
fn order_service_binary() -> std::path::PathBuf {
    let handoff = std::path::Path::new(env!("CARGO_BIN_EXE_handoff"));
    let path = handoff.with_file_name("order-service");
    assert!(
        path.exists(),
        "{} is missing: build it first (cargo build -p order-service)",
        path.display()
    );
    path
}

/// `order-service --no-migrate` on `database_url`, killed on drop.
struct OrderService {
    child: Child,
    url: String,
}

impl OrderService {
    fn start(database_url: &str) -> Self {
        let mut child = Command::new(order_service_binary())
            .args([
                "--listen",
                "127.0.0.1:0",
                "--max-connections",
                "4",
                "--no-migrate",
            ])
            .env("DATABASE_URL", database_url)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn order-service");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("order-service printed {line:?} (see its stderr above)"))
            .to_owned();
        OrderService {
            child,
            url: format!("http://{addr}"),
        }
    }
}

impl Drop for OrderService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Asserts that `sql`, run as `url`'s role, is refused for lack of privilege (SQLSTATE 42501).
async fn assert_refused(url: &str, sql: &str) {
    let mut conn = PgConnection::connect(url).await.unwrap();
    let error = sqlx::raw_sql(sql)
        .execute(&mut conn)
        .await
        .expect_err(&format!("{sql} was allowed"));
    let code = error
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    assert_eq!(
        code.as_deref(),
        Some("42501"),
        "{sql}: not a permission error: {error}"
    );
    assert!(error.to_string().contains("permission denied"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_and_operators_run_under_the_printed_roles_and_nothing_more() {
    let db = TestDb::migrated("roles").await;
    {
        let mut conn = db.pool.acquire().await.unwrap();
        order_service::migrate(&mut conn).await.unwrap();
    }
    let schema = db.schema().to_owned();
    let roles = Roles {
        prefix: schema.clone(),
        admin: db.connect_options(),
        db_url: db.url(),
    };

    // The printed SQL, applied twice: the second run must change nothing and fail nowhere.
    let printed = handoff(
        &db.url(),
        &[
            "roles",
            "--print",
            "--schema",
            &schema,
            "--role-prefix",
            &schema,
        ],
    );
    assert!(printed.status.success(), "{}", text(&printed));
    let sql = String::from_utf8(printed.stdout).unwrap();
    assert!(
        sql.contains(&format!("CREATE ROLE \"{schema}_writer\" NOLOGIN")),
        "{sql}"
    );
    let mut admin = db.connect_options().connect().await.unwrap();
    for run in 1..=2 {
        sqlx::raw_sql(&sql)
            .execute(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("run {run} of the printed SQL failed: {e}"));
    }
    // Login roles, as an operator would make them, and the service's own tables for the
    // writer's login (the application's to grant, not handoff's).
    for part in ["writer", "relay", "operator"] {
        sqlx::raw_sql(&format!(
            "CREATE ROLE \"{login}\" LOGIN IN ROLE \"{group}\"",
            login = roles.login(part),
            group = roles.group(part)
        ))
        .execute(&mut admin)
        .await
        .unwrap();
    }
    sqlx::raw_sql(&format!(
        "GRANT SELECT, INSERT, UPDATE ON \"{schema}\".orders, \"{schema}\".order_lines,
             \"{schema}\".idempotency_keys TO \"{login}\";
         GRANT SELECT ON \"{schema}\".order_service_migrations TO \"{login}\"",
        login = roles.login("writer")
    ))
    .execute(&mut admin)
    .await
    .unwrap();

    // The order service writes orders and their events as the writer.
    let service = OrderService::start(&roles.url("writer"));
    let http = reqwest::Client::new();
    for n in 0..5 {
        let response = http
            .post(format!("{}/orders", service.url))
            .header("Idempotency-Key", format!("roles-{n}"))
            .json(&serde_json::json!({
                "customer_id": format!("c-{n}"),
                "lines": [{"sku": "apple", "quantity": 1 + n, "unit_price_cents": 150}]
            }))
            .send()
            .await
            .unwrap();
        let status = response.status();
        assert!(
            status.is_success(),
            "order {n} as the writer: {status} {}",
            response.text().await.unwrap()
        );
    }
    // The library's other enqueue path (sequence heads, INSERT ... RETURNING) as the writer.
    let outbox = handoff_postgres::Outbox::new(
        handoff_postgres::OutboxConfig::default(),
        factory::catalog(),
    )
    .unwrap();
    let mut writer = PgConnection::connect(&roles.url("writer")).await.unwrap();
    let mut tx = writer.begin().await.unwrap();
    outbox
        .enqueue(
            &mut tx,
            &[factory::event("w-1", 1), factory::event("w-1", 2)],
        )
        .await
        .expect("Outbox::enqueue as the writer");
    tx.commit().await.unwrap();
    assert_eq!(db.count("outbox").await, 7);

    // The relay publishes everything as the relay, once and in order.
    let _client = prepare_shared_server().await;
    let stream = unique_name("roles");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let relay = RelayProcess::spawn(
        &roles.url("relay"),
        "roles-relay",
        &[
            "--nats-url",
            &shared_url(),
            "--stream",
            &stream,
            "--subject-prefix",
            &stream,
        ],
        &[],
    );
    wait_drained(&db.pool, Duration::from_secs(30), || relay.log()).await;
    let client = async_nats::connect(shared_url()).await.unwrap();
    let messages = read_stream(&client, &stream).await;
    let check = check_stream(&db.pool, &messages).await;
    assert_eq!((check.messages, check.duplicates), (7, 0), "{check:?}");
    drop(relay);

    // What each role must not do.
    let writer_url = roles.url("writer");
    assert_refused(&writer_url, "UPDATE outbox SET published_at = now()").await;
    assert_refused(&writer_url, "DELETE FROM outbox").await;
    assert_refused(&writer_url, "UPDATE outbox SET payload = '{}'::jsonb").await;
    let relay_url = roles.url("relay");
    assert_refused(&relay_url, "UPDATE outbox SET payload = '{}'::jsonb").await;
    assert_refused(&relay_url, "UPDATE outbox SET headers = '{}'::jsonb").await;
    assert_refused(&relay_url, "DELETE FROM outbox").await;
    assert_refused(
        &relay_url,
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_sequence,
                             event_type, schema_version, payload)
         VALUES (gen_random_uuid(), 'x', 'x', 1, 'x', 1, '{}')",
    )
    .await;
    let operator_url = roles.url("operator");
    assert_refused(&operator_url, "UPDATE outbox SET published_at = now()").await;

    // Reconcile (reads every retained event, compares with the stream) as the operator: clean.
    let reconcile = handoff(
        &operator_url,
        &[
            "reconcile",
            "--since",
            "1h",
            "--nats-url",
            &shared_url(),
            "--stream",
            &stream,
            "--subject-prefix",
            &stream,
        ],
    );
    assert_eq!(reconcile.status.code(), Some(0), "{}", text(&reconcile));

    // The operator's commands as the operator: a held event listed and retried, status,
    // cleanup with the archive.
    let mut tx = db.pool.begin().await.unwrap();
    let held = outbox
        .enqueue(&mut tx, &[factory::event("held-1", 1)])
        .await
        .unwrap()[0]
        .event_id;
    tx.commit().await.unwrap();
    sqlx::query(
        "UPDATE outbox SET available_at = 'infinity', quarantined_at = now(),
                hold_reason = 'attempts', attempt_count = 20, last_error = 'held by the test'
         WHERE event_id = $1",
    )
    .bind(held)
    .execute(&db.pool)
    .await
    .unwrap();
    let list = handoff(&operator_url, &["quarantine", "list"]);
    assert!(list.status.success(), "{}", text(&list));
    assert!(
        String::from_utf8_lossy(&list.stdout).contains(&held.to_string()),
        "{}",
        text(&list)
    );
    let retry = handoff(&operator_url, &["quarantine", "retry", &held.to_string()]);
    assert!(retry.status.success(), "{}", text(&retry));
    let audited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_quarantine_actions WHERE event_id = $1")
            .bind(held)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(audited, 1);
    // A pending event held by the operator (quarantine hold writes the lease and park columns
    // too), then skipped.
    let mut tx = db.pool.begin().await.unwrap();
    let stuck = outbox
        .enqueue(&mut tx, &[factory::event("stuck-1", 1)])
        .await
        .unwrap()[0]
        .event_id
        .to_string();
    tx.commit().await.unwrap();
    for args in [
        ["quarantine", "hold", &stuck, "--reason", "stuck"],
        ["quarantine", "skip", &stuck, "--reason", "never"],
    ] {
        let acted = handoff(&operator_url, &args);
        assert!(acted.status.success(), "{args:?}: {}", text(&acted));
    }
    let status = handoff(&operator_url, &["status"]);
    // 0: all well; 2: an alert holds (the retried event is pending). 1 would be an error.
    assert!(
        matches!(status.status.code(), Some(0 | 2)),
        "{}",
        text(&status)
    );
    sqlx::query(
        "UPDATE outbox SET published_at = now() - interval '2 days' WHERE published_at IS NOT NULL",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let cleanup = handoff(
        &operator_url,
        &[
            "cleanup",
            "--archive",
            "--retention",
            "1d",
            "--dedup-retention",
            "1d",
        ],
    );
    assert!(cleanup.status.success(), "{}", text(&cleanup));
    assert_eq!(db.count("outbox_archive").await, 7, "{}", text(&cleanup));
    assert_eq!(
        db.count("outbox").await,
        2,
        "only the retried and the skipped events are left"
    );
    let consumer_list = handoff(
        &operator_url,
        &["consumer", "quarantine", "list", "--consumer", "inventory"],
    );
    assert!(consumer_list.status.success(), "{}", text(&consumer_list));
    let sagas = handoff(&operator_url, &["saga", "list"]);
    assert!(sagas.status.success(), "{}", text(&sagas));
}

#[test]
fn roles_prints_by_default_and_a_bad_name_fails_with_one_line() {
    // `--print` is what it does anyway: both spellings print the same SQL.
    let bare = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["roles"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(bare.status.success(), "{}", text(&bare));
    let print = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["roles", "--print"])
        .output()
        .unwrap();
    assert_eq!(bare.stdout, print.stdout);
    assert!(String::from_utf8_lossy(&bare.stdout).contains("\"public\".outbox"));
    for bad in [["--schema", "Bad\"; DROP"], ["--role-prefix", "x y"]] {
        let output = Command::new(env!("CARGO_BIN_EXE_handoff"))
            .args(["roles", "--print"])
            .args(bad)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(1), "{}", text(&output));
        assert!(
            output.stdout.is_empty(),
            "no SQL printed: {}",
            text(&output)
        );
    }
    // Deadline-free: printing needs no database.
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["roles", "--print"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("\"public\".outbox"));
    assert!(started.elapsed() < Duration::from_secs(10));
}
