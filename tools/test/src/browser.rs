//! A real browser for tests: Debian's chromium, headless, driven through WebDriver by a
//! chromedriver this helper starts on a free port (and kills, with the browser, on drop).
//! Nothing is skipped: without chromium or chromedriver the test fails and says how to
//! install them.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder};

/// Where Debian installs them (`apt-get install chromium chromium-driver`).
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A headless chromium session and the chromedriver behind it.
pub struct Browser {
    /// The WebDriver session.
    pub client: Client,
    driver: Child,
}

impl Browser {
    /// Starts chromedriver on a free port and opens a headless chromium session (1280x900).
    ///
    /// # Panics
    ///
    /// When chromium or chromedriver is missing (the message says how to install them), or
    /// the session cannot be opened within 30 s.
    pub async fn start() -> Self {
        for binary in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(binary).exists(),
                "{binary} is missing: the browser tests need Debian's chromium and \
                 chromedriver (`apt-get install -y chromium chromium-driver`; .ci/run installs \
                 them)"
            );
        }
        let port = crate::free_port().expect("a free loopback port");
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own process group: dropping the browser kills chromedriver and every
            // chromium process it started, not only chromedriver.
            .process_group(0)
            .spawn()
            .expect("start chromedriver");
        let mut browser_args = vec![
            "--headless=new",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1280,900",
        ];
        // Chromium's sandbox refuses to run as root, which CI is.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            browser_args.push("--no-sandbox");
        }
        let capabilities = serde_json::json!({
            "goog:chromeOptions": { "binary": CHROMIUM, "args": browser_args }
        });
        let serde_json::Value::Object(capabilities) = capabilities else {
            unreachable!("a JSON object literal")
        };
        let url = format!("http://127.0.0.1:{port}");
        let mut guard = KillGroup(Some(driver));
        let client = crate::eventually(
            "chromedriver accepts a session",
            Duration::from_secs(30),
            async || {
                ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                    .capabilities(capabilities.clone())
                    .connect(&url)
                    .await
                    .map_err(|e| e.to_string())
            },
        )
        .await;
        Browser {
            client,
            driver: guard.0.take().expect("the driver is still there"),
        }
    }

    /// Saves a PNG of the page as `NAME.png` in the directory `HANDOFF_SCREENSHOTS` names
    /// (the docs' screenshots are made so); does nothing without it. Returns the file.
    ///
    /// # Panics
    ///
    /// When the screenshot cannot be taken or written.
    pub async fn screenshot(&self, name: &str) -> Option<PathBuf> {
        let dir = std::env::var_os("HANDOFF_SCREENSHOTS")?;
        let dir = PathBuf::from(dir);
        std::fs::create_dir_all(&dir).expect("create the screenshot directory");
        let png = self.client.screenshot().await.expect("take a screenshot");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write the screenshot");
        Some(path)
    }

    /// Ends the session, then the driver and its browsers.
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        kill_group(&mut self.driver);
    }
}

struct KillGroup(Option<Child>);

impl Drop for KillGroup {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            kill_group(child);
        }
    }
}

fn kill_group(child: &mut Child) {
    // SAFETY: a signal to the process group we made for this child.
    unsafe {
        libc::kill(-(child.id() as i32), libc::SIGKILL);
    }
    let _ = child.wait();
}
