//! Status computed from observed state. Pure: [`compute`] takes what the reconcile saw and
//! the previous status, and returns the new one; [`transitions`] lists the condition changes
//! that deserve an Event.
//!
//! Reasons are stable API (documented in docs/operations.md):
//! - `Ready`: `Ready` | `InvalidSpec` | `SecretsNotFound` | `SecretKeysInvalid` |
//!   `ServingCertificatePending` | `KubeconfigInvalid` | `ProxyCaInvalid` | `ApplyFailed` |
//!   `RuntimeClassNotFound` | `ProxyUnavailable` | `DeploymentUnavailable` |
//!   `WarmPoolFilling` | `WarmPoolUnhealthy`
//! - `WarmPoolReady`: `Full` | `Disabled` | `Filling` | `PodsFailing` | `Blocked`
//! - `Degraded`: `AsExpected` | `InvalidSpec` | `ApplyFailed` | `PoolPodsFailing` |
//!   `ApiServerUnknown` | `ExposeUnavailable`
//! - `NetworkPolicyEnforced`, `PodSecurityEnforced`: `Enforced` | `NotEnforced` | `NotProbed` |
//!   `ProbeFailed` ([`crate::isolation`])

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use cli_mcp_api::crd::{CliMcpInstanceStatus, SandboxStatus, WarmPoolStatus};

use crate::isolation::{Finding, Findings, NETWORK_POLICY_ENFORCED, POD_SECURITY_ENFORCED};
use crate::pool::PoolOutcome;

pub const READY: &str = "Ready";
pub const WARM_POOL_READY: &str = "WarmPoolReady";
pub const DEGRADED: &str = "Degraded";

/// The server Deployment as observed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeploymentState {
    pub replicas: i32,
    pub ready: i32,
    /// Available=True for the current generation.
    pub available: bool,
    pub message: String,
}

impl DeploymentState {
    /// `ready/replicas ready replicas`, with the first failing condition's message.
    pub fn replicas_summary(&self) -> String {
        let mut s = format!("{}/{} ready replicas", self.ready, self.replicas);
        if !self.message.is_empty() {
            s.push_str(": ");
            s.push_str(&self.message);
        }
        s
    }
}

/// Everything the status is computed from.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub generation: Option<i64>,
    /// The spec cannot be used (only for objects that bypassed admission).
    pub spec_error: Option<String>,
    /// Required Secrets that do not exist (`name (what it is for)`).
    pub missing_secrets: Vec<String>,
    /// Required Secrets whose keys are missing or unusable.
    pub invalid_secrets: Vec<String>,
    /// The admin kubeconfig cannot be held by the credential proxy, and why.
    pub kubeconfig_invalid: Option<String>,
    /// An allow-list target's `caConfigMap` cannot be used, and why.
    pub proxy_ca_invalid: Option<String>,
    pub apply_error: Option<String>,
    pub deployment: Option<DeploymentState>,
    /// Why the credential proxy is not serving yet.
    pub proxy_unavailable: Option<String>,
    pub pool: PoolOutcome,
    pub active_sessions: i32,
    pub image: Option<String>,
    pub endpoint: Option<String>,
    pub ca_config_map: Option<String>,
    /// Label selector of the server pods.
    pub selector: Option<String>,
    /// Why the API server's addresses could not be read (the sandbox NetworkPolicy then
    /// has no rule for it).
    pub api_server_problem: Option<String>,
    /// `https://<host>/mcp` while `spec.server.expose` publishes the endpoint.
    pub external_endpoint: Option<String>,
    /// Why the object `spec.server.expose` asks for is not published (no Gateway API, not
    /// OpenShift, a Route no router admitted).
    pub expose_problem: Option<String>,
    /// On OpenShift: what the service CA has not provided yet (the serving certificate or
    /// its CA bundle).
    pub serving_cert_pending: Option<String>,
    /// Whether NetworkPolicy and Pod Security are enforced where the instance runs.
    pub isolation: Findings,
    /// A RuntimeClass the spec names does not exist: which, where, and what to do.
    pub runtime_class_missing: Option<String>,
    /// The runtime the sandboxes run with (`status.sandbox`).
    pub sandbox: Option<SandboxStatus>,
}

struct Cond {
    type_: &'static str,
    ok: bool,
    reason: &'static str,
    message: String,
}

fn ready_condition(prev_ready: bool, o: &Observed) -> Cond {
    let bad = |reason, message| Cond {
        type_: READY,
        ok: false,
        reason,
        message,
    };
    if let Some(e) = &o.spec_error {
        return bad("InvalidSpec", e.clone());
    }
    if !o.missing_secrets.is_empty() {
        return bad(
            "SecretsNotFound",
            format!(
                "required Secrets do not exist: {}",
                o.missing_secrets.join(", ")
            ),
        );
    }
    if !o.invalid_secrets.is_empty() {
        return bad("SecretKeysInvalid", o.invalid_secrets.join("; "));
    }
    if let Some(m) = &o.serving_cert_pending {
        return bad("ServingCertificatePending", m.clone());
    }
    if let Some(e) = &o.kubeconfig_invalid {
        return bad("KubeconfigInvalid", e.clone());
    }
    if let Some(e) = &o.proxy_ca_invalid {
        return bad("ProxyCaInvalid", e.clone());
    }
    if let Some(e) = &o.apply_error {
        return bad("ApplyFailed", e.clone());
    }
    // Before the proxy and the server: a missing proxy or server class is why they are
    // unavailable, and a missing sandbox class why no sandbox starts.
    if let Some(e) = &o.runtime_class_missing {
        return bad(crate::runtime_class::NOT_FOUND, e.clone());
    }
    if let Some(e) = &o.proxy_unavailable {
        return bad("ProxyUnavailable", e.clone());
    }
    match &o.deployment {
        Some(d) if d.available => {}
        Some(d) => {
            return bad(
                "DeploymentUnavailable",
                format!("server Deployment has {}", d.replicas_summary()),
            )
        }
        None => {
            return bad(
                "DeploymentUnavailable",
                "server Deployment not observed yet".into(),
            )
        }
    }
    let p = &o.pool;
    if !p.failing.is_empty() {
        return bad("WarmPoolUnhealthy", failing_message(p));
    }
    // The first time, Ready waits for a full pool. Afterwards a short pool (sessions just
    // claimed pods, replacements are starting) does not flip Ready: no flapping on claims.
    if !prev_ready && p.ready < p.desired {
        return bad(
            "WarmPoolFilling",
            format!("warm pool has {}/{} ready sandboxes", p.ready, p.desired),
        );
    }
    Cond {
        type_: READY,
        ok: true,
        reason: "Ready",
        message: "the MCP server is available".into(),
    }
}

fn failing_message(p: &PoolOutcome) -> String {
    let first = &p.failing[0];
    let mut m = format!(
        "{} warm sandbox(es) are not starting; {} is {}: {}",
        p.failing.len(),
        first.name,
        first.reason,
        first.message
    );
    if first.reason == "Unschedulable" {
        // The scheduler cannot place them: the image and the Secrets are not the cause.
        m = format!(
            "{} warm sandbox(es) are not starting; {}: {}",
            p.failing.len(),
            first.name,
            cli_mcp_api::pod_state::unschedulable_hint(&first.message)
        );
        m.push_str(". They are kept (the scheduler places them when room appears)");
    } else {
        m.push_str(". They are kept (the kubelet retries them) instead of being recreated; fix spec.sandbox.image, spec.sandbox.runtimeClassName or the kubeconfig Secret");
    }
    m
}

fn pool_condition(o: &Observed) -> Cond {
    let p = &o.pool;
    let c = |ok, reason, message| Cond {
        type_: WARM_POOL_READY,
        ok,
        reason,
        message,
    };
    if p.desired == 0 {
        return c(true, "Disabled", "spec.sandbox.warmPoolSize is 0".into());
    }
    if !p.failing.is_empty() {
        return c(false, "PodsFailing", failing_message(p));
    }
    if let Some(why) = &p.blocked {
        return c(
            false,
            "Blocked",
            format!("no warm sandboxes are created: {why}"),
        );
    }
    if let Some(error) = &p.api_error {
        let retry = p
            .backoff
            .map(|b| format!("; the next create in {}s", b.as_secs()))
            .unwrap_or_default();
        return c(
            false,
            "ApiError",
            format!(
                "{}/{} warm sandboxes are ready; the pool could not be brought up to date: \
                 {error}{retry}",
                p.ready, p.desired
            ),
        );
    }
    if p.ready >= p.desired {
        return c(
            true,
            "Full",
            format!("{}/{} warm sandboxes are ready", p.ready, p.desired),
        );
    }
    let mut m = format!("{}/{} warm sandboxes are ready", p.ready, p.desired);
    if p.stale > 0 {
        m.push_str(&format!("; replacing {} outdated", p.stale));
    }
    if let Some(b) = p.backoff {
        m.push_str(&format!("; next create in {}s after failures", b.as_secs()));
    }
    c(false, "Filling", m)
}

fn degraded_condition(o: &Observed) -> Cond {
    let c = |ok, reason, message| Cond {
        type_: DEGRADED,
        ok,
        reason,
        message,
    };
    if let Some(e) = &o.spec_error {
        return c(true, "InvalidSpec", e.clone());
    }
    if let Some(e) = &o.apply_error {
        return c(true, "ApplyFailed", e.clone());
    }
    if !o.pool.failing.is_empty() {
        return c(true, "PoolPodsFailing", failing_message(&o.pool));
    }
    if let Some(p) = &o.api_server_problem {
        return c(
            true,
            "ApiServerUnknown",
            format!(
                "{p}; the sandbox NetworkPolicy has no egress rule for the Kubernetes API \
                 server, so under an enforcing CNI sandboxes cannot reach it: grant the \
                 operator config/rbac's apiserver-endpoints Role and RoleBinding in namespace \
                 default (an overlay's `namespace:` must not move them)"
            ),
        );
    }
    if let Some(p) = &o.expose_problem {
        return c(true, "ExposeUnavailable", p.clone());
    }
    c(false, "AsExpected", "nothing needs attention".into())
}

fn to_condition(c: Cond, prev: &[Condition], generation: Option<i64>, now: &Time) -> Condition {
    // `ok` is the condition's truth value (for Degraded, True is the bad state).
    let status = if c.ok { "True" } else { "False" };
    condition(c.type_, status, c.reason, c.message, prev, generation, now)
}

/// A condition from one isolation finding (True, False or Unknown).
fn finding_condition(
    type_: &'static str,
    f: &Finding,
    prev: &[Condition],
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    let (status, reason, message) = f.condition();
    condition(type_, status, reason, message, prev, generation, now)
}

fn condition(
    type_: &str,
    status: &str,
    reason: &str,
    message: String,
    prev: &[Condition],
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    let last = prev
        .iter()
        .find(|p| p.type_ == type_ && p.status == status)
        .map(|p| p.last_transition_time.clone())
        .unwrap_or_else(|| now.clone());
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time: last,
    }
}

/// The new status.
pub fn compute(
    prev: Option<&CliMcpInstanceStatus>,
    o: &Observed,
    now: Time,
) -> CliMcpInstanceStatus {
    let empty = Vec::new();
    let prev_conditions = prev.map(|s| &s.conditions).unwrap_or(&empty);
    let prev_ready = prev_conditions
        .iter()
        .any(|c| c.type_ == READY && c.status == "True");
    let conds = [
        ready_condition(prev_ready, o),
        pool_condition(o),
        degraded_condition(o),
    ];
    let mut conditions: Vec<Condition> = conds
        .into_iter()
        .map(|c| to_condition(c, prev_conditions, o.generation, &now))
        .collect();
    for (type_, f) in [
        (NETWORK_POLICY_ENFORCED, &o.isolation.network_policy),
        (POD_SECURITY_ENFORCED, &o.isolation.pod_security),
    ] {
        conditions.push(finding_condition(
            type_,
            f,
            prev_conditions,
            o.generation,
            &now,
        ));
    }
    let d = o.deployment.clone().unwrap_or_default();
    CliMcpInstanceStatus {
        observed_generation: o.generation,
        conditions,
        replicas: d.replicas,
        ready_replicas: d.ready,
        warm_pool: WarmPoolStatus {
            ready: o.pool.ready,
            desired: o.pool.desired,
            sessions_last_minute: o.pool.sessions_last_minute,
        },
        active_sessions: o.active_sessions,
        resolved_sandbox_image: o.image.clone(),
        endpoint: o.endpoint.clone(),
        external_endpoint: o.external_endpoint.clone(),
        ca_config_map: o.ca_config_map.clone(),
        selector: o.selector.clone(),
        sandbox: o.sandbox.clone(),
    }
}

/// A condition change worth an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    /// True when the new state is the healthy one (Normal event), else Warning.
    pub healthy: bool,
}

pub fn transitions(
    prev: Option<&CliMcpInstanceStatus>,
    next: &CliMcpInstanceStatus,
) -> Vec<Transition> {
    let empty = Vec::new();
    let before = prev.map(|s| &s.conditions).unwrap_or(&empty);
    next.conditions
        .iter()
        .filter(|c| {
            !before
                .iter()
                .any(|b| b.type_ == c.type_ && b.status == c.status && b.reason == c.reason)
        })
        .map(|c| Transition {
            type_: c.type_.clone(),
            status: c.status.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
            healthy: (c.type_ == DEGRADED) == (c.status == "False"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::FailingPod;

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).expect("ts"))
    }

    fn healthy(desired: i32, ready: i32) -> Observed {
        Observed {
            generation: Some(2),
            deployment: Some(DeploymentState {
                replicas: 1,
                ready: 1,
                available: true,
                message: String::new(),
            }),
            pool: PoolOutcome {
                desired,
                ready,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn cond<'a>(s: &'a CliMcpInstanceStatus, ty: &str) -> &'a Condition {
        s.conditions
            .iter()
            .find(|c| c.type_ == ty)
            .expect("condition")
    }

    #[test]
    fn ready_waits_for_the_first_full_pool_then_does_not_flap_on_claims() {
        let s1 = compute(None, &healthy(3, 1), t(10));
        assert_eq!(cond(&s1, READY).status, "False");
        assert_eq!(cond(&s1, READY).reason, "WarmPoolFilling");
        let s2 = compute(Some(&s1), &healthy(3, 3), t(20));
        assert_eq!(cond(&s2, READY).status, "True");
        assert_eq!(cond(&s2, WARM_POOL_READY).reason, "Full");
        // A session claims a pod: pool short, Ready stays True; WarmPoolReady reflects it.
        let s3 = compute(Some(&s2), &healthy(3, 2), t(30));
        assert_eq!(cond(&s3, READY).status, "True");
        assert_eq!(cond(&s3, READY).last_transition_time, t(20));
        assert_eq!(cond(&s3, WARM_POOL_READY).status, "False");
        assert_eq!(cond(&s3, DEGRADED).status, "False");
        assert_eq!(s3.observed_generation, Some(2));
    }

    #[test]
    fn an_unpublishable_route_degrades_and_the_external_endpoint_is_published_otherwise() {
        let mut o = healthy(0, 0);
        o.external_endpoint = Some("https://mcp.example.com/mcp".into());
        let s = compute(None, &o, t(1));
        assert_eq!(
            s.external_endpoint.as_deref(),
            Some("https://mcp.example.com/mcp")
        );
        assert_eq!(cond(&s, DEGRADED).status, "False");

        let mut o = healthy(0, 0);
        o.expose_problem = Some("spec.server.expose.httpRoute is not published: no CRDs".into());
        let s = compute(None, &o, t(1));
        let d = cond(&s, DEGRADED);
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "ExposeUnavailable")
        );
        assert!(d.message.contains("httpRoute"), "{}", d.message);
        assert_eq!(s.external_endpoint, None);
        // The endpoint inside the cluster still serves.
        assert_eq!(cond(&s, READY).status, "True");
    }

    #[test]
    fn a_serving_certificate_the_service_ca_has_not_issued_keeps_the_instance_not_ready() {
        let mut o = healthy(0, 0);
        o.serving_cert_pending =
            Some("waiting for OpenShift's service CA to provide Secret x".into());
        let s = compute(None, &o, t(1));
        let r = cond(&s, READY);
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("False", "ServingCertificatePending")
        );
        assert!(r.message.contains("Secret x"), "{}", r.message);
        // A missing Secret the admin must create says so first.
        o.missing_secrets = vec!["kc (sandbox kubeconfig)".into()];
        assert_eq!(
            cond(&compute(None, &o, t(1)), READY).reason,
            "SecretsNotFound"
        );
    }

    #[test]
    fn unreadable_api_server_addresses_degrade_but_keep_ready() {
        let mut o = healthy(0, 0);
        o.api_server_problem = Some("cannot read Service default/kubernetes: forbidden".into());
        let s = compute(None, &o, t(1));
        let d = cond(&s, DEGRADED);
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "ApiServerUnknown")
        );
        assert!(d.message.contains("forbidden"), "{}", d.message);
        assert!(d.message.contains("apiserver-endpoints"), "{}", d.message);
        // The server serves; only the sandboxes' API egress is at risk.
        assert_eq!(cond(&s, READY).status, "True");
    }

    #[test]
    fn an_unusable_kubeconfig_or_a_down_proxy_keeps_the_instance_not_ready() {
        let mut o = healthy(0, 0);
        o.kubeconfig_invalid =
            Some("Secret kc key 'kubeconfig': user \"u\" uses exec; only a bearer token".into());
        o.proxy_unavailable = Some("proxy Deployment has 0/2 ready replicas".into());
        let s = compute(None, &o, t(1));
        assert_eq!(cond(&s, READY).reason, "KubeconfigInvalid");
        assert!(cond(&s, READY).message.contains("uses exec"));
        o.kubeconfig_invalid = None;
        o.proxy_ca_invalid =
            Some("ConfigMap web-ca (spec.proxy.targets[].caConfigMap) does not exist".into());
        let s = compute(None, &o, t(1));
        assert_eq!(cond(&s, READY).reason, "ProxyCaInvalid");
        assert!(cond(&s, READY).message.contains("web-ca"));
        o.proxy_ca_invalid = None;
        let s = compute(None, &o, t(1));
        assert_eq!(cond(&s, READY).reason, "ProxyUnavailable");
        assert_eq!(cond(&s, READY).status, "False");
    }

    #[test]
    fn a_missing_runtime_class_keeps_the_instance_not_ready_and_says_which() {
        let mut o = healthy(1, 0);
        o.runtime_class_missing = Some(
            "RuntimeClass \"gvisor\" not found: spec.sandbox.runtimeClassName names it".into(),
        );
        o.pool.blocked = o.runtime_class_missing.clone();
        o.proxy_unavailable = Some("proxy Deployment has 0/2 ready replicas".into());
        o.sandbox = Some(SandboxStatus {
            runtime_class_name: Some("gvisor".into()),
            runtime_handler: None,
        });
        let s = compute(None, &o, t(1));
        let r = cond(&s, READY);
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("False", "RuntimeClassNotFound")
        );
        assert!(r.message.contains("\"gvisor\""), "{}", r.message);
        let p = cond(&s, WARM_POOL_READY);
        assert_eq!((p.status.as_str(), p.reason.as_str()), ("False", "Blocked"));
        assert!(p.message.contains("RuntimeClass \"gvisor\" not found"));
        let sandbox = s.sandbox.as_ref().expect("status.sandbox");
        assert_eq!(sandbox.runtime_class_name.as_deref(), Some("gvisor"));
        // Once it exists the instance goes on, and says which class its sandboxes run with.
        let mut o = healthy(1, 1);
        o.sandbox = Some(SandboxStatus {
            runtime_class_name: Some("gvisor".into()),
            runtime_handler: Some("runsc".into()),
        });
        let s2 = compute(Some(&s), &o, t(2));
        assert_eq!(cond(&s2, READY).status, "True");
        let tr = transitions(Some(&s), &s2);
        assert!(tr.iter().any(|t| t.type_ == READY && t.healthy), "{tr:?}");
        assert_eq!(
            s2.sandbox.and_then(|s| s.runtime_handler).as_deref(),
            Some("runsc")
        );
    }

    #[test]
    fn a_failed_pool_api_call_is_said_in_the_pool_condition_with_the_next_try() {
        let mut o = healthy(3, 1);
        o.pool.api_error = Some("Kubernetes API: 500 failed calling webhook".into());
        o.pool.backoff = Some(std::time::Duration::from_secs(4));
        let s = compute(None, &o, t(10));
        let c = cond(&s, WARM_POOL_READY);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "ApiError")
        );
        assert!(
            c.message.contains("1/3 warm sandboxes are ready")
                && c.message.contains("failed calling webhook")
                && c.message.ends_with("the next create in 4s"),
            "{}",
            c.message
        );
    }

    #[test]
    fn reasons_follow_the_first_failing_gate() {
        let mut o = healthy(0, 0);
        o.missing_secrets = vec!["cli-mcp-demo-kubeconfig (sandbox kubeconfig)".into()];
        let s = compute(None, &o, t(1));
        assert_eq!(cond(&s, READY).reason, "SecretsNotFound");
        assert!(cond(&s, READY).message.contains("cli-mcp-demo-kubeconfig"));
        let mut o = healthy(1, 0);
        o.pool.failing = vec![FailingPod {
            name: "p".into(),
            reason: "ImagePullBackOff".into(),
            message: "m".into(),
        }];
        let s = compute(None, &o, t(1));
        assert_eq!(cond(&s, READY).reason, "WarmPoolUnhealthy");
        assert_eq!(cond(&s, WARM_POOL_READY).reason, "PodsFailing");
        assert_eq!(cond(&s, DEGRADED).status, "True");
        assert_eq!(cond(&s, DEGRADED).reason, "PoolPodsFailing");
        assert!(cond(&s, READY).message.contains("spec.sandbox.image"));
        // A pool the scheduler cannot place is told what fixes that, not the image.
        o.pool.failing[0] = FailingPod {
            name: "p".into(),
            reason: "Unschedulable".into(),
            message: "0/1 nodes are available: 1 Insufficient cpu.".into(),
        };
        let s = compute(None, &o, t(1));
        let m = &cond(&s, READY).message;
        assert!(
            m.contains("out of cpu")
                && m.contains("spec.sandbox.resources.requests")
                && !m.contains("spec.sandbox.image"),
            "{m}"
        );
        let mut o = healthy(0, 0);
        o.deployment = Some(DeploymentState {
            replicas: 1,
            ready: 0,
            available: false,
            message: String::new(),
        });
        let s = compute(None, &o, t(1));
        assert_eq!(cond(&s, READY).reason, "DeploymentUnavailable");
    }

    #[test]
    fn same_observation_gives_equal_status_and_no_transitions() {
        let s1 = compute(None, &healthy(0, 0), t(1));
        let s2 = compute(Some(&s1), &healthy(0, 0), t(99));
        assert_eq!(s1, s2, "unchanged observations must not produce a write");
        assert!(transitions(Some(&s1), &s2).is_empty());
        let tr = transitions(None, &s1);
        assert_eq!(tr.len(), 5);
        assert!(tr.iter().all(|t| t.healthy));
    }

    #[test]
    fn isolation_not_in_force_is_a_warning_and_unprobed_is_unknown() {
        let s = compute(None, &healthy(0, 0), t(1));
        let np = cond(&s, NETWORK_POLICY_ENFORCED);
        assert_eq!(
            (np.status.as_str(), np.reason.as_str()),
            ("Unknown", "NotProbed")
        );
        let mut o = healthy(0, 0);
        o.isolation.network_policy = Finding::NotEnforced("opened".into());
        o.isolation.pod_security = Finding::Enforced("refused".into());
        let s2 = compute(Some(&s), &o, t(2));
        assert_eq!(cond(&s2, NETWORK_POLICY_ENFORCED).status, "False");
        assert_eq!(cond(&s2, POD_SECURITY_ENFORCED).status, "True");
        // Isolation does not decide Ready: the instance works, the admin is warned.
        assert_eq!(cond(&s2, READY).status, "True");
        let tr = transitions(Some(&s), &s2);
        let warned: Vec<_> = tr.iter().filter(|t| !t.healthy).map(|t| &t.type_).collect();
        assert_eq!(warned, vec![NETWORK_POLICY_ENFORCED], "{tr:?}");
    }
}
