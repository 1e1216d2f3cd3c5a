//! Cluster DNS of the real node: CoreDNS as the `coredns` Deployment in `kube-system`,
//! labelled `k8s-app: kube-dns` as on real clusters, from a one-layer image of the built
//! binary, behind the `kube-dns` Service at the kubelet's `clusterDNS`.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use super::{locate_addons_async, CLUSTER_DOMAIN, DNS_SERVICE_IP};
use crate::cluster_info::ClusterInfo;
use crate::error::{Error, Result};

/// The CoreDNS image the real node runs: the built `coredns` binary alone, one layer.
pub const DNS_POD_IMAGE: &str = "localhost/cli-mcp-coredns:1";
/// Name of the Deployment, its ServiceAccount and ConfigMap in `kube-system`.
pub const DNS_POD_NAME: &str = "coredns";
/// The label real clusters put on their DNS pods, which NetworkPolicies (the operator's
/// sandbox egress rule among them) select.
pub const DNS_POD_LABEL: (&str, &str) = ("k8s-app", "kube-dns");
/// Inside the pod: `health` and `ready` ports (probed by the kubelet from the node).
pub const DNS_POD_HEALTH_PORT: u16 = 8080;
pub const DNS_POD_READY_PORT: u16 = 8181;
/// The unprivileged user CoreDNS runs as (the number upstream's image uses).
pub const DNS_POD_UID: i64 = 65532;

/// The Corefile of the DNS pod: the same single server block as the host's (cluster names
/// and reverse zones from the API, nothing forwarded), listening on every address of the
/// pod's own network namespace, with the in-cluster API credentials of its ServiceAccount.
pub fn pod_corefile(domain: &str) -> String {
    format!(
        r#"{domain}:53 in-addr.arpa:53 ip6.arpa:53 {{
    errors
    health :{DNS_POD_HEALTH_PORT}
    ready :{DNS_POD_READY_PORT}
    kubernetes {domain} in-addr.arpa ip6.arpa {{
        pods disabled
        ttl 5
    }}
    cache 5
}}
"#
    )
}

/// Everything the DNS pod needs in `kube-system`, in the order it is applied.
#[derive(Debug, Clone)]
pub struct DnsPodObjects {
    pub service_account: ServiceAccount,
    pub cluster_role: ClusterRole,
    pub cluster_role_binding: ClusterRoleBinding,
    pub config_map: ConfigMap,
    pub deployment: Deployment,
    pub service: Service,
}

/// The DNS pod's objects. The pod meets the `restricted` Pod Security Standard (non-root,
/// no privilege escalation, no capability, RuntimeDefault seccomp) with a read-only root
/// filesystem; binding port 53 without `NET_BIND_SERVICE` is allowed by the namespaced
/// sysctl `net.ipv4.ip_unprivileged_port_start`, which both the kubelet and Pod Security
/// count as safe. `dnsPolicy: None` with the pod's own loopback as resolver: CoreDNS never
/// sees the node's resolv.conf, so nothing of the host's resolver configuration is used.
pub fn dns_pod_objects(domain: &str) -> Result<DnsPodObjects> {
    let (lk, lv) = DNS_POD_LABEL;
    fn parse<T: serde::de::DeserializeOwned>(what: &str, v: serde_json::Value) -> Result<T> {
        serde_json::from_value(v)
            .map_err(|e| Error::Other(format!("the DNS pod's {what} does not parse: {e}")))
    }
    let labels = serde_json::json!({lk: lv, "kubernetes.io/name": "CoreDNS"});
    Ok(DnsPodObjects {
        service_account: parse("ServiceAccount", service_account_json(&labels))?,
        cluster_role: parse("ClusterRole", cluster_role_json(&labels))?,
        cluster_role_binding: parse("ClusterRoleBinding", cluster_role_binding_json(&labels))?,
        config_map: parse("ConfigMap", config_map_json(&labels, domain))?,
        deployment: parse("Deployment", deployment_json(&labels))?,
        service: parse("Service", service_json(&labels))?,
    })
}

/// The namespace of the DNS pod and its objects.
const NAMESPACE: &str = "kube-system";

/// The ServiceAccount CoreDNS reads the API as.
fn service_account_json(labels: &serde_json::Value) -> serde_json::Value {
    let (ns, name) = (NAMESPACE, DNS_POD_NAME);
    serde_json::json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
    })
}

/// What CoreDNS may read: Services, namespaces and EndpointSlices (no pods: `pods disabled`).
fn cluster_role_json(labels: &serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "system:coredns", "labels": labels},
        "rules": [
            {"apiGroups": [""], "resources": ["services", "namespaces"],
             "verbs": ["list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "verbs": ["list", "watch"]},
        ],
    })
}

/// Binds [`cluster_role_json`] to the DNS pod's ServiceAccount.
fn cluster_role_binding_json(labels: &serde_json::Value) -> serde_json::Value {
    let (ns, name) = (NAMESPACE, DNS_POD_NAME);
    serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "system:coredns", "labels": labels},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "system:coredns"},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
    })
}

/// The Corefile ([`pod_corefile`]).
fn config_map_json(labels: &serde_json::Value, domain: &str) -> serde_json::Value {
    let (ns, name) = (NAMESPACE, DNS_POD_NAME);
    serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "data": {"Corefile": pod_corefile(domain)},
    })
}

/// One CoreDNS replica under the `restricted` Pod Security Standard (see [`dns_pod_objects`]), probed on its `health` and `ready` ports.
fn deployment_json(labels: &serde_json::Value) -> serde_json::Value {
    let (lk, lv) = DNS_POD_LABEL;
    let (ns, name) = (NAMESPACE, DNS_POD_NAME);
    serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {lk: lv}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": name,
                    "priorityClassName": "system-cluster-critical",
                    "dnsPolicy": "None",
                    "dnsConfig": {"nameservers": ["127.0.0.1"]},
                    "enableServiceLinks": false,
                    "terminationGracePeriodSeconds": 5,
                    "securityContext": {
                        "runAsNonRoot": true,
                        "runAsUser": DNS_POD_UID,
                        "runAsGroup": DNS_POD_UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                        "sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start",
                                     "value": "53"}],
                    },
                    "containers": [{
                        "name": "coredns",
                        "image": DNS_POD_IMAGE,
                        "imagePullPolicy": "Never",
                        "args": ["-conf", "/etc/coredns/Corefile"],
                        "ports": [
                            {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                            {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                        ],
                        "resources": {
                            "requests": {"cpu": "10m", "memory": "32Mi"},
                            "limits": {"memory": "128Mi"},
                        },
                        "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns",
                                          "readOnly": true}],
                        "livenessProbe": {
                            "httpGet": {"path": "/health", "port": DNS_POD_HEALTH_PORT},
                            "periodSeconds": 10, "failureThreshold": 5,
                        },
                        "readinessProbe": {
                            "httpGet": {"path": "/ready", "port": DNS_POD_READY_PORT},
                            "periodSeconds": 1,
                        },
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true,
                            "runAsNonRoot": true,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }],
                    "volumes": [{"name": "config", "configMap": {"name": name}}],
                },
            },
        },
    })
}

/// The `kube-dns` Service at [`DNS_SERVICE_IP`], selecting the DNS pods.
fn service_json(labels: &serde_json::Value) -> serde_json::Value {
    let (lk, lv) = DNS_POD_LABEL;
    let ns = NAMESPACE;
    serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": ns, "labels": labels},
        "spec": {
            "clusterIP": DNS_SERVICE_IP.to_string(),
            "selector": {lk: lv},
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": "dns-tcp"},
            ],
        },
    })
}

/// Labels `kube-system` with the `restricted` Pod Security level, enforced: a DNS pod that
/// breaks it is refused at admission rather than run.
pub const KUBE_SYSTEM_POD_SECURITY: &[(&str, &str)] = &[
    ("pod-security.kubernetes.io/enforce", "restricted"),
    ("pod-security.kubernetes.io/enforce-version", "latest"),
];

/// Build [`DNS_POD_IMAGE`] from the `coredns` binary: a one-layer image holding `/coredns`
/// and nothing else (the binary is static).
pub fn build_dns_image(coredns: &Path, dir: &Path) -> Result<PathBuf> {
    let root = dir.join("rootfs");
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(root.join("etc/coredns")).map_err(|e| Error::io("creating", &root, e))?;
    let target = root.join("coredns");
    fs::copy(coredns, &target).map_err(|e| Error::io("copying", coredns, e))?;
    let archive = dir.join("coredns.tar");
    crate::node::build_image_archive(
        &root,
        DNS_POD_IMAGE,
        &["/coredns"],
        &dir.join("work"),
        &archive,
    )?;
    let _ = fs::remove_dir_all(&root);
    Ok(archive)
}

const FIELD_MANAGER: &str = "cli-mcp-e2e";

async fn apply<K>(api: Api<K>, obj: &K) -> Result<()>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await?;
    Ok(())
}

/// Run cluster DNS as the `coredns` Deployment in `kube-system` of a real-node cluster: build
/// and import its image into the node's containerd, enforce `restricted` Pod Security on
/// `kube-system`, apply the ServiceAccount, RBAC, Corefile, Deployment and the `kube-dns`
/// Service (ClusterIP [`DNS_SERVICE_IP`], the kubelet's `clusterDNS`), then wait until the
/// Service's EndpointSlice lists a ready CoreDNS pod (its Kubernetes caches synced) or
/// `timeout` passes. The `coredns` binary comes from [`locate_addons_async`].
pub async fn deploy_dns_pod(info: &ClusterInfo, timeout: Duration) -> Result<()> {
    let socket = info.containerd_socket.clone().ok_or_else(|| {
        Error::Prerequisite(
            "cluster DNS as a pod needs the real node (its containerd); the process kubelet \
             runs CoreDNS on the host (addons::ClusterDns)"
                .into(),
        )
    })?;
    let bin_dir = locate_addons_async(None).await?;
    let coredns = bin_dir.join("coredns");
    if !coredns.is_file() {
        return Err(Error::Prerequisite(format!(
            "{} does not exist; build it with hack/build-addons.sh",
            coredns.display()
        )));
    }
    let dir = info.run_dir.join("node/images/coredns");
    tokio::task::spawn_blocking(move || {
        let archive = build_dns_image(&coredns, &dir)?;
        crate::node::import_image(&socket, &archive)?;
        let _ = fs::remove_file(&archive);
        Ok::<_, Error>(())
    })
    .await
    .map_err(|e| Error::Other(format!("building the DNS image panicked: {e}")))??;

    let client = info.client().await?;
    let labels: std::collections::BTreeMap<String, String> = KUBE_SYSTEM_POD_SECURITY
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Api::<Namespace>::all(client.clone())
        .patch(
            "kube-system",
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(serde_json::json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "kube-system", "labels": labels},
            })),
        )
        .await?;
    let o = dns_pod_objects(CLUSTER_DOMAIN)?;
    apply(
        Api::<ServiceAccount>::namespaced(client.clone(), "kube-system"),
        &o.service_account,
    )
    .await?;
    apply(Api::<ClusterRole>::all(client.clone()), &o.cluster_role).await?;
    apply(
        Api::<ClusterRoleBinding>::all(client.clone()),
        &o.cluster_role_binding,
    )
    .await?;
    apply(
        Api::<ConfigMap>::namespaced(client.clone(), "kube-system"),
        &o.config_map,
    )
    .await?;
    apply(
        Api::<Deployment>::namespaced(client.clone(), "kube-system"),
        &o.deployment,
    )
    .await?;
    apply(
        Api::<Service>::namespaced(client.clone(), "kube-system"),
        &o.service,
    )
    .await?;

    let slices = Api::<EndpointSlice>::namespaced(client.clone(), "kube-system");
    let ready = crate::wait::wait_for_set(
        slices,
        "kubernetes.io/service-name=kube-dns",
        "a ready CoreDNS pod behind the kube-dns Service",
        timeout,
        |s: &[EndpointSlice]| {
            s.iter().any(|s| {
                s.endpoints
                    .iter()
                    .flatten()
                    .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
            })
        },
    )
    .await;
    if let Err(e) = ready {
        return Err(Error::Other(format!(
            "{e}; CoreDNS pod: {}",
            dns_pod_state(&client).await
        )));
    }
    Ok(())
}

/// What the DNS pods and their ReplicaSet say, for an error message (why it is not ready:
/// refused at admission, image missing, crashing).
async fn dns_pod_state(client: &Client) -> String {
    let (lk, lv) = DNS_POD_LABEL;
    let lp = kube::api::ListParams::default().labels(&format!("{lk}={lv}"));
    let mut out = Vec::new();
    if let Ok(pods) = Api::<Pod>::namespaced(client.clone(), "kube-system")
        .list(&lp)
        .await
    {
        for p in pods.items {
            out.push(format!(
                "pod {}: {}",
                p.metadata.name.unwrap_or_default(),
                serde_json::to_string(&p.status).unwrap_or_default()
            ));
        }
    }
    if let Ok(rs) = Api::<ReplicaSet>::namespaced(client.clone(), "kube-system")
        .list(&lp)
        .await
    {
        for r in rs.items {
            let conds = r.status.and_then(|s| s.conditions).unwrap_or_default();
            for c in conds {
                out.push(format!(
                    "replicaset {}: {} {}",
                    r.metadata.name.clone().unwrap_or_default(),
                    c.reason.unwrap_or_default(),
                    c.message.unwrap_or_default()
                ));
            }
        }
    }
    if out.is_empty() {
        "no pod and no ReplicaSet condition".into()
    } else {
        out.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn the_dns_pod_corefile_answers_cluster_names_only() {
        let c = pod_corefile(CLUSTER_DOMAIN);
        assert!(
            c.starts_with("cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {"),
            "{c}"
        );
        assert!(c.contains("health :8080\n") && c.contains("ready :8181\n"));
        assert!(c.contains("pods disabled\n"));
        // In-cluster credentials (the pod's ServiceAccount), no kubeconfig, no bind.
        for absent in [
            "kubeconfig",
            "bind",
            "forward",
            "proxy",
            "fallthrough",
            ".:53",
        ] {
            assert!(!c.contains(absent), "{absent:?} in {c}");
        }
    }

    #[test]
    fn the_dns_pod_is_restricted_labelled_kube_dns_and_behind_the_cluster_dns_ip() {
        let o = dns_pod_objects(CLUSTER_DOMAIN).expect("objects");
        let d = o.deployment.spec.clone();
        let tpl = d.template;
        let labels = tpl.metadata.and_then(|m| m.labels).expect("pod labels");
        assert_eq!(labels["k8s-app"], "kube-dns");
        let spec = tpl.spec.expect("pod spec");
        assert_eq!(spec.service_account_name.as_deref(), Some("coredns"));
        assert_eq!(spec.dns_policy.as_deref(), Some("None"));
        assert_eq!(
            spec.dns_config.and_then(|c| c.nameservers),
            Some(vec!["127.0.0.1".to_string()])
        );
        let psc = spec.security_context.expect("pod securityContext");
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(psc.run_as_user, Some(DNS_POD_UID));
        assert_eq!(
            psc.seccomp_profile.map(|p| p.type_).as_deref(),
            Some("RuntimeDefault")
        );
        let sysctls = psc.sysctls.expect("sysctls");
        assert_eq!(sysctls[0].name, "net.ipv4.ip_unprivileged_port_start");
        assert_eq!(sysctls[0].value, "53");
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some(DNS_POD_IMAGE));
        assert_eq!(c.image_pull_policy.as_deref(), Some("Never"));
        let sc = c
            .security_context
            .clone()
            .expect("container securityContext");
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        let caps = sc.capabilities.expect("capabilities");
        assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
        assert_eq!(caps.add, None, "no capability is added back");
        let cm = o.config_map.data.expect("Corefile");
        assert_eq!(cm["Corefile"], pod_corefile(CLUSTER_DOMAIN));

        let svc = o.service.spec.expect("service spec");
        assert_eq!(svc.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(
            svc.cluster_ip.as_deref(),
            Some(crate::node::CLUSTER_DNS.to_string().as_str()),
            "the address the real kubelet writes into pods' resolv.conf"
        );
        assert_eq!(
            svc.selector.expect("selector")["k8s-app"],
            "kube-dns",
            "the Service selects the pod"
        );
        let rules = o.cluster_role.rules.expect("rules");
        let granted: Vec<(String, String)> = rules
            .iter()
            .flat_map(|r| {
                r.resources
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .flat_map(move |res| r.verbs.clone().into_iter().map(move |v| (res.clone(), v)))
            })
            .collect();
        for want in ["services", "endpointslices", "namespaces"] {
            for verb in ["list", "watch"] {
                assert!(
                    granted.contains(&(want.to_string(), verb.to_string())),
                    "{want} {verb}: {granted:?}"
                );
            }
        }
        assert!(
            granted.iter().all(|(_, v)| v == "list" || v == "watch"),
            "read-only: {granted:?}"
        );
        let subject = &o.cluster_role_binding.subjects.expect("subjects")[0];
        assert_eq!(
            (subject.name.as_str(), subject.namespace.as_deref()),
            ("coredns", Some("kube-system"))
        );
    }

    #[test]
    fn the_dns_image_holds_only_the_binary() {
        let dir = std::env::temp_dir().join(format!("cli-mcp-dns-image-{}", std::process::id()));
        let bin = dir.join("coredns-bin");
        fs::create_dir_all(&dir).expect("dir");
        fs::write(&bin, b"#!/bin/true\n").expect("binary");
        let archive = build_dns_image(&bin, &dir.join("build")).expect("image");
        let out = Command::new("tar")
            .arg("-xOf")
            .arg(&archive)
            .arg("manifest.json")
            .output()
            .expect("tar");
        let m: serde_json::Value = serde_json::from_slice(&out.stdout).expect("manifest");
        assert_eq!(m[0]["RepoTags"][0], DNS_POD_IMAGE);
        let layer = m[0]["Layers"][0].as_str().expect("layer").to_string();
        let listing = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "tar -xOf '{}' '{layer}' | tar -t",
                archive.display()
            ))
            .output()
            .expect("tar");
        let files: Vec<String> = String::from_utf8_lossy(&listing.stdout)
            .lines()
            .map(|l| l.trim_start_matches("./").trim_end_matches('/').to_string())
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(files, ["coredns", "etc", "etc/coredns"], "{files:?}");
        let _ = fs::remove_dir_all(&dir);
    }
}
