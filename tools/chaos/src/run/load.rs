//! The load: clients sending orders, lines and cancellations over HTTP, each retried with its
//! `Idempotency-Key` until it is answered.

use super::*;

/// Counters shared by the load's clients, and the flag that stops them early.
#[derive(Debug, Default, Clone)]
pub(crate) struct Load {
    pub(crate) commands: Arc<AtomicU64>,
    pub(crate) retries: Arc<AtomicU64>,
    pub(crate) refused: Arc<AtomicU64>,
    pub(crate) abandoned: Arc<AtomicU64>,
    /// Set to end the load before its deadline; each client finishes its command first.
    pub(crate) stop: Arc<AtomicBool>,
}

impl Load {
    /// Starts [`CLIENTS`] clients seeded from `seed` that send commands until `until` (or
    /// [`Load::stop`]); with `rate` (commands per second over all clients) each client paces
    /// itself, without it each sends its next command as soon as the last is answered. With
    /// `hold`, a client sends no new command while it says `true` (the consumers are too far
    /// behind: the load waits for them instead of measuring how far they can fall behind).
    pub(crate) fn spawn_clients(
        &self,
        seed: u64,
        urls: &Urls,
        until: Instant,
        rate: Option<f64>,
        hold: Option<watch::Receiver<bool>>,
    ) -> Result<Vec<JoinHandle<()>>, RunError> {
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(Duration::from_secs(1))
            .build()
            .map_err(|e| RunError::Task(format!("http client: {e}")))?;
        // A rate that is not positive and finite means no pacing (validated by the callers).
        let pace = rate
            .filter(|r| r.is_finite() && *r > 0.0)
            .map(|r| Duration::from_secs_f64(CLIENTS as f64 / r));
        let mut clients = Vec::new();
        for worker in 0..CLIENTS {
            let client = Client {
                http: http.clone(),
                base: urls.service.clone(),
                rng: StdRng::seed_from_u64(seed ^ (worker + 1).wrapping_mul(0x9E37_79B9)),
                keys: format!("chaos-{seed}-{worker}"),
                sent: 0,
                open: Vec::new(),
                closed: Vec::new(),
                load: self.clone(),
                hold: hold.clone(),
            };
            clients.push(tokio::spawn(client.send_until(until, pace)));
        }
        Ok(clients)
    }

    /// Waits for the clients of [`Load::spawn_clients`] to end.
    pub(crate) async fn join(&self, clients: Vec<JoinHandle<()>>) -> Result<(), RunError> {
        for handle in clients {
            handle.await.map_err(|e| RunError::Task(e.to_string()))?;
        }
        Ok(())
    }
}

/// One client of the order service, with its own seeded generator and keys.
pub(super) struct Client {
    http: reqwest::Client,
    base: String,
    rng: StdRng,
    /// The prefix of its idempotency keys.
    keys: String,
    /// Commands sent so far, numbering its keys.
    sent: u64,
    /// Its orders not yet cancelled.
    open: Vec<String>,
    /// Its cancelled orders: a line for one of them is refused.
    closed: Vec<String>,
    load: Load,
    /// While it says `true`, no new command is sent.
    hold: Option<watch::Receiver<bool>>,
}

/// How a command ended.
pub(super) enum Answer {
    /// Accepted: the order as the command left it.
    Accepted(serde_json::Value),
    /// Refused for good.
    Refused,
    /// Not answered within [`COMMAND_PATIENCE`].
    Abandoned,
}

impl Client {
    /// Sends commands one after another until `until`: creates orders of 1 to 3 lines, adds
    /// lines to its open orders and cancels some, several commands per order; now and then a
    /// line for a cancelled order, which the service refuses.
    ///
    /// With `pace`, a command starts at most every `pace` (a late one starts at once, and the
    /// ones after it keep the pace from there rather than catching up in a burst).
    async fn send_until(mut self, until: Instant, pace: Option<Duration>) {
        let mut ticks = pace.map(|pace| {
            let mut ticks = tokio::time::interval(pace);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks
        });
        while Instant::now() < until && !self.load.stop.load(Ordering::Relaxed) {
            if let Some(hold) = self.hold.as_mut() {
                // Until released, or the end of the load; a monitor that is gone holds nothing.
                let released = hold.wait_for(|held| !*held);
                match tokio::time::timeout_at(until.into(), released).await {
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            if let Some(ticks) = ticks.as_mut() {
                ticks.tick().await;
            }
            let roll: f64 = self.rng.random();
            if !self.closed.is_empty() && roll < 0.03 {
                // A refused command: it must leave no event (invariant 2).
                let id = self.closed[self.rng.random_range(0..self.closed.len())].clone();
                let line = self.line();
                self.command(format!("/orders/{id}/lines"), line).await;
            } else if self.open.is_empty() || roll < 0.35 {
                let lines: Vec<serde_json::Value> = (0..self.rng.random_range(1..=3))
                    .map(|_| self.line())
                    .collect();
                let body = serde_json::json!({
                    "customer_id": format!("customer-{}", self.rng.random_range(0..50)),
                    "lines": lines,
                });
                if let Answer::Accepted(order) = self.command("/orders".to_owned(), body).await {
                    if let Some(id) = order["order_id"].as_str() {
                        self.open.push(id.to_owned());
                    }
                }
            } else {
                let index = self.rng.random_range(0..self.open.len());
                let id = self.open[index].clone();
                if roll < 0.85 {
                    let line = self.line();
                    self.command(format!("/orders/{id}/lines"), line).await;
                } else {
                    self.open.swap_remove(index);
                    let body = serde_json::json!({ "reason": "chaos" });
                    if let Answer::Accepted(_) =
                        self.command(format!("/orders/{id}/cancel"), body).await
                    {
                        self.closed.push(id);
                    }
                }
            }
        }
    }

    fn line(&mut self) -> serde_json::Value {
        serde_json::json!({
            "sku": format!("sku-{}", self.rng.random_range(1..=8)),
            "quantity": self.rng.random_range(1..=5),
            "unit_price_cents": self.rng.random_range(100..5000),
        })
    }

    /// POSTs `body` to `path` with a new key, and again with the same key after an error,
    /// a timeout, a dropped connection, a 5xx or "key in flight", until it is answered.
    async fn command(&mut self, path: String, body: serde_json::Value) -> Answer {
        self.sent += 1;
        let key = format!("{}-{}", self.keys, self.sent);
        let url = format!("{}{path}", self.base);
        let give_up = Instant::now() + COMMAND_PATIENCE;
        let mut pause = Duration::from_millis(50);
        loop {
            let sent = self
                .http
                .post(&url)
                .header("Idempotency-Key", &key)
                .json(&body)
                .send()
                .await;
            if let Ok(response) = sent {
                let status = response.status();
                let body: serde_json::Value = response.json().await.unwrap_or_default();
                if status.is_success() {
                    self.load.commands.fetch_add(1, Ordering::Relaxed);
                    return Answer::Accepted(body);
                }
                let in_flight = body["error"]["code"] == "idempotency_key_in_flight";
                if status.is_client_error() && !in_flight {
                    self.load.refused.fetch_add(1, Ordering::Relaxed);
                    return Answer::Refused;
                }
            }
            if Instant::now() >= give_up {
                self.load.abandoned.fetch_add(1, Ordering::Relaxed);
                return Answer::Abandoned;
            }
            self.load.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }
}
