//! Process supervision: the run's servers and child processes, started, killed on the
//! schedule and restarted.

use super::*;

/// What the supervisor is to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Follow the fault schedule, restart what is down.
    Faults,
    /// No more faults: restart everything down now, keep it running.
    Calm,
    /// Stop supervising.
    Stop,
}

/// One child process of the run and how to start it again.
pub(crate) struct Proc {
    pub(crate) kind: Kind,
    pub(crate) instance: usize,
    program: PathBuf,
    /// Its arguments; the backlog drill adds to the relays'.
    pub(crate) args: Vec<String>,
    env: Vec<(&'static str, String)>,
    log: Option<PathBuf>,
    child: Option<Child>,
    /// When a child that is down is to be started again.
    back_at: Option<Instant>,
}

impl Proc {
    fn label(&self) -> String {
        format!("{}-{}", self.kind.name(), self.instance)
    }

    fn spawn(&mut self) -> Result<(), RunError> {
        let what = || self.label();
        let stderr = match &self.log {
            Some(path) => Stdio::from(append(path).map_err(|source| RunError::Spawn {
                what: what(),
                source,
            })?),
            None => Stdio::null(),
        };
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true);
        // The user's own handoff settings are not the run's.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("HANDOFF_") {
                command.env_remove(name);
            }
        }
        for (name, value) in &self.env {
            command.env(name, value);
        }
        let child = command.spawn().map_err(|source| RunError::Spawn {
            what: what(),
            source,
        })?;
        self.child = Some(child);
        self.back_at = None;
        Ok(())
    }
}

pub(super) fn append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// The run's child processes, not yet started.
pub(super) fn processes(
    bin_dir: &Path,
    log_dir: Option<&Path>,
    urls: &Urls,
    relay_source: RelaySource,
) -> Vec<Proc> {
    let bin = |name: &str| bin_dir.join(name);
    let proc = |kind: Kind,
                instance: usize,
                program: &str,
                args: Vec<String>,
                env: Vec<(&'static str, String)>| Proc {
        kind,
        instance,
        program: bin(program),
        args,
        env,
        log: log_dir.map(|dir| dir.join(format!("{}-{instance}.log", kind.name()))),
        child: None,
        back_at: None,
    };
    let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let listen = |url: &str| url.trim_start_matches("http://").to_owned();
    let mut procs = vec![proc(
        Kind::OrderService,
        0,
        "order-service",
        vec![
            "--listen".into(),
            listen(&urls.service),
            "--max-connections".into(),
            "8".into(),
        ],
        vec![("DATABASE_URL", urls.orders.clone())],
    )];
    let (relay_flags, relay_env) = urls.broker.relay_flags();
    for instance in 0..Kind::Relay.instances() {
        let mut args = strings(&["relay"]);
        args.extend(relay_flags.iter().cloned());
        args.extend(strings(&[
            // Short leases and polls: a killed relay's claims come back within seconds.
            "--lease",
            "4s",
            "--publish-timeout",
            "1s",
            "--poll-interval",
            "200ms",
            // Outages are not charged as attempts; this only keeps an unlucky event from
            // being held for an operator during a long run.
            "--max-attempts",
            "1000",
        ]));
        args.extend(["--relay-id".to_owned(), format!("chaos-relay-{instance}")]);
        if relay_source == RelaySource::Logical {
            args.extend(strings(&[
                "--source",
                "logical",
                "--slot",
                CDC_SLOT,
                "--publication",
                CDC_PUBLICATION,
            ]));
        }
        if relay_source == RelaySource::Log {
            args.extend(strings(&["--source", "log"]));
        }
        let mut env = vec![("DATABASE_URL", urls.orders.clone())];
        env.extend(relay_env.iter().cloned());
        procs.push(proc(Kind::Relay, instance, "handoff", args, env));
    }
    procs.push(proc(
        Kind::PaymentProvider,
        0,
        "payment-provider",
        vec![
            "--listen".into(),
            listen(&urls.provider),
            "--max-connections".into(),
            "4".into(),
        ],
        vec![("DATABASE_URL", urls.provider_db.clone())],
    ));
    for kind in [Kind::Inventory, Kind::Payments] {
        let (consumer_flags, consumer_env) = urls.broker.consumer_flags(kind);
        for instance in 0..kind.instances() {
            let mut args = consumer_flags.clone();
            args.extend(strings(&[
                "--consumer-name",
                kind.name(),
                // A killed instance's unacknowledged events come back after this.
                "--ack-wait",
                "5s",
                // Deliveries fail while a server or the provider is down; none of them should
                // send an event to the consumer quarantine.
                "--max-deliveries",
                "1000",
                "--concurrency",
                "4",
            ]));
            let url = if kind == Kind::Inventory {
                urls.inventory.clone()
            } else {
                args.extend(strings(&[
                    "--provider-url",
                    &urls.provider,
                    "--provider-timeout",
                    "1s",
                ]));
                urls.payments.clone()
            };
            let mut env = vec![("DATABASE_URL", url)];
            env.extend(consumer_env.iter().cloned());
            procs.push(proc(kind, instance, kind.name(), args, env));
        }
    }
    procs
}

/// The servers and child processes of the run; dropping it kills the children
/// (`kill_on_drop`) and stops the servers.
pub(crate) struct World {
    pub(super) postgres: Option<PrivatePostgres>,
    /// The private nats-server (destination nats).
    pub(super) nats: Option<NatsServer>,
    /// The private tansu (destination kafka).
    pub(super) tansu: Option<Tansu>,
    /// The run's exchange and queues on RabbitMQ (destination amqp), deleted at tear-down.
    pub(super) amqp: Option<BrokerUrls>,
    pub(super) postgres_back_at: Option<Instant>,
    pub(super) nats_back_at: Option<Instant>,
    /// The child processes, started or not.
    pub(crate) procs: Vec<Proc>,
    /// Where the relays read from.
    pub(super) relay_source: RelaySource,
    /// The `handoff` binary, for `handoff cdc setup`.
    pub(super) handoff: PathBuf,
    /// SIGKILLs sent, per kind.
    pub(crate) kills: BTreeMap<Kind, u64>,
    /// Children that exited on their own, per kind.
    pub(crate) exits: BTreeMap<Kind, u64>,
    /// Each restart of a server after a kill, and how long it took to be ready again.
    pub(crate) recoveries: Vec<Recovery>,
    /// The start of the load, which `recoveries` count from.
    pub(crate) started: Option<Instant>,
}

/// One restart of a killed server: how long it took to come back (PostgreSQL's crash
/// recovery, JetStream's recovery of its streams), which grows with what they hold.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recovery {
    /// `postgres` or `nats-server`.
    pub kind: Kind,
    /// When it was started again, in seconds from the start of the load.
    pub at_seconds: f64,
    /// How long it took to be ready, in seconds.
    pub seconds: f64,
}

impl World {
    /// Starts the children in dependency order: the order service (it migrates the outbox),
    /// the relays (they create the stream), the provider, then the consumers.
    pub(crate) async fn start_up(&mut self, urls: &Urls) -> Result<(), RunError> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| RunError::Task(format!("http client: {e}")))?;
        self.start_kind(Kind::OrderService)?;
        self.wait(Kind::OrderService, "the order service to answer", || {
            let request = http.get(format!("{}/healthz", urls.service)).send();
            async move { request.await.is_ok_and(|r| r.status().is_success()) }
        })
        .await?;
        if self.relay_source == RelaySource::Logical {
            self.set_up_slot(urls).await?;
        }
        self.start_kind(Kind::Relay)?;
        self.wait(Kind::Relay, "a relay to create the stream or topic", || {
            urls.broker.ready()
        })
        .await?;
        self.start_kind(Kind::PaymentProvider)?;
        self.wait(Kind::PaymentProvider, "the payment provider", || {
            let request = http.get(format!("{}/charges", urls.provider)).send();
            async move { request.await.is_ok_and(|r| r.status().is_success()) }
        })
        .await?;
        self.start_kind(Kind::Inventory)?;
        self.start_kind(Kind::Payments)?;
        Ok(())
    }

    /// `handoff cdc setup` on the order service's database, which the order service has
    /// migrated: the publication and the slot exist before any relay starts.
    async fn set_up_slot(&self, urls: &Urls) -> Result<(), RunError> {
        let output = tokio::process::Command::new(&self.handoff)
            .args([
                "cdc",
                "setup",
                "--slot",
                CDC_SLOT,
                "--publication",
                CDC_PUBLICATION,
            ])
            .env("DATABASE_URL", &urls.orders)
            .env_remove("HANDOFF_SCHEMA")
            .output()
            .await
            .map_err(|e| RunError::Task(format!("handoff cdc setup: {e}")))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(RunError::Task(format!(
                "handoff cdc setup failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )))
        }
    }

    /// SIGKILLs sent, per kind by name, every kind listed.
    pub(crate) fn kill_counts(&self) -> BTreeMap<String, u64> {
        Kind::ALL
            .iter()
            .map(|k| (k.name().to_owned(), self.kills.get(k).copied().unwrap_or(0)))
            .collect()
    }

    /// Children that exited on their own, per kind by name.
    pub(crate) fn exit_counts(&self) -> BTreeMap<String, u64> {
        self.exits
            .iter()
            .map(|(k, n)| (k.name().to_owned(), *n))
            .collect()
    }

    fn start_kind(&mut self, kind: Kind) -> Result<(), RunError> {
        for proc in self.procs.iter_mut().filter(|p| p.kind == kind) {
            proc.spawn()?;
        }
        Ok(())
    }

    /// Polls `ready` until it holds, failing when `kind`'s first instance exits or
    /// [`START_TIMEOUT`] passes.
    async fn wait<F, Fut>(&mut self, kind: Kind, what: &str, ready: F) -> Result<(), RunError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if ready().await {
                return Ok(());
            }
            for proc in self.procs.iter_mut().filter(|p| p.kind == kind) {
                if let Some(child) = proc.child.as_mut() {
                    if let Ok(Some(status)) = child.try_wait() {
                        return Err(RunError::NotReady(format!(
                            "{} exited ({status}) while waiting for {what}; run with --log-dir \
                             to see why",
                            proc.label()
                        )));
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(RunError::NotReady(format!(
                    "gave up waiting for {what} after {}s",
                    START_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// Follows `faults` (times from `started`) while the phase is [`Phase::Faults`], restarts
    /// whatever is down when due, and returns itself when told to stop.
    pub(crate) async fn supervise(
        mut self,
        faults: Vec<Fault>,
        started: Instant,
        mut phase: watch::Receiver<Phase>,
    ) -> Self {
        let mut next = 0;
        let mut calm = false;
        self.started = Some(started);
        loop {
            let now = *phase.borrow_and_update();
            match now {
                Phase::Stop => break,
                Phase::Calm if !calm => {
                    calm = true;
                    self.bring_everything_back();
                }
                Phase::Faults => {
                    while let Some(fault) = faults.get(next) {
                        if started + fault.at > Instant::now() {
                            break;
                        }
                        self.inject(fault).await;
                        next += 1;
                    }
                }
                Phase::Calm => {}
            }
            self.tend().await;
            tokio::select! {
                () = tokio::time::sleep(TICK) => {}
                changed = phase.changed() => if changed.is_err() { break },
            }
        }
        self
    }

    /// SIGKILLs the fault's target and marks it to come back after the pause; a target that
    /// is down already (it crashed, or is still restarting) is left alone.
    async fn inject(&mut self, fault: &Fault) {
        let back_at = Instant::now() + fault.pause;
        let killed = match fault.kind {
            Kind::Postgres => match self.postgres.take() {
                Some(postgres) if self.postgres_back_at.is_none() => {
                    let outcome = blocking(move || {
                        let mut postgres = postgres;
                        let killed = postgres.kill_postmaster();
                        (postgres, killed)
                    })
                    .await;
                    match outcome {
                        Ok((postgres, killed)) => {
                            self.postgres = Some(postgres);
                            self.postgres_back_at = Some(back_at);
                            if let Err(error) = &killed {
                                tracing::warn!(%error, "could not kill postgres");
                            }
                            killed.is_ok()
                        }
                        Err(error) => {
                            tracing::warn!(%error, "the task killing postgres failed");
                            false
                        }
                    }
                }
                other => {
                    self.postgres = other;
                    false
                }
            },
            Kind::NatsServer => match self.nats.as_mut() {
                Some(nats) if nats.is_running() => {
                    let killed = nats.kill();
                    self.nats_back_at = Some(back_at);
                    killed.is_ok()
                }
                _ => false,
            },
            kind => {
                let proc = self
                    .procs
                    .iter_mut()
                    .find(|p| p.kind == kind && p.instance == fault.instance);
                match proc {
                    Some(proc) => match proc.child.take() {
                        Some(mut child) => {
                            let killed = child.kill().await.is_ok();
                            proc.back_at = Some(back_at);
                            killed
                        }
                        None => false,
                    },
                    None => false,
                }
            }
        };
        if killed {
            tracing::info!(
                kind = fault.kind.name(),
                instance = fault.instance,
                "killed"
            );
            *self.kills.entry(fault.kind).or_default() += 1;
        }
    }

    /// Starts what is due back, and notices children that exited on their own.
    async fn tend(&mut self) {
        let now = Instant::now();
        if self.postgres_back_at.is_some_and(|at| at <= now) {
            if let Some(postgres) = self.postgres.take() {
                let outcome = blocking(move || {
                    let mut postgres = postgres;
                    let started = postgres.start_again();
                    (postgres, started)
                })
                .await;
                match outcome {
                    Ok((postgres, started)) => {
                        self.postgres = Some(postgres);
                        match started {
                            Ok(()) => {
                                self.postgres_back_at = None;
                                self.recovered(Kind::Postgres, now);
                            }
                            Err(error) => {
                                tracing::warn!(%error, "postgres did not start again; retrying");
                                self.postgres_back_at = Some(now + Duration::from_secs(1));
                            }
                        }
                    }
                    Err(error) => tracing::warn!(%error, "the task restarting postgres failed"),
                }
            }
        }
        if self.nats_back_at.is_some_and(|at| at <= now) {
            if let Some(nats) = self.nats.as_mut() {
                match nats.start_again() {
                    Ok(()) => {
                        self.nats_back_at = None;
                        self.recovered(Kind::NatsServer, now);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "nats-server did not start again; retrying");
                        self.nats_back_at = Some(now + Duration::from_secs(1));
                    }
                }
            }
        }
        for proc in &mut self.procs {
            if let Some(child) = proc.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    tracing::info!(process = %proc.label(), %status, "exited; restarting");
                    *self.exits.entry(proc.kind).or_default() += 1;
                    proc.child = None;
                    proc.back_at = Some(now + CRASH_RESTART);
                }
            } else if proc.back_at.is_some_and(|at| at <= now) {
                if let Err(error) = proc.spawn() {
                    tracing::warn!(%error, "retrying");
                    proc.back_at = Some(now + Duration::from_secs(1));
                }
            }
        }
    }

    /// SIGKILLs the children of `kinds` and leaves them down, without counting them as the
    /// schedule's kills: the system is to hold still while it is read.
    pub(crate) async fn halt(&mut self, kinds: &[Kind]) {
        for proc in self.procs.iter_mut().filter(|p| kinds.contains(&p.kind)) {
            proc.back_at = None;
            if let Some(mut child) = proc.child.take() {
                let _ = child.kill().await;
            }
        }
    }

    /// Records that the server `kind`, started again at `since`, is ready.
    fn recovered(&mut self, kind: Kind, since: Instant) {
        let at = self.started.map_or(0.0, |started| {
            since.saturating_duration_since(started).as_secs_f64()
        });
        self.recoveries.push(Recovery {
            kind,
            at_seconds: at,
            seconds: since.elapsed().as_secs_f64(),
        });
    }

    /// Makes everything that is down due back now.
    fn bring_everything_back(&mut self) {
        let now = Instant::now();
        if self.postgres_back_at.is_some() {
            self.postgres_back_at = Some(now);
        }
        if self.nats_back_at.is_some() {
            self.nats_back_at = Some(now);
        }
        for proc in &mut self.procs {
            if proc.child.is_none() {
                proc.back_at = Some(now);
            }
        }
    }

    /// Kills the children, then stops the servers.
    pub(crate) async fn tear_down(mut self) {
        for proc in &mut self.procs {
            if let Some(mut child) = proc.child.take() {
                let _ = child.kill().await;
            }
        }
        drop(self.nats.take());
        drop(self.tansu.take());
        if let Some(amqp) = self.amqp.take() {
            amqp.delete_queues().await;
        }
        if let Some(postgres) = self.postgres.take() {
            match blocking(move || postgres.stop()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "while stopping postgres"),
                Err(error) => tracing::warn!(%error, "while stopping postgres"),
            }
        }
    }
}

/// Runs blocking `work` (the servers' helpers wait for processes) off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RunError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| RunError::Task(e.to_string()))
}

pub(crate) async fn connect(url: &str) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
}

/// A loopback port that was free a moment ago, for a service that must keep its port across
/// restarts.
pub(crate) fn free_port() -> Result<u16, RunError> {
    handoff_test::free_port().map_err(|source| RunError::Spawn {
        what: "a free port".into(),
        source,
    })
}
