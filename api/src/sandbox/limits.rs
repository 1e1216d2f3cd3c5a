//! What a sandbox may take from its node beyond CPU and memory, and how its pod is bounded:
//! processes, disk, and the termination-log file. The kubelet settings these rely on are in
//! docs/operator.md (section 13).
//!
//! - **Processes.** The bound per pod is the kubelet's `podPidsLimit`, the pod's pids
//!   cgroup. The agent's own bound (`--max-processes`, killing the session's largest process
//!   groups at three quarters of it before the next command) sits below it, so a fork bomb
//!   is cleared before the pod's forks fail for long. It is not bash's `RLIMIT_NPROC` in a
//!   pod (`--nproc-rlimit false`): the kernel counts that limit per uid over the whole node
//!   (every sandbox runs as one uid, or one per namespace on OpenShift), so two sessions
//!   flooding processes made every other session's forks fail.
//! - **Disk.** `/tmp` is memory-backed: the kernel bounds its tmpfs at its `sizeLimit`
//!   (ENOSPC at once), and its pages count against the container's memory limit, not against
//!   ephemeral storage. `/workspace` stays on the node's disk. The kubelet bounds it, after
//!   the fact, by evicting the pod once a measurement shows it past its `sizeLimit` or the
//!   container's `ephemeral-storage` limit. The builder adds that limit, and a small
//!   request, when the instance's resources set none.
//! - **Termination log.** The kubelet bind-mounts a host file it created with mode 0666
//!   read-write at the container's `terminationMessagePath`, and nothing counts what is
//!   written there. The path is a file in a directory of the image that only root may enter
//!   (`/var/lib/cli-mcp/termination`, root:root 0700): the runtime creates the mount point
//!   as root before the root filesystem becomes read-only, and the sandbox user, whatever
//!   its uid and even in group 0, cannot reach the file.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EmptyDirVolumeSource, ResourceRequirements, Volume};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::SandboxConfig;

/// `--max-processes` of the agent in a sandbox pod: the agent clears a flood at three
/// quarters of it (384), well before the local node's `podPidsLimit` (1024) refuses forks.
pub const AGENT_MAX_PROCESSES: u64 = 512;

/// The directory of the termination-log file, which the sandbox image must have owned by
/// root with mode 0700. If it is missing, the runtime creates it with mode 0755, and the
/// file becomes writable for the sandbox user again.
pub const TERMINATION_MESSAGE_DIR: &str = "/var/lib/cli-mcp/termination";
/// The sandbox container's `terminationMessagePath`.
pub const TERMINATION_MESSAGE_PATH: &str = "/var/lib/cli-mcp/termination/log";

pub const EPHEMERAL_STORAGE: &str = "ephemeral-storage";
/// The `ephemeral-storage` request a sandbox gets when its instance sets none: what it holds
/// at rest (its log, an empty workspace, the downward-API and ConfigMap files). The
/// workspace is bounded by the limit, not reserved at scheduling, just as memory is
/// requested at a quarter of its limit. It is small enough for the process kubelet's
/// 10Gi to fit `make bench`'s 1,100 sandboxes.
pub const EPHEMERAL_STORAGE_REQUEST: &str = "8Mi";
/// What the `ephemeral-storage` limit leaves beside the workspace's `sizeLimit`: container
/// logs (the kubelet rotates them at 5 × 10Mi by default) and the read-only root's mount
/// points. `/tmp` is memory-backed and counts against memory instead.
pub const EPHEMERAL_STORAGE_MARGIN: u128 = 256 << 20;

/// The agent's process-limit flags in a sandbox pod: its own bound, and no per-uid rlimit.
pub(super) fn agent_process_args() -> [String; 4] {
    [
        "--max-processes".into(),
        AGENT_MAX_PROCESSES.to_string(),
        "--nproc-rlimit".into(),
        "false".into(),
    ]
}

/// `/workspace` on the node's disk (evicted past its size) and `/tmp` in memory (ENOSPC at
/// its size). Both survive container restarts; the agent's state dir is on `/tmp`.
pub(super) fn scratch_volumes(cfg: &SandboxConfig) -> [Volume; 2] {
    let empty_dir = |name: &str, limit: &Quantity, medium: Option<&str>| Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: medium.map(Into::into),
            size_limit: Some(limit.clone()),
            ..Default::default()
        }),
        ..Default::default()
    };
    [
        empty_dir("workspace", &cfg.workspace_size_limit, None),
        empty_dir("tmp", &cfg.tmp_size_limit, Some("Memory")),
    ]
}

/// The container's resources: the instance's, with an `ephemeral-storage` request and
/// limit added where they set none. The limit is the workspace's `sizeLimit` plus
/// [`EPHEMERAL_STORAGE_MARGIN`] (and never below the instance's own request), the request
/// [`EPHEMERAL_STORAGE_REQUEST`] (and never above the limit). A request left out would be
/// defaulted to the limit by the API server, reserving the whole workspace on the node.
pub(super) fn container_resources(cfg: &SandboxConfig) -> ResourceRequirements {
    let mut r = cfg.resources.clone();
    let own = |m: &Option<BTreeMap<String, Quantity>>| {
        m.as_ref().and_then(|m| m.get(EPHEMERAL_STORAGE)).cloned()
    };
    let (request, limit) = (own(&r.requests), own(&r.limits));
    if limit.is_none() {
        if let Some(workspace) = quantity_bytes(&cfg.workspace_size_limit) {
            let floor = request.as_ref().and_then(quantity_bytes).unwrap_or(0);
            let bytes = workspace
                .saturating_add(EPHEMERAL_STORAGE_MARGIN)
                .max(floor);
            r.limits
                .get_or_insert_with(BTreeMap::new)
                .insert(EPHEMERAL_STORAGE.into(), quantity_of(bytes));
        }
    }
    if request.is_none() {
        let default = Quantity(EPHEMERAL_STORAGE_REQUEST.into());
        let lower =
            |l: &Quantity| quantity_bytes(l).is_some_and(|l| Some(l) < quantity_bytes(&default));
        let request = match own(&r.limits) {
            Some(l) if lower(&l) => l,
            _ => default,
        };
        r.requests
            .get_or_insert_with(BTreeMap::new)
            .insert(EPHEMERAL_STORAGE.into(), request);
    }
    r
}

/// The bytes of a Kubernetes quantity (`1Gi`, `256Mi`, `500M`, `1.5Gi`, `1e9`, `100m`),
/// rounded up; `None` for anything else, negative ones included.
pub fn quantity_bytes(q: &Quantity) -> Option<u128> {
    let s = q.0.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(end);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return None;
    }
    let digits: u128 = format!("{int}{frac}").parse().ok()?;
    let pow10 = |e: u32| 10u128.checked_pow(e);
    let (mul, div): (u128, u128) = match suffix {
        "" => (1, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        "n" => (1, pow10(9)?),
        "u" => (1, pow10(6)?),
        "m" => (1, pow10(3)?),
        "k" => (pow10(3)?, 1),
        "M" => (pow10(6)?, 1),
        "G" => (pow10(9)?, 1),
        "T" => (pow10(12)?, 1),
        "P" => (pow10(15)?, 1),
        "E" => (pow10(18)?, 1),
        exp => {
            let e: i32 = exp.strip_prefix(['e', 'E'])?.parse().ok()?;
            if e >= 0 {
                (pow10(e.unsigned_abs())?, 1)
            } else {
                (1, pow10(e.unsigned_abs())?)
            }
        }
    };
    let den = pow10(u32::try_from(frac.len()).ok()?)?.checked_mul(div)?;
    Some(digits.checked_mul(mul)?.div_ceil(den))
}

/// `bytes` as a quantity: in Mi when whole, else plain bytes.
fn quantity_of(bytes: u128) -> Quantity {
    const MI: u128 = 1 << 20;
    if bytes.is_multiple_of(MI) {
        Quantity(format!("{}Mi", bytes / MI))
    } else {
        Quantity(bytes.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{build_sandbox_pod, SandboxRole, CONTAINER_NAME};
    use super::*;
    use crate::names::{InstanceName, PoolSuffix};
    use crate::token::{HmacKey, SandboxNonce};
    use crate::SessionId;
    use k8s_openapi::api::core::v1::{Container, Pod};

    fn cfg() -> SandboxConfig {
        SandboxConfig::new(
            InstanceName::parse("demo").expect("valid"),
            "ns1",
            "quay.io/x/cli-mcp-sandbox:1",
        )
    }

    /// A pool pod and a session pod of `c`: every check holds for both roles.
    fn pods(c: &SandboxConfig) -> [Pod; 2] {
        let key = HmacKey::from_bytes([7; 32]);
        let suffix = PoolSuffix::from_random_bytes([1; 10]);
        let assign = key.assign_token(&c.instance.pool_pod(&suffix)).commitment();
        let sid = SessionId::parse("s1").expect("valid");
        let nonce = SandboxNonce::from_bytes([9; crate::token::NONCE_LEN]);
        [
            build_sandbox_pod(c, &SandboxRole::Pool { suffix, assign }, "t"),
            build_sandbox_pod(c, &SandboxRole::session(&key, sid, nonce, None), "t"),
        ]
    }

    fn agent(pod: &Pod) -> &Container {
        let c = &pod.spec.as_ref().expect("spec").containers[0];
        assert_eq!(c.name, CONTAINER_NAME);
        c
    }

    fn q(s: &str) -> Quantity {
        Quantity(s.into())
    }

    fn ephemeral(r: &ResourceRequirements) -> (Option<Quantity>, Option<Quantity>) {
        let get = |m: &Option<BTreeMap<String, Quantity>>| {
            m.as_ref().and_then(|m| m.get(EPHEMERAL_STORAGE)).cloned()
        };
        (get(&r.requests), get(&r.limits))
    }

    fn with_resources(requests: &[(&str, &str)], limits: &[(&str, &str)]) -> SandboxConfig {
        let map = |kv: &[(&str, &str)]| {
            (!kv.is_empty()).then(|| kv.iter().map(|(k, v)| (k.to_string(), q(v))).collect())
        };
        SandboxConfig {
            resources: ResourceRequirements {
                requests: map(requests),
                limits: map(limits),
                ..Default::default()
            },
            ..cfg()
        }
    }

    #[test]
    fn the_agent_in_a_pod_sets_no_per_uid_process_limit() {
        // RLIMIT_NPROC counts the uid's tasks on the whole node: in a pod it would be shared
        // with every other sandbox. The agent keeps its own bound, below podPidsLimit.
        for pod in pods(&cfg()) {
            let args = agent(&pod).args.clone().expect("args");
            let value = |flag: &str| {
                let at = args
                    .iter()
                    .position(|a| a == flag)
                    .unwrap_or_else(|| panic!("no {flag}: {args:?}"));
                args[at + 1].clone()
            };
            assert_eq!(value("--nproc-rlimit"), "false", "{args:?}");
            assert_eq!(value("--max-processes"), AGENT_MAX_PROCESSES.to_string());
        }
        const { assert!(AGENT_MAX_PROCESSES > 0, "the agent's own bound is on") };
    }

    #[test]
    fn tmp_is_memory_backed_at_its_size_and_the_workspace_stays_on_disk() {
        for pod in pods(&cfg()) {
            let volumes = pod.spec.expect("spec").volumes.expect("volumes");
            let dir = |name: &str| {
                volumes
                    .iter()
                    .find(|v| v.name == name)
                    .and_then(|v| v.empty_dir.clone())
                    .unwrap_or_else(|| panic!("no emptyDir {name}: {volumes:?}"))
            };
            let tmp = dir("tmp");
            assert_eq!(tmp.medium.as_deref(), Some("Memory"));
            assert_eq!(tmp.size_limit, Some(q("256Mi")));
            let ws = dir("workspace");
            assert_eq!(ws.medium, None, "the workspace is on the node's disk");
            assert_eq!(ws.size_limit, Some(q("1Gi")));
        }
    }

    #[test]
    fn the_default_tmp_takes_at_most_half_the_default_memory_limit() {
        // /tmp's pages count against the container's memory limit: a full /tmp must leave
        // the agent and the shell's commands room to run.
        let c = cfg();
        let memory = c
            .resources
            .limits
            .as_ref()
            .and_then(|l| l.get("memory"))
            .and_then(quantity_bytes)
            .expect("a default memory limit");
        let tmp = quantity_bytes(&c.tmp_size_limit).expect("tmp size");
        assert!(tmp * 2 <= memory, "tmp {tmp} B, memory limit {memory} B");
    }

    #[test]
    fn ephemeral_storage_is_added_when_the_instance_sets_none() {
        for pod in pods(&cfg()) {
            let r = agent(&pod).resources.clone().expect("resources");
            assert_eq!(ephemeral(&r), (Some(q("8Mi")), Some(q("1280Mi"))));
            // The instance's CPU and memory are kept as they were.
            assert_eq!(
                r.requests.as_ref().expect("requests")["memory"],
                q(crate::crd::DEFAULT_SANDBOX_REQUESTS.1)
            );
            assert_eq!(r.limits.as_ref().expect("limits")["cpu"], q("500m"));
        }
        // The limit follows the workspace's size.
        let big = SandboxConfig {
            workspace_size_limit: q("10Gi"),
            ..cfg()
        };
        let r = container_resources(&big);
        assert_eq!(ephemeral(&r).1, Some(q("10496Mi")));
        // Resources with nothing at all still get both.
        let r = container_resources(&with_resources(&[], &[]));
        assert_eq!(ephemeral(&r), (Some(q("8Mi")), Some(q("1280Mi"))));
    }

    #[test]
    fn an_instances_own_ephemeral_storage_is_kept_and_never_inverted() {
        let e = |requests: &[(&str, &str)], limits: &[(&str, &str)]| {
            ephemeral(&container_resources(&with_resources(requests, limits)))
        };
        let es = EPHEMERAL_STORAGE;
        assert_eq!(
            e(&[(es, "1Gi")], &[(es, "3Gi")]),
            (Some(q("1Gi")), Some(q("3Gi")))
        );
        // A limit alone: the default request, or the limit when that is lower.
        assert_eq!(e(&[], &[(es, "500Mi")]), (Some(q("8Mi")), Some(q("500Mi"))));
        assert_eq!(e(&[], &[(es, "4Mi")]), (Some(q("4Mi")), Some(q("4Mi"))));
        // A request alone: the default limit, or the request when that is higher.
        assert_eq!(
            e(&[(es, "64Mi")], &[]),
            (Some(q("64Mi")), Some(q("1280Mi")))
        );
        assert_eq!(e(&[(es, "2Gi")], &[]), (Some(q("2Gi")), Some(q("2048Mi"))));
    }

    #[test]
    fn the_termination_log_is_in_a_directory_of_the_image_not_under_a_volume() {
        for pod in pods(&cfg()) {
            let c = agent(&pod);
            assert_eq!(
                c.termination_message_path.as_deref(),
                Some(TERMINATION_MESSAGE_PATH)
            );
            assert_eq!(
                std::path::Path::new(TERMINATION_MESSAGE_PATH).parent(),
                Some(std::path::Path::new(TERMINATION_MESSAGE_DIR))
            );
            // The default (/dev/termination-log) is on the runtime's /dev; this one must be
            // in the image's own directory, never under a volume that could make it reachable.
            for m in c.volume_mounts.iter().flatten() {
                assert!(
                    !TERMINATION_MESSAGE_PATH.starts_with(&format!("{}/", m.mount_path)),
                    "under volume {}",
                    m.mount_path
                );
            }
            assert_eq!(
                c.termination_message_policy.as_deref(),
                Some("FallbackToLogsOnError")
            );
        }
    }

    #[test]
    fn the_images_make_the_termination_directory_root_only() {
        // Both recipes of the sandbox image create the directory root:root 0700 (0750 would
        // let OpenShift's group-0 sandbox user in).
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let read = |p: &str| std::fs::read_to_string(root.join(p)).expect(p);
        let containerfile = read("images/sandbox/Containerfile");
        assert!(
            containerfile.contains(&format!(
                "install -d -o 0 -g 0 -m 0700 {TERMINATION_MESSAGE_DIR}"
            )),
            "images/sandbox/Containerfile"
        );
        let rootfs = read("images/rootfs.sh");
        assert!(
            rootfs.contains(&format!(
                "install -d -o 0 -g 0 -m 0700 \"$sbx{TERMINATION_MESSAGE_DIR}\""
            )),
            "images/rootfs.sh"
        );
    }

    #[test]
    fn quantities_parse_to_bytes_rounded_up() {
        for (s, bytes) in [
            ("1Gi", 1u128 << 30),
            ("256Mi", 256 << 20),
            ("1.5Gi", 3 << 29),
            ("500M", 500_000_000),
            ("1e9", 1_000_000_000),
            ("1E3", 1000),
            ("2k", 2000),
            ("1E", 1_000_000_000_000_000_000),
            ("100m", 1),
            ("0", 0),
            ("+7", 7),
            (".5Ki", 512),
        ] {
            assert_eq!(quantity_bytes(&q(s)), Some(bytes), "{s}");
        }
        for bad in [
            "", "-1Gi", "Gi", "1..2", "1.2.3", "1Xi", "1e", "abc", "1 Gi",
        ] {
            assert_eq!(quantity_bytes(&q(bad)), None, "{bad:?}");
        }
        assert_eq!(quantity_of(1280 << 20), q("1280Mi"));
        assert_eq!(quantity_of(1000), q("1000"));
    }
}
