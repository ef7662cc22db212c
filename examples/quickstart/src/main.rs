//! The quickstart as a program: `quickstart serve` runs the order service (`POST /orders`),
//! `quickstart consume` the shipping consumer. Both read their settings from the environment.

use quickstart::{
    migrate_consumer, migrate_service, outbox, router, run_consumer, serve_metrics, AppState, Bus,
};
use sqlx::PgPool;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A setting from the environment, or its default.
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    // Ctrl-C stops either role; requests and events in flight finish first.
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match std::env::args().nth(1).as_deref() {
        Some("serve") => {
            let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
            let pool = PgPool::connect(&url).await?;
            migrate_service(&pool).await?;
            let listener =
                tokio::net::TcpListener::bind(var("LISTEN_ADDR", "127.0.0.1:3000")).await?;
            println!("listening: POST http://{}/orders", listener.local_addr()?);
            let state = AppState {
                pool,
                outbox: outbox(),
            };
            axum::serve(listener, router(state))
                .with_graceful_shutdown(shutdown)
                .await?;
        }
        Some("consume") => {
            // Before `run_consumer`: the consumer registers its metrics with this recorder.
            serve_metrics(var("METRICS_ADDR", "127.0.0.1:9465").parse()?)?;
            let url =
                std::env::var("CONSUMER_DATABASE_URL").map_err(|_| "set CONSUMER_DATABASE_URL")?;
            let pool = PgPool::connect(&url).await?;
            migrate_consumer(&pool).await?;
            let bus = Bus {
                nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
                stream: var("STREAM", "OUTBOX"),
                subject_prefix: var("SUBJECT_PREFIX", "outbox"),
            };
            run_consumer(pool, &bus, shutdown).await?;
        }
        _ => return Err("usage: quickstart serve | quickstart consume".into()),
    }
    Ok(())
}
