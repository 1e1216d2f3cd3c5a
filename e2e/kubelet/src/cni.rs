//! CNI: the `ptp` plugin with `host-local` IPAM over the node's pod CIDR.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use ipnet::Ipv4Net;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

/// Everything needed to invoke the plugin; one per kubelet.
#[derive(Debug, Clone)]
pub struct Cni {
    pub bin_dir: PathBuf,
    pub cidr: Ipv4Net,
    pub ipam_dir: PathBuf,
    /// Extra host routes for pods (the apiserver address when it is outside the pod CIDR).
    /// Pods get no default route: they can reach the pod CIDR and these, nothing else.
    pub extra_routes: Vec<Ipv4Net>,
}

/// The first usable address of the pod CIDR: the gateway (host side of every veth) and the
/// node's InternalIP.
pub fn gateway(cidr: &Ipv4Net) -> Option<Ipv4Addr> {
    let net = u32::from(cidr.network());
    if cidr.prefix_len() > 30 {
        return None;
    }
    Some(Ipv4Addr::from(net + 1))
}

/// How many pods fit: addresses minus network, gateway and broadcast. Not capped at the real
/// kubelet's default 110: this node's pods are processes, and the test suite runs a burst of
/// 100 session pods next to other tests' operators, servers and pools on one node, which a cap
/// of 110 left unschedulable ("Too many pods").
pub fn pod_capacity(cidr: &Ipv4Net) -> u32 {
    let hosts = 1u64 << (32 - cidr.prefix_len() as u64);
    u32::try_from(hosts.saturating_sub(3)).unwrap_or(u32::MAX)
}

impl Cni {
    /// The network configuration sent on stdin.
    pub fn config(&self) -> Value {
        let gw = gateway(&self.cidr).map(|g| g.to_string());
        // ptp itself routes the pod CIDR via the gateway; no default route on purpose.
        let routes: Vec<Value> = self
            .extra_routes
            .iter()
            .filter(|r| !self.cidr.contains(*r))
            .map(|r| json!({ "dst": r.to_string() }))
            .collect();
        let mut ipam = json!({
            "type": "host-local",
            "ranges": [[{ "subnet": self.cidr.to_string(), "gateway": gw }]],
            "dataDir": self.ipam_dir.display().to_string(),
        });
        if !routes.is_empty() {
            ipam["routes"] = Value::Array(routes);
        }
        json!({
            "cniVersion": "1.0.0",
            "name": "cli-mcp",
            "type": "ptp",
            "ipMasq": false,
            "ipam": ipam,
        })
    }

    /// `ADD`: returns the pod IP.
    pub async fn add(&self, container_id: &str, netns: &Path) -> Result<Ipv4Addr, String> {
        let out = self.invoke("ADD", container_id, Some(netns)).await?;
        parse_add_result(&out)
    }

    /// `DEL`: releases the IP and removes the host side. Idempotent.
    pub async fn del(&self, container_id: &str, netns: Option<&Path>) -> Result<(), String> {
        self.invoke("DEL", container_id, netns).await.map(|_| ())
    }

    async fn invoke(
        &self,
        command: &str,
        container_id: &str,
        netns: Option<&Path>,
    ) -> Result<String, String> {
        let plugin = self.bin_dir.join("ptp");
        if !plugin.exists() {
            return Err(format!(
                "CNI plugin {} not found; install it with `apt-get install -y containernetworking-plugins` or pass --cni-bin-dir",
                plugin.display()
            ));
        }
        let netns = netns.map(|p| p.display().to_string()).unwrap_or_default();
        let mut child = tokio::process::Command::new(&plugin)
            .env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", container_id)
            .env("CNI_NETNS", &netns)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", &self.bin_dir)
            .env("PATH", crate::env::DEFAULT_PATH)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", plugin.display()))?;
        let config = self.config().to_string();
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(config.as_bytes())
                .await
                .map_err(|e| format!("writing CNI config to {}: {e}", plugin.display()))?;
        }
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .map_err(|_| format!("CNI {command} timed out after 60s"))?
            .map_err(|e| format!("CNI {command} failed: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(format!(
                "CNI {command} ({}) failed: {} {}",
                plugin.display(),
                plugin_error(&stdout),
                stderr.trim()
            ));
        }
        Ok(stdout)
    }
}

/// Extracts `msg`/`details` from a CNI error result, or returns the raw text.
fn plugin_error(stdout: &str) -> String {
    match serde_json::from_str::<Value>(stdout) {
        Ok(v) => {
            let msg = v.get("msg").and_then(Value::as_str).unwrap_or("");
            let details = v.get("details").and_then(Value::as_str).unwrap_or("");
            format!("{msg} {details}").trim().to_string()
        }
        Err(_) => stdout.trim().to_string(),
    }
}

/// Reads the first IPv4 address from an `ADD` result.
pub fn parse_add_result(stdout: &str) -> Result<Ipv4Addr, String> {
    let v: Value = serde_json::from_str(stdout)
        .map_err(|e| format!("CNI ADD returned invalid JSON ({e}): {stdout}"))?;
    v.get("ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("address").and_then(Value::as_str))
        .filter_map(|a| a.split('/').next()?.parse::<Ipv4Addr>().ok())
        .next()
        .ok_or_else(|| format!("CNI ADD result has no IPv4 address: {stdout}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cni() -> Cni {
        Cni {
            bin_dir: "/usr/lib/cni".into(),
            cidr: "10.244.7.0/24".parse().expect("cidr"),
            ipam_dir: "/state/cni/ipam".into(),
            extra_routes: vec![
                "10.244.7.1/32".parse().expect("net"),
                "172.30.0.5/32".parse().expect("net"),
            ],
        }
    }

    #[test]
    fn config_uses_ptp_and_host_local() {
        let c = cni().config();
        assert_eq!(c["type"], "ptp");
        assert_eq!(c["cniVersion"], "1.0.0");
        assert_eq!(c["ipam"]["type"], "host-local");
        assert_eq!(c["ipam"]["ranges"][0][0]["subnet"], "10.244.7.0/24");
        assert_eq!(c["ipam"]["ranges"][0][0]["gateway"], "10.244.7.1");
        assert_eq!(c["ipam"]["dataDir"], "/state/cni/ipam");
        // No default route; only the out-of-CIDR extra route.
        assert_eq!(c["ipam"]["routes"], json!([{ "dst": "172.30.0.5/32" }]));
    }

    #[test]
    fn gateway_and_capacity() {
        let n: Ipv4Net = "10.244.7.0/24".parse().expect("cidr");
        assert_eq!(gateway(&n), Some(Ipv4Addr::new(10, 244, 7, 1)));
        assert_eq!(pod_capacity(&n), 253);
        let small: Ipv4Net = "10.0.0.0/28".parse().expect("cidr");
        assert_eq!(pod_capacity(&small), 13);
        let tiny: Ipv4Net = "10.0.0.0/31".parse().expect("cidr");
        assert_eq!(gateway(&tiny), None);
    }

    #[test]
    fn parses_results() {
        let ok = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"eth0"}],
            "ips":[{"interface":0,"address":"10.244.7.2/24","gateway":"10.244.7.1"}]}"#;
        assert_eq!(parse_add_result(ok), Ok(Ipv4Addr::new(10, 244, 7, 2)));
        assert!(parse_add_result(r#"{"ips":[]}"#).is_err());
        assert!(parse_add_result("garbage").is_err());
        assert_eq!(
            plugin_error(r#"{"code":11,"msg":"failed to allocate","details":"range full"}"#),
            "failed to allocate range full"
        );
    }
}
