//! The migrator against the real PostgreSQL.

use handoff_postgres::{MigrateErrorKind, Migrator, Schema, HANDOFF_MIGRATIONS};
use handoff_test::TestDb;

/// Every handoff migration's version, in order.
fn versions() -> Vec<i64> {
    HANDOFF_MIGRATIONS.iter().map(|m| m.version).collect()
}

const SEED_COLUMNS: [&str; 14] = [
    "event_id",
    "aggregate_type",
    "aggregate_id",
    "aggregate_sequence",
    "event_type",
    "schema_version",
    "payload",
    "occurred_at",
    "available_at",
    "claimed_by",
    "claim_until",
    "published_at",
    "attempt_count",
    "last_error",
];

#[tokio::test]
async fn migrate_creates_the_seed_schema_in_the_default_schema_and_is_idempotent() {
    let db = TestDb::new("migrate_idempotent").await;
    let mut conn = db.pool.acquire().await.unwrap();
    let migrator = Migrator::handoff(Schema::default());

    let first = migrator.run(&mut conn).await.unwrap();
    assert_eq!(first.applied, versions());
    let second = migrator.run(&mut conn).await.unwrap();
    assert!(second.applied.is_empty());
    assert_eq!(second.already_applied, versions());

    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns
         WHERE table_schema = $1 AND table_name = 'outbox'",
    )
    .bind(db.schema())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for seed in SEED_COLUMNS {
        assert!(columns.iter().any(|c| c == seed), "outbox lacks {seed}");
    }
    let constraints: Vec<String> = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
         JOIN pg_namespace n ON n.oid = c.connamespace
         WHERE n.nspname = $1 AND c.conname = 'outbox_aggregate_sequence_key'",
    )
    .bind(db.schema())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        constraints,
        ["UNIQUE (aggregate_type, aggregate_id, aggregate_sequence)"]
    );
    let pending_index: String = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'outbox_pending_idx'",
    )
    .bind(db.schema())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        pending_index.contains("WHERE (published_at IS NULL)"),
        "{pending_index}"
    );
    assert_eq!(db.count("processed_events").await, 0);
}

#[tokio::test]
async fn concurrent_migrations_apply_each_file_once() {
    let db = TestDb::new("migrate_concurrent").await;
    let runs = (0..6).map(|_| {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            Migrator::handoff(Schema::default()).run(&mut conn).await
        })
    });
    let reports: Vec<_> = futures::future::join_all(runs)
        .await
        .into_iter()
        .map(|r| r.unwrap().expect("every concurrent run succeeds"))
        .collect();
    let applied: usize = reports.iter().map(|r| r.applied.len()).sum();
    let all = HANDOFF_MIGRATIONS.len();
    assert_eq!(
        applied, all,
        "each migration is applied by exactly one run: {reports:?}"
    );
    assert!(
        reports.iter().any(|r| r.applied.len() == all),
        "the run that took the lock first applied them all: {reports:?}"
    );
    assert_eq!(db.count("handoff_migrations").await, all as i64);
}

#[tokio::test]
async fn a_changed_migration_is_refused() {
    let db = TestDb::new("migrate_checksum").await;
    let mut conn = db.pool.acquire().await.unwrap();
    let migrator = Migrator::handoff(Schema::default());
    migrator.run(&mut conn).await.unwrap();
    sqlx::query("UPDATE handoff_migrations SET checksum = '\\x00' WHERE version = 1")
        .execute(&mut *conn)
        .await
        .unwrap();

    let err = migrator.run(&mut conn).await.unwrap_err();
    assert_eq!(err.kind(), MigrateErrorKind::ChecksumMismatch);
    let err = migrator.check(&mut conn).await.unwrap_err();
    assert_eq!(err.kind(), MigrateErrorKind::ChecksumMismatch);
}

#[tokio::test]
async fn check_refuses_a_schema_that_is_behind() {
    let db = TestDb::new("migrate_behind").await;
    let mut conn = db.pool.acquire().await.unwrap();
    let migrator = Migrator::handoff(Schema::default());

    let err = migrator.check(&mut conn).await.unwrap_err();
    assert_eq!(err.kind(), MigrateErrorKind::Behind);
    migrator.run(&mut conn).await.unwrap();
    migrator.check(&mut conn).await.expect("current after run");
}

#[tokio::test]
async fn a_named_schema_holds_the_tables_and_revert_removes_them() {
    let db = TestDb::new("migrate_named").await;
    let named = format!("{}_named", db.schema());
    let mut conn = db.pool.acquire().await.unwrap();
    let migrator = Migrator::handoff(Schema::named(named.clone()).unwrap());

    migrator.run(&mut conn).await.unwrap();
    let outbox: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{named}.outbox"))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert!(outbox.is_some(), "outbox created in {named}");
    let in_default: Option<String> = sqlx::query_scalar("SELECT to_regclass('outbox')::text")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(
        in_default, None,
        "nothing leaks into the search_path schema"
    );

    let mut reverted = versions();
    reverted.reverse();
    assert_eq!(migrator.revert(&mut conn, 0).await.unwrap(), reverted);
    let outbox: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{named}.outbox"))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(outbox, None);
    // The down file is right if up applies again on top of it.
    assert_eq!(migrator.run(&mut conn).await.unwrap().applied, versions());
    sqlx::raw_sql(&format!("DROP SCHEMA \"{named}\" CASCADE"))
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// What `schema.sql` says of itself, above the generated text.
const SCHEMA_SQL_HEADER: &str = "\
-- handoff's schema after every migration: the tables with their columns, defaults and
-- constraints, the indexes, the triggers and the functions with their current bodies, in one
-- place for reading. migrations/ is what runs; this file never does.
--
-- Generated; do not edit. The test schema_sql_is_the_schema_after_every_migration
-- (tests/migrate.rs) migrates a fresh schema, reads it back from PostgreSQL's catalog and fails
-- when this file differs. After changing a migration, regenerate it with
--
--     HANDOFF_BLESS=1 cargo nextest run -p handoff-postgres --test it migrate::schema_sql
--
-- and commit it with the migration. Names are unqualified: the objects live in the schema
-- `handoff migrate --schema` names (the connection's search_path by default), which stands as
-- {schema} where the catalog spells it out (a function's search_path). Columns are in table
-- order (a column a later migration added comes last); everything else is by name.
";

/// The tables (and views), each with its columns in table order, its constraints by name and
/// its storage options; `$1` is the schema.
const DUMP_TABLES: &str = r"
SELECT c.relname::text,
       CASE WHEN c.relkind IN ('v', 'm') THEN
           format(E'CREATE %sVIEW %I AS\n%s',
                  CASE c.relkind WHEN 'm' THEN 'MATERIALIZED ' ELSE '' END, c.relname,
                  pg_get_viewdef(c.oid, true))
       ELSE
           format(E'CREATE TABLE %I (\n%s\n)%s;', c.relname,
                  array_to_string(
                      ARRAY(SELECT format('    %I %s%s%s%s', a.attname,
                                          format_type(a.atttypid, a.atttypmod),
                                          CASE a.attidentity
                                              WHEN 'a' THEN ' GENERATED ALWAYS AS IDENTITY'
                                              WHEN 'd' THEN ' GENERATED BY DEFAULT AS IDENTITY'
                                              ELSE '' END,
                                          CASE a.attgenerated
                                              WHEN 's' THEN ' GENERATED ALWAYS AS ('
                                                  || pg_get_expr(d.adbin, d.adrelid) || ') STORED'
                                              ELSE coalesce(' DEFAULT '
                                                  || pg_get_expr(d.adbin, d.adrelid), '') END,
                                          CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END)
                            FROM pg_attribute a
                            LEFT JOIN pg_attrdef d
                                   ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                            WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                            ORDER BY a.attnum)
                      || ARRAY(SELECT format('    CONSTRAINT %I %s', k.conname,
                                            pg_get_constraintdef(k.oid, true))
                               FROM pg_constraint k
                               WHERE k.conrelid = c.oid
                               ORDER BY k.conname),
                      E',\n'),
                  coalesce(' WITH (' || array_to_string(c.reloptions, ', ') || ')', ''))
       END
FROM pg_class c
WHERE c.relnamespace = $1::regnamespace
  AND c.relkind IN ('r', 'p', 'v', 'm')
ORDER BY c.relname
";

/// The indexes no constraint made (a primary key's or a unique constraint's index is in its
/// table's constraints) and the triggers, each with its table's name; `$1` is the schema.
const DUMP_INDEXES_AND_TRIGGERS: &str = r#"
SELECT t.relname::text COLLATE "C" AS table_name, 0 AS kind, i.relname::text COLLATE "C" AS name,
       pg_get_indexdef(x.indexrelid) || ';'
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
WHERE t.relnamespace = $1::regnamespace
  AND NOT EXISTS (SELECT 1 FROM pg_constraint k
                  WHERE k.conindid = x.indexrelid AND k.contype IN ('p', 'u', 'x'))
UNION ALL
SELECT t.relname::text, 1, g.tgname::text, pg_get_triggerdef(g.oid, true) || ';'
FROM pg_trigger g
JOIN pg_class t ON t.oid = g.tgrelid
WHERE t.relnamespace = $1::regnamespace AND NOT g.tgisinternal
ORDER BY table_name, kind, name
"#;

/// What the tables do not show: sequences no identity column owns, enum types, and the
/// functions and procedures with their bodies; `$1` is the schema.
const DUMP_OTHERS: &str = r#"
SELECT 0 AS kind, c.relname::text COLLATE "C" AS name, format('CREATE SEQUENCE %I;', c.relname)
FROM pg_class c
WHERE c.relnamespace = $1::regnamespace AND c.relkind = 'S'
  AND NOT EXISTS (SELECT 1 FROM pg_depend d
                  WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                    AND d.deptype IN ('a', 'i'))
UNION ALL
SELECT 1, t.typname::text,
       format('CREATE TYPE %I AS ENUM (%s);', t.typname,
              string_agg(quote_literal(l.enumlabel), ', ' ORDER BY l.enumsortorder))
FROM pg_type t
JOIN pg_enum l ON l.enumtypid = t.oid
WHERE t.typnamespace = $1::regnamespace
GROUP BY t.typname
UNION ALL
SELECT 2, p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
       rtrim(pg_get_functiondef(p.oid), E'\n') || ';'
FROM pg_proc p
WHERE p.pronamespace = $1::regnamespace AND p.prokind IN ('f', 'p')
ORDER BY kind, name
"#;

/// The schema `db` holds, as `schema.sql` has it: read from the catalog (not `pg_dump`, which
/// a test machine may lack or have in another major version than the server's), in an order
/// that depends only on names, and with the test schema's name taken out.
async fn schema_sql(db: &TestDb) -> String {
    let schema = db.schema();
    let tables: Vec<(String, String)> = sqlx::query_as(DUMP_TABLES)
        .bind(schema)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let attached: Vec<(String, i32, String, String)> = sqlx::query_as(DUMP_INDEXES_AND_TRIGGERS)
        .bind(schema)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let others: Vec<(i32, String, String)> = sqlx::query_as(DUMP_OTHERS)
        .bind(schema)
        .fetch_all(&db.pool)
        .await
        .unwrap();

    let mut out = String::from(SCHEMA_SQL_HEADER);
    for (table, definition) in &tables {
        out.push('\n');
        out.push_str(definition);
        out.push('\n');
        for (_, _, _, index_or_trigger) in attached.iter().filter(|a| &a.0 == table) {
            out.push_str(index_or_trigger);
            out.push('\n');
        }
    }
    for (_, _, definition) in &others {
        out.push('\n');
        out.push_str(definition);
        out.push('\n');
    }
    // The catalog qualifies some names (a function's own, a relation outside the search_path);
    // the test schema's name is this run's alone.
    out.replace(&format!("\"{schema}\"."), "")
        .replace(&format!("{schema}."), "")
        .replace(schema, "{schema}")
}

#[tokio::test]
async fn schema_sql_is_the_schema_after_every_migration() {
    let db = TestDb::migrated("schema_sql").await;
    let generated = schema_sql(&db).await;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schema.sql");
    if std::env::var("HANDOFF_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        // The first line that differs, so that the failure says where without a diff tool.
        let want: Vec<&str> = generated.lines().collect();
        let got: Vec<&str> = committed.lines().collect();
        let line = (0..want.len().max(got.len()))
            .find(|&i| want.get(i) != got.get(i))
            .unwrap_or(want.len());
        let end = "(end of text)";
        let (want, got) = (
            want.get(line).copied().unwrap_or(end),
            got.get(line).copied().unwrap_or(end),
        );
        panic!(
            "{} is not the schema the migrations make (line {}: migrations give {want:?}, the \
             file has {got:?}); regenerate it with \
             HANDOFF_BLESS=1 cargo nextest run -p handoff-postgres --test it migrate::schema_sql",
            path.display(),
            line + 1,
        );
    }
}
