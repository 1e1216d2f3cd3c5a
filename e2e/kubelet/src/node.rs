//! Node registration, status heartbeats and the node Lease in `kube-node-lease`.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use ipnet::Ipv4Net;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

pub const LEASE_NAMESPACE: &str = "kube-node-lease";
pub const LEASE_DURATION_SECONDS: i32 = 40;
pub const KUBELET_VERSION: &str = "v1.37.0-cli-mcp";

/// What this kubelet reports about its node.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub name: String,
    pub internal_ip: Ipv4Addr,
    pub cidr: Ipv4Net,
    pub cpu_cores: u32,
    pub memory_bytes: u64,
    pub max_pods: u32,
    /// Port of the `kubectl logs` endpoint on `internal_ip`; 0 when not served.
    pub kubelet_port: u16,
}

impl NodeInfo {
    /// Reads cpu and memory from this machine.
    pub fn detect(name: &str, internal_ip: Ipv4Addr, cidr: Ipv4Net, max_pods: u32) -> NodeInfo {
        let cpu_cores = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| parse_meminfo_total(&m))
            .unwrap_or(1 << 30);
        NodeInfo {
            name: name.to_string(),
            internal_ip,
            cidr,
            cpu_cores,
            memory_bytes,
            max_pods,
            kubelet_port: 0,
        }
    }

    fn resources(&self) -> Value {
        json!({
            "cpu": self.cpu_cores.to_string(),
            "memory": format!("{}Ki", self.memory_bytes / 1024),
            "pods": self.max_pods.to_string(),
            "ephemeral-storage": "10Gi",
        })
    }
}

pub fn parse_meminfo_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The Node object to create.
pub fn node_object(info: &NodeInfo) -> Node {
    let labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_string(), info.name.clone()),
        ("kubernetes.io/os".to_string(), "linux".to_string()),
        (
            "kubernetes.io/arch".to_string(),
            std::env::consts::ARCH
                .replace("x86_64", "amd64")
                .replace("aarch64", "arm64"),
        ),
    ]);
    Node {
        metadata: ObjectMeta {
            name: Some(info.name.clone()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: Some(info.cidr.to_string()),
            pod_cidrs: Some(vec![info.cidr.to_string()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn os_image() -> String {
    std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_string())
        })
        .unwrap_or_else(|| "Linux".into())
}

/// The status patch (strategic merge: conditions merge by type).
pub fn status_patch(info: &NodeInfo, ready: bool, now: Timestamp, since: Timestamp) -> Value {
    let t = Value::String(now.to_string());
    let cond = |type_: &str, status: &str, reason: &str, message: &str, since: Timestamp| {
        json!({
            "type": type_, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": t, "lastTransitionTime": since.to_string(),
        })
    };
    let (ready_status, ready_reason, ready_msg) = if ready {
        (
            "True",
            "KubeletReady",
            "cli-mcp-kubelet is posting ready status",
        )
    } else {
        ("False", "KubeletNotReady", "cli-mcp-kubelet stopped")
    };
    json!({
        "status": {
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available", since),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure", since),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available", since),
                cond("Ready", ready_status, ready_reason, ready_msg, since),
            ],
            // No `Hostname` address: the apiserver prefers it for kubelet connections and would
            // resolve the node name through the host's DNS server (traffic off the host).
            "addresses": [
                { "type": "InternalIP", "address": info.internal_ip.to_string() },
            ],
            "daemonEndpoints": { "kubeletEndpoint": { "Port": info.kubelet_port } },
            "capacity": info.resources(),
            "allocatable": info.resources(),
            "nodeInfo": {
                "machineID": read_trimmed("/etc/machine-id"),
                "systemUUID": read_trimmed("/sys/class/dmi/id/product_uuid"),
                "bootID": read_trimmed("/proc/sys/kernel/random/boot_id"),
                "kernelVersion": read_trimmed("/proc/sys/kernel/osrelease"),
                "osImage": os_image(),
                "containerRuntimeVersion": "cli-mcp://0.1.0",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": std::env::consts::ARCH.replace("x86_64", "amd64").replace("aarch64", "arm64"),
            },
        }
    })
}

/// Creates the Node (or adopts an existing one) and posts a Ready status.
pub async fn register(client: &Client, info: &NodeInfo, since: Timestamp) -> Result<(), String> {
    let api: Api<Node> = Api::all(client.clone());
    match api.create(&PostParams::default(), &node_object(info)).await {
        Ok(_) => tracing::info!(node = %info.name, "registered node"),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let existing = api
                .get(&info.name)
                .await
                .map_err(|e| format!("reading existing node {}: {e}", info.name))?;
            let cidr = existing.spec.as_ref().and_then(|s| s.pod_cidr.clone());
            if cidr.as_deref().is_some_and(|c| c != info.cidr.to_string()) {
                tracing::warn!(
                    node = %info.name,
                    "node already exists with podCIDR {cidr:?}, not {}; delete the Node or start with the same --pod-cidr",
                    info.cidr
                );
            }
            let patch = json!({
                "metadata": { "labels": node_object(info).metadata.labels },
                "spec": if cidr.is_none() {
                    json!({ "podCIDR": info.cidr.to_string(), "podCIDRs": [info.cidr.to_string()] })
                } else {
                    json!({})
                },
            });
            api.patch(&info.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| format!("updating existing node {}: {e}", info.name))?;
            tracing::info!(node = %info.name, "adopted existing node");
        }
        Err(e) => return Err(format!("creating node {}: {e}", info.name)),
    }
    post_status(client, info, true, since).await
}

/// Posts the node status (heartbeat).
pub async fn post_status(
    client: &Client,
    info: &NodeInfo,
    ready: bool,
    since: Timestamp,
) -> Result<(), String> {
    let api: Api<Node> = Api::all(client.clone());
    let patch = status_patch(info, ready, Timestamp::now(), since);
    api.patch_status(
        &info.name,
        &PatchParams::default(),
        &Patch::Strategic(&patch),
    )
    .await
    .map(|_| ())
    .map_err(|e| format!("updating status of node {}: {e}", info.name))
}

/// Renews (or creates) the node Lease.
pub async fn renew_lease(client: &Client, info: &NodeInfo) -> Result<(), String> {
    let api: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    let now = MicroTime(Timestamp::now());
    let patch = json!({ "spec": {
        "holderIdentity": info.name,
        "leaseDurationSeconds": LEASE_DURATION_SECONDS,
        "renewTime": now,
    }});
    match api
        .patch(&info.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => {
            let nodes: Api<Node> = Api::all(client.clone());
            let owner = nodes
                .get_opt(&info.name)
                .await
                .ok()
                .flatten()
                .and_then(|n| {
                    Some(OwnerReference {
                        api_version: "v1".into(),
                        kind: "Node".into(),
                        name: info.name.clone(),
                        uid: n.metadata.uid?,
                        ..Default::default()
                    })
                });
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(info.name.clone()),
                    namespace: Some(LEASE_NAMESPACE.into()),
                    owner_references: owner.map(|o| vec![o]),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(info.name.clone()),
                    lease_duration_seconds: Some(LEASE_DURATION_SECONDS),
                    renew_time: Some(now),
                    ..Default::default()
                }),
            };
            api.create(&PostParams::default(), &lease)
                .await
                .map(|_| ())
                .map_err(|e| format!("creating lease {LEASE_NAMESPACE}/{}: {e}", info.name))
        }
        Err(e) => Err(format!(
            "renewing lease {LEASE_NAMESPACE}/{}: {e}",
            info.name
        )),
    }
}

/// Renews the lease every `lease_every` and posts status every `status_every` until cancelled;
/// re-registers the node if it was deleted.
pub async fn heartbeat(
    client: Client,
    info: NodeInfo,
    since: Timestamp,
    lease_every: Duration,
    status_every: Duration,
    cancel: CancellationToken,
) {
    let mut lease_tick = tokio::time::interval(lease_every);
    let mut status_tick = tokio::time::interval(status_every);
    status_tick.tick().await; // registration just posted status
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = lease_tick.tick() => {
                if let Err(e) = renew_lease(&client, &info).await {
                    tracing::warn!("{e}");
                }
            }
            _ = status_tick.tick() => {
                if let Err(e) = post_status(&client, &info, true, since).await {
                    tracing::warn!("{e}; re-registering");
                    if let Err(e) = register(&client, &info, since).await {
                        tracing::warn!("{e}");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> NodeInfo {
        NodeInfo {
            name: "proc-1".into(),
            internal_ip: Ipv4Addr::new(10, 244, 1, 1),
            cidr: "10.244.1.0/24".parse().expect("cidr"),
            cpu_cores: 2,
            memory_bytes: 24 * 1024 * 1024 * 1024,
            max_pods: 110,
            kubelet_port: 10250,
        }
    }

    #[test]
    fn node_object_has_cidr_and_labels() {
        let n = node_object(&info());
        assert_eq!(n.metadata.name.as_deref(), Some("proc-1"));
        let spec = n.spec.unwrap_or_default();
        assert_eq!(spec.pod_cidr.as_deref(), Some("10.244.1.0/24"));
        let labels = n.metadata.labels.unwrap_or_default();
        assert_eq!(
            labels.get("kubernetes.io/hostname").map(String::as_str),
            Some("proc-1")
        );
    }

    #[test]
    fn status_reports_ready_capacity_and_address() {
        let now = Timestamp::from_second(1_700_000_100).expect("ts");
        let since = Timestamp::from_second(1_700_000_000).expect("ts");
        let p = status_patch(&info(), true, now, since);
        let s = &p["status"];
        assert_eq!(s["capacity"]["cpu"], "2");
        assert_eq!(s["daemonEndpoints"]["kubeletEndpoint"]["Port"], 10250);
        assert_eq!(s["capacity"]["pods"], "110");
        assert_eq!(
            s["allocatable"]["memory"],
            format!("{}Ki", 24 * 1024 * 1024)
        );
        assert_eq!(s["addresses"][0]["type"], "InternalIP");
        assert_eq!(s["addresses"][0]["address"], "10.244.1.1");
        assert_eq!(s["addresses"].as_array().map(Vec::len), Some(1));
        let ready = s["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
            .cloned()
            .unwrap_or_default();
        assert_eq!(ready["status"], "True");
        assert_eq!(ready["lastHeartbeatTime"], now.to_string());
        let parsed: Result<k8s_openapi::api::core::v1::NodeStatus, _> =
            serde_json::from_value(s.clone());
        assert!(parsed.is_ok(), "{parsed:?}");
    }

    #[test]
    fn meminfo() {
        let m = "MemTotal:       24600000 kB\nMemFree: 1 kB\n";
        assert_eq!(parse_meminfo_total(m), Some(24_600_000 * 1024));
        assert_eq!(parse_meminfo_total("nothing"), None);
    }
}
