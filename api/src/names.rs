//! API group, label and annotation keys, and the names of every object cli-mcp creates.
//!
//! Names are built only here so the operator, the server and the docs never drift apart.
//! Every name is instance-scoped: two instances in one namespace never collide.

use std::fmt;

use serde::{Deserialize, Serialize};

use sha2::{Digest, Sha256};

use crate::SessionId;

/// Ten random characters `[a-z0-9]` naming one warm-pool pod. Built from caller-supplied
/// random bytes so this crate stays pure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSuffix(String);

impl PoolSuffix {
    pub const LEN: usize = 10;

    pub fn from_random_bytes(bytes: [u8; Self::LEN]) -> Self {
        const ALPHABET: &[u8; 36] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        // 256 % 36 skews a few letters slightly; uniqueness, not secrecy, is what matters.
        Self(
            bytes
                .iter()
                .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
                .collect(),
        )
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

pub const GROUP: &str = "cli-mcp.redhat.com";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "CliMcpInstance";
pub const PLURAL: &str = "climcpinstances";
/// Finalizer the operator puts on every instance.
pub const FINALIZER: &str = "cli-mcp.redhat.com/finalizer";
/// Field manager used for every server-side apply, so ownership of fields is stable.
pub const FIELD_MANAGER: &str = "cli-mcp-operator";

pub mod label {
    pub const INSTANCE: &str = "cli-mcp.redhat.com/instance";
    pub const COMPONENT: &str = "cli-mcp.redhat.com/component";
    pub const SESSION_ID: &str = "cli-mcp.redhat.com/session-id";
    pub const LAUNCH: &str = "cli-mcp.redhat.com/launch";

    pub const APP_NAME: &str = "app.kubernetes.io/name";
    pub const APP_INSTANCE: &str = "app.kubernetes.io/instance";
    pub const APP_COMPONENT: &str = "app.kubernetes.io/component";
    pub const APP_PART_OF: &str = "app.kubernetes.io/part-of";
    pub const APP_MANAGED_BY: &str = "app.kubernetes.io/managed-by";

    pub const COMPONENT_SERVER: &str = "server";
    pub const COMPONENT_SANDBOX: &str = "sandbox";
    pub const COMPONENT_PROXY: &str = "proxy";
    pub const COMPONENT_CLIENT: &str = "client";
    /// A session slot (a Lease): one of `maxSessions` places, or of a client's
    /// `maxSessionsPerClient`, held by one session's sandbox pod.
    pub const COMPONENT_SLOT: &str = "slot";
    pub const LAUNCH_WARM: &str = "warm";
    pub const LAUNCH_COLD: &str = "cold";
    pub const PART_OF: &str = "cli-mcp";
    pub const MANAGED_BY: &str = "cli-mcp-operator";
}

pub mod annotation {
    pub const CREATED_AT: &str = "cli-mcp.redhat.com/created-at";
    pub const LAST_ACTIVITY: &str = "cli-mcp.redhat.com/last-activity";
    pub const SANDBOX_HASH: &str = "cli-mcp.redhat.com/sandbox-hash";
    pub const TOKEN_SHA256: &str = "cli-mcp.redhat.com/token-sha256";
    /// The per-sandbox nonce the session token is bound to (not a secret; see
    /// `token::SandboxNonce`).
    pub const SANDBOX_NONCE: &str = "cli-mcp.redhat.com/sandbox-nonce";
    pub const OWNER: &str = "cli-mcp.redhat.com/owner";
    /// Who the session's pod serves: `{"user": …, "groups": [...]}` of the MCP caller that
    /// started or claimed it, as the server's TokenReview saw them. The credential proxy
    /// names them in its audit log and impersonates them on `impersonateCaller` targets;
    /// only cli-mcp's own identities may write a sandbox pod (the tenant pod policy).
    pub const CALLER: &str = "cli-mcp.redhat.com/caller";
    /// Set by the server just before it deletes a sandbox that holds no session state worth
    /// reporting (ended by `DELETE /sessions/{id}`, a duplicate that lost, a pod that never
    /// started or never accepted its session), so other replicas do not report its
    /// disappearance as a reset of the session's state.
    pub const RETIRED: &str = "cli-mcp.redhat.com/retired";
    /// The pod's seal: an HMAC under the instance key over its namespace, name and uid,
    /// written by the pod's writer right after the create (see `seal`). Routing and the warm
    /// pool trust a sandbox pod by this, never by its name, labels or other annotations.
    pub const SEAL: &str = "cli-mcp.redhat.com/seal";
}

/// Longest instance name: `cli-mcp-<n>-kubeconfig` must stay a 63-character DNS-1123 label.
pub const MAX_INSTANCE_NAME_LEN: usize = 44;

/// A validated `CliMcpInstance` name (DNS-1123 label of at most 44 characters).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct InstanceName(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InstanceNameError {
    #[error("instance name {name:?} is {len} characters long; at most 44 are allowed so that every derived object name fits in 63")]
    TooLong { name: String, len: usize },
    #[error("instance name {0:?} is not a DNS-1123 label (lowercase letters, digits and '-', starting and ending with a letter or digit)")]
    Invalid(String),
}

impl InstanceName {
    pub fn parse(s: &str) -> Result<Self, InstanceNameError> {
        if s.len() > MAX_INSTANCE_NAME_LEN {
            return Err(InstanceNameError::TooLong {
                name: s.to_owned(),
                len: s.len(),
            });
        }
        // A DNS-1123 label has the same grammar as a session id.
        SessionId::parse(s).map_err(|_| InstanceNameError::Invalid(s.to_owned()))?;
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn prefixed(&self, suffix: &str) -> String {
        format!("cli-mcp-{}{suffix}", self.0)
    }

    /// Deployment, Service, MCP ServiceAccount, Role and RoleBinding.
    pub fn server(&self) -> String {
        self.prefixed("")
    }
    /// Sandbox ServiceAccount and NetworkPolicy.
    pub fn sandbox(&self) -> String {
        self.prefixed("-sandbox")
    }
    /// The client ServiceAccount, Role and RoleBinding: who may use the MCP endpoint.
    pub fn client(&self) -> String {
        self.prefixed("-client")
    }
    pub fn hmac_secret(&self) -> String {
        self.prefixed("-hmac")
    }
    pub fn tls_secret(&self) -> String {
        self.prefixed("-tls")
    }
    pub fn kubeconfig_secret(&self) -> String {
        self.prefixed("-kubeconfig")
    }
    /// The credential proxy's Deployment, Service, ServiceAccount, ConfigMap (routes, the
    /// sandboxes' dummy kubeconfig and the proxy CA certificate), NetworkPolicy and
    /// PodDisruptionBudget.
    pub fn proxy(&self) -> String {
        self.prefixed("-proxy")
    }
    /// The generate-once proxy CA (certificate and key) the proxy mints leaf certificates from.
    pub fn proxy_ca_secret(&self) -> String {
        self.prefixed("-proxy-ca")
    }
    /// `http://cli-mcp-<n>-proxy.<ns>.svc:<port>`, the sandboxes' `HTTPS_PROXY`.
    pub fn proxy_url(&self, namespace: &str) -> String {
        format!(
            "http://{}.{namespace}.svc:{}",
            self.proxy(),
            crate::proxy::PROXY_PORT
        )
    }
    /// The per-instance ClusterRoleBinding to `system:auth-delegator`. It is cluster-scoped,
    /// so it carries the namespace too, plus 8 hex of sha256(`<ns>/<n>`): without them,
    /// namespace `a-b` + instance `c` and namespace `a` + instance `b-c` would share a binding
    /// and one tenant's teardown would break the other's auth.
    pub fn auth_delegator_binding(&self, namespace: &str) -> String {
        let digest = Sha256::digest(format!("{namespace}/{}", self.0).as_bytes());
        format!(
            "cli-mcp-{namespace}-{}-auth-delegator-{}",
            self.0,
            &hex::encode(digest)[..8]
        )
    }
    /// The pod of one session: `cli-mcp-<n>-s-<sid>-<h>`, `h` = 8 hex of sha256(`<n>/<sid>`).
    ///
    /// The product spec names it `cli-mcp-<n>-s-<sid>`, but that is ambiguous: instance `a` with
    /// session `s-b` and instance `a-s` with session `b` both give `cli-mcp-a-s-s-b`. The
    /// fixed-length suffix makes names of different instances differ (equal names would need
    /// equal lengths and a hash collision), while keeping the session id readable.
    pub fn session_pod(&self, sid: &SessionId) -> String {
        let digest = Sha256::digest(format!("{}/{}", self.0, sid).as_bytes());
        self.prefixed(&format!("-s-{sid}-{}", &hex::encode(digest)[..8]))
    }
    /// A warm-pool pod: `cli-mcp-<n>-pool-<suffix>`; the fixed-length suffix keeps it
    /// unambiguous (see [`InstanceName::session_pod`]).
    pub fn pool_pod(&self, suffix: &PoolSuffix) -> String {
        self.prefixed(&format!("-pool-{}", suffix.0))
    }
    /// Labels that select every object of this instance.
    pub fn selector(&self) -> String {
        format!("{}={}", label::INSTANCE, self.0)
    }
    /// Label selector of this instance's server pods (the Deployment's pod selector, also
    /// published as `status.selector` for the scale subresource).
    pub fn server_selector(&self) -> String {
        format!(
            "{}={},{}={}",
            label::INSTANCE,
            self.0,
            label::COMPONENT,
            label::COMPONENT_SERVER
        )
    }
    /// Label selector of this instance's sandbox pods.
    pub fn sandbox_selector(&self) -> String {
        format!(
            "{}={},{}={}",
            label::INSTANCE,
            self.0,
            label::COMPONENT,
            label::COMPONENT_SANDBOX
        )
    }
    /// Sandbox pods that belong to session `sid`.
    pub fn session_selector(&self, sid: &SessionId) -> String {
        format!("{},{}={sid}", self.sandbox_selector(), label::SESSION_ID)
    }
    /// Warm (unassigned) sandbox pods.
    pub fn unassigned_selector(&self) -> String {
        format!("{},!{}", self.sandbox_selector(), label::SESSION_ID)
    }
    /// Assigned sandbox pods of any session.
    pub fn assigned_selector(&self) -> String {
        format!("{},{}", self.sandbox_selector(), label::SESSION_ID)
    }
    /// Prefix of the instance's session slots (Leases): `cli-mcp-<n>-slot-<k>` for the
    /// instance's `maxSessions` places, `cli-mcp-<n>-slot-c<client>-<k>` for one client's
    /// `maxSessionsPerClient` places.
    pub fn slot_prefix(&self) -> String {
        self.prefixed("-slot-")
    }
    /// Label selector of the instance's session slots.
    pub fn slot_selector(&self) -> String {
        format!(
            "{}={},{}={}",
            label::INSTANCE,
            self.0,
            label::COMPONENT,
            label::COMPONENT_SLOT
        )
    }
}

impl TryFrom<String> for InstanceName {
    type Error = InstanceNameError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(&s)
    }
}

impl From<InstanceName> for String {
    fn from(n: InstanceName) -> Self {
        n.0
    }
}

impl fmt::Display for InstanceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for InstanceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InstanceName({})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn is_dns1123_label(s: &str) -> bool {
        SessionId::parse(s).is_ok()
    }

    /// Kubernetes' IsDNS1123Subdomain: no per-part length limit, 253 in total.
    fn is_dns1123_subdomain(s: &str) -> bool {
        let part_ok = |p: &str| {
            let b = p.as_bytes();
            let ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
            !b.is_empty()
                && b.first().is_some_and(ok)
                && b.last().is_some_and(ok)
                && b.iter().all(|c| ok(c) || *c == b'-')
        };
        s.len() <= 253 && s.split('.').all(part_ok)
    }

    #[test]
    fn names_follow_the_contract() {
        let n = InstanceName::parse("demo").expect("valid");
        let sid = SessionId::parse("abc").expect("valid");
        assert_eq!(n.server(), "cli-mcp-demo");
        assert_eq!(n.sandbox(), "cli-mcp-demo-sandbox");
        assert_eq!(n.hmac_secret(), "cli-mcp-demo-hmac");
        assert_eq!(n.tls_secret(), "cli-mcp-demo-tls");
        assert_eq!(n.kubeconfig_secret(), "cli-mcp-demo-kubeconfig");
        assert!(n.session_pod(&sid).starts_with("cli-mcp-demo-s-abc-"));
        assert_eq!(n.session_pod(&sid).len(), "cli-mcp-demo-s-abc-".len() + 8);
        assert_eq!(
            n.pool_pod(&PoolSuffix::from_random_bytes([
                0, 1, 2, 3, 4, 5, 6, 7, 8, 35
            ])),
            "cli-mcp-demo-pool-abcdefghi9"
        );
        assert_eq!(
            n.session_selector(&sid),
            "cli-mcp.redhat.com/instance=demo,cli-mcp.redhat.com/component=sandbox,cli-mcp.redhat.com/session-id=abc"
        );
        assert_eq!(
            n.server_selector(),
            "cli-mcp.redhat.com/instance=demo,cli-mcp.redhat.com/component=server"
        );
        assert_eq!(
            n.unassigned_selector(),
            "cli-mcp.redhat.com/instance=demo,cli-mcp.redhat.com/component=sandbox,!cli-mcp.redhat.com/session-id"
        );
    }

    #[test]
    fn auth_delegator_bindings_of_different_namespaces_never_collide() {
        let c = InstanceName::parse("c").expect("valid");
        let b_c = InstanceName::parse("b-c").expect("valid");
        assert_ne!(
            c.auth_delegator_binding("a-b"),
            b_c.auth_delegator_binding("a")
        );
        assert!(c
            .auth_delegator_binding("a-b")
            .starts_with("cli-mcp-a-b-c-auth-delegator-"));
    }

    #[test]
    fn instance_name_limit_is_44() {
        assert!(InstanceName::parse(&"a".repeat(44)).is_ok());
        let err = InstanceName::parse(&"a".repeat(45)).expect_err("45 is too long");
        assert!(err.to_string().contains("at most 44"), "{err}");
        assert!(matches!(
            InstanceName::parse("Bad"),
            Err(InstanceNameError::Invalid(_))
        ));
    }

    #[test]
    fn session_pods_of_two_instances_never_collide() {
        // The naive `cli-mcp-<n>-s-<sid>` gives `cli-mcp-a-s-s-b` for both pairs.
        let a = InstanceName::parse("a").expect("valid");
        let a_s = InstanceName::parse("a-s").expect("valid");
        let s_b = SessionId::parse("s-b").expect("valid");
        let b = SessionId::parse("b").expect("valid");
        assert_ne!(a.session_pod(&s_b), a_s.session_pod(&b));
    }

    proptest! {
        #[test]
        fn every_derived_name_is_valid(n in "[a-z0-9]([a-z0-9-]{0,42}[a-z0-9])?",
                                       sid in "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?") {
            let n = InstanceName::parse(&n).expect("generated valid");
            let sid = SessionId::parse(&sid).expect("generated valid");
            for label_name in [n.server(), n.sandbox(), n.hmac_secret(), n.tls_secret(), n.kubeconfig_secret()] {
                prop_assert!(label_name.len() <= 63 && is_dns1123_label(&label_name), "{}", label_name);
            }
            let pod = n.session_pod(&sid);
            prop_assert!(is_dns1123_subdomain(&pod), "{}", pod);
            let pool = n.pool_pod(&PoolSuffix::from_random_bytes([7; PoolSuffix::LEN]));
            prop_assert!(is_dns1123_subdomain(&pool), "{}", pool);
        }
    }
}
