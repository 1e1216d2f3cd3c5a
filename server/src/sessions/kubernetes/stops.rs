//! Which sandbox containers stopped, from the pod watch: a call in flight to a sandbox whose
//! container stopped (killed past its memory limit, crashed) is answered at once with why,
//! instead of waiting out the command's timeout for an agent that is gone.
//!
//! Under runc a command past the memory limit is killed alone and the agent reports it. Under
//! gVisor the host's OOM killer stops the whole sandbox (its kernel, the Sentry, is the
//! process that holds the memory), and with it the network stack that owned the pod's
//! address: the server's connection to the agent then neither answers nor breaks.

use std::collections::HashMap;
use std::sync::Mutex;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use tokio::sync::watch;

/// What the watch last saw of a pod's containers: their restarts in all, and why one of
/// them stopped, when one is stopped now or stopped last.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    pub restarts: i32,
    /// Set while a container is down after a stop: `state.terminated`, or `state.waiting`
    /// with a `lastState.terminated` (why it stopped).
    pub stopped: Option<String>,
    /// Why a container stopped last (`lastState.terminated`).
    pub last: Option<String>,
}

impl Seen {
    pub fn of(pod: &Pod) -> Seen {
        let statuses = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_deref())
            .unwrap_or_default();
        let why = |t: &k8s_openapi::api::core::v1::ContainerStateTerminated| {
            format!(
                "{} (exit code {})",
                t.reason.as_deref().unwrap_or("stopped"),
                t.exit_code
            )
        };
        Seen {
            restarts: statuses.iter().map(|c| c.restart_count).sum(),
            // Down: terminated, or waiting to be made again after a termination (the
            // kubelet's CreateContainerError or CrashLoopBackOff in between).
            stopped: statuses.iter().find_map(|c| {
                let state = c.state.as_ref()?;
                match (&state.terminated, &state.waiting) {
                    (Some(t), _) => Some(why(t)),
                    (None, Some(_)) => c.last_state.as_ref()?.terminated.as_ref().map(why),
                    (None, None) => None,
                }
            }),
            last: statuses
                .iter()
                .find_map(|c| c.last_state.as_ref()?.terminated.as_ref().map(why)),
        }
    }

    /// Why the sandbox stopped since `before` was seen, if it did. A container already
    /// stopped at `before` that comes back (one restart more) is the end of that stop, not a
    /// new one: a call may begin on a sandbox whose agent answers again before the watch has
    /// seen it restart (the call after an out-of-memory stop under gVisor).
    fn stopped_since(&self, before: &Seen) -> Option<String> {
        // The restarts the call expects to see: one more when it began during a stop.
        let expected = before.restarts + i32::from(before.stopped.is_some());
        match &self.stopped {
            Some(why) => (self.restarts >= expected).then(|| why.clone()),
            None => (self.restarts > expected)
                .then(|| self.last.clone().unwrap_or_else(|| "restarted".into())),
        }
    }
}

/// The containers of the instance's assigned pods, by pod uid.
#[derive(Debug, Default)]
pub struct ContainerStops {
    pods: Mutex<HashMap<String, watch::Sender<Seen>>>,
}

impl ContainerStops {
    /// The watch saw `pod` (added or changed).
    pub fn applied(&self, pod: &Pod) {
        let Some(uid) = pod.uid() else { return };
        let seen = Seen::of(pod);
        let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        match pods.get(&uid) {
            Some(tx) => {
                tx.send_if_modified(|old| {
                    let changed = *old != seen;
                    *old = seen;
                    changed
                });
            }
            None => {
                pods.insert(uid, watch::channel(seen).0);
            }
        }
    }

    /// The pod is gone: its waiters are dropped with it (a deleted pod's calls fail on
    /// their own and are reported as deletions).
    pub fn deleted(&self, pod: &Pod) {
        if let Some(uid) = pod.uid() {
            self.pods
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&uid);
        }
    }

    /// Resolves with why the sandbox with `uid` stopped after this call; never, while it
    /// runs, or when the watch does not know it (yet).
    pub fn stopped(&self, uid: &str) -> BoxFuture<'static, String> {
        let rx = self
            .pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .map(watch::Sender::subscribe);
        // What the call began with, taken now, not when the future is first polled.
        let Some(mut rx) = rx else {
            return Box::pin(std::future::pending());
        };
        let before = rx.borrow_and_update().clone();
        Box::pin(async move {
            loop {
                if rx.changed().await.is_err() {
                    return std::future::pending().await;
                }
                if let Some(why) = rx.borrow_and_update().stopped_since(&before) {
                    return why;
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(uid: &str, restarts: i32, state: serde_json::Value, last: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "uid": uid},
            "status": {"containerStatuses": [{
                "name": "agent", "image": "i", "imageID": "", "ready": true,
                "restartCount": restarts, "state": state, "lastState": last,
            }]},
        }))
        .expect("pod")
    }

    fn running() -> serde_json::Value {
        json!({"running": {}})
    }

    #[tokio::test]
    async fn a_stop_seen_after_the_call_began_answers_it_with_the_reason() {
        let stops = ContainerStops::default();
        stops.applied(&pod("u", 0, running(), json!({})));
        let wait = stops.stopped("u");
        let waiter = tokio::spawn(wait);
        // A change that is not a stop wakes nothing.
        stops.applied(&pod("u", 0, running(), json!({})));
        stops.applied(&pod(
            "u",
            0,
            json!({"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
            json!({}),
        ));
        let why = waiter.await.expect("join");
        assert_eq!(why, "OOMKilled (exit code 137)");
    }

    #[tokio::test]
    async fn a_restart_counts_even_when_the_stop_itself_was_not_seen() {
        let stops = ContainerStops::default();
        stops.applied(&pod("u", 1, running(), json!({})));
        let waiter = tokio::spawn(stops.stopped("u"));
        stops.applied(&pod(
            "u",
            2,
            running(),
            json!({"terminated": {"exitCode": 128, "reason": "Error"}}),
        ));
        assert_eq!(waiter.await.expect("join"), "Error (exit code 128)");
    }

    #[test]
    fn a_call_begun_while_the_sandbox_was_down_is_not_answered_by_its_restart() {
        let oom = || json!({"terminated": {"exitCode": 128, "reason": "OOMKilled"}});
        let down = Seen::of(&pod("u", 0, oom(), json!({})));
        // Still down, then back (the restart that ends the stop the call began with).
        assert_eq!(down.stopped_since(&down), None);
        let back = Seen::of(&pod("u", 1, running(), oom()));
        assert_eq!(back.stopped_since(&down), None);
        // Down again, or back a second time: a stop of the call's own.
        let again = Seen::of(&pod("u", 1, oom(), oom()));
        assert_eq!(
            again.stopped_since(&down).as_deref(),
            Some("OOMKilled (exit code 128)")
        );
        let twice = Seen::of(&pod("u", 2, running(), oom()));
        assert!(twice.stopped_since(&down).is_some());
        // Begun while the kubelet failed to make it again (waiting, the stop in lastState):
        // the same, down until it is back.
        let waiting = json!({"waiting": {"reason": "CreateContainerError"}});
        let retrying = Seen::of(&pod("u", 0, waiting, oom()));
        assert_eq!(back.stopped_since(&retrying), None);
        assert!(again.stopped_since(&retrying).is_some());
        // Begun while running, a stop is one at once.
        let up = Seen::of(&pod("u", 0, running(), json!({})));
        assert!(down.stopped_since(&up).is_some());
        assert_eq!(up.stopped_since(&up), None);
    }

    #[tokio::test]
    async fn an_earlier_restart_or_an_unknown_pod_answers_nothing() {
        let stops = ContainerStops::default();
        stops.applied(&pod(
            "u",
            3,
            running(),
            json!({"terminated": {"exitCode": 1, "reason": "Error"}}),
        ));
        let wait = stops.stopped("u");
        let unknown = stops.stopped("nobody");
        let quiet = tokio::time::timeout(std::time::Duration::from_millis(50), async {
            tokio::join!(wait, unknown)
        })
        .await;
        assert!(quiet.is_err(), "nothing stopped after the calls began");
    }
}
