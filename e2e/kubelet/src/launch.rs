//! Preparing one container start: the command line and the exec helper's spec.

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

/// `/etc/resolv.conf` inside pods: there is no cluster DNS and pods must not send traffic
/// off the host, so lookups fail fast on the pod's own loopback.
pub const RESOLV_CONF: &str =
    "# cli-mcp-kubelet: no DNS server for pods (no cluster DNS, no outside traffic)\n\
nameserver 127.0.0.1\noptions timeout:1 attempts:1\n";

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
pub fn write_etc_files(etc_dir: &Path, pod: &Pod, pod_ip: &str) -> Result<Vec<BindMount>, String> {
    std::fs::create_dir_all(etc_dir).map_err(|e| format!("creating {}: {e}", etc_dir.display()))?;
    let files = [
        ("hosts", hosts_file(pod, pod_ip)),
        ("resolv.conf", RESOLV_CONF.to_string()),
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
        let mounts = write_etc_files(tmp.path(), &pod, "10.244.0.5").expect("written");
        let targets: Vec<_> = mounts
            .iter()
            .map(|m| m.target.display().to_string())
            .collect();
        assert_eq!(
            targets,
            vec!["/etc/hosts", "/etc/resolv.conf", "/etc/hostname"]
        );
        assert!(RESOLV_CONF.contains("nameserver 127.0.0.1"));
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
