//! Where the demo's events go: a stream of its own on the NATS server the user already runs,
//! or on a private throwaway server when none is reachable.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_nats::jetstream::{self, context::GetStreamErrorKind, ErrorCode};
use handoff_test::nats::{NatsServer, ANCHOR_STREAM, DEFAULT_NATS_URL};

/// How long to wait for a server before calling it unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the relay and the demo need to publish to and read the demo's stream.
#[derive(Clone)]
pub struct Broker {
    /// The server's URL, for the relay.
    pub url: String,
    /// `HANDOFF_DEMO_<pid>`: created by the relay, deleted at exit.
    pub stream: String,
    /// `demo_<pid>`: events go to `demo_<pid>.order.<order id>`.
    pub prefix: String,
    /// A connection of the demo's own, to watch and read the stream.
    pub client: async_nats::Client,
}

/// The demo's NATS resources, removed by [`remove`](Self::remove).
pub struct DemoNats {
    /// The server, the stream and our connection.
    broker: Broker,
    /// Whether the stream is ours to delete: `false` until we know it did not exist before.
    owns_stream: bool,
    /// The private server, when we started one; stopping it removes everything.
    private: Option<NatsServer>,
}

/// Why the first server could not be used.
enum Unusable {
    /// Nothing answered.
    Unreachable(String),
    /// Something answered, but not a usable JetStream.
    Refused(String),
}

impl DemoNats {
    /// Connects to `HANDOFF_NATS_URL` (or the local default), or starts a private server when the
    /// default one does not answer with JetStream, and checks that the demo's stream does not
    /// exist yet. The relay creates the stream later.
    ///
    /// The resources are put in `slot` before anything is created in them, so that an
    /// interruption at any point still leads to their removal.
    pub async fn prepare(slot: &mut Option<DemoNats>) -> Result<Broker> {
        let explicit = handoff_telemetry::env::var("HANDOFF_NATS_URL");
        let url = explicit
            .clone()
            .unwrap_or_else(|| DEFAULT_NATS_URL.to_owned());
        let shown = redacted(&url);
        let pid = std::process::id();
        let stream = format!("HANDOFF_DEMO_{pid}");
        let prefix = format!("demo_{pid}");

        let nats = match connect(&url).await {
            Ok(client) => {
                println!("   using the server at {shown}");
                let client = prepare_shared(client).await?;
                slot.insert(Self {
                    broker: Broker {
                        url,
                        stream,
                        prefix,
                        client,
                    },
                    owns_stream: false,
                    private: None,
                })
            }
            // The user chose this server: starting another one would hide their problem.
            Err(Unusable::Unreachable(reason) | Unusable::Refused(reason))
                if explicit.is_some() =>
            {
                bail!("the NATS server at HANDOFF_NATS_URL ({shown}) is not usable: {reason}");
            }
            Err(Unusable::Unreachable(reason) | Unusable::Refused(reason)) => {
                println!(
                    "   NATS JetStream not available at {shown} ({reason});\n   starting a \
                     private throwaway server"
                );
                // If we are interrupted meanwhile, the blocking task still finishes and drops
                // the server, which kills it.
                let server = tokio::task::spawn_blocking(NatsServer::start)
                    .await
                    .context("the task starting the private NATS server failed")?
                    .context("while starting a private NATS server")?;
                println!(
                    "   private server ready at {}, store in {} (removed at exit)",
                    server.url(),
                    server.store_dir().display()
                );
                let url = server.url();
                let nats = slot.insert(Self {
                    broker: Broker {
                        client: connect(&url).await.map_err(|e| match e {
                            Unusable::Unreachable(reason) | Unusable::Refused(reason) => {
                                anyhow::anyhow!("the private NATS server is not usable: {reason}")
                            }
                        })?,
                        url,
                        stream,
                        prefix,
                    },
                    owns_stream: false,
                    private: Some(server),
                });
                nats
            }
        };

        let broker = &nats.broker;
        let context = jetstream::new(broker.client.clone());
        match context.get_stream(&broker.stream).await {
            Ok(_) => bail!(
                "the stream {} already exists on {shown}, left by an earlier run; delete it with: \
                 nats stream rm {}",
                broker.stream,
                broker.stream
            ),
            Err(error) => match error.kind() {
                GetStreamErrorKind::JetStream(e)
                    if e.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
                _ => return Err(error).context("while looking for the demo's stream"),
            },
        }
        nats.owns_stream = true;
        println!(
            "   the relay will create the stream {} for the subjects {}.> (deleted at exit)",
            broker.stream, broker.prefix
        );
        Ok(broker.clone())
    }

    /// Deletes the stream, or stops the private server and removes its store. Reports problems
    /// instead of failing: it runs at exit.
    pub async fn remove(self) {
        let Self {
            broker,
            owns_stream,
            private,
        } = self;
        if let Some(mut server) = private {
            // Our connection first, so that it does not log its reconnection attempts.
            drop(broker.client);
            let dir = server.store_dir().display().to_string();
            let stopped = tokio::task::spawn_blocking(move || {
                let stopped = server.stop();
                // Dropping the server removes its store.
                drop(server);
                stopped
            })
            .await;
            match stopped {
                Ok(Ok(())) => {
                    println!("cleaned up: stopped the private NATS server, removed {dir}")
                }
                Ok(Err(error)) => eprintln!("warning: while stopping the NATS server: {error}"),
                Err(error) => eprintln!("warning: while stopping the NATS server: {error}"),
            }
            return;
        }
        if !owns_stream {
            return;
        }
        let context = jetstream::new(broker.client);
        match context.delete_stream(&broker.stream).await {
            Ok(_) => println!("cleaned up: deleted the stream {}", broker.stream),
            // The demo ended before the relay created it.
            Err(error)
                if matches!(error.kind(), GetStreamErrorKind::JetStream(e)
                    if e.error_code() == ErrorCode::STREAM_NOT_FOUND) => {}
            Err(error) => eprintln!(
                "warning: could not delete the stream {} ({error}); delete it with: nats stream \
                 rm {}",
                broker.stream, broker.stream
            ),
        }
    }
}

/// Connects and checks that the server has JetStream.
async fn connect(url: &str) -> Result<async_nats::Client, Unusable> {
    let connecting = async_nats::ConnectOptions::new()
        .name("handoff-demo")
        .connection_timeout(CONNECT_TIMEOUT)
        .connect(url);
    let client = match tokio::time::timeout(CONNECT_TIMEOUT * 2, connecting).await {
        Err(_) => {
            return Err(Unusable::Unreachable(format!(
                "no answer within {}s",
                CONNECT_TIMEOUT.as_secs()
            )))
        }
        Ok(Err(error)) => {
            return Err(match error.kind() {
                async_nats::ConnectErrorKind::Io | async_nats::ConnectErrorKind::TimedOut => {
                    Unusable::Unreachable(error.to_string())
                }
                _ => Unusable::Refused(error.to_string()),
            })
        }
        Ok(Ok(client)) => client,
    };
    // JetStream's account info, read raw: only whether the server answers it matters here, and
    // async-nats's own reply type does not parse a 2.9 server's answer.
    let info = match client.request("$JS.API.INFO", Vec::new().into()).await {
        Ok(info) => info,
        Err(error) => {
            return Err(Unusable::Refused(format!(
                "it answers, but without JetStream: {error}"
            )))
        }
    };
    match serde_json::from_slice::<serde_json::Value>(&info.payload) {
        Ok(reply) if reply.get("error").is_none() => Ok(client),
        Ok(reply) => Err(Unusable::Refused(format!(
            "its JetStream refuses the account: {}",
            reply["error"]
        ))),
        Err(error) => Err(Unusable::Refused(format!(
            "its JetStream answered with something that is not JSON: {error}"
        ))),
    }
}

/// Makes the shared server safe to create and delete a stream on while handoff's tests do the
/// same, and returns the connection to use.
async fn prepare_shared(client: async_nats::Client) -> Result<async_nats::Client> {
    let anchor_existed = jetstream::new(client.clone())
        .get_stream(ANCHOR_STREAM)
        .await
        .is_ok();
    // It panics on failure: in a task of its own, a panic becomes an error we can report (and
    // clean up after).
    let prepared = tokio::spawn(handoff_test::nats::prepare_shared_server())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("while preparing the shared NATS server")?;
    if !anchor_existed {
        println!(
            "   created the stream {ANCHOR_STREAM}, kept on purpose: with one stream that is \
             never\n   deleted, nats-server 2.9 cannot lose a stream created while another is \
             deleted"
        );
    }
    drop(client);
    Ok(prepared)
}

/// `url` with any password or token replaced, for printing.
fn redacted(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() || !parsed.username().is_empty() => {
            // Cannot fail: a URL with credentials has a host.
            let _ = parsed.set_username("***");
            let _ = parsed.set_password(None);
            parsed.into()
        }
        Ok(parsed) => parsed.into(),
        // Such as `127.0.0.1:4222`, which async-nats accepts too.
        Err(_) if !url.contains('@') => url.to_owned(),
        Err(_) => "(an unparsable URL)".to_owned(),
    }
}
