//! What an idle sandbox pod holds in memory on the real node: its pod cgroup's charge (what
//! the kernel counts against the pod's memory limit), and the processes its runtime runs for
//! it on the host: under gVisor runsc's (the Sentry, one gofer per container, the systrap
//! stubs), under both the pod's containerd shim. The kubelet makes the pod cgroup
//! `<cgroupRoot>/kubepods/<qos>/pod<uid>` (cgroupfs driver; the real node's `cgroupRoot` is
//! `/cli-mcp-node-N`), so it is found by its name under the memory hierarchy.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use cli_mcp_e2e::journey::{sandbox_selector, session_of, Env};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::cgroup::find_dir;
use super::ctr_events::pod_containers;
use super::INSTANCE;

/// The idle sandbox pods' memory, one entry per pod (bytes for the cgroup, KiB for
/// processes, as the kernel gives them).
#[derive(Default)]
pub(super) struct IdleMemory {
    /// The file the charge was read from (`memory.current` on cgroup v2, its v1 equivalent
    /// `memory.usage_in_bytes`).
    pub(super) charge_file: &'static str,
    pub(super) charge: Vec<u64>,
    /// Of the charge (memory.stat): anonymous memory, shared memory (gVisor keeps its
    /// sandbox's memory in a memfd, which the kernel counts as shmem), other page cache.
    pub(super) anon: Vec<u64>,
    pub(super) shmem: Vec<u64>,
    pub(super) file: Vec<u64>,
    /// The pod's gVisor sandbox: the Sentry (runsc `boot`), its systrap stubs (its
    /// descendants, with an empty command line) and the gofers (runsc `gofer`, one per
    /// container); RSS and PSS summed (PSS splits the pages they share, e.g. the runsc
    /// binary's and the sandbox's memory file, which the Sentry and its stubs both map).
    pub(super) sandbox_rss: Vec<u64>,
    pub(super) sandbox_pss: Vec<u64>,
    /// Other runsc processes naming the pod's containers (the shim's `runsc wait`, …), outside
    /// the pod cgroup: RSS and PSS.
    pub(super) helper_rss: Vec<u64>,
    pub(super) helper_pss: Vec<u64>,
    /// runsc's processes by subcommand (`stub` for systrap's) over all pods: how many, and
    /// how many of them outside their pod's cgroup (whose charge then misses them).
    pub(super) runsc_roles: BTreeMap<String, (usize, usize)>,
    /// The pod's containerd shim (outside the pod cgroup under both runtimes): RSS and PSS.
    pub(super) shim_rss: Vec<u64>,
    pub(super) shim_pss: Vec<u64>,
    /// PSS of the runtime's processes outside the pod cgroup (the shim, runsc's helpers).
    pub(super) outside_pss: Vec<u64>,
    /// The pod cgroup's CPU use over [`CPU_WINDOW`] of idleness, in millicores.
    pub(super) cpu_millicores: Vec<f64>,
    pub(super) errors: Vec<String>,
}

/// How long the idle pods' CPU use is measured over.
pub(super) const CPU_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

/// A host process of a runtime: its pid, its parent's, argv and memory cgroup path.
struct Proc {
    pid: u32,
    ppid: u32,
    argv: Vec<String>,
    cgroup: String,
}

/// The memory of every session pod of instance `bench` (idle: each has answered its one
/// call), on the real node whose containerd listens on `socket`.
pub(super) async fn idle(env: &Env, socket: &Path) -> IdleMemory {
    idle_of(env, socket, INSTANCE).await
}

/// [`idle`] for the session pods of `instance`.
pub(super) async fn idle_of(env: &Env, socket: &Path, instance: &str) -> IdleMemory {
    let mut out = IdleMemory::default();
    let Some((root, v2)) = memory_hierarchy() else {
        out.errors
            .push("no memory cgroup hierarchy under /sys/fs/cgroup".into());
        return out;
    };
    out.charge_file = if v2 {
        "memory.current"
    } else {
        "memory.usage_in_bytes"
    };
    let procs = runtime_processes();
    let pods: Vec<Pod> = env.list::<Pod>(&sandbox_selector(instance)).await;
    let sessions: Vec<&Pod> = pods.iter().filter(|p| session_of(p).is_some()).collect();
    let uids: Vec<String> = sessions.iter().filter_map(|p| p.uid()).collect();
    let (cpu, cpu_errors) = super::idle_cpu::millicores(&uids, CPU_WINDOW).await;
    out.cpu_millicores = cpu;
    out.errors.extend(cpu_errors);
    for p in sessions {
        let uid = p.uid().unwrap_or_default();
        let Some(dir) = find_dir(&root, &format!("pod{uid}"), 4) else {
            out.errors
                .push(format!("{}: no pod cgroup pod{uid}", p.name_any()));
            continue;
        };
        match read_u64(&dir.join(out.charge_file)) {
            Some(c) => out.charge.push(c),
            None => out
                .errors
                .push(format!("{}: no {}", dir.display(), out.charge_file)),
        }
        let stat = memory_stat(&dir);
        let get = |v1: &str, v2k: &str| stat.get(if v2 { v2k } else { v1 }).copied();
        let (anon, shmem, cache) = (
            get("total_rss", "anon").unwrap_or(0),
            get("total_shmem", "shmem").unwrap_or(0),
            get("total_cache", "file").unwrap_or(0),
        );
        out.anon.push(anon);
        out.shmem.push(shmem);
        out.file.push(cache.saturating_sub(shmem));
        let ids = match pod_containers(socket, &uid).await {
            Ok(ids) if !ids.is_empty() => ids,
            Ok(_) => {
                out.errors
                    .push(format!("{}: containerd lists no container", p.name_any()));
                continue;
            }
            Err(e) => {
                out.errors.push(format!("{}: {e}", p.name_any()));
                continue;
            }
        };
        account_processes(&mut out, &procs, &ids, &uid);
    }
    out
}

/// Adds the runsc processes and the shim serving the containers `ids` of pod `uid`.
fn account_processes(out: &mut IdleMemory, procs: &[Proc], ids: &[String], uid: &str) {
    let named = |p: &&Proc| {
        p.argv
            .iter()
            .any(|a| ids.iter().any(|id| a.contains(id.as_str())))
    };
    let mut of_pod: Vec<(&Proc, &str)> = procs
        .iter()
        .filter(named)
        .map(|p| (p, if is_shim(p) { "shim" } else { subcommand(p) }))
        .collect();
    // systrap's stubs, where the sandbox's processes run, are the Sentry's descendants with
    // an empty command line: they name no container.
    let mut parents: Vec<u32> = of_pod
        .iter()
        .filter(|(_, role)| *role == "boot")
        .map(|(p, _)| p.pid)
        .collect();
    while !parents.is_empty() {
        let stubs: Vec<&Proc> = procs
            .iter()
            .filter(|p| p.argv.is_empty() && parents.contains(&p.ppid))
            .collect();
        parents = stubs.iter().map(|p| p.pid).collect();
        of_pod.extend(stubs.into_iter().map(|p| (p, "stub")));
    }
    // [sandbox RSS, sandbox PSS, helpers' RSS, helpers' PSS, shim RSS, shim PSS]
    let mut sum = [0u64; 6];
    for (p, role) in of_pod {
        let (rss, pss) = rss_pss_kib(p.pid);
        let at = match role {
            "shim" => 4,
            "boot" | "gofer" | "stub" => 0,
            _ => 2,
        };
        sum[at] += rss;
        sum[at + 1] += pss;
        if role == "shim" {
            continue;
        }
        let e = out.runsc_roles.entry(role.to_owned()).or_default();
        e.0 += 1;
        if !p.cgroup.contains(&format!("pod{uid}")) {
            e.1 += 1;
        }
    }
    if sum[0] > 0 {
        out.sandbox_rss.push(sum[0]);
        out.sandbox_pss.push(sum[1]);
        out.helper_rss.push(sum[2]);
        out.helper_pss.push(sum[3]);
    }
    if sum[4] > 0 {
        out.shim_rss.push(sum[4]);
        out.shim_pss.push(sum[5]);
        out.outside_pss.push(sum[3] + sum[5]);
    }
}

/// A runsc process's subcommand: its first argument that is not a flag (`boot`, `gofer`,
/// `wait`, …).
fn subcommand(p: &Proc) -> &str {
    p.argv
        .iter()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map_or("?", String::as_str)
}

fn is_shim(p: &Proc) -> bool {
    p.argv
        .first()
        .is_some_and(|a| basename(a).starts_with("containerd-shim"))
}

fn basename(a: &str) -> &str {
    a.rsplit('/').next().unwrap_or(a)
}

/// The memory hierarchy's root and whether it is cgroup v2.
fn memory_hierarchy() -> Option<(PathBuf, bool)> {
    let v1 = PathBuf::from("/sys/fs/cgroup/memory");
    if v1.join("memory.usage_in_bytes").is_file() || v1.join("memory.stat").is_file() {
        return Some((v1, false));
    }
    let v2 = PathBuf::from("/sys/fs/cgroup");
    v2.join("cgroup.controllers")
        .is_file()
        .then_some((v2, true))
}

fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `memory.stat` of a cgroup as key → value.
fn memory_stat(dir: &Path) -> BTreeMap<String, u64> {
    fs::read_to_string(dir.join("memory.stat"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_owned(), v.trim().parse().ok()?))
        })
        .collect()
}

/// Every host process of runsc (`runsc`, `runsc-sandbox`, `runsc-gofer`, …) or of a
/// containerd shim, and every one with an empty command line, with its memory cgroup.
fn runtime_processes() -> Vec<Proc> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let argv: Vec<String> = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            // An empty command line: a kernel thread, or one of systrap's stubs.
            let runtime = argv.first().is_none_or(|a| {
                let exe = basename(a);
                exe.starts_with("runsc") || exe.starts_with("containerd-shim")
            });
            if !runtime {
                return None;
            }
            let cgroup = fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .unwrap_or_default()
                .lines()
                .find(|l| l.contains(":memory:") || l.starts_with("0::"))
                .and_then(|l| l.splitn(3, ':').nth(2))
                .unwrap_or_default()
                .to_owned();
            Some(Proc {
                pid,
                ppid: parent_pid(pid).unwrap_or(0),
                argv,
                cgroup,
            })
        })
        .collect()
}

/// A process's parent (`/proc/<pid>/stat`, the field after the state, which follows the
/// command name in parentheses).
fn parent_pid(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(1)?.parse().ok()
}

/// A process's RSS and PSS in KiB (`/proc/<pid>/smaps_rollup`), zeros when it is gone.
fn rss_pss_kib(pid: u32) -> (u64, u64) {
    let text = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("Rss:"), field("Pss:"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(pid: u32, ppid: u32, argv: &[&str], cgroup: &str) -> Proc {
        Proc {
            pid,
            ppid,
            argv: argv.iter().map(|a| a.to_string()).collect(),
            cgroup: cgroup.into(),
        }
    }

    #[test]
    fn a_pods_runsc_processes_are_found_by_its_container_ids_and_the_sentrys_stubs() {
        // Pids beyond any pid_max: no /proc entry, so their memory reads as zero.
        let pod = "/cli-mcp-node-1/kubepods/burstable/podU/sb";
        let procs = [
            proc(
                5_000_001,
                1,
                &["runsc-sandbox", "--root=/r", "boot", "--bundle=/b/sb", "sb"],
                pod,
            ),
            proc(
                5_000_002,
                1,
                &["runsc-gofer", "--root=/r", "gofer", "--bundle", "/b/sb"],
                pod,
            ),
            proc(
                5_000_003,
                1,
                &["runsc-gofer", "--root=/r", "gofer", "--bundle", "/b/app"],
                pod,
            ),
            proc(5_000_004, 5_000_001, &[], pod),
            proc(5_000_005, 5_000_004, &[], pod),
            proc(5_000_006, 2, &[], "/"),
            proc(
                5_000_007,
                1,
                &["runsc", "--root=/r", "wait", "app"],
                "/containerd",
            ),
            proc(
                5_000_008,
                1,
                &["containerd-shim-runsc-v1", "-id", "sb"],
                "/containerd",
            ),
            proc(
                5_000_009,
                1,
                &["runsc-sandbox", "boot", "another-pod"],
                "/other",
            ),
        ];
        let mut out = IdleMemory::default();
        account_processes(&mut out, &procs, &["sb".into(), "app".into()], "U");
        let roles: Vec<(&str, (usize, usize))> = out
            .runsc_roles
            .iter()
            .map(|(r, n)| (r.as_str(), *n))
            .collect();
        assert_eq!(
            roles,
            [
                ("boot", (1, 0)),
                ("gofer", (2, 0)),
                ("stub", (2, 0)),
                ("wait", (1, 1))
            ],
            "the kernel thread, the shim and the other pod's Sentry are not counted as runsc's"
        );
    }
}
