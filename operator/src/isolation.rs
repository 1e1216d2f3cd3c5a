//! Whether the boundary around an instance is in force where it runs: the two conditions
//! `NetworkPolicyEnforced` and `PodSecurityEnforced`.
//!
//! The operator's NetworkPolicies and the sandbox pods' securityContext are correct whether
//! or not anything enforces them, so their presence says nothing. Each condition comes from
//! a probe that a working enforcer must refuse, made at most once per [`PROBE_EVERY`] per
//! instance (no pod is created for either):
//!
//! - **NetworkPolicy**: a TCP connection from the operator's own pod to a ready pod of the
//!   instance's credential proxy, at its own address. The proxy's ingress policy admits only
//!   the instance's sandboxes, so a connection that opens means nothing enforces policies
//!   there: any pod could use the proxy's identity, and sandboxes could reach the API server
//!   directly. The pod, not its Service: a Service whose endpoints the node has not
//!   programmed yet refuses every connection, enforced or not. The probe runs only while the
//!   proxy has a ready pod, and only from inside the cluster (connections from a node are
//!   never subject to NetworkPolicy).
//! - **Pod Security**: a server-side dry run (`dryRun=All`, nothing is stored) of a pool pod
//!   as the builder makes it but without `capabilities.drop: [ALL]`, which the `restricted`
//!   standard refuses and none of our admission policies checks. Refused by PodSecurity
//!   means `restricted` is enforced on the namespace; admitted means anyone who may create
//!   pods there can run privileged, host-namespace and hostPath pods beside the instance.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cli_mcp_api::names::PoolSuffix;
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};
use cli_mcp_api::token::Commitment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::Api;

/// How often each instance is probed again.
pub const PROBE_EVERY: Duration = Duration::from_secs(300);
/// A refused connection under kube-router is answered at once (REJECT); enforcers that drop
/// instead leave the connect hanging, which counts as refused after this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a proxy pod must have been Ready before it is probed: an enforcer programs a
/// new pod's rules after it sees the pod, and a probe of a pod it has not programmed yet
/// opens a connection and would report "not enforced" (and keep saying so until the next
/// probe) where policies are enforced. Until then the finding is `Settling`, and the
/// reconcile looks again after this long.
pub const SETTLE: Duration = Duration::from_secs(15);
/// The reason of a finding that waits for [`SETTLE`].
pub const SETTLING: &str = "Settling";

pub const NETWORK_POLICY_ENFORCED: &str = "NetworkPolicyEnforced";
pub const POD_SECURITY_ENFORCED: &str = "PodSecurityEnforced";

/// What one probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    Enforced(String),
    NotEnforced(String),
    /// Not probed (yet), or the probe could not tell; `reason` is a condition reason.
    Unknown {
        reason: &'static str,
        message: String,
    },
}

impl Finding {
    fn unknown(reason: &'static str, message: impl Into<String>) -> Self {
        Finding::Unknown {
            reason,
            message: message.into(),
        }
    }

    /// The condition's status, reason and message.
    pub fn condition(&self) -> (&'static str, &'static str, String) {
        match self {
            Finding::Enforced(m) => ("True", "Enforced", m.clone()),
            Finding::NotEnforced(m) => ("False", "NotEnforced", m.clone()),
            Finding::Unknown { reason, message } => ("Unknown", reason, message.clone()),
        }
    }
}

impl Default for Finding {
    fn default() -> Self {
        Finding::unknown("NotProbed", "not probed yet")
    }
}

/// Both findings of an instance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    pub network_policy: Finding,
    pub pod_security: Finding,
}

/// What the probes of one instance need, read by the reconcile.
pub struct ProbeTarget<'a> {
    pub uid: &'a str,
    /// Whether the proxy Deployment has a ready replica (only then is it probed).
    pub proxy_ready: bool,
    /// The label selector of the instance's proxy pods.
    pub proxy_selector: String,
    pub sandbox: &'a SandboxConfig,
    /// Pods of the instance's namespace (the dry run, the proxy's pods).
    pub pods: Api<Pod>,
}

/// The last known findings of every instance, each with when it was made.
#[derive(Debug, Default)]
struct Known {
    network_policy: Option<(Instant, Finding)>,
    pod_security: Option<(Instant, Finding)>,
}

/// A finding still fresh enough to reuse.
fn fresh(slot: &Option<(Instant, Finding)>) -> Option<Finding> {
    slot.as_ref()
        .filter(|(at, _)| at.elapsed() < PROBE_EVERY)
        .map(|(_, f)| f.clone())
}

/// Keeps `f` unless it could not be made (`Unknown`), which is tried again next time.
fn keep(slot: &mut Option<(Instant, Finding)>, f: &Finding) {
    if !matches!(f, Finding::Unknown { .. }) {
        *slot = Some((Instant::now(), f.clone()));
    }
}

/// The last findings of every instance.
#[derive(Debug)]
pub struct IsolationProbes {
    last: Mutex<HashMap<String, Known>>,
    /// Whether this process runs in a pod (else its connections come from a node).
    in_cluster: bool,
}

impl Default for IsolationProbes {
    fn default() -> Self {
        Self::new(std::env::var_os("KUBERNETES_SERVICE_HOST").is_some())
    }
}

impl IsolationProbes {
    pub fn new(in_cluster: bool) -> Self {
        IsolationProbes {
            last: Mutex::new(HashMap::new()),
            in_cluster,
        }
    }

    /// The instance's findings: each one cached while fresh, else probed anew.
    pub async fn observe(&self, t: ProbeTarget<'_>) -> Findings {
        let (np, psa) = {
            let last = self.lock();
            let known = last.get(t.uid);
            (
                known.and_then(|k| fresh(&k.network_policy)),
                known.and_then(|k| fresh(&k.pod_security)),
            )
        };
        let (network_policy, pod_security) = tokio::join!(
            async {
                match np {
                    Some(f) => f,
                    None if !self.in_cluster => network_policy(false, ProxyPod::None).await,
                    None => {
                        let proxy = if t.proxy_ready {
                            ready_pod_address(&t.pods, &t.proxy_selector).await
                        } else {
                            ProxyPod::None
                        };
                        network_policy(true, proxy).await
                    }
                }
            },
            async {
                match psa {
                    Some(f) => f,
                    None => pod_security(&t.pods, t.sandbox).await,
                }
            }
        );
        let mut last = self.lock();
        let known = last.entry(t.uid.to_owned()).or_default();
        keep(&mut known.network_policy, &network_policy);
        keep(&mut known.pod_security, &pod_security);
        Findings {
            network_policy,
            pod_security,
        }
    }

    /// Forgets a deleted instance.
    pub fn forget(&self, uid: &str) {
        self.lock().remove(uid);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Known>> {
        // The map holds only cached findings: one left behind by a panic is still usable.
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Which proxy pod to probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProxyPod {
    /// A pod Ready for at least [`SETTLE`]: its address (pod IP, proxy port).
    Settled(SocketAddr),
    /// Ready pods, all of them for less than [`SETTLE`].
    Settling,
    None,
}

/// A proxy pod to probe, if one is listed.
async fn ready_pod_address(pods: &Api<Pod>, selector: &str) -> ProxyPod {
    let Ok(list) = pods
        .list(&kube::api::ListParams::default().labels(selector))
        .await
    else {
        return ProxyPod::None;
    };
    pick_proxy_pod(&list.items, k8s_openapi::jiff::Timestamp::now())
}

/// The first pod Ready for at least [`SETTLE`] at `now`, else whether any is Ready at all.
fn pick_proxy_pod(pods: &[Pod], now: k8s_openapi::jiff::Timestamp) -> ProxyPod {
    let mut settling = false;
    for p in pods {
        if !cli_mcp_api::pod_state::is_ready(p) || cli_mcp_api::pod_state::is_deleting(p) {
            continue;
        }
        let status = p.status.as_ref();
        let Some(ip) = status
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
        else {
            continue;
        };
        let ready_since = status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
            .and_then(|c| c.last_transition_time.as_ref())
            .map(|t| t.0);
        let settled =
            ready_since.is_some_and(|t| now.duration_since(t).unsigned_abs() >= SETTLE && t <= now);
        if settled {
            return ProxyPod::Settled(SocketAddr::new(ip, cli_mcp_api::proxy::PROXY_PORT));
        }
        settling = true;
    }
    if settling {
        ProxyPod::Settling
    } else {
        ProxyPod::None
    }
}

async fn network_policy(in_cluster: bool, proxy: ProxyPod) -> Finding {
    if !in_cluster {
        return Finding::unknown(
            "NotProbed",
            "the operator runs outside the cluster: its connections come from a node, which \
             NetworkPolicy never restricts, so it cannot tell whether policies are enforced",
        );
    }
    let addr = match proxy {
        ProxyPod::Settled(addr) => addr,
        ProxyPod::Settling => {
            return Finding::unknown(
                SETTLING,
                format!(
                    "the credential proxy's pods became ready less than {}s ago; probed once \
                     an enforcer has had time to program them",
                    SETTLE.as_secs()
                ),
            )
        }
        ProxyPod::None => {
            return Finding::unknown("NotProbed", "the credential proxy has no ready pod yet")
        }
    };
    match connect_outcome(addr).await {
        Connect::Opened => Finding::NotEnforced(format!(
            "the operator opened a connection to the credential proxy ({addr}), which the \
             proxy's NetworkPolicy admits only from this instance's sandboxes: nothing \
             enforces NetworkPolicy here, so any pod can use the proxy's identity and \
             sandboxes can reach the API server and other pods directly. Run a network \
             plugin that enforces NetworkPolicy (docs/network-policy.md)"
        )),
        Connect::Refused(how) => Finding::Enforced(format!(
            "a connection from the operator to the credential proxy ({addr}) was {how}, as \
             its NetworkPolicy requires"
        )),
    }
}

enum Connect {
    Opened,
    Refused(&'static str),
}

async fn connect_outcome(addr: SocketAddr) -> Connect {
    match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Connect::Opened,
        Ok(Err(_)) => Connect::Refused("refused"),
        Err(_) => Connect::Refused("dropped (no answer within 2 s)"),
    }
}

/// A pool pod as the builder makes it, less `capabilities.drop: [ALL]`: what `restricted`
/// refuses and nothing else of ours does. Its RuntimeClass is left out too: Pod Security
/// does not read it, and a class the cluster lacks would have the probe refused by the
/// RuntimeClass admission instead (the instance says `RuntimeClassNotFound` for that).
pub fn pod_security_probe(sandbox: &SandboxConfig) -> Pod {
    let role = SandboxRole::Pool {
        suffix: PoolSuffix::from_random_bytes(rand::random()),
        assign: Commitment::of("pod-security-probe"),
    };
    let mut pod = build_sandbox_pod(sandbox, &role, "1970-01-01T00:00:00Z");
    if let Some(spec) = pod.spec.as_mut() {
        spec.runtime_class_name = None;
        for c in &mut spec.containers {
            if let Some(caps) = c
                .security_context
                .as_mut()
                .and_then(|s| s.capabilities.as_mut())
            {
                caps.drop = None;
            }
        }
    }
    pod
}

async fn pod_security(pods: &Api<Pod>, sandbox: &SandboxConfig) -> Finding {
    let pp = PostParams {
        dry_run: true,
        field_manager: Some(cli_mcp_api::names::FIELD_MANAGER.into()),
    };
    classify_pod_security(pods.create(&pp, &pod_security_probe(sandbox)).await.err())
}

/// The finding for the dry run's outcome (`None`: it was admitted).
fn classify_pod_security(refused: Option<kube::Error>) -> Finding {
    let Some(e) = refused else {
        return Finding::NotEnforced(
            "a pod without `capabilities.drop: [ALL]` was admitted in this namespace (a dry \
             run): Pod Security `restricted` is not enforced, so whoever may create pods \
             here can run privileged, host-namespace and hostPath pods beside the \
             instance. Label the namespace pod-security.kubernetes.io/enforce=restricted"
                .into(),
        );
    };
    match &e {
        kube::Error::Api(s) if s.message.contains("violates PodSecurity") => {
            Finding::Enforced(format!(
                "Pod Security refuses a pod that `restricted` forbids in this namespace: {}",
                s.message
            ))
        }
        _ => Finding::unknown(
            "ProbeFailed",
            format!("the Pod Security probe (a dry-run pod create) failed: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli_mcp_api::names::InstanceName;

    fn sandbox() -> SandboxConfig {
        SandboxConfig::new(InstanceName::parse("demo").expect("name"), "ns", "img")
    }

    #[test]
    fn the_pod_security_probe_lacks_only_the_capability_drop() {
        let probe = pod_security_probe(&sandbox());
        let c = &probe.spec.as_ref().expect("spec").containers[0];
        let sc = c.security_context.as_ref().expect("securityContext");
        assert_eq!(sc.capabilities.as_ref().and_then(|c| c.drop.clone()), None);
        // Everything else our own admission policy checks is as the builder makes it.
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.run_as_non_root, Some(true));
        let pod_sc = probe.spec.as_ref().and_then(|s| s.security_context.clone());
        assert_eq!(
            pod_sc
                .and_then(|s| s.seccomp_profile)
                .map(|p| p.type_)
                .as_deref(),
            Some("RuntimeDefault")
        );
    }

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Forbidden")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn a_dry_run_is_read_by_who_refused_it() {
        assert!(matches!(
            classify_pod_security(None),
            Finding::NotEnforced(_)
        ));
        let psa = api_error(
            403,
            "pods \"x\" is forbidden: violates PodSecurity \"restricted:latest\": \
             unrestricted capabilities (container \"agent\" must set \
             securityContext.capabilities.drop=[\"ALL\"])",
        );
        assert!(matches!(
            classify_pod_security(Some(psa)),
            Finding::Enforced(_)
        ));
        // Another refusal (a quota, a webhook) says nothing about Pod Security.
        let quota = api_error(403, "exceeded quota: pods");
        let f = classify_pod_security(Some(quota));
        assert_eq!(f.condition().0, "Unknown", "{f:?}");
    }

    #[tokio::test]
    async fn an_open_connection_means_not_enforced_and_a_refused_one_enforced() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let open = listener.local_addr().expect("addr");
        let f = network_policy(true, ProxyPod::Settled(open)).await;
        assert!(matches!(f, Finding::NotEnforced(_)), "{f:?}");
        drop(listener);
        // Nothing listens there any more: refused at once, as a REJECT rule answers.
        let f = network_policy(true, ProxyPod::Settled(open)).await;
        assert!(matches!(f, Finding::Enforced(_)), "{f:?}");
        // Outside the cluster, or without a proxy endpoint, nothing is claimed.
        let f = network_policy(false, ProxyPod::Settled(open)).await;
        assert_eq!(f.condition().0, "Unknown");
        let f = network_policy(true, ProxyPod::None).await;
        assert_eq!(f.condition().0, "Unknown");
    }

    fn proxy_pod(ip: &str, ready_since: Option<k8s_openapi::jiff::Timestamp>) -> Pod {
        use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        Pod {
            status: Some(PodStatus {
                pod_ip: Some(ip.into()),
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready_since.is_some() {
                        "True"
                    } else {
                        "False"
                    }
                    .into(),
                    last_transition_time: ready_since.map(Time),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_proxy_pod_ready_long_enough_for_an_enforcer_is_probed() {
        let now = k8s_openapi::jiff::Timestamp::now();
        let ago = |s: i64| Some(now - k8s_openapi::jiff::SignedDuration::from_secs(s));
        // Just ready: an enforcer may not have programmed it; probing it would read "open".
        assert_eq!(
            pick_proxy_pod(&[proxy_pod("10.0.0.1", ago(2))], now),
            ProxyPod::Settling
        );
        let settled = pick_proxy_pod(
            &[
                proxy_pod("10.0.0.1", ago(2)),
                proxy_pod("10.0.0.2", ago(30)),
            ],
            now,
        );
        assert_eq!(
            settled,
            ProxyPod::Settled(SocketAddr::new(
                "10.0.0.2".parse().expect("ip"),
                cli_mcp_api::proxy::PROXY_PORT
            ))
        );
        assert_eq!(
            pick_proxy_pod(&[proxy_pod("10.0.0.1", None)], now),
            ProxyPod::None
        );
        assert_eq!(pick_proxy_pod(&[], now), ProxyPod::None);
    }

    #[test]
    fn known_findings_are_kept_while_fresh_and_unknown_ones_never() {
        let mut slot = None;
        keep(&mut slot, &Finding::default());
        assert_eq!(fresh(&slot), None, "an unknown finding is probed again");
        keep(&mut slot, &Finding::Enforced("x".into()));
        assert_eq!(fresh(&slot), Some(Finding::Enforced("x".into())));
        let stale = Instant::now().checked_sub(PROBE_EVERY + Duration::from_secs(1));
        if let Some(at) = stale {
            slot = Some((at, Finding::Enforced("x".into())));
            assert_eq!(fresh(&slot), None, "a stale finding is probed again");
        }
        let probes = IsolationProbes::new(false);
        probes.lock().insert("uid".into(), Known::default());
        probes.forget("uid");
        assert!(probes.lock().is_empty());
    }
}
