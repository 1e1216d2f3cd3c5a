//! Which sandbox sent a connection, proven, never guessed from where it comes from.
//!
//! Each CONNECT carries `Proxy-Authorization: Bearer <token>` (the agent's relay in the
//! sandbox adds it): the pod's projected ServiceAccount token, whose audience only this
//! instance's proxy accepts. A connection is served only when all of this holds:
//! 1. a TokenReview ([`review`]) says the token is valid for this audience, belongs to the
//!    instance's sandbox ServiceAccount and is bound to a pod that still exists;
//! 2. that pod ([`pods`]) is sealed under the instance key (its server or operator made it),
//!    is not being deleted and serves a session;
//! 3. the connection comes from that pod's IP: a token copied out of its pod is worthless.
//!
//! Anything else gets `407` (no valid token) or `403` (a valid token for something that is
//! not, or no longer, a serving sandbox here) and nothing is dialled. The admitted
//! [`Sandbox`] names the session and the MCP caller for the audit log and impersonation, and
//! is revoked the moment its pod stops serving the session.

pub mod pods;
pub mod review;

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderValue, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tokio::sync::watch;

use cli_mcp_api::names::InstanceName;
use cli_mcp_api::proxy::{sandbox_token_audience, SessionCaller, SANDBOX_TOKEN_DIR};
use cli_mcp_api::token::HmacKey;

use crate::refusal::Refusal;
use pods::{Admission, PodView, Pods};
use review::{ReviewError, Reviewed, Reviewer, MAX_TOKEN_LEN};

/// How long a CONNECT waits for the pod watch to show what the review vouched for (see
/// [`Pods::admit_within`]).
const WATCH_LAG: std::time::Duration = std::time::Duration::from_secs(3);

/// A connection's proven sandbox.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub pod: String,
    pub session: String,
    pub caller: Option<SessionCaller>,
    revoked: watch::Receiver<bool>,
}

impl Sandbox {
    /// Whether the pod stopped serving the session since it was admitted.
    pub fn is_revoked(&self) -> bool {
        *self.revoked.borrow()
    }

    /// Completes once the pod stops serving the session (at once if it already has).
    pub async fn revoked(&self) {
        let mut rx = self.revoked.clone();
        // An error means the sender is gone, which happens only on revocation.
        let _ = rx.wait_for(|r| *r).await;
    }
}

/// The sandbox identity check of one instance's proxy.
pub struct Identity {
    reviewer: Reviewer,
    pods: Pods,
    namespace: String,
    instance: InstanceName,
    service_account: String,
}

impl Identity {
    /// Starts the pod watch (its task lives as long as the returned handle's runtime) with
    /// the proxy's own in-cluster identity.
    pub fn start(
        client: kube::Client,
        namespace: &str,
        instance: InstanceName,
        key: HmacKey,
    ) -> Self {
        let pods = Pods::default();
        let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
        tokio::spawn(pods.clone().watch(api, instance.to_string(), key));
        Self {
            reviewer: Reviewer::new(client, sandbox_token_audience(namespace, instance.as_str())),
            pods,
            namespace: namespace.to_owned(),
            service_account: format!(
                "system:serviceaccount:{namespace}:cli-mcp-{instance}-sandbox"
            ),
            instance,
        }
    }

    /// `None` when ready to admit; else why not (for `/readyz`).
    pub fn not_ready(&self) -> Option<&'static str> {
        (!self.pods.synced()).then_some("the sandbox pods have not been listed yet")
    }

    /// The sandbox `peer` proves to be with `authorization` (the CONNECT's
    /// `Proxy-Authorization`), or the refusal.
    pub async fn admit(
        &self,
        peer: IpAddr,
        authorization: Option<&HeaderValue>,
    ) -> Result<Arc<Sandbox>, Refusal> {
        let token = bearer(authorization).map_err(|why| self.unauthenticated(why))?;
        let (pod_name, uid) = match self.reviewer.review(token).await {
            Ok(Reviewed::Pod {
                username,
                pod_name,
                pod_uid,
            }) if username == self.service_account => (pod_name, pod_uid),
            Ok(Reviewed::Pod { username, .. } | Reviewed::Unbound { username }) => {
                return Err(self.not_a_sandbox(format!(
                    "the token belongs to {username}, not to a sandbox pod of this instance"
                )))
            }
            Ok(Reviewed::Invalid(why)) => return Err(self.unauthenticated(&why)),
            Err(e @ ReviewError::Busy) | Err(e @ ReviewError::Api(_)) => {
                return Err(Refusal::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "identity_unavailable",
                    format!("the proxy cannot check the sandbox's token now ({e}); retry"),
                ))
            }
        };
        let admission = self
            .pods
            .admit_within(&uid, WATCH_LAG)
            .await
            .map_err(|view| self.not_serving(&pod_name, view))?;
        let Admission {
            view,
            session,
            revoked,
        } = admission;
        if view.ip != Some(peer.to_canonical()) {
            return Err(Refusal::new(
                StatusCode::FORBIDDEN,
                "wrong_source",
                format!(
                    "the token belongs to sandbox pod {pod_name}, and this connection does not \
                     come from it: a sandbox's token is worth nothing outside its pod"
                ),
            ));
        }
        Ok(Arc::new(Sandbox {
            pod: view.name,
            session,
            caller: view.caller,
            revoked,
        }))
    }

    fn unauthenticated(&self, why: &str) -> Refusal {
        Refusal::new(
            StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            "proxy_auth_invalid",
            format!(
                "this proxy serves only the sandboxes of cli-mcp instance {}/{}, each proving \
                 itself with its pod's token ({SANDBOX_TOKEN_DIR}/token, as \
                 Proxy-Authorization: Bearer; the sandbox's HTTPS_PROXY adds it): {why}",
                self.namespace, self.instance
            ),
        )
    }

    fn not_a_sandbox(&self, why: String) -> Refusal {
        Refusal::new(StatusCode::FORBIDDEN, "not_a_sandbox", why)
    }

    fn not_serving(&self, pod: &str, view: Option<PodView>) -> Refusal {
        // Each its own reason: a plant (not sealed) must stand out in the metrics from the
        // ordinary end of a session.
        let (reason, why) = match view {
            None => (
                "session_ended",
                "is not a sandbox pod of this instance (or is gone)",
            ),
            Some(v) if v.deleting => ("session_ended", "is being deleted: its session has ended"),
            Some(v) if v.terminal => ("session_ended", "has stopped (failed, evicted or done)"),
            Some(v) if !v.sealed => (
                "not_sealed",
                "is not sealed by the instance: cli-mcp did not make it",
            ),
            Some(v) if v.session.is_none() => {
                ("no_session", "is a warm pod that serves no session yet")
            }
            Some(_) => ("no_session", "has no IP yet"),
        };
        Refusal::new(
            StatusCode::FORBIDDEN,
            reason,
            format!("the token's pod {pod} {why}"),
        )
    }
}

/// The token of a `Proxy-Authorization: Bearer <token>` header.
fn bearer(h: Option<&HeaderValue>) -> Result<&str, &'static str> {
    let h = h.ok_or("no Proxy-Authorization header")?;
    let h = h
        .to_str()
        .map_err(|_| "a malformed Proxy-Authorization header")?;
    let (scheme, rest) = h
        .split_once(' ')
        .ok_or("a malformed Proxy-Authorization header")?;
    let rest = rest.trim();
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err("Proxy-Authorization must be Bearer <token>");
    }
    let token = rest;
    if token.is_empty() || token.len() > MAX_TOKEN_LEN {
        return Err("an empty or oversized token");
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bearer_token_is_read() {
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert_eq!(bearer(Some(&h("Bearer abc"))), Ok("abc"));
        assert_eq!(bearer(Some(&h("bearer  abc "))), Ok("abc"));
        assert!(bearer(None).is_err());
        assert!(bearer(Some(&h("Bearer "))).is_err());
        assert!(bearer(Some(&h("Basic dXNlcjp0b2tlbg=="))).is_err());
        assert!(bearer(Some(&h("Token abc"))).is_err());
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_LEN + 1));
        assert!(bearer(Some(&h(&long))).is_err());
    }
}
