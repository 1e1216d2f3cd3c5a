//! What one sandbox must not take from the others on the node: processes, disk, and the
//! termination-log file the kubelet keeps for each container.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;

use super::{Outcome, Target};

/// The longest a sandbox flooding its workspace may keep writing before the kubelet stops it
/// (measured ~20 s on this machine kind with the local node's stats period; see
/// docs/operator.md).
const DISK_FLOOD_STOPPED_WITHIN: Duration = Duration::from_secs(120);

pub async fn run(t: &Target) -> Vec<Outcome> {
    vec![
        fork_flood(t).await,
        termination_log(t).await,
        tmp_flood(t).await,
        workspace_flood(t).await,
    ]
}

/// Two sessions start 3,000 processes each; a third session must still fork. Before: the
/// per-UID process limit counted every sandbox of the node, and the third session's forks
/// failed.
async fn fork_flood(t: &Target) -> Outcome {
    // xargs forks until it cannot (then it stops, its children live on); bash's own `&` would
    // retry every failed fork for half a minute. While the flood builds up, the loop counts
    // the pod's processes and waits with builtins only (a fork would fail at the limit): fd 9
    // is a pipe opened before the flood, which `read -t` waits on.
    let flood = "exec 9< <(exec sleep 300); \
                 seq 3000 | xargs -P 3000 -n 1 sleep 600 >/dev/null 2>&1 & \
                 for i in {1..200}; do p=(/proc/[0-9]*); n=${#p[@]}; \
                 [ \"$n\" -ge 900 ] && break; read -t 0.1 -u 9; done; echo \"$n processes\"";
    let (a, b) = tokio::join!(
        t.bash("attack-fork-a", flood),
        t.bash("attack-fork-b", flood)
    );
    let started = |s: &super::Shell| s.stdout.trim().to_owned();
    let c = t
        .bash(
            "attack-fork-c",
            "for i in $(seq 1 50); do /bin/true || { echo fork-failed; exit 1; }; done; echo forked-fine",
        )
        .await;
    assert!(
        c.stdout.contains("forked-fine"),
        "a third session cannot fork while two others flood ({}; {}): {}",
        started(&a),
        started(&b),
        c.text
    );
    // The flooder's next command: the agent's own bound (below the pod's) clears the flood
    // first and says so. Under gVisor the flood's processes are the sandbox kernel's, held
    // in its memory: past the sandbox's memory limit the whole sandbox is stopped, and the
    // next command runs in a fresh one, which it is told.
    let next = t.bash("attack-fork-a", "echo next").await;
    let cleared = next.text.contains("processes or more");
    let reset = ["new session", "reset", "restarted"]
        .iter()
        .any(|w| next.text.contains(w));
    assert!(
        next.stdout.contains("next") && (cleared || (t.gvisor && reset)),
        "the agent did not clear the flood before the next command: {}",
        next.text
    );
    for s in ["attack-fork-a", "attack-fork-b", "attack-fork-c"] {
        t.end(s).await;
    }
    Outcome::new(
        "two sessions start 3,000 processes each; a third session forks",
        format!(
            "the pod PID limit: flooders {} and {}; the third session forked; the agent cleared \
             the flood before the flooder's next command",
            started(&a),
            started(&b)
        ),
    )
}

/// The sandbox writes to the termination-log path of its container and to the default one.
/// Before: /dev/termination-log took 300 MB, counted nowhere.
async fn termination_log(t: &Target) -> Outcome {
    let s = "attack-termlog";
    t.bash(s, "true").await;
    let pod = t.session_pod(s).await;
    let path = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.termination_message_path.clone())
        .unwrap_or_else(|| "/dev/termination-log".into());
    let r = t
        .bash(
            s,
            &format!(
                "for f in /dev/termination-log {path}; do \
                 head -c 1048576 /dev/zero 2>/dev/null >\"$f\" && echo \"$f written\" || echo \"$f refused\"; done"
            ),
        )
        .await;
    assert!(
        !r.stdout.contains("written"),
        "the sandbox writes its termination log: {}",
        r.text
    );
    t.end(s).await;
    Outcome::new(
        "sandbox floods its termination log",
        format!(
            "terminationMessagePath {path} in a directory the sandbox user cannot enter ({})",
            r.stdout.trim().replace('\n', "; ")
        ),
    )
}

/// A memory-backed /tmp is bounded by the kernel at its size: ENOSPC at once.
async fn tmp_flood(t: &Target) -> Outcome {
    let s = "attack-tmp";
    let r = t
        .bash(
            s,
            "dd if=/dev/zero of=/tmp/flood bs=1M count=2048 2>$HOME/dd.err; echo \"dd exit $?\"; \
             grep -o 'No space left on device' $HOME/dd.err; du -m /tmp/flood | cut -f1",
        )
        .await;
    let written: u64 = r
        .stdout
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("no size of /tmp/flood: {}", r.text));
    assert!(
        r.stdout.contains("No space left") && !r.stdout.contains("dd exit 0") && written <= 256,
        "/tmp took {written} MiB: {}",
        r.text
    );
    t.end(s).await;
    Outcome::new(
        "sandbox floods /tmp (2 GiB)",
        format!("the memory-backed /tmp's size: ENOSPC after {written} MiB"),
    )
}

/// The workspace is on the node's disk: the kubelet evicts the pod once it sees the usage
/// past the pod's ephemeral-storage limit or the volume's sizeLimit. The flood is bounded
/// here (3 GiB), the eviction's delay is measured.
async fn workspace_flood(t: &Target) -> Outcome {
    let s = "attack-disk";
    t.bash(s, "true").await;
    let pod = t.session_pod(s).await;
    let name = pod.metadata.name.clone().unwrap_or_default();
    let started = Instant::now();
    let r = t
        .bash(
            s,
            "dd if=/dev/zero of=$HOME/flood bs=1M count=3072 2>&1 | tail -n 1",
        )
        .await;
    let wrote_for = started.elapsed();
    let why = stopped_within(t, &name, started + DISK_FLOOD_STOPPED_WITHIN, &r.text).await;
    let after = started.elapsed();
    t.end(s).await;
    Outcome::new(
        "sandbox floods its workspace (3 GiB on the node's disk)",
        format!(
            "kubelet eviction {:.0} s after the flood began (dd ran {:.1} s: {}): {why}",
            after.as_secs_f64(),
            wrote_for.as_secs_f64(),
            r.stdout.trim()
        ),
    )
}

/// Why pod `name` stopped (evicted, or deleted after its eviction), read every half second
/// until `deadline`. A GET per read, not a watch: a watch on the one pod once missed its
/// eviction and deletion on a loaded machine (the kubelet's log had both), and a missed
/// event must not read as "not stopped".
async fn stopped_within(t: &Target, name: &str, deadline: Instant, flood: &str) -> String {
    let pods = Api::<Pod>::namespaced(t.admin.clone(), &t.ns);
    loop {
        let last = match pods.get_opt(name).await {
            Ok(None) => return "the pod was evicted and deleted".into(),
            Ok(Some(p)) if evicted(&p) => return eviction_message(p),
            Ok(Some(p)) => format!("phase {:?}", p.status.and_then(|s| s.phase)),
            Err(e) => e.to_string(),
        };
        assert!(
            Instant::now() < deadline,
            "the sandbox that wrote 3 GiB to its workspace ({flood}) was not stopped in \
             {DISK_FLOOD_STOPPED_WITHIN:?}; last seen: {last}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Whether the kubelet has stopped `p` for good: a terminal phase (an evicted pod whose agent
/// exits cleanly on SIGTERM ends `Succeeded`, not `Failed`), or its eviction's marks.
fn evicted(p: &Pod) -> bool {
    p.status.as_ref().is_some_and(|s| {
        matches!(s.phase.as_deref(), Some("Failed" | "Succeeded"))
            || s.reason.as_deref() == Some("Evicted")
            || s.conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "DisruptionTarget" && c.status == "True")
    })
}

/// What the kubelet said when it stopped `p`.
fn eviction_message(p: Pod) -> String {
    let status = p.status.unwrap_or_default();
    let condition = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "DisruptionTarget")
        .and_then(|c| c.message.clone());
    status
        .message
        .or(condition)
        .unwrap_or_else(|| format!("phase {:?}", status.phase))
}
