//! Waiting for the agent of an existing session pod: right after its container died the pod
//! still exists and may still say Ready, but nothing listens until the kubelet has restarted
//! the container.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use cli_mcp_api::pod_state::{is_deleting, is_terminal};
use cli_mcp_api::wire::AGENT_PORT;
use cli_mcp_api::SessionId;

use super::pods::{pod_ip, start_failure};
use super::KubeBackend;
use crate::sessions::SessionError;

/// How long a call waits for the agent of an existing session pod to accept connections
/// again after its container died (the kubelet restarts it, after a back-off from the second
/// crash on).
pub(super) const AGENT_RESTART_WAIT: Duration = Duration::from_secs(30);

impl KubeBackend {
    /// The existing pod of a session, once its agent accepts connections (and, for a claimed
    /// warm pod, its assignment). Right after the agent's container died the pod still exists
    /// and may still say Ready, but nothing listens until the kubelet has restarted the
    /// container: wait for that, bounded, rather than fail as if the sandbox could not start.
    pub(super) async fn await_agent(
        &self,
        mut pod: Pod,
        sid: &SessionId,
    ) -> Result<Pod, SessionError> {
        let name = pod.name_any();
        let deadline =
            tokio::time::Instant::now() + AGENT_RESTART_WAIT.min(self.limits.start_timeout);
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
                    self.delete_pod(&pod).await;
                    return Err(SessionError::Sandbox(format!(
                        "the agent of pod {name} keeps crashing ({why}); the pod was deleted, and the next call starts a new sandbox"
                    )));
                }
                return Err(SessionError::Restarting(format!(
                    "pod {name} still does not answer after {:?} ({reason})",
                    AGENT_RESTART_WAIT.min(self.limits.start_timeout)
                )));
            }
            tracing::info!(session = %sid, pod = %name, reason = %reason,
                "the session's agent does not answer (restarting?); waiting for it");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
            // The pod may have been deleted or have failed meanwhile, or got a new IP.
            match self.pods.get_opt(&name).await? {
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
    pub(super) async fn agent_listens(&self, pod: &Pod) -> Result<(), String> {
        let ip = pod_ip(pod).ok_or("the pod has no IP")?;
        let addr = match ip.parse::<std::net::IpAddr>() {
            Ok(ip) => std::net::SocketAddr::new(ip, AGENT_PORT),
            Err(e) => return Err(format!("pod IP {ip}: {e}")),
        };
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
}
