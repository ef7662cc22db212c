//! `--otlp-endpoint` exports over OTLP/HTTP: spans reach an in-process receiver at
//! `URL/v1/traces` as protobuf, under the binary's service name.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use handoff_telemetry::{OtlpArgs, Telemetry};

/// One HTTP request as the receiver saw it: request line, body.
type Received = (String, Vec<u8>);

/// Accepts connections on `listener`, answers every request 200 and sends it on `tx`.
fn receive(listener: TcpListener, tx: mpsc::Sender<Received>) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { return };
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        loop {
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
                break;
            }
            let mut length = 0;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let line = line.trim_end();
                if line.is_empty() {
                    break;
                }
                if let Some((name, value)) = line.split_once(':') {
                    if name.eq_ignore_ascii_case("content-length") {
                        length = value.trim().parse().unwrap();
                    }
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            let _ = tx.send((request_line.trim_end().to_owned(), body));
        }
    }
}

#[test]
fn spans_are_exported_to_the_endpoint_traces_path() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || receive(listener, tx));

    let telemetry = Telemetry::builder("telemetry-test")
        .otlp(&OtlpArgs {
            otlp_endpoint: Some(endpoint),
        })
        .init()
        .unwrap();
    assert!(telemetry.exports());
    tracing::info_span!("exported_span_name").in_scope(|| {});
    // Dropping the guard sends what the batch holds.
    drop(telemetry);

    let (request_line, body) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(request_line, "POST /v1/traces HTTP/1.1");
    // Protobuf stores strings as their bytes.
    let contains = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    assert!(contains(b"exported_span_name"), "the span is in the export");
    assert!(contains(b"telemetry-test"), "under the service name");
}
