//! Startup, liveness and readiness probes: exec, httpGet, tcpSocket (gRPC is checked as a TCP
//! connect). HTTP and TCP probes connect from the host to the pod IP (the ptp route).

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::Ipv4Net;
use k8s_openapi::api::core::v1::{ContainerPort, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::process;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Startup,
    Liveness,
    Readiness,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Startup => "Startup",
            Kind::Liveness => "Liveness",
            Kind::Readiness => "Readiness",
        }
    }
}

/// Where a probe runs.
#[derive(Debug, Clone)]
pub struct Target {
    pub pod_ip: Ipv4Addr,
    pub pod_cidr: Ipv4Net,
    pub pid: i32,
    pub spec_path: PathBuf,
    pub ports: Vec<ContainerPort>,
}

/// Probe timing with the API defaults applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

fn secs(v: Option<i32>, default: i32, min: i32) -> Duration {
    Duration::from_secs(v.unwrap_or(default).max(min) as u64)
}

pub fn timing(p: &Probe) -> Timing {
    Timing {
        initial_delay: secs(p.initial_delay_seconds, 0, 0),
        period: secs(p.period_seconds, 10, 1),
        timeout: secs(p.timeout_seconds, 1, 1),
        success_threshold: p.success_threshold.unwrap_or(1).max(1) as u32,
        failure_threshold: p.failure_threshold.unwrap_or(3).max(1) as u32,
    }
}

/// Consecutive-result counting; reports the thresholded state when it changes.
#[derive(Debug, Clone, Default)]
pub struct Counter {
    successes: u32,
    failures: u32,
    state: Option<bool>,
}

impl Counter {
    pub fn observe(&mut self, ok: bool, t: &Timing) -> Option<bool> {
        if ok {
            self.successes += 1;
            self.failures = 0;
        } else {
            self.failures += 1;
            self.successes = 0;
        }
        let next = if self.successes >= t.success_threshold {
            Some(true)
        } else if self.failures >= t.failure_threshold {
            Some(false)
        } else {
            None
        };
        match next {
            Some(n) if self.state != Some(n) => {
                self.state = Some(n);
                Some(n)
            }
            _ => None,
        }
    }
}

/// Resolves an int-or-named port against the container's ports.
pub fn resolve_port(port: &IntOrString, ports: &[ContainerPort]) -> Result<u16, String> {
    let n = match port {
        IntOrString::Int(n) => *n,
        IntOrString::String(s) => match s.parse::<i32>() {
            Ok(n) => n,
            Err(_) => ports
                .iter()
                .find(|p| p.name.as_deref() == Some(s))
                .map(|p| p.container_port)
                .ok_or_else(|| format!("named port {s:?} is not declared by the container"))?,
        },
    };
    u16::try_from(n)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| format!("port {n} is out of range"))
}

/// The address to probe: the pod IP, or an explicit host if it is inside the pod CIDR or on
/// loopback (this kubelet never sends probe traffic elsewhere).
pub fn probe_host(host: Option<&str>, t: &Target) -> Result<IpAddr, String> {
    match host.filter(|h| !h.is_empty()) {
        None => Ok(IpAddr::V4(t.pod_ip)),
        Some(h) => {
            let ip: IpAddr = h.parse().map_err(|_| {
                format!("probe host {h:?} is not an IP address; cli-mcp-kubelet only probes IPs")
            })?;
            let allowed =
                ip.is_loopback() || matches!(ip, IpAddr::V4(v4) if t.pod_cidr.contains(&v4));
            if allowed {
                Ok(ip)
            } else {
                Err(format!(
                    "probe host {h} is outside the pod CIDR {}; refusing to send probe traffic there",
                    t.pod_cidr
                ))
            }
        }
    }
}

/// Runs the probe once. `Err` carries the failure message.
pub async fn probe_once(
    p: &Probe,
    t: &Target,
    timeout: Duration,
    http: &reqwest::Client,
) -> Result<(), String> {
    if let Some(exec) = &p.exec {
        let cmd = exec.command.clone().unwrap_or_default();
        if cmd.is_empty() {
            return Err("exec probe has an empty command".into());
        }
        let out = process::exec_in_container(&t.spec_path, t.pid, &cmd, timeout).await?;
        return if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "command {cmd:?} exited with {}: {}",
                out.status.code().unwrap_or(-1),
                out.output.trim()
            ))
        };
    }
    if let Some(h) = &p.http_get {
        let host = probe_host(h.host.as_deref(), t)?;
        let port = resolve_port(&h.port, &t.ports)?;
        let scheme = h.scheme.as_deref().unwrap_or("HTTP").to_ascii_lowercase();
        let mut path = h.path.clone().unwrap_or_else(|| "/".into());
        if !path.starts_with('/') {
            path.insert(0, '/');
        }
        let url = format!("{scheme}://{host}:{port}{path}");
        let mut req = http
            .get(&url)
            .timeout(timeout)
            .header("User-Agent", "kube-probe/1.37")
            .header("Accept", "*/*");
        for hdr in h.http_headers.iter().flatten() {
            req = req.header(hdr.name.as_str(), hdr.value.as_str());
        }
        let resp = req.send().await.map_err(|e| format!("Get {url:?}: {e}"))?;
        let code = resp.status().as_u16();
        return if (200..400).contains(&code) {
            Ok(())
        } else {
            Err(format!("HTTP probe failed with statuscode: {code}"))
        };
    }
    let tcp_port = match (&p.tcp_socket, &p.grpc) {
        (Some(tcp), _) => Some((tcp.host.as_deref(), resolve_port(&tcp.port, &t.ports)?)),
        (None, Some(g)) => Some((
            None,
            u16::try_from(g.port).map_err(|_| format!("port {} is out of range", g.port))?,
        )),
        (None, None) => None,
    };
    if let Some((host, port)) = tcp_port {
        let host = probe_host(host, t)?;
        return match tokio::time::timeout(timeout, tokio::net::TcpStream::connect((host, port)))
            .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("dial tcp {host}:{port}: {e}")),
            Err(_) => Err(format!("dial tcp {host}:{port}: i/o timeout")),
        };
    }
    Err("probe has no handler (exec, httpGet, tcpSocket or grpc)".into())
}

/// Runs a probe forever, calling `report(ok, message)` whenever the thresholded result
/// changes. Liveness and startup probes stop after their first decisive report that needs
/// action (failure for liveness; success or failure for startup).
pub async fn run(
    kind: Kind,
    p: Probe,
    target: Target,
    http: reqwest::Client,
    report: impl Fn(bool, String) + Send,
) {
    let t = timing(&p);
    tokio::time::sleep(t.initial_delay).await;
    let mut counter = Counter::default();
    let mut ticker = tokio::time::interval(t.period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let result = probe_once(&p, &target, t.timeout, &http).await;
        let ok = result.is_ok();
        if let Some(state) = counter.observe(ok, &t) {
            let msg = match result {
                Ok(()) => String::new(),
                Err(e) => format!("{} probe failed: {e}", kind.as_str()),
            };
            report(state, msg);
            let done = match kind {
                Kind::Liveness => !state,
                Kind::Startup => true,
                Kind::Readiness => false,
            };
            if done {
                return;
            }
        }
    }
}

/// The HTTP client shared by all probes (no redirects followed; 3xx counts as success).
pub fn http_client() -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .danger_accept_invalid_certs(true)
        .no_proxy()
        .build()
        .map_err(|e| format!("building the probe HTTP client: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            pod_ip: Ipv4Addr::new(10, 244, 0, 5),
            pod_cidr: "10.244.0.0/24".parse().expect("cidr"),
            pid: 1,
            spec_path: PathBuf::from("/nonexistent"),
            ports: vec![ContainerPort {
                name: Some("http".into()),
                container_port: 8080,
                ..Default::default()
            }],
        }
    }

    #[test]
    fn defaults() {
        let t = timing(&Probe::default());
        assert_eq!(t.period, Duration::from_secs(10));
        assert_eq!(t.timeout, Duration::from_secs(1));
        assert_eq!((t.success_threshold, t.failure_threshold), (1, 3));
    }

    #[test]
    fn thresholds() {
        let t = Timing {
            initial_delay: Duration::ZERO,
            period: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            success_threshold: 2,
            failure_threshold: 3,
        };
        let mut c = Counter::default();
        assert_eq!(c.observe(true, &t), None);
        assert_eq!(c.observe(true, &t), Some(true));
        assert_eq!(c.observe(true, &t), None);
        assert_eq!(c.observe(false, &t), None);
        assert_eq!(c.observe(false, &t), None);
        assert_eq!(c.observe(true, &t), None);
        assert_eq!(c.observe(false, &t), None);
        assert_eq!(c.observe(false, &t), None);
        assert_eq!(c.observe(false, &t), Some(false));
    }

    #[test]
    fn ports() {
        let ports = target().ports;
        assert_eq!(resolve_port(&IntOrString::Int(80), &ports), Ok(80));
        assert_eq!(
            resolve_port(&IntOrString::String("http".into()), &ports),
            Ok(8080)
        );
        assert_eq!(
            resolve_port(&IntOrString::String("81".into()), &ports),
            Ok(81)
        );
        assert!(resolve_port(&IntOrString::String("grpc".into()), &ports).is_err());
        assert!(resolve_port(&IntOrString::Int(70000), &ports).is_err());
    }

    #[test]
    fn probe_hosts_stay_local() {
        let t = target();
        assert_eq!(probe_host(None, &t), Ok("10.244.0.5".parse().expect("ip")));
        assert!(probe_host(Some("10.244.0.9"), &t).is_ok());
        assert!(probe_host(Some("127.0.0.1"), &t).is_ok());
        assert!(probe_host(Some("192.0.2.1"), &t).is_err());
        assert!(probe_host(Some("example.com"), &t).is_err());
    }

    #[tokio::test]
    async fn tcp_probe_against_a_local_listener() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let p = Probe {
            tcp_socket: Some(k8s_openapi::api::core::v1::TCPSocketAction {
                host: Some("127.0.0.1".into()),
                port: IntOrString::Int(port as i32),
            }),
            ..Default::default()
        };
        let http = http_client().expect("client");
        let ok = probe_once(&p, &target(), Duration::from_secs(2), &http).await;
        assert_eq!(ok, Ok(()));
        drop(listener);
        let closed = probe_once(&p, &target(), Duration::from_secs(2), &http).await;
        assert!(closed.is_err());
    }

    #[tokio::test]
    async fn http_probe_status_codes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            for code in ["200 OK", "500 Internal Server Error"] {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let resp =
                    format!("HTTP/1.1 {code}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        let p = Probe {
            http_get: Some(k8s_openapi::api::core::v1::HTTPGetAction {
                host: Some("127.0.0.1".into()),
                port: IntOrString::Int(port as i32),
                path: Some("/healthz".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let http = http_client().expect("client");
        assert_eq!(
            probe_once(&p, &target(), Duration::from_secs(2), &http).await,
            Ok(())
        );
        let second = probe_once(&p, &target(), Duration::from_secs(2), &http).await;
        assert_eq!(
            second,
            Err("HTTP probe failed with statuscode: 500".to_string())
        );
        let _ = server.await;
    }
}
