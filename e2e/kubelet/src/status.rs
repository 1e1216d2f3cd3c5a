//! Pod status from the kubelet's view of its containers: phase, conditions, container
//! statuses. Pure functions, so the rules are unit-tested.

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, HostIP, Pod, PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// How a container ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Terminated {
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub reason: String,
    pub message: Option<String>,
    pub started_at: Option<Timestamp>,
    pub finished_at: Timestamp,
    pub container_id: Option<String>,
}

/// The current state of one container.
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running {
        started_at: Timestamp,
    },
    Terminated(Terminated),
}

impl State {
    pub fn waiting(reason: &str, message: Option<String>) -> State {
        State::Waiting {
            reason: reason.to_string(),
            message,
        }
    }
}

/// What the status builder needs to know about a container.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerView {
    pub name: String,
    pub image: String,
    pub image_id: String,
    pub container_id: Option<String>,
    pub state: State,
    pub last_terminated: Option<Terminated>,
    pub restart_count: i32,
    pub ready: bool,
    pub started: bool,
    /// Init container with `restartPolicy: Always` (a sidecar).
    pub sidecar: bool,
}

/// Pod-level facts.
#[derive(Debug, Clone)]
pub struct PodView<'a> {
    pub pod: &'a Pod,
    pub init: &'a [ContainerView],
    pub containers: &'a [ContainerView],
    pub network_ready: bool,
    pub pod_ip: Option<String>,
    pub host_ip: String,
    pub start_time: Timestamp,
    /// The pod is being torn down and all its containers have stopped.
    pub terminated: bool,
    /// A pod-level problem (e.g. network setup failed) for the status message.
    pub message: Option<String>,
    pub now: Timestamp,
}

fn time(t: Timestamp) -> Time {
    Time(t)
}

fn restart_policy(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.restart_policy.as_deref())
        .unwrap_or("Always")
}

/// Whether an init container counts as done (exited 0, or a started sidecar).
pub fn init_done(c: &ContainerView) -> bool {
    if c.sidecar {
        return c.started;
    }
    matches!(&c.state, State::Terminated(t) if t.exit_code == 0)
}

/// The kubelet's phase rules (`getPhase`), simplified.
pub fn phase(v: &PodView<'_>) -> &'static str {
    let policy = restart_policy(v.pod);
    let init_failed_for_good = policy == "Never"
        && v.init
            .iter()
            .any(|c| !c.sidecar && matches!(&c.state, State::Terminated(t) if t.exit_code != 0));
    if init_failed_for_good {
        return "Failed";
    }
    if !v.init.iter().all(init_done) {
        return "Pending";
    }
    let (mut running, mut waiting, mut stopped, mut succeeded) = (0, 0, 0, 0);
    for c in v.containers {
        match &c.state {
            State::Running { .. } => running += 1,
            State::Terminated(t) => {
                stopped += 1;
                if t.exit_code == 0 {
                    succeeded += 1;
                }
            }
            State::Waiting { .. } => {
                if c.last_terminated.is_some() {
                    stopped += 1;
                    if c.last_terminated.as_ref().is_some_and(|t| t.exit_code == 0) {
                        succeeded += 1;
                    }
                } else {
                    waiting += 1;
                }
            }
        }
    }
    if v.terminated {
        return if stopped == succeeded && stopped > 0 {
            "Succeeded"
        } else {
            "Failed"
        };
    }
    if waiting > 0 {
        return "Pending";
    }
    if running > 0 {
        return "Running";
    }
    if stopped > 0 {
        return match policy {
            "Always" => "Running",
            "OnFailure" if stopped == succeeded => "Succeeded",
            "OnFailure" => "Running",
            _ if stopped == succeeded => "Succeeded",
            _ => "Failed",
        };
    }
    "Pending"
}

fn container_status(c: &ContainerView) -> ContainerStatus {
    let terminated = |t: &Terminated| ContainerStateTerminated {
        exit_code: t.exit_code,
        signal: t.signal,
        reason: Some(t.reason.clone()),
        message: t.message.clone(),
        started_at: t.started_at.map(time),
        finished_at: Some(time(t.finished_at)),
        container_id: t.container_id.clone(),
    };
    let state = match &c.state {
        State::Waiting { reason, message } => ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some(reason.clone()),
                message: message.clone(),
            }),
            ..Default::default()
        },
        State::Running { started_at } => ContainerState {
            running: Some(ContainerStateRunning {
                started_at: Some(time(*started_at)),
            }),
            ..Default::default()
        },
        State::Terminated(t) => ContainerState {
            terminated: Some(terminated(t)),
            ..Default::default()
        },
    };
    ContainerStatus {
        name: c.name.clone(),
        image: c.image.clone(),
        image_id: c.image_id.clone(),
        container_id: c.container_id.clone(),
        state: Some(state),
        last_state: Some(
            c.last_terminated
                .as_ref()
                .map(|t| ContainerState {
                    terminated: Some(terminated(t)),
                    ..Default::default()
                })
                .unwrap_or_default(),
        ),
        ready: c.ready && matches!(c.state, State::Running { .. }),
        restart_count: c.restart_count,
        started: Some(c.started && matches!(c.state, State::Running { .. })),
        ..Default::default()
    }
}

/// A condition, keeping `lastTransitionTime` from `previous` when the status did not flip.
fn condition(
    previous: &[PodCondition],
    type_: &str,
    ok: bool,
    reason: Option<&str>,
    message: Option<String>,
    generation: Option<i64>,
    now: Timestamp,
) -> PodCondition {
    let status = if ok { "True" } else { "False" };
    let last = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| time(now));
    PodCondition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: if ok { None } else { reason.map(str::to_string) },
        message: if ok { None } else { message },
        last_transition_time: Some(last),
        last_probe_time: None,
        observed_generation: generation,
    }
}

fn names(list: &[&ContainerView]) -> String {
    format!(
        "[{}]",
        list.iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// Builds the full status to send (`podIP`, conditions, container statuses, phase).
pub fn build(v: &PodView<'_>) -> PodStatus {
    let phase = phase(v);
    let terminal = phase == "Succeeded" || phase == "Failed";
    let pod_ip = v.pod_ip.clone();
    PodStatus {
        phase: Some(phase.to_string()),
        conditions: Some(conditions(v, terminal)),
        host_ip: Some(v.host_ip.clone()),
        host_ips: Some(vec![HostIP {
            ip: v.host_ip.clone(),
        }]),
        pod_ip: pod_ip.clone(),
        pod_ips: pod_ip.map(|ip| vec![PodIP { ip }]),
        start_time: Some(time(v.start_time)),
        message: v.message.clone(),
        container_statuses: Some(v.containers.iter().map(container_status).collect()),
        init_container_statuses: (!v.init.is_empty())
            .then(|| v.init.iter().map(container_status).collect()),
        observed_generation: v.pod.metadata.generation,
        ..Default::default()
    }
}

/// The pod's conditions: those owned by others as the pod has them, with `PodScheduled`
/// added if missing, then the four this kubelet owns (see [`our_conditions`]). `terminal`:
/// the phase is `Succeeded` or `Failed`.
fn conditions(v: &PodView<'_>, terminal: bool) -> Vec<PodCondition> {
    let previous: Vec<PodCondition> = v
        .pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let ours = our_conditions(v, &previous, terminal);
    // Keep conditions owned by others (PodScheduled, DisruptionTarget, readiness gates).
    let mut conditions: Vec<PodCondition> = previous
        .iter()
        .filter(|c| !ours.iter().any(|o| o.type_ == c.type_))
        .cloned()
        .collect();
    if !conditions.iter().any(|c| c.type_ == "PodScheduled") {
        conditions.push(condition(
            &[],
            "PodScheduled",
            true,
            None,
            None,
            v.pod.metadata.generation,
            v.now,
        ));
    }
    conditions.extend(ours);
    conditions
}

/// `PodReadyToStartContainers`, `Initialized`, `ContainersReady` and `Ready`, from the
/// containers' states; `previous` gives the readiness gates' conditions and the transition
/// times to keep.
fn our_conditions(v: &PodView<'_>, previous: &[PodCondition], terminal: bool) -> Vec<PodCondition> {
    let generation = v.pod.metadata.generation;
    let init_pending: Vec<&ContainerView> = v.init.iter().filter(|c| !init_done(c)).collect();
    let initialized = init_pending.is_empty() || (terminal && !v.init.is_empty());
    let sidecars = v.init.iter().filter(|c| c.sidecar);
    let unready: Vec<&ContainerView> = sidecars
        .chain(v.containers.iter())
        .filter(|c| !(c.ready && matches!(c.state, State::Running { .. })))
        .collect();
    let containers_ready = unready.is_empty() && !terminal;
    let (ready_reason, ready_msg) = if terminal {
        ("PodCompleted", None)
    } else {
        (
            "ContainersNotReady",
            Some(format!(
                "containers with unready status: {}",
                names(&unready)
            )),
        )
    };
    let gates_ok = readiness_gates_ok(v.pod, previous);

    vec![
        condition(
            previous,
            "PodReadyToStartContainers",
            v.network_ready,
            None,
            None,
            generation,
            v.now,
        ),
        condition(
            previous,
            "Initialized",
            initialized,
            Some("ContainersNotInitialized"),
            Some(format!(
                "containers with incomplete status: {}",
                names(&init_pending)
            )),
            generation,
            v.now,
        ),
        condition(
            previous,
            "ContainersReady",
            containers_ready,
            Some(ready_reason),
            ready_msg.clone(),
            generation,
            v.now,
        ),
        condition(
            previous,
            "Ready",
            containers_ready && gates_ok,
            Some(if containers_ready {
                "ReadinessGatesNotReady"
            } else {
                ready_reason
            }),
            if containers_ready {
                Some("the status of pod readiness gates is not \"True\"".into())
            } else {
                ready_msg
            },
            generation,
            v.now,
        ),
    ]
}

/// Whether every readiness gate of the pod has its condition `True` in `previous` (others
/// set those conditions; a pod without gates has them all).
fn readiness_gates_ok(pod: &Pod, previous: &[PodCondition]) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_ref())
        .map(|gates| {
            gates.iter().all(|g| {
                previous
                    .iter()
                    .any(|c| c.type_ == g.condition_type && c.status == "True")
            })
        })
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodSpec;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).expect("valid timestamp")
    }

    fn pod(policy: &str) -> Pod {
        Pod {
            spec: Some(PodSpec {
                restart_policy: Some(policy.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn c(name: &str, state: State) -> ContainerView {
        ContainerView {
            name: name.into(),
            image: "img:1".into(),
            image_id: "cli-mcp://bin".into(),
            container_id: None,
            state,
            last_terminated: None,
            restart_count: 0,
            ready: false,
            started: false,
            sidecar: false,
        }
    }

    fn running() -> State {
        State::Running { started_at: ts(1) }
    }

    fn exited(code: i32) -> State {
        State::Terminated(Terminated {
            exit_code: code,
            signal: None,
            reason: if code == 0 { "Completed" } else { "Error" }.into(),
            message: None,
            started_at: Some(ts(1)),
            finished_at: ts(2),
            container_id: None,
        })
    }

    fn view<'a>(p: &'a Pod, init: &'a [ContainerView], cs: &'a [ContainerView]) -> PodView<'a> {
        PodView {
            pod: p,
            init,
            containers: cs,
            network_ready: true,
            pod_ip: Some("10.244.0.2".into()),
            host_ip: "10.244.0.1".into(),
            start_time: ts(0),
            terminated: false,
            message: None,
            now: ts(10),
        }
    }

    #[test]
    fn phases() {
        let always = pod("Always");
        let never = pod("Never");
        let on_failure = pod("OnFailure");
        let waiting = [c("a", State::waiting("ContainerCreating", None))];
        assert_eq!(phase(&view(&always, &[], &waiting)), "Pending");
        assert_eq!(phase(&view(&always, &[], &[c("a", running())])), "Running");
        assert_eq!(phase(&view(&never, &[], &[c("a", exited(0))])), "Succeeded");
        assert_eq!(phase(&view(&never, &[], &[c("a", exited(1))])), "Failed");
        assert_eq!(
            phase(&view(&on_failure, &[], &[c("a", exited(0))])),
            "Succeeded"
        );
        let mut crashing = c("a", State::waiting("CrashLoopBackOff", None));
        crashing.last_terminated = Some(Terminated {
            exit_code: 1,
            signal: None,
            reason: "Error".into(),
            message: None,
            started_at: None,
            finished_at: ts(3),
            container_id: None,
        });
        assert_eq!(phase(&view(&always, &[], &[crashing])), "Running");
        let init = [c("init", running())];
        assert_eq!(phase(&view(&always, &init, &waiting)), "Pending");
        let failed_init = [c("init", exited(2))];
        assert_eq!(phase(&view(&never, &failed_init, &waiting)), "Failed");
        let killed = [c("a", exited(143))];
        let mut deleting = view(&always, &[], &killed);
        deleting.terminated = true;
        assert_eq!(phase(&deleting), "Failed");
    }

    #[test]
    fn ready_conditions_and_statuses() {
        let p = pod("Always");
        let mut a = c("a", running());
        a.ready = true;
        a.started = true;
        let b = c("b", running());
        let s = build(&view(&p, &[], &[a.clone(), b]));
        let cond = |s: &PodStatus, t: &str| {
            s.conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == t)
                .map(|c| (c.status.clone(), c.message.clone()))
        };
        assert_eq!(
            cond(&s, "Ready"),
            Some((
                "False".into(),
                Some("containers with unready status: [b]".into())
            ))
        );
        assert_eq!(cond(&s, "PodScheduled").map(|c| c.0), Some("True".into()));
        assert_eq!(cond(&s, "Initialized").map(|c| c.0), Some("True".into()));
        assert_eq!(s.pod_ip.as_deref(), Some("10.244.0.2"));
        assert_eq!(s.phase.as_deref(), Some("Running"));
        let statuses = s.container_statuses.unwrap_or_default();
        assert!(statuses[0].ready);
        assert_eq!(statuses[0].started, Some(true));
        assert!(statuses[0]
            .state
            .as_ref()
            .and_then(|st| st.running.as_ref())
            .is_some());

        let s = build(&view(&p, &[], std::slice::from_ref(&a)));
        assert_eq!(cond(&s, "Ready"), Some(("True".into(), None)));
        assert_eq!(cond(&s, "ContainersReady"), Some(("True".into(), None)));
    }

    #[test]
    fn transition_time_is_kept_when_status_is_unchanged() {
        let mut p = pod("Always");
        let mut a = c("a", running());
        a.ready = true;
        let first = build(&view(&p, &[], std::slice::from_ref(&a)));
        p.status = Some(first.clone());
        let mut later = view(&p, &[], std::slice::from_ref(&a));
        later.now = ts(500);
        let second = build(&later);
        let ready_time = |s: &PodStatus| {
            s.conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "Ready")
                .and_then(|c| c.last_transition_time.clone())
        };
        assert_eq!(ready_time(&first), ready_time(&second));
        assert_eq!(ready_time(&second), Some(Time(ts(10))));
    }

    #[test]
    fn waiting_reason_is_reported() {
        let p = pod("Always");
        let w = c(
            "a",
            State::waiting("ErrImagePull", Some("image \"x:1\" has no mapping".into())),
        );
        let s = build(&view(&p, &[], &[w]));
        let st = s.container_statuses.unwrap_or_default();
        let waiting = st[0].state.as_ref().and_then(|s| s.waiting.clone());
        assert_eq!(waiting.and_then(|w| w.reason), Some("ErrImagePull".into()));
        assert_eq!(s.phase.as_deref(), Some("Pending"));
    }
}
