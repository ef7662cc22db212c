//! [`RecordedResponse`]: what an endpoint's 2xx answer leaves in the event's delivery receipt
//! (`outbox.delivery_receipt`), so an operator can see what the endpoint said (design F1: the
//! answer is recorded).

use std::collections::BTreeMap;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use reqwest::header::HeaderMap;
use sha2::{Digest, Sha256};

/// The response headers a receipt keeps, by lowercase name; every other header is left out.
/// Headers that carry credentials or session state (`Authorization`, `Set-Cookie`,
/// `WWW-Authenticate`, ...) are never among them.
pub const RECORDED_HEADERS: [&str; 8] = [
    "content-type",
    "location",
    "etag",
    "retry-after",
    "x-request-id",
    "request-id",
    "x-correlation-id",
    // Stripe-style endpoints say so when they answered a repeated Idempotency-Key from memory.
    "idempotent-replayed",
];

/// Most bytes of the response body a receipt keeps (4 KiB); a longer body is cut, on a
/// character boundary, and marked [`body_truncated`](RecordedResponse::body_truncated).
pub const RECORDED_BODY_BYTES: usize = 4096;

/// Most bytes of one recorded header value; a longer one is cut and ends in `...`.
const RECORDED_HEADER_BYTES: usize = 256;

/// An endpoint's 2xx answer as [`HttpTransport`](crate::HttpTransport) records it: the event's
/// receipt detail is this, as one line of compact JSON.
///
/// ```json
/// {"status":201,"headers":{"content-type":"application/json","x-request-id":"r-7"},
///  "body":"{\"id\":\"pay_1\"}","body_truncated":false,"body_bytes":14,"sha256":"5b0c…"}
/// ```
///
/// # Examples
///
/// ```
/// use handoff_http::RecordedResponse;
///
/// let receipt = r#"{"status":200,"headers":{},"body":"ok","body_truncated":false,"body_bytes":2,"sha256":"2689367b205c16ce32ed4200942b8b8b1e262dfc70d9bc9fbc77c49699a4f1df"}"#;
/// let recorded = RecordedResponse::parse(receipt).unwrap();
/// assert_eq!(recorded.status, 200);
/// assert_eq!(recorded.body.as_deref(), Some("ok"));
/// assert!(RecordedResponse::parse("kafka outbox/3@1207").is_none());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct RecordedResponse {
    /// The HTTP status code (2xx).
    pub status: u16,
    /// The response's headers named in [`RECORDED_HEADERS`], by lowercase name; several values
    /// of one header are joined with `, `. Values are cut to 256 bytes.
    pub headers: BTreeMap<String, String>,
    /// The body's first [`RECORDED_BODY_BYTES`] as text (cut on a character boundary); absent
    /// when the body is not UTF-8 (then [`body_base64`](Self::body_base64) holds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The body's first [`RECORDED_BODY_BYTES`] in standard base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
    /// Whether the body was longer than what is kept.
    pub body_truncated: bool,
    /// The whole body's length, in bytes.
    pub body_bytes: u64,
    /// The SHA-256 of the whole body as received, in lowercase hex (of the empty body when there
    /// was none). A receiver that answers a repeated key with its recorded answer gives the same
    /// digest on every retry.
    pub sha256: String,
}

impl RecordedResponse {
    /// Reads a receipt detail written by the HTTP transport; `None` for anything else (another
    /// destination's receipt, or an older `http <status> sha256:<hex>` one).
    pub fn parse(receipt: &str) -> Option<RecordedResponse> {
        serde_json::from_str(receipt).ok()
    }

    /// The receipt detail: this as one line of compact JSON (control characters in the body are
    /// escaped, so it never spans lines).
    pub fn to_receipt(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| {
            // Unreachable (strings, numbers and a string map always serialise); the status and
            // digest still say which answer settled the event.
            format!("http {} sha256:{}", self.status, self.sha256)
        })
    }
}

/// Builds a [`RecordedResponse`] while the body streams in: keeps its start and digests all
/// of it.
pub(crate) struct Recorder {
    status: u16,
    headers: BTreeMap<String, String>,
    kept: Vec<u8>,
    total: u64,
    digest: Sha256,
}

impl Recorder {
    /// Starts recording an answer with `status` and `headers`.
    pub(crate) fn new(status: u16, headers: &HeaderMap) -> Recorder {
        let mut recorded = BTreeMap::new();
        for name in RECORDED_HEADERS {
            let values: Vec<String> = headers
                .get_all(name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).trim().to_owned())
                .collect();
            if !values.is_empty() {
                recorded.insert(
                    name.to_owned(),
                    bounded(&values.join(", "), RECORDED_HEADER_BYTES),
                );
            }
        }
        Recorder {
            status,
            headers: recorded,
            kept: Vec::new(),
            total: 0,
            digest: Sha256::new(),
        }
    }

    /// Takes the next chunk of the body.
    pub(crate) fn update(&mut self, chunk: &[u8]) {
        self.digest.update(chunk);
        self.total += chunk.len() as u64;
        // One byte more than is kept, to tell a body of exactly the bound from a longer one.
        let room = (RECORDED_BODY_BYTES + 1).saturating_sub(self.kept.len());
        self.kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }

    /// The record of the whole answer.
    pub(crate) fn finish(self) -> RecordedResponse {
        let truncated = self.kept.len() > RECORDED_BODY_BYTES;
        let kept = &self.kept[..self.kept.len().min(RECORDED_BODY_BYTES)];
        let (body, body_base64) = match std::str::from_utf8(kept) {
            Ok(text) => (Some(text.to_owned()), None),
            // Only the cut split a character: keep the text up to it.
            Err(e) if truncated && e.error_len().is_none() => {
                let text = std::str::from_utf8(&kept[..e.valid_up_to()]).unwrap_or_default();
                (Some(text.to_owned()), None)
            }
            Err(_) => (None, Some(STANDARD.encode(kept))),
        };
        RecordedResponse {
            status: self.status,
            headers: self.headers,
            body,
            body_base64,
            body_truncated: truncated,
            body_bytes: self.total,
            sha256: hex(&self.digest.finalize()),
        }
    }
}

/// `text` cut to at most `max` bytes on a character boundary, `...` marking a cut.
fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderValue;

    use super::*;

    fn record(headers: &HeaderMap, chunks: &[&[u8]]) -> RecordedResponse {
        let mut recorder = Recorder::new(200, headers);
        for chunk in chunks {
            recorder.update(chunk);
        }
        recorder.finish()
    }

    #[test]
    fn only_allowed_headers_are_kept() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("text/plain"));
        headers.insert("x-request-id", HeaderValue::from_static("r-1"));
        headers.insert("authorization", HeaderValue::from_static("Bearer s3cret"));
        headers.insert("set-cookie", HeaderValue::from_static("session=s3cret"));
        headers.append("etag", HeaderValue::from_static("\"a\""));
        headers.append("etag", HeaderValue::from_static("\"b\""));
        let recorded = record(&headers, &[b"hi"]);
        assert_eq!(
            recorded.headers.keys().collect::<Vec<_>>(),
            ["content-type", "etag", "x-request-id"]
        );
        assert_eq!(recorded.headers["etag"], "\"a\", \"b\"");
        assert!(!recorded.to_receipt().contains("s3cret"));
    }

    #[test]
    fn a_long_body_is_cut_on_a_character_boundary() {
        // 4095 ASCII bytes, then 'é' (2 bytes) straddles the bound.
        let body = format!("{}é and more", "x".repeat(RECORDED_BODY_BYTES - 1));
        let recorded = record(
            &HeaderMap::new(),
            &[&body.as_bytes()[..100], &body.as_bytes()[100..]],
        );
        assert!(recorded.body_truncated);
        assert_eq!(
            recorded.body.as_deref(),
            Some(&body[..RECORDED_BODY_BYTES - 1])
        );
        assert_eq!(recorded.body_bytes, body.len() as u64);
        assert_eq!(recorded.sha256, hex(&Sha256::digest(body.as_bytes())));
    }

    #[test]
    fn a_body_of_exactly_the_bound_is_whole() {
        let body = "y".repeat(RECORDED_BODY_BYTES);
        let recorded = record(&HeaderMap::new(), &[body.as_bytes()]);
        assert!(!recorded.body_truncated);
        assert_eq!(recorded.body.as_deref(), Some(body.as_str()));
    }

    #[test]
    fn a_binary_body_is_kept_as_base64() {
        let recorded = record(&HeaderMap::new(), &[&[0xff, 0xfe, 0x00]]);
        assert_eq!(recorded.body, None);
        assert_eq!(recorded.body_base64.as_deref(), Some("//4A"));
    }

    #[test]
    fn the_receipt_is_one_line_and_parses_back() {
        let recorded = record(&HeaderMap::new(), &[b"line 1\nline 2\r\n"]);
        let receipt = recorded.to_receipt();
        assert!(!receipt.contains(['\n', '\r']), "{receipt}");
        assert_eq!(RecordedResponse::parse(&receipt), Some(recorded));
    }

    #[test]
    fn long_header_values_are_cut() {
        let mut headers = HeaderMap::new();
        let long = "é".repeat(200);
        headers.insert("location", HeaderValue::from_str(&long).unwrap());
        let recorded = record(&headers, &[]);
        let kept = &recorded.headers["location"];
        assert!(kept.ends_with("...") && kept.len() <= RECORDED_HEADER_BYTES + 3);
        assert_eq!(recorded.body.as_deref(), Some(""));
    }
}
