//! The proxy binary as a process of its own (so that its RSS is a real process's): started on
//! loopback ports it picks, its addresses read from its `proxy serving` log line, its
//! `/readyz` and `/metrics` read over HTTP, killed when dropped.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};

/// The running binary; killed when dropped.
pub(crate) struct ProxyProcess {
    child: std::process::Child,
    /// The CONNECT listener, `127.0.0.1:<port>`.
    pub(crate) listen: String,
    /// `/healthz`, `/readyz`, `/metrics`.
    pub(crate) health: String,
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ProxyProcess {
    /// `bin` with `args` (the listeners are added: loopback, ports picked by the kernel) and
    /// `KUBECONFIG=kubeconfig` (the proxy's own identity for the TokenReviews and the pod
    /// watch), once it serves.
    pub(crate) fn start(bin: &Path, args: &[OsString], kubeconfig: &Path) -> anyhow::Result<Self> {
        let mut child = Command::new(bin)
            .args(args)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--health-listen",
                "127.0.0.1:0",
                "--log-json",
            ])
            .env("KUBECONFIG", kubeconfig)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stderr = child.stderr.take().context("the proxy's stderr")?;
        match serving_addrs(stderr) {
            Ok((listen, health)) => Ok(Self {
                child,
                listen,
                health,
            }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until `/readyz` answers 200 (the sandbox pods listed), for up to 30 s.
    pub(crate) async fn ready(&self, http: &reqwest::Client) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let r = http
                .get(format!("http://{}/readyz", self.health))
                .send()
                .await?;
            if r.status().is_success() {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("the proxy is not ready: {}", r.text().await?);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The value of the series `series` (`name` or `name{labels}`) of its `/metrics`, 0 when
    /// absent.
    pub(crate) async fn metric(&self, http: &reqwest::Client, series: &str) -> anyhow::Result<f64> {
        let metrics = http
            .get(format!("http://{}/metrics", self.health))
            .send()
            .await?
            .text()
            .await?;
        Ok(metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0.0))
    }
}

/// The proxy's `proxy serving` log line names both addresses it bound.
fn serving_addrs(stderr: std::process::ChildStderr) -> anyhow::Result<(String, String)> {
    let mut lines = BufReader::new(stderr).lines();
    let mut tail = Vec::new();
    for line in lines.by_ref() {
        let line = line?;
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            tail.push(line);
            continue;
        };
        if v["message"] == "proxy serving" {
            let listen = v["listen"].as_str().context("listen")?.to_owned();
            let health = v["health"].as_str().context("health")?.to_owned();
            // Keep draining the log so the proxy never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return Ok((listen, health));
        }
        tail.push(line);
    }
    let tail = tail.split_off(tail.len().saturating_sub(5)).join("\n");
    bail!("the proxy exited before serving:\n{tail}")
}
