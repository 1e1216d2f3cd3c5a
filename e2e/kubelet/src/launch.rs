//! Preparing one container start: the command line and the exec helper's spec.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::env::{expand_all, EnvList};
use crate::exec_helper::{BindMount, ExecSpec};
use crate::identity::Identity;

/// The argv to execute.
///
/// * `command[0]` is an absolute path that exists on the host → `command + args` as written
///   (e.g. `["/bin/sh", "-c", "..."]`);
/// * otherwise the image's mapped binary runs with `command[1..] + args` (the image's
///   entrypoint is replaced by the mapped binary, the rest of the command line is kept).
///
/// `$(VAR)` references are expanded with the container's environment first.
pub fn command_line(
    binary: &Path,
    c: &Container,
    env: &EnvList,
    exists: impl Fn(&Path) -> bool,
) -> Vec<String> {
    let command = expand_all(c.command.as_deref().unwrap_or_default(), env);
    let args = expand_all(c.args.as_deref().unwrap_or_default(), env);
    let bin = binary.display().to_string();
    match command.split_first() {
        Some((first, _)) if first.starts_with('/') && exists(Path::new(first)) => {
            command.into_iter().chain(args).collect()
        }
        Some((_, rest)) => std::iter::once(bin)
            .chain(rest.iter().cloned())
            .chain(args)
            .collect(),
        None => std::iter::once(bin).chain(args).collect(),
    }
}

/// The hostname inside the pod: `spec.hostname`, else the pod name (at most 63 bytes).
pub fn hostname(pod: &Pod) -> String {
    let name = pod
        .spec
        .as_ref()
        .and_then(|s| s.hostname.clone())
        .or_else(|| pod.metadata.name.clone())
        .unwrap_or_else(|| "pod".into());
    name.chars().take(63).collect()
}

/// `/etc/resolv.conf` of a pod whose lookups must go nowhere: the pod's own loopback, where
/// nothing listens, so they fail fast and never reach the host's resolver.
pub const RESOLV_CONF: &str =
    "# cli-mcp-kubelet: no DNS server for pods (no cluster DNS, no outside traffic)\n\
nameserver 127.0.0.1\noptions timeout:1 attempts:1\n";

/// Cluster DNS as the kubelet's `--cluster-dns`/`--cluster-domain` give it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodDns {
    /// The cluster DNS server; `None`: there is none.
    pub server: Option<IpAddr>,
    pub domain: String,
}

/// A resolv.conf option: `name` or `name:value`.
type DnsOption = (String, Option<String>);

/// glibc reads at most this many nameservers.
const MAX_NAMESERVERS: usize = 3;
/// The real kubelet's limit on search domains.
const MAX_SEARCHES: usize = 32;

/// The pod's `/etc/resolv.conf`, as the real kubelet writes it, except that the host's
/// resolver is never used (pods must not send traffic off the host):
/// - `ClusterFirst` (the default) and `ClusterFirstWithHostNet`: the cluster DNS server, the
///   search path `<ns>.svc.<domain> svc.<domain> <domain>`, `ndots:5`; with no cluster DNS,
///   [`RESOLV_CONF`] (the real kubelet would fall back to the node's resolver);
/// - `Default` (the node's resolver): [`RESOLV_CONF`];
/// - `None`: only `dnsConfig`.
///
/// `dnsConfig` is merged in as the real kubelet does: nameservers and searches appended
/// (duplicates dropped), options replacing those of the same name.
pub fn resolv_conf(pod: &Pod, dns: &PodDns) -> String {
    let spec = pod.spec.as_ref();
    let policy = spec
        .and_then(|s| s.dns_policy.as_deref())
        .unwrap_or("ClusterFirst");
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let d = &dns.domain;
    let (mut servers, mut searches, mut options): (Vec<String>, Vec<String>, Vec<DnsOption>) =
        match (policy, dns.server) {
            ("ClusterFirst" | "ClusterFirstWithHostNet", Some(server)) => (
                vec![server.to_string()],
                vec![format!("{ns}.svc.{d}"), format!("svc.{d}"), d.clone()],
                vec![("ndots".into(), Some("5".into()))],
            ),
            ("None", _) => (Vec::new(), Vec::new(), Vec::new()),
            _ => return RESOLV_CONF.to_string(),
        };
    if let Some(cfg) = spec.and_then(|s| s.dns_config.as_ref()) {
        for n in cfg.nameservers.iter().flatten() {
            if !servers.contains(n) {
                servers.push(n.clone());
            }
        }
        for s in cfg.searches.iter().flatten() {
            if !searches.contains(s) {
                searches.push(s.clone());
            }
        }
        for o in cfg.options.iter().flatten() {
            let Some(name) = o.name.clone().filter(|n| !n.is_empty()) else {
                continue;
            };
            options.retain(|(n, _)| *n != name);
            options.push((name, o.value.clone()));
        }
    }
    if servers.is_empty() {
        return RESOLV_CONF.to_string();
    }
    servers.truncate(MAX_NAMESERVERS);
    searches.truncate(MAX_SEARCHES);
    let mut out = String::from("# cli-mcp-kubelet: cluster DNS\n");
    for s in &servers {
        out.push_str(&format!("nameserver {s}\n"));
    }
    if !searches.is_empty() {
        out.push_str(&format!("search {}\n", searches.join(" ")));
    }
    if !options.is_empty() {
        let opts: Vec<String> = options
            .iter()
            .map(|(n, v)| match v {
                Some(v) => format!("{n}:{v}"),
                None => n.clone(),
            })
            .collect();
        out.push_str(&format!("options {}\n", opts.join(" ")));
    }
    out
}

/// `/etc/hosts` inside pods: localhost, the pod's own name and `spec.hostAliases`.
pub fn hosts_file(pod: &Pod, pod_ip: &str) -> String {
    let mut out = String::from(
        "# Kubernetes-managed hosts file (cli-mcp-kubelet).\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    );
    out.push_str(&format!("{pod_ip}\t{}\n", hostname(pod)));
    for alias in pod
        .spec
        .as_ref()
        .and_then(|s| s.host_aliases.as_ref())
        .into_iter()
        .flatten()
    {
        let names = alias.hostnames.clone().unwrap_or_default().join(" ");
        if !names.is_empty() {
            out.push_str(&format!("{}\t{names}\n", alias.ip));
        }
    }
    out
}

/// Writes the pod's `hosts`, `resolv.conf` and `hostname` into `etc_dir` and returns the
/// bind mounts that put them over `/etc/...` in every container.
pub fn write_etc_files(
    etc_dir: &Path,
    pod: &Pod,
    pod_ip: &str,
    dns: &PodDns,
) -> Result<Vec<BindMount>, String> {
    std::fs::create_dir_all(etc_dir).map_err(|e| format!("creating {}: {e}", etc_dir.display()))?;
    let files = [
        ("hosts", hosts_file(pod, pod_ip)),
        ("resolv.conf", resolv_conf(pod, dns)),
        ("hostname", format!("{}\n", hostname(pod))),
    ];
    let mut mounts = Vec::new();
    for (name, content) in files {
        let path = etc_dir.join(name);
        std::fs::write(&path, content).map_err(|e| format!("writing {}: {e}", path.display()))?;
        mounts.push(BindMount {
            source: path,
            target: Path::new("/etc").join(name),
            read_only: false,
        });
    }
    Ok(mounts)
}

pub fn exec_spec(
    pod: &Pod,
    c: &Container,
    netns: PathBuf,
    argv: Vec<String>,
    env: &EnvList,
    id: &Identity,
    mounts: Vec<BindMount>,
) -> ExecSpec {
    ExecSpec {
        netns: Some(netns),
        hostname: Some(hostname(pod)),
        mounts,
        uid: id.uid,
        gid: id.gid,
        groups: id.groups.clone(),
        working_dir: c
            .working_dir
            .clone()
            .filter(|d| !d.is_empty())
            .map(PathBuf::from),
        argv,
        env: env.0.clone(),
        no_new_privs: id.no_new_privs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(command: Option<&[&str]>, args: Option<&[&str]>) -> Container {
        let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Container {
            name: "c".into(),
            command: command.map(v),
            args: args.map(v),
            ..Default::default()
        }
    }

    fn env() -> EnvList {
        EnvList(vec![("PORT".into(), "8080".into())])
    }

    #[test]
    fn mapped_binary_gets_args() {
        let c = container(None, Some(&["--port", "$(PORT)"]));
        let argv = command_line(Path::new("/opt/agent"), &c, &env(), |_| true);
        assert_eq!(argv, vec!["/opt/agent", "--port", "8080"]);
    }

    #[test]
    fn existing_absolute_command_replaces_binary() {
        let c = container(Some(&["/bin/sh", "-c"]), Some(&["echo $(PORT)"]));
        let argv = command_line(Path::new("/opt/agent"), &c, &env(), |p| {
            p == Path::new("/bin/sh")
        });
        assert_eq!(argv, vec!["/bin/sh", "-c", "echo 8080"]);
    }

    #[test]
    fn other_command_keeps_the_mapped_binary() {
        let c = container(Some(&["/app/agent", "serve"]), Some(&["-v"]));
        let argv = command_line(Path::new("/opt/agent"), &c, &env(), |_| false);
        assert_eq!(argv, vec!["/opt/agent", "serve", "-v"]);
        let c = container(Some(&["agent"]), None);
        let argv = command_line(Path::new("/opt/agent"), &c, &env(), |_| true);
        assert_eq!(argv, vec!["/opt/agent"]);
    }

    #[test]
    fn hosts_file_names_the_pod_and_aliases() {
        let pod = Pod {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("web-0".into()),
                ..Default::default()
            },
            spec: Some(k8s_openapi::api::core::v1::PodSpec {
                host_aliases: Some(vec![k8s_openapi::api::core::v1::HostAlias {
                    ip: "10.244.0.9".into(),
                    hostnames: Some(vec!["db".into(), "db.local".into()]),
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let h = hosts_file(&pod, "10.244.0.5");
        assert!(h.contains("127.0.0.1\tlocalhost\n"));
        assert!(h.contains("10.244.0.5\tweb-0\n"));
        assert!(h.contains("10.244.0.9\tdb db.local\n"));
        let tmp = tempfile::tempdir().expect("tempdir");
        let mounts = write_etc_files(tmp.path(), &pod, "10.244.0.5", &no_dns()).expect("written");
        let targets: Vec<_> = mounts
            .iter()
            .map(|m| m.target.display().to_string())
            .collect();
        assert_eq!(
            targets,
            vec!["/etc/hosts", "/etc/resolv.conf", "/etc/hostname"]
        );
        assert!(RESOLV_CONF.contains("nameserver 127.0.0.1"));
        let written = std::fs::read_to_string(tmp.path().join("resolv.conf")).expect("read");
        assert_eq!(written, RESOLV_CONF, "no cluster DNS: the loopback");
    }

    fn no_dns() -> PodDns {
        PodDns {
            server: None,
            domain: "cluster.local".into(),
        }
    }

    fn cluster_dns() -> PodDns {
        PodDns {
            server: Some("10.244.3.1".parse().expect("ip")),
            domain: "cluster.local".into(),
        }
    }

    fn dns_pod(policy: Option<&str>, config: Option<serde_json::Value>) -> Pod {
        let mut spec = serde_json::json!({"containers": []});
        if let Some(p) = policy {
            spec["dnsPolicy"] = p.into();
        }
        if let Some(c) = config {
            spec["dnsConfig"] = c;
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "team-a"},
            "spec": spec,
        }))
        .expect("pod")
    }

    #[test]
    fn cluster_first_pods_get_the_cluster_dns_server_and_search_path() {
        let want = "# cli-mcp-kubelet: cluster DNS\n\
nameserver 10.244.3.1\n\
search team-a.svc.cluster.local svc.cluster.local cluster.local\n\
options ndots:5\n";
        for policy in [None, Some("ClusterFirst"), Some("ClusterFirstWithHostNet")] {
            assert_eq!(
                resolv_conf(&dns_pod(policy, None), &cluster_dns()),
                want,
                "{policy:?}"
            );
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        write_etc_files(
            tmp.path(),
            &dns_pod(None, None),
            "10.244.3.7",
            &cluster_dns(),
        )
        .expect("written");
        let written = std::fs::read_to_string(tmp.path().join("resolv.conf")).expect("read");
        assert_eq!(written, want);
    }

    #[test]
    fn the_hosts_resolver_is_never_used() {
        // Default means "the node's resolver": pods of this kubelet must not reach it.
        assert_eq!(
            resolv_conf(&dns_pod(Some("Default"), None), &cluster_dns()),
            RESOLV_CONF
        );
        // No cluster DNS: the real kubelet would fall back to the node's resolver.
        assert_eq!(resolv_conf(&dns_pod(None, None), &no_dns()), RESOLV_CONF);
        assert_eq!(
            resolv_conf(&dns_pod(Some("Bogus"), None), &cluster_dns()),
            RESOLV_CONF
        );
    }

    #[test]
    fn dns_config_is_merged_and_none_uses_it_alone() {
        let cfg = serde_json::json!({
            "nameservers": ["10.244.3.1", "10.244.3.9"],
            "searches": ["extra.example", "svc.cluster.local"],
            "options": [{"name": "ndots", "value": "2"}, {"name": "edns0"}],
        });
        let merged = resolv_conf(&dns_pod(None, Some(cfg.clone())), &cluster_dns());
        assert!(
            merged.contains("nameserver 10.244.3.1\nnameserver 10.244.3.9\n"),
            "{merged}"
        );
        assert_eq!(
            merged.matches("nameserver 10.244.3.1").count(),
            1,
            "{merged}"
        );
        assert!(
            merged.contains(
                "search team-a.svc.cluster.local svc.cluster.local cluster.local extra.example\n"
            ),
            "{merged}"
        );
        assert!(merged.contains("options ndots:2 edns0\n"), "{merged}");
        let none = resolv_conf(&dns_pod(Some("None"), Some(cfg)), &no_dns());
        assert!(
            none.contains("nameserver 10.244.3.1\nnameserver 10.244.3.9\n"),
            "{none}"
        );
        assert!(
            none.contains("search extra.example svc.cluster.local\n"),
            "{none}"
        );
        assert!(!none.contains("team-a.svc"), "{none}");
        let many =
            serde_json::json!({"nameservers": ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]});
        let capped = resolv_conf(&dns_pod(Some("None"), Some(many)), &no_dns());
        assert_eq!(capped.matches("nameserver").count(), 3, "{capped}");
        let empty = resolv_conf(&dns_pod(Some("None"), None), &cluster_dns());
        assert_eq!(empty, RESOLV_CONF, "no nameserver at all: the loopback");
    }

    #[test]
    fn hostname_is_truncated() {
        let pod = Pod {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("x".repeat(80)),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(hostname(&pod).len(), 63);
    }
}
