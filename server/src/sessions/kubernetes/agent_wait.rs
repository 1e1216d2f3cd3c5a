//! Waiting for a sandbox's agent: a new pod until it is Ready (or its agent answers), an
//! existing session pod until its agent accepts connections again (right after its
//! container died the pod still exists and may still say Ready, but nothing listens until
//! the kubelet has restarted the container), and the `/assign` of a claimed warm pod.
//!
//! [`AgentWait`] is shared by the lookup (adopting a pod that exists) and the start (a pod it
//! has just claimed or created).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::wait::await_condition;
use kube::ResourceExt;

use cli_mcp_api::names::label;
use cli_mcp_api::pod_state::{is_deleting, is_ready, is_terminal};
use cli_mcp_api::sandbox::session_token_of;
use cli_mcp_api::token::HmacKey;
use cli_mcp_api::wire::{AssignRequest, AGENT_PORT};
use cli_mcp_api::SessionId;

use super::pods::{
    agent_running, deleted_while_starting, endpoint_of, has_launch, pending_reason, pod_ip,
    start_failure, SandboxPods,
};
use crate::agent_client::AgentClient;
use crate::sessions::SessionError;

/// How long a call waits for the agent of an existing session pod to accept connections
/// again after its container died (the kubelet restarts it, after a back-off from the second
/// crash on).
const AGENT_RESTART_WAIT: Duration = Duration::from_secs(30);

/// Waits for sandbox agents, and assigns claimed warm pods; cheap to clone.
#[derive(Debug, Clone)]
pub struct AgentWait {
    pods: SandboxPods,
    agent: AgentClient,
    key: HmacKey,
    /// `--start-timeout`: the longest wait for a pod to become Ready.
    start_timeout: Duration,
}

impl AgentWait {
    pub fn new(
        pods: SandboxPods,
        agent: AgentClient,
        key: HmacKey,
        start_timeout: Duration,
    ) -> Self {
        Self {
            pods,
            agent,
            key,
            start_timeout,
        }
    }

    /// The existing pod of a session, once its agent accepts connections (and, for a claimed
    /// warm pod, its assignment). Right after the agent's container died the pod still exists
    /// and may still say Ready, but nothing listens until the kubelet has restarted the
    /// container: wait for that, bounded, rather than fail as if the sandbox could not start.
    pub async fn await_agent(&self, mut pod: Pod, sid: &SessionId) -> Result<Pod, SessionError> {
        let name = pod.name_any();
        let deadline = tokio::time::Instant::now() + AGENT_RESTART_WAIT.min(self.start_timeout);
        let mut pause = Duration::from_millis(100);
        loop {
            let reason = match self.agent_listens(&pod).await {
                Err(e) => e,
                Ok(()) => return self.ensure_assigned(&pod, sid).await.map(|()| pod),
            };
            if tokio::time::Instant::now() + pause > deadline {
                // Still crash-looping after the wait: the agent does not come back by itself
                // soon, so the pod is replaced as one that cannot start.
                if let Some(why) = start_failure(&pod) {
                    self.pods.delete(&pod).await;
                    return Err(SessionError::Sandbox(format!(
                        "the agent of pod {name} keeps crashing ({why}); the pod was deleted, and the next call starts a new sandbox"
                    )));
                }
                return Err(SessionError::Restarting(format!(
                    "pod {name} still does not answer after {:?} ({reason})",
                    AGENT_RESTART_WAIT.min(self.start_timeout)
                )));
            }
            tracing::info!(session = %sid, pod = %name, reason = %reason,
                "the session's agent does not answer (restarting?); waiting for it");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
            // The pod may have been deleted or have failed meanwhile, or got a new IP.
            match self.pods.api().get_opt(&name).await? {
                Some(p) if p.uid() == pod.uid() && !is_deleting(&p) && !is_terminal(&p) => pod = p,
                _ => {
                    return Err(SessionError::Sandbox(format!(
                        "pod {name} went away while its agent was restarting; the next call starts a new sandbox"
                    )))
                }
            }
        }
    }

    /// Whether something accepts TCP connections on the pod's agent port.
    async fn agent_listens(&self, pod: &Pod) -> Result<(), String> {
        let addr = agent_addr(pod)?;
        match tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr))
            .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("connecting to the agent at {addr}: {e}")),
            Err(_) => Err(format!(
                "connecting to the agent at {addr}: no answer within 3s"
            )),
        }
    }

    /// Waits until `pod`'s agent can be used: Ready with an IP (watched, not polled), or —
    /// once its container runs with an IP — its agent answering `/healthz` to the server
    /// directly. The kubelet probes readiness once a second, so without the direct check a
    /// cold start would wait up to a second for a probe that asks the same question. A pod
    /// that cannot start is deleted, so the next call starts a fresh one.
    pub async fn wait_ready(&self, pod: Pod) -> Result<Pod, SessionError> {
        if is_ready(&pod) && pod_ip(&pod).is_some() {
            return Ok(pod);
        }
        let name = pod.name_any();
        let uid = pod.uid();
        let settled = |want: Option<String>| {
            move |p: Option<&Pod>| match p {
                None => true,
                Some(p) => {
                    p.uid() != want
                        || is_deleting(p)
                        || (is_ready(p) && pod_ip(p).is_some())
                        || start_failure(p).is_some()
                }
            }
        };
        let deadline = tokio::time::Instant::now() + self.start_timeout;
        let want = uid.clone();
        let running = move |p: Option<&Pod>| {
            settled(want.clone())(p) || p.is_some_and(|p| agent_running(p) && pod_ip(p).is_some())
        };
        let waited = match tokio::time::timeout_at(
            deadline,
            await_condition(self.pods.api().clone(), &name, running),
        )
        .await
        {
            Ok(Ok(Some(p))) if p.uid() == uid && !is_deleting(&p) && !is_ready(&p) => {
                match (start_failure(&p), endpoint_of(&p)) {
                    (None, Some(endpoint)) => {
                        tokio::select! {
                            () = self.until_healthy(&endpoint) => return Ok(p),
                            w = tokio::time::timeout_at(
                                deadline,
                                await_condition(self.pods.api().clone(), &name, settled(uid.clone())),
                            ) => w,
                        }
                    }
                    _ => Ok(Ok(Some(p))),
                }
            }
            other => other,
        };
        let outcome: Result<(), String> = match waited {
            Err(_) => {
                let why = self
                    .pods
                    .api()
                    .get_opt(&name)
                    .await
                    .ok()
                    .flatten()
                    .map(|p| pending_reason(&p))
                    .unwrap_or_default();
                Err(format!(
                    "pod {name} did not become ready within {:?}{why}",
                    self.start_timeout
                ))
            }
            Ok(Err(e)) => return Err(SessionError::Kubernetes(e.to_string())),
            Ok(Ok(None)) => return Err(deleted_while_starting(&name)),
            Ok(Ok(Some(p))) if p.uid() != uid || is_deleting(&p) => {
                return Err(deleted_while_starting(&name))
            }
            Ok(Ok(Some(p))) => match start_failure(&p) {
                Some(reason) => Err(format!("pod {name} cannot start: {reason}")),
                None => return Ok(p),
            },
        };
        let msg = outcome.err().unwrap_or_default();
        self.pods.retire(&pod, "never-started").await;
        Err(SessionError::Sandbox(format!(
            "{msg}; it was deleted, and the next call starts a new sandbox (check the instance's sandbox image and resources)"
        )))
    }

    /// Returns once the agent at `endpoint` answers `/healthz`; the caller bounds the wait.
    /// Polls (the agent cannot announce itself), from 5 ms up to 100 ms apart: a container
    /// that has just started usually answers within tens of milliseconds.
    async fn until_healthy(&self, endpoint: &str) {
        let mut pause = Duration::from_millis(5);
        while !self.agent.healthy(endpoint).await {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// `POST /assign` on a warm pod (idempotent in the agent: a repeat of the same
    /// assignment succeeds).
    pub async fn assign(
        &self,
        pod: &Pod,
        sid: &SessionId,
        token_sha256: &str,
    ) -> Result<(), String> {
        let endpoint = endpoint_of(pod).ok_or("the pod has no IP")?;
        let req = AssignRequest {
            session_id: sid.clone(),
            token_sha256: token_sha256.to_owned(),
        };
        self.agent
            .assign(&endpoint, &self.key.assign_token(&pod.name_any()), &req)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// A claimed warm pod found by label may not have had its `/assign` yet (its claimer is
    /// still on the way): assign it ourselves; the agent accepts a repeat of the same
    /// assignment.
    async fn ensure_assigned(&self, pod: &Pod, sid: &SessionId) -> Result<(), SessionError> {
        if !has_launch(pod, label::LAUNCH_WARM) || !is_ready(pod) {
            return Ok(());
        }
        let token = session_token_of(pod, sid, &self.key).ok_or_else(|| {
            SessionError::Sandbox(format!(
                "pod {} was claimed for session {sid} without a token of this server's key",
                pod.name_any()
            ))
        })?;
        self.assign(pod, sid, &token.commitment().to_hex())
            .await
            .map_err(|e| {
                SessionError::Sandbox(format!(
                    "pod {} did not accept /assign: {e}",
                    pod.name_any()
                ))
            })
    }
}

/// The address of the pod's agent: its IP, the agent's port.
fn agent_addr(pod: &Pod) -> Result<std::net::SocketAddr, String> {
    let ip = pod_ip(pod).ok_or("the pod has no IP")?;
    match ip.parse::<std::net::IpAddr>() {
        Ok(ip) => Ok(std::net::SocketAddr::new(ip, AGENT_PORT)),
        Err(e) => Err(format!("pod IP {ip}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_ip(ip: Option<&str>) -> Pod {
        Pod {
            status: Some(k8s_openapi::api::core::v1::PodStatus {
                pod_ip: ip.map(str::to_owned),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_agent_is_reached_on_its_port_at_the_pods_ip() {
        let v4 = agent_addr(&with_ip(Some("10.244.1.7"))).expect("v4");
        assert_eq!(v4.to_string(), format!("10.244.1.7:{AGENT_PORT}"));
        let v6 = agent_addr(&with_ip(Some("fd00::5"))).expect("v6");
        assert_eq!(v6.to_string(), format!("[fd00::5]:{AGENT_PORT}"));
        assert!(agent_addr(&with_ip(None)).is_err(), "no IP yet");
        assert!(
            agent_addr(&with_ip(Some(""))).is_err(),
            "an empty IP is none"
        );
        let bad = agent_addr(&with_ip(Some("not-an-ip"))).expect_err("bad IP");
        assert!(bad.contains("not-an-ip"), "{bad}");
    }
}
