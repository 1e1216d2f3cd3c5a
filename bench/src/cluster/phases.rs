//! Where a cold start's time goes on the real node. Three clocks meet, all reading the
//! host's wall clock: the bench (when it sent the call, when the answer came), the server
//! (its `create` and `ready` steps, in milliseconds from the start of the call, which its log
//! gives), and containerd (when the pod's sandbox and agent container records were created
//! and their tasks started: `ctr events`; containerd 1.6 sets up the pod's network between
//! the sandbox's record and its task). The kubelet's own timestamps (pod
//! conditions, events) have whole seconds only, too coarse for a start under a second.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use cli_mcp_e2e::journey::{sandbox_selector, session_of, Env};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::ctr_events::{pod_containers, Event};
use super::starts::Starts;
use super::INSTANCE;

/// The phases of a cold start, in order: what each spans (from the previous point to its
/// own). The first starts when the bench sends the call.
pub(super) const PHASES: [&str; 7] = [
    "server: the pod created (`create` step: admission, slot, the pod's POST)",
    "scheduled; the kubelet's sync (pod cgroup, volumes), up to containerd's sandbox container",
    "the pod's network (CNI), then the sandbox created and started (runc: the pause container; runsc: the Sentry and its gofer booted)",
    "the kubelet, up to the agent's container (its image checked, its configuration)",
    "the agent's container created and started (runsc: in the running sandbox, a gofer of its own)",
    "the agent answers `/healthz` (its start; the server's polls: its `ready` step ends)",
    "`/assign`, the first `true` and the answer",
];

/// For each phase, how long it took in each start where all its points were seen (ms; a
/// few ms of skew between the bench's and the server's start of the call are possible).
#[derive(Default)]
pub(super) struct Phases {
    pub(super) ms: BTreeMap<usize, Vec<f64>>,
    /// Starts with every point seen.
    pub(super) complete: usize,
    pub(super) errors: Vec<String>,
}

/// The phases of the cold starts `starts`, from containerd's `events` and the server's log.
pub(super) async fn cold(env: &Env, socket: &Path, events: Vec<Event>, starts: &Starts) -> Phases {
    let mut out = Phases::default();
    let steps: BTreeMap<String, crate::steps::Start> = starts
        .server_log
        .lines()
        .filter_map(crate::steps::parse_line)
        .filter_map(|s| Some((s.session.clone()?, s)))
        .collect();
    let pods: BTreeMap<String, Pod> = env
        .list::<Pod>(&sandbox_selector(INSTANCE))
        .await
        .into_iter()
        .filter_map(|p| Some((session_of(&p)?.to_string(), p)))
        .collect();
    for ((sid, sent), took) in starts.sent.iter().zip(&starts.samples) {
        let (Some(step), Some(pod)) = (steps.get(sid), pods.get(sid)) else {
            out.errors
                .push(format!("{sid}: no server log line or no pod"));
            continue;
        };
        let ids = match pod_containers(socket, &pod.uid().unwrap_or_default()).await {
            Ok(ids) => ids,
            Err(e) => {
                out.errors.push(format!("{sid}: {e}"));
                continue;
            }
        };
        let app = app_container(pod);
        let at = |topic: &str, sandbox: bool| {
            events
                .iter()
                .filter(|e| e.topic == topic && ids.contains(&e.id))
                .find(|e| (Some(&e.id) == app.as_ref()) != sandbox)
                .map(|e| ms_since(*sent, e.at))
        };
        let step_end = |name: &str| {
            step.steps
                .iter()
                .find(|(n, _, _)| n == name)
                .map(|(_, start, took)| start + took)
        };
        let points = [
            Some(0.0),
            step_end("create"),
            at("/containers/create", true),
            // runsc's shim sends no `/tasks/create`: a task's creation and start go together.
            at("/tasks/start", true),
            at("/containers/create", false),
            at("/tasks/start", false),
            step_end("ready"),
            Some(took.as_secs_f64() * 1000.0),
        ];
        let mut all = true;
        for (i, w) in points.windows(2).enumerate() {
            match (w[0], w[1]) {
                (Some(a), Some(b)) => out.ms.entry(i).or_default().push(b - a),
                _ => all = false,
            }
        }
        if all {
            out.complete += 1;
        } else {
            out.errors.push(format!("{sid}: points seen {points:?}"));
        }
    }
    out
}

/// The pod's agent container's id (containerd's, without the `containerd://` prefix).
fn app_container(pod: &Pod) -> Option<String> {
    let id = pod
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .container_id
        .clone()?;
    Some(id.strip_prefix("containerd://").unwrap_or(&id).to_owned())
}

/// Milliseconds from `from` to `to` (negative when `to` is earlier).
fn ms_since(from: SystemTime, to: SystemTime) -> f64 {
    match to.duration_since(from) {
        Ok(d) => d.as_secs_f64() * 1000.0,
        Err(e) => -e.duration().as_secs_f64() * 1000.0,
    }
}
