//! The Kubernetes manifests under `deploy/kubernetes/` held against the binary, so they cannot
//! drift from it: the migration Job's command migrates a database with its URL read from the
//! file the Job mounts; the relay Deployment's command, its ConfigMap's TOML and its
//! secret files start a real `handoff relay`, whose `/healthz` and `/readyz` answer 200 on the
//! port and paths the probes name; SIGTERM ends it well within `terminationGracePeriodSeconds`,
//! which covers the relay's shutdown grace and a last write; every `HANDOFF_*` variable is one
//! the binary reads; and the memory limit covers what docs/relay.md says the relay takes.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use handoff_test::nats::{prepare_shared_server, shared_url, unique_name, DeleteStreamOnDrop};
use handoff_test::{eventually, TestDb};
use serde_yaml::Value;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every document of every `deploy/kubernetes/*.yaml`, by `kind/name`.
fn manifests() -> BTreeMap<String, Value> {
    let dir = workspace().join("deploy/kubernetes");
    let mut found = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for document in serde_yaml::Deserializer::from_str(&text) {
            let value = <Value as serde::Deserialize>::deserialize(document)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let kind = value["kind"].as_str().unwrap().to_owned();
            let name = value["metadata"]["name"].as_str().unwrap().to_owned();
            found.insert(format!("{kind}/{name}"), value);
        }
    }
    found
}

fn get<'a>(manifests: &'a BTreeMap<String, Value>, key: &str) -> &'a Value {
    manifests
        .get(key)
        .unwrap_or_else(|| panic!("deploy/kubernetes has no {key}"))
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_sequence()
        .map(|s| s.iter().map(|v| v.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

/// The container's `env` as `(name, value)`.
fn env(container: &Value) -> Vec<(String, String)> {
    container["env"]
        .as_sequence()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_owned(),
                e["value"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Kubernetes quantities as bytes: `256Mi`, `1Gi`, `500M`.
fn bytes(quantity: &str) -> u64 {
    let (number, unit) = quantity.split_at(quantity.find(|c: char| c.is_alphabetic()).unwrap());
    let n: u64 = number.parse().unwrap();
    n * match unit {
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        other => panic!("unit {other}"),
    }
}

/// The file a `<VAR>_FILE` value names, written with `content` under `dir`, in place of the
/// mounted secret; checks that a secret volume of the pod mounts a key of that name.
fn secret_file(pod: &Value, container: &Value, path: &str, dir: &Path, content: &str) -> PathBuf {
    let path = Path::new(path);
    let mount_dir = path.parent().unwrap().to_str().unwrap();
    let key = path.file_name().unwrap().to_str().unwrap();
    let mount = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str() == Some(mount_dir))
        .unwrap_or_else(|| panic!("nothing mounted at {mount_dir}"));
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let secret = &volume["secret"];
    assert!(secret.is_mapping(), "{mount_dir} is not a secret volume");
    if let Some(items) = secret["items"].as_sequence() {
        assert!(
            items.iter().any(|i| i["path"].as_str() == Some(key)),
            "{mount_dir} does not project {key}"
        );
    }
    let file = dir.join(key);
    std::fs::write(&file, format!("{content}\n")).unwrap();
    file
}

/// The variables `handoff <command> --help` names.
fn help_names(command: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args([command, "--help"])
        .env_clear()
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap()
}

/// Every `HANDOFF_*` variable a container sets is one `handoff <command>` reads: named in its
/// help, or `<VAR>_FILE` of a variable that may come from a file.
fn assert_known_variables(command: &str, container: &Value) {
    let help = help_names(command);
    for (name, _) in env(container) {
        if !name.starts_with("HANDOFF_") {
            continue;
        }
        match name.strip_suffix("_FILE") {
            Some(var) => {
                assert!(
                    handoff_telemetry::secrets::SECRET_VARS.contains(&var),
                    "{name}: {var} is not read from a file"
                );
                assert!(help.contains(var), "handoff {command} does not read {var}");
            }
            None => assert!(
                help.contains(&name),
                "handoff {command} does not read {name}"
            ),
        }
    }
}

#[tokio::test]
async fn the_migration_job_migrates_through_its_secret_file() {
    let manifests = manifests();
    let job = get(&manifests, "Job/handoff-migrate");
    let pod = &job["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let args = strings(&container["args"]);
    assert_eq!(args, ["migrate"], "the Job runs `handoff migrate`");
    assert_eq!(pod["restartPolicy"].as_str(), Some("Never"));
    assert_known_variables("migrate", container);
    let (_, path) = env(container)
        .into_iter()
        .find(|(name, _)| name == "HANDOFF_DATABASE_URL_FILE")
        .expect("the Job reads the database URL from a file");
    // Migrations need a direct connection: the key holds the direct URL, not the relay's.
    assert!(
        path.ends_with("_direct"),
        "the Job's URL file {path} is not the direct one"
    );
    let secret = get(&manifests, "Secret/handoff-relay");
    let key = Path::new(&path).file_name().unwrap().to_str().unwrap();
    let example = secret["stringData"][key].as_str().unwrap();
    assert!(
        !example.contains("pgbouncer") && !example.contains(":6432"),
        "{key} goes through the pooler: {example}"
    );

    let db = TestDb::new("deploy_kubernetes_job").await;
    let dir = tempfile::tempdir().unwrap();
    let file = secret_file(pod, container, &path, dir.path(), &db.url());
    let run = |args: &[String]| {
        Command::new(env!("CARGO_BIN_EXE_handoff"))
            .args(args)
            .env_clear()
            .env("HANDOFF_DATABASE_URL_FILE", &file)
            .output()
            .unwrap()
    };
    let output = run(&args);
    assert!(output.status.success(), "{output:?}");
    let check = run(&["migrate".to_owned(), "--check".to_owned()]);
    assert_eq!(check.status.code(), Some(0), "{check:?}");
    // Rerunning the Job is harmless.
    assert!(run(&args).status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_deployment_starts_a_relay_its_probes_find_ready() {
    let manifests = manifests();
    let deployment = get(&manifests, "Deployment/handoff-relay");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_known_variables("relay", container);
    let args = strings(&container["args"]);
    assert_eq!(args.first().map(String::as_str), Some("relay"));
    let config_at = args.iter().position(|a| a == "--config").expect("--config");
    let config_path = Path::new(&args[config_at + 1]);

    // The ConfigMap mounted where --config points, and its TOML.
    let mount = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str() == config_path.parent().and_then(Path::to_str))
        .expect("the config file's directory is mounted");
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let map_name = volume["configMap"]["name"].as_str().unwrap();
    let config_map = get(&manifests, &format!("ConfigMap/{map_name}"));
    let file_name = config_path.file_name().unwrap().to_str().unwrap();
    let toml_text = config_map["data"][file_name].as_str().unwrap();
    let mut config: toml::Table = toml_text.parse().unwrap();

    // Probes: liveness on /healthz, readiness on /readyz, on the port metrics_addr binds.
    let metrics_addr: std::net::SocketAddr =
        config["metrics_addr"].as_str().unwrap().parse().unwrap();
    let port_of = |name: &str| -> u16 {
        container["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("no container port named {name}"))
            .try_into()
            .unwrap()
    };
    let liveness = &container["livenessProbe"]["httpGet"];
    let readiness = &container["readinessProbe"]["httpGet"];
    assert_eq!(liveness["path"].as_str(), Some("/healthz"));
    assert_eq!(readiness["path"].as_str(), Some("/readyz"));
    for probe in [liveness, readiness] {
        assert_eq!(
            port_of(probe["port"].as_str().unwrap()),
            metrics_addr.port(),
            "a probe's port is not the relay's metrics_addr"
        );
    }
    // The endpoint gives up on its checks after 2 s; the probe must wait longer.
    assert!(
        container["readinessProbe"]["timeoutSeconds"]
            .as_u64()
            .unwrap()
            > 2
    );

    // Shutdown: the relay's grace for in-flight publishes plus one bounded write of their
    // outcomes must fit in terminationGracePeriodSeconds.
    let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap());
    let query_timeout =
        humantime::parse_duration(config["query_timeout"].as_str().unwrap()).unwrap();
    let shutdown_grace = handoff_relay::RelayConfig::default().shutdown_grace;
    assert!(
        grace > shutdown_grace + query_timeout,
        "terminationGracePeriodSeconds {grace:?} does not cover the relay's shutdown grace \
         {shutdown_grace:?} and a write of {query_timeout:?}"
    );

    // Memory: docs/relay.md's rule, about four times max_in_flight_bytes plus 40 MB.
    let in_flight = config["max_in_flight_bytes"].as_integer().unwrap() as u64;
    let limit = bytes(container["resources"]["limits"]["memory"].as_str().unwrap());
    assert!(
        limit >= 4 * in_flight + 40_000_000,
        "a memory limit of {limit} bytes is below 4 x {in_flight} + 40 MB"
    );

    // The relay as the manifest starts it, with the addresses of this machine: the shared
    // nats-server (no credentials), a stream of its own, a free port for the probes.
    prepare_shared_server().await;
    let stream = unique_name("deploy_k8s");
    let _cleanup = DeleteStreamOnDrop::new(&shared_url(), &stream);
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let creds = config.remove("nats_creds");
    assert!(
        creds
            .as_ref()
            .and_then(|c| c.as_str())
            .is_some_and(|c| c.starts_with("/run/secrets/")),
        "NATS credentials come from the mounted secret: {creds:?}"
    );
    config.insert("nats_url".into(), shared_url().into());
    config.insert("stream".into(), stream.clone().into());
    config.insert("subject_prefix".into(), stream.to_lowercase().into());
    config.insert("metrics_addr".into(), format!("127.0.0.1:{port}").into());
    let dir = tempfile::tempdir().unwrap();
    let config_file = dir.path().join(file_name);
    std::fs::write(&config_file, toml::to_string(&config).unwrap()).unwrap();

    let db = TestDb::migrated("deploy_kubernetes_relay").await;
    let mut command = Command::new(env!("CARGO_BIN_EXE_handoff"));
    let mut relay_args = args.clone();
    relay_args[config_at + 1] = config_file.to_str().unwrap().to_owned();
    command.args(&relay_args).env_clear();
    for (name, value) in env(container) {
        if name.ends_with("_FILE") {
            let file = secret_file(pod, container, &value, dir.path(), &db.url());
            command.env(name, file);
        } else {
            command.env(name, value);
        }
    }
    let log = dir.path().join("relay.log");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let http = reqwest::Client::new();
    for path in ["/healthz", "/readyz"] {
        let url = format!("http://127.0.0.1:{port}{path}");
        eventually(
            &format!("{path} answers 200"),
            Duration::from_secs(30),
            async || match http.get(&url).send().await {
                Ok(response) if response.status().as_u16() == 200 => Ok(()),
                Ok(response) => Err(format!(
                    "{}; log: {}",
                    response.status(),
                    std::fs::read_to_string(&log).unwrap_or_default()
                )),
                Err(error) => Err(format!(
                    "{error}; log: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )),
            },
        )
        .await;
    }

    // What the kubelet sends first.
    let stopped = Instant::now();
    // SAFETY: kill(2) on a child this test spawned and has not reaped.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(
        stopped.elapsed() < grace,
        "the relay took {:?} to stop, the pod gets {grace:?}",
        stopped.elapsed()
    );
}

/// The shared libraries docs/deploy-kubernetes.md lists (between its `runtime-libraries`
/// markers) are exactly those the `handoff` binary links: its ELF `NEEDED` entries, read with
/// `readelf -d` (binutils, which the C toolchain the build needs brings along).
#[test]
fn the_page_lists_the_libraries_the_binary_links() {
    let output = Command::new("readelf")
        .args(["-d", env!("CARGO_BIN_EXE_handoff")])
        .output()
        .expect("readelf (binutils) is needed to read the binary's NEEDED entries");
    assert!(output.status.success(), "{output:?}");
    let dynamic = String::from_utf8(output.stdout).unwrap();
    let linked: std::collections::BTreeSet<String> = dynamic
        .lines()
        .filter(|line| line.contains("(NEEDED)"))
        .filter_map(|line| Some(line.split('[').nth(1)?.split(']').next()?.to_owned()))
        .collect();
    assert!(linked.iter().any(|l| l.starts_with("libc.so")), "{dynamic}");
    let page = std::fs::read_to_string(workspace().join("docs/deploy-kubernetes.md")).unwrap();
    let start = page.find("<!-- runtime-libraries -->").unwrap();
    let end = page.find("<!-- /runtime-libraries -->").unwrap();
    let listed: std::collections::BTreeSet<String> = page[start..end]
        .lines()
        .filter_map(|line| {
            let cell = line.strip_prefix("| `")?;
            Some(cell.split('`').next()?.to_owned())
        })
        .collect();
    assert_eq!(
        listed, linked,
        "docs/deploy-kubernetes.md lists other libraries than `handoff` links"
    );
}
