//! The stylesheet and script, embedded in the binary: no Node toolchain, no files to deploy.

use axum::http::header;
use axum::response::IntoResponse;

pub(crate) async fn css() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../assets/console.css"),
    )
}

pub(crate) async fn js() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("../assets/console.js"),
    )
}
