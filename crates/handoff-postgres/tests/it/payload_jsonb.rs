//! Payload validation agrees with the real PostgreSQL's `jsonb` (design W6): what validation
//! accepts, `$1::jsonb` accepts and prints within the size validation counted; what it refuses
//! as a number out of range or a NUL, `jsonb` refuses too. Over edge numbers and the committed
//! fuzz corpus (`fuzz/corpus/payload/`).

use std::path::PathBuf;

use handoff_core::{EventCatalog, Limits, NewEvent, ValidationErrorKind as V};
use handoff_postgres::EnqueueErrorKind;
use handoff_test::{factory, TestDb};

use crate::common::migrated;

/// What PostgreSQL says of `payload::jsonb`: the length of its text, or the error message.
async fn jsonb_text_len(db: &TestDb, payload: &str) -> Result<i32, String> {
    sqlx::query_scalar("SELECT octet_length($1::jsonb::text)")
        .bind(payload)
        .fetch_one(&db.pool)
        .await
        .map_err(|e| e.to_string())
}

fn validate(payload: &str, limits: &Limits) -> Option<V> {
    let catalog = EventCatalog::new().declare("order", "E", 1);
    NewEvent::new("order", "o-1", "E", 1, payload)
        .validate(&catalog, limits)
        .err()
        .map(|e| e.kind())
}

/// Numbers at and just past each bound of PostgreSQL 15's `numeric_in`.
fn edge_payloads() -> Vec<String> {
    let mut numbers: Vec<String> = [
        "0e9223372036854775807",
        "-0e9223372036854775807",
        "1e-9223372036854775808",
        "0e1073741822",
        "0e1073741823",
        "0.0e1073741822",
        "0.00e1073741823",
        "1e00000000000000000000000001",
        "1e1000",
        "1e308",
        "1.7976931348623157e308",
        "1e309",
        "1e-400",
        "1e-16383",
        "1e-16384",
        "0e-16383",
        "0e-16384",
        "0.5e-16382",
        "0.5e-16383",
        "-0.0e-16382",
        "-0.0e-16383",
        "-0",
        "-0.0",
        "0.10e1",
        "1E+2",
        "2.5e-3",
        "-12.50",
    ]
    .iter()
    .map(|n| n.to_string())
    .collect();
    // 16383 and 16384 digits after the point, 131072 and 131073 before it.
    numbers.push(format!("0.{}1", "0".repeat(16_382)));
    numbers.push(format!("0.{}1", "0".repeat(16_383)));
    numbers.push(format!("1.{}", "0".repeat(16_383)));
    numbers.push(format!("1.{}", "0".repeat(16_384)));
    numbers.push(format!("1{}", "0".repeat(131_071)));
    numbers.push(format!("1{}", "0".repeat(131_072)));
    let mut payloads: Vec<String> = numbers.iter().map(|n| format!("[{n}]")).collect();
    payloads.extend(numbers);
    payloads.extend(
        [
            r#"{"a":"x\u0000"}"#,
            r#"{"\u0000":1}"#,
            r#"{"a":"\\u0000"}"#,
            r#""\ud83d\ude00""#,
            r#""\u0001""#,
        ]
        .map(String::from),
    );
    payloads
}

/// Every file of the committed payload corpus, lossily decoded as the fuzz target reads it.
fn corpus_payloads() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/payload");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let entry = entry.unwrap();
            let text = String::from_utf8_lossy(&std::fs::read(entry.path()).unwrap()).into_owned();
            (entry.file_name().to_string_lossy().into_owned(), text)
        })
        .collect();
    files.sort();
    files
}

#[tokio::test]
async fn what_validation_accepts_jsonb_stores_and_what_it_refuses_as_unstorable_jsonb_refuses() {
    let db = TestDb::new("payload_jsonb_agrees").await;
    // Large enough that size never decides, so each case tests the number and NUL rules alone.
    let limits = Limits {
        max_payload_bytes: 1 << 30,
        ..Limits::default()
    };
    let mut cases: Vec<(String, String)> = edge_payloads()
        .into_iter()
        .map(|p| (format!("edge {:.40}", p), p))
        .collect();
    cases.extend(corpus_payloads());
    let (mut accepted, mut refused) = (0, 0);
    for (name, payload) in &cases {
        let postgres = jsonb_text_len(&db, payload).await;
        match validate(payload, &limits) {
            None => {
                let printed = postgres.unwrap_or_else(|e| panic!("{name}: accepted, jsonb: {e}"));
                // The size validation checks bounds what PostgreSQL returns.
                let bound = Limits {
                    max_payload_bytes: usize::try_from(printed).unwrap() - 1,
                    ..Limits::default()
                };
                if printed > 1 {
                    assert_eq!(
                        validate(payload, &bound),
                        Some(V::PayloadTooLarge),
                        "{name}: jsonb prints {printed} bytes, more than validation counts"
                    );
                }
                accepted += 1;
            }
            Some(kind @ (V::PayloadNumberOutOfRange | V::PayloadHasNul)) => {
                let error = postgres.expect_err(name);
                let expected = match kind {
                    V::PayloadHasNul => "unsupported Unicode escape sequence",
                    _ => "value overflows numeric format",
                };
                assert!(error.contains(expected), "{name}: {kind:?}, jsonb: {error}");
                refused += 1;
            }
            // Stricter than jsonb by choice: numbers beyond f64, nesting past 128 levels.
            Some(V::PayloadNotJson) => {}
            Some(other) => panic!("{name}: unexpected {other:?}"),
        }
    }
    assert!(accepted >= 30, "{accepted} accepted");
    assert!(refused >= 20, "{refused} refused");
}

#[tokio::test]
async fn an_overflowing_exponent_is_refused_before_any_sql_and_the_transaction_goes_on() {
    let (db, outbox) = migrated("payload_jsonb_exponent").await;
    let mut tx = db.pool.begin().await.unwrap();
    for payload in [
        r#"{"n":0e9223372036854775807}"#,
        "[1e-9223372036854775808]",
        r#"{"s":"a\u0000b"}"#,
    ] {
        let event = NewEvent::new(
            factory::AGGREGATE_TYPE,
            "o-1",
            factory::EVENT_TYPE,
            1,
            payload,
        );
        let err = outbox.enqueue(&mut tx, &[event]).await.unwrap_err();
        assert!(
            matches!(
                err.kind(),
                EnqueueErrorKind::Invalid(V::PayloadNumberOutOfRange | V::PayloadHasNul)
            ),
            "{payload}: {err}"
        );
    }
    // Nothing reached PostgreSQL, so the caller's transaction is still usable.
    outbox
        .enqueue(&mut tx, &[factory::event("o-1", 1)])
        .await
        .expect("transaction still usable");
    tx.commit().await.unwrap();
    assert_eq!(db.count("outbox").await, 1);
}
