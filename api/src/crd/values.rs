//! What an admitted spec means as values: the durations parsed, the Secret names with their
//! defaults, and the [`SandboxConfig`] both pod writers build sandboxes from. Total for
//! objects that came through admission; [`CrdError`] covers the rest.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::{Resource, ResourceExt};

use k8s_openapi::api::core::v1::ResourceRequirements;

use super::{
    CliMcpInstance, PlacementSpec, ProxySpec, ProxyTarget, ProxyTargetType, SandboxSpec, ServerSpec,
};
use crate::names::{InstanceName, InstanceNameError};
use crate::proxy::{Domain, RouteError, RouteIdentity};
use crate::sandbox::{allowed_sandbox_env, Placement, SandboxConfig, SandboxProxy};

/// Why a CR cannot be turned into a sandbox configuration (the CRD's admission rules make
/// these unreachable for objects that came through the apiserver).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CrdError {
    #[error("the CliMcpInstance has no {0}; only objects read from the apiserver can be used")]
    Missing(&'static str),
    #[error(transparent)]
    Name(#[from] InstanceNameError),
    #[error("{field}: {value:?} is not a duration like 30m, 90s or 1h30m")]
    Duration { field: &'static str, value: String },
    #[error("no sandbox image: set spec.sandbox.image or the operator's RELATED_IMAGE_SANDBOX")]
    NoImage,
    #[error("spec.proxy.targets: allowlist domain {domain:?}: {error}")]
    Domain { domain: String, error: RouteError },
    #[error("spec.proxy.targets: allowlist domain {0} is in two targets with different caConfigMap; list it once, or under the same caConfigMap")]
    TwoCas(String),
    #[error("spec.sandbox.warmPool: {0}")]
    WarmPool(String),
    #[error("the instance's ServiceAccount {account} is the operator's own in this namespace: its server (or proxy, sandboxes, clients) would act as the operator; give the instance another name")]
    OperatorsAccount { account: String },
}

/// The credential proxy every instance runs: what `spec.proxy` asks for or, without it, the
/// implied proxy (one kubernetes target whose kubeconfig is `spec.sandbox.kubeconfigSecret`,
/// default `cli-mcp-<name>-kubeconfig`, and the proxy defaults), with the defaults applied
/// and the allow-list parsed into canonical domains.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyPlan {
    /// The Secret whose `kubeconfig` the proxy holds, with a kubernetes target.
    pub kubeconfig_secret: Option<String>,
    /// Whose identity the kubernetes target's routes carry (its `identity`, default shared).
    pub kubernetes_identity: RouteIdentity,
    /// Allow-listed upstreams, sorted, each once.
    pub allowlist: Vec<Domain>,
    /// The allow-listed upstreams verified against a CA of their own: domain → the
    /// ConfigMap (key `ca.crt`) holding it.
    pub allowlist_cas: BTreeMap<Domain, String>,
    pub replicas: i32,
    pub resources: ResourceRequirements,
    /// `spec.proxy`'s runtime, scheduling and pull Secrets, for the proxy pods.
    pub placement: Placement,
}

/// Parses a Go-style duration (`1h30m`, `90s`, `500ms`, `1.5h`); only non-negative values.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let value: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += value * scale;
    }
    if !total.is_finite() || !(0.0..=1e12).contains(&total) {
        return None;
    }
    Some(Duration::from_secs_f64(total))
}

impl SandboxSpec {
    /// Runtime, scheduling and pull Secrets of the sandbox pods.
    pub fn placement(&self) -> Placement {
        Placement::from(&self.placement)
    }

    /// The idle timeout as a `Duration`.
    pub fn idle_timeout(&self) -> Result<Duration, CrdError> {
        parse_duration(&self.idle_timeout).ok_or_else(|| CrdError::Duration {
            field: "spec.sandbox.idleTimeout",
            value: self.idle_timeout.clone(),
        })
    }

    /// `(default, max)` command timeouts in whole seconds (at least 1).
    pub fn command_timeouts(&self) -> Result<(u64, u64), CrdError> {
        let secs = |field, v: &String| {
            parse_duration(v)
                .map(|d| d.as_secs().max(1))
                .ok_or_else(|| CrdError::Duration {
                    field,
                    value: v.clone(),
                })
        };
        Ok((
            secs(
                "spec.sandbox.commandTimeout.default",
                &self.command_timeout.default,
            )?,
            secs("spec.sandbox.commandTimeout.max", &self.command_timeout.max)?,
        ))
    }
}

impl ProxySpec {
    /// The proxy of an instance without `spec.proxy`: one kubernetes target holding the
    /// kubeconfig Secret `secret_name` (`None`: `cli-mcp-<name>-kubeconfig`), two replicas,
    /// the default resources and no placement.
    pub fn implied(secret_name: Option<String>) -> Self {
        ProxySpec {
            targets: vec![ProxyTarget {
                type_: ProxyTargetType::Kubernetes,
                secret_name,
                domains: None,
                ca_config_map: None,
                identity: None,
            }],
            replicas: super::proxy::default_proxy_replicas(),
            resources: super::proxy::default_proxy_resources(),
            placement: PlacementSpec::default(),
        }
    }

    /// Runtime, scheduling and pull Secrets of the proxy pods.
    pub fn placement(&self) -> Placement {
        Placement::from(&self.placement)
    }
}

impl ServerSpec {
    /// Runtime, scheduling and pull Secrets of the server pods.
    pub fn placement(&self) -> Placement {
        Placement::from(&self.placement)
    }
}

impl CliMcpInstance {
    /// The validated instance name.
    pub fn instance_name(&self) -> Result<InstanceName, CrdError> {
        let name = self
            .metadata
            .name
            .as_deref()
            .ok_or(CrdError::Missing("metadata.name"))?;
        Ok(InstanceName::parse(name)?)
    }

    /// The sandbox image: `spec.sandbox.image`, else the operator default.
    pub fn sandbox_image(&self, default_image: Option<&str>) -> Result<String, CrdError> {
        self.spec
            .sandbox
            .image
            .as_deref()
            .or(default_image)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .ok_or(CrdError::NoImage)
    }

    /// `spec.proxy`, or without it the implied proxy: one kubernetes target holding
    /// `spec.sandbox.kubeconfigSecret` (default `cli-mcp-<name>-kubeconfig`), with the
    /// proxy's default replicas, resources and placement. Every instance has a proxy: a
    /// sandbox never holds a real credential.
    pub fn proxy_spec(&self) -> ProxySpec {
        match &self.spec.proxy {
            Some(p) => p.clone(),
            None => ProxySpec::implied(self.spec.sandbox.kubeconfig_secret.clone()),
        }
    }

    /// The proxy this instance runs (see [`CliMcpInstance::proxy_spec`]).
    pub fn proxy_plan(&self) -> Result<ProxyPlan, CrdError> {
        let p = self.proxy_spec();
        let mut kubeconfig_secret = None;
        let mut kubernetes_identity = RouteIdentity::Shared;
        let mut allowlist = Vec::new();
        let mut allowlist_cas = BTreeMap::new();
        for t in &p.targets {
            match t.type_ {
                ProxyTargetType::Kubernetes => {
                    kubeconfig_secret = Some(match &t.secret_name {
                        Some(s) => s.clone(),
                        None => self.instance_name()?.kubeconfig_secret(),
                    });
                    kubernetes_identity = t.identity.unwrap_or_default().into();
                }
                ProxyTargetType::Allowlist => {
                    for d in t.domains.iter().flatten() {
                        let parsed = Domain::with_default_port(d, 443).map_err(|error| {
                            CrdError::Domain {
                                domain: d.clone(),
                                error,
                            }
                        })?;
                        let ca = t.ca_config_map.as_ref();
                        let pinned = allowlist_cas.get(&parsed);
                        if allowlist.contains(&parsed) && pinned != ca {
                            return Err(CrdError::TwoCas(parsed.to_string()));
                        }
                        if let Some(ca) = ca {
                            allowlist_cas.insert(parsed.clone(), ca.clone());
                        }
                        allowlist.push(parsed);
                    }
                }
            }
        }
        allowlist.sort();
        allowlist.dedup();
        Ok(ProxyPlan {
            kubeconfig_secret,
            kubernetes_identity,
            allowlist,
            allowlist_cas,
            replicas: p.replicas,
            placement: p.placement(),
            resources: p.resources,
        })
    }

    /// The Secret with the server's certificate (`tls.crt`, `tls.key`).
    pub fn tls_secret(&self) -> Result<String, CrdError> {
        Ok(match &self.spec.server.tls_secret_name {
            Some(s) => s.clone(),
            None => self.instance_name()?.tls_secret(),
        })
    }

    /// The sandbox configuration both pod writers build pods from. Pure: the operator passes
    /// it to the server as JSON, so warm and cold pods of one instance are identical.
    /// `owner` is this CR's controller reference, so sandboxes are garbage-collected with it.
    pub fn sandbox_config(&self, default_image: Option<&str>) -> Result<SandboxConfig, CrdError> {
        let instance = self.instance_name()?;
        let namespace = self
            .namespace()
            .ok_or(CrdError::Missing("metadata.namespace"))?;
        let owner = self
            .controller_owner_ref(&())
            .ok_or(CrdError::Missing("metadata.uid"))?;
        let sb = &self.spec.sandbox;
        let mut cfg = SandboxConfig::new(instance, namespace, self.sandbox_image(default_image)?);
        cfg.image_pull_policy = sb.image_pull_policy.map(|p| p.as_str().to_owned());
        cfg.resources = sb.resources.clone();
        // Admission rejects these; dropping them here too keeps the function total and covers
        // objects stored before a rule existed.
        cfg.env = sb
            .env
            .iter()
            .filter(|e| allowed_sandbox_env(e))
            .cloned()
            .collect();
        let plan = self.proxy_plan()?;
        let name = self.instance_name()?;
        cfg.proxy = Some(SandboxProxy {
            url: name.proxy_url(&cfg.namespace),
            config_map: name.proxy(),
            kubeconfig: plan.kubeconfig_secret.is_some(),
        });
        cfg.owner = Some(owner);
        cfg.placement = sb.placement();
        cfg.output_budget = usize::try_from(sb.output_budget_bytes)
            .ok()
            .filter(|b| *b != crate::wire::DEFAULT_OUTPUT_BUDGET);
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::proxy::default_proxy_resources;
    use crate::crd::tests::cr;
    use crate::crd::CrdError;

    #[test]
    fn a_proxy_is_planned_from_spec_proxy_or_the_older_kubeconfig_secret() {
        use crate::crd::values::ProxyPlan;
        // Without spec.proxy: the implied proxy, holding the older kubeconfigSecret (or
        // the default name), with the proxy defaults; the sandbox uses it like any other.
        for (spec, secret) in [
            (serde_json::json!({}), "cli-mcp-demo-kubeconfig"),
            (
                serde_json::json!({"sandbox": {"kubeconfigSecret": "go-era-kubeconfig"}}),
                "go-era-kubeconfig",
            ),
        ] {
            let o = cr(spec);
            let plan: ProxyPlan = o.proxy_plan().expect("plan");
            assert_eq!(plan.kubeconfig_secret.as_deref(), Some(secret));
            assert!(plan.allowlist.is_empty() && plan.allowlist_cas.is_empty());
            assert_eq!(plan.replicas, 2);
            assert_eq!(plan.resources, default_proxy_resources());
            assert!(plan.placement.is_empty());
            assert_eq!(
                o.proxy_spec(),
                ProxySpec::implied(o.spec.sandbox.kubeconfig_secret.clone())
            );
            let p = o
                .sandbox_config(Some("img:1"))
                .expect("config")
                .proxy
                .expect("every sandbox uses a proxy");
            assert_eq!(p.url, "http://cli-mcp-demo-proxy.ns1.svc:8080");
            assert_eq!(p.config_map, "cli-mcp-demo-proxy");
            assert!(p.kubeconfig, "the sandbox gets the dummy kubeconfig");
        }
        // The implied proxy is exactly what spec.proxy with one kubernetes target says.
        assert_eq!(
            cr(serde_json::json!({"sandbox": {"kubeconfigSecret": "kc"}})).proxy_plan(),
            cr(serde_json::json!({"proxy": {"targets": [{"type": "kubernetes", "secretName": "kc"}]}}))
                .proxy_plan()
        );

        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "kubernetes"},
            {"type": "allowlist", "domains": ["Example.com", "b.example:8443", "example.com:443"]}
        ]}}));
        let plan: ProxyPlan = o.proxy_plan().expect("plan");
        assert_eq!(
            plan.kubeconfig_secret.as_deref(),
            Some("cli-mcp-demo-kubeconfig")
        );
        let domains: Vec<_> = plan.allowlist.iter().map(|d| d.as_str()).collect();
        assert_eq!(domains, ["b.example:8443", "example.com:443"]);
        assert_eq!(plan.replicas, 2, "two replicas unless told otherwise");
        let cfg = o.sandbox_config(Some("img:1")).expect("config");
        let p = cfg.proxy.expect("sandbox uses the proxy");
        assert_eq!(p.url, "http://cli-mcp-demo-proxy.ns1.svc:8080");
        assert_eq!(p.config_map, "cli-mcp-demo-proxy");
        assert!(p.kubeconfig);

        // An allow-list only: the proxy, but no kubeconfig.
        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["pypi.org"]}
        ]}}));
        let plan = o.proxy_plan().expect("plan");
        assert_eq!(plan.kubeconfig_secret, None);
        assert!(
            !o.sandbox_config(Some("i"))
                .expect("config")
                .proxy
                .expect("proxy")
                .kubeconfig
        );

        // A CA of its own for an allow-list target's domains.
        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["web.example:8443", "a.example"], "caConfigMap": "web-ca"},
            {"type": "allowlist", "domains": ["pypi.org", "a.example:443"]}
        ]}}));
        let e = o
            .proxy_plan()
            .expect_err("two CAs for one domain")
            .to_string();
        assert!(
            e.contains("a.example:443") && e.contains("caConfigMap"),
            "{e}"
        );
        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["web.example:8443"], "caConfigMap": "web-ca"},
            {"type": "allowlist", "domains": ["pypi.org"]}
        ]}}));
        let plan = o.proxy_plan().expect("plan");
        let pinned: Vec<_> = plan
            .allowlist_cas
            .iter()
            .map(|(d, cm)| (d.as_str(), cm.as_str()))
            .collect();
        assert_eq!(pinned, [("web.example:8443", "web-ca")]);

        // A domain admission would refuse, from an object stored before the rule.
        let o = cr(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["*.example.com"]}
        ]}}));
        let e = o.proxy_plan().expect_err("bad domain").to_string();
        assert!(
            e.contains("*.example.com") && e.contains("without '*'"),
            "{e}"
        );
    }

    #[test]
    fn the_kubernetes_targets_identity_is_planned_shared_by_default() {
        let identity = |target: serde_json::Value| {
            cr(serde_json::json!({"proxy": {"targets": [target]}}))
                .proxy_plan()
                .expect("plan")
                .kubernetes_identity
        };
        assert_eq!(
            identity(serde_json::json!({"type": "kubernetes"})),
            RouteIdentity::Shared
        );
        assert_eq!(
            identity(serde_json::json!({"type": "kubernetes", "identity": "shared"})),
            RouteIdentity::Shared
        );
        assert_eq!(
            identity(serde_json::json!({"type": "kubernetes", "identity": "impersonateCaller"})),
            RouteIdentity::ImpersonateCaller
        );
        // The implied proxy shares the kubeconfig's identity, as before the field.
        let implied = cr(serde_json::json!({})).proxy_plan().expect("plan");
        assert_eq!(implied.kubernetes_identity, RouteIdentity::Shared);
        // Only the two values parse.
        let bad: Result<crate::crd::CliMcpInstance, _> =
            serde_json::from_value(serde_json::json!({
                "apiVersion": "cli-mcp.redhat.com/v1alpha1", "kind": "CliMcpInstance",
                "metadata": {"name": "demo", "namespace": "ns1"},
                "spec": {"proxy": {"targets": [{"type": "kubernetes", "identity": "caller"}]}}
            }));
        assert!(bad.is_err());
    }

    #[test]
    fn sandbox_config_is_built_from_the_cr() {
        let o = cr(serde_json::json!({"sandbox": {
            "image": "img:1", "imagePullPolicy": "Never",
            "env": [{"name": "FOO", "value": "bar"}, {"name": "HOME", "value": "/evil"}]
        }}));
        let cfg = o.sandbox_config(Some("default:1")).expect("config");
        assert_eq!(cfg.image, "img:1");
        assert_eq!(cfg.image_pull_policy.as_deref(), Some("Never"));
        assert_eq!(cfg.namespace, "ns1");
        assert!(cfg.proxy.is_some(), "a proxy even when not asked for");
        assert_eq!(cfg.env.len(), 1);
        let owner = cfg.owner.expect("owner");
        assert_eq!(owner.uid, "u-1");
        assert_eq!(owner.controller, Some(true));
        assert_eq!(owner.kind, "CliMcpInstance");

        assert_eq!(cfg.output_budget, None, "the agent's default budget");
        let big = cr(serde_json::json!({"sandbox": {"outputBudgetBytes": 1048576}}));
        let big = big.sandbox_config(Some("default:1")).expect("config");
        assert_eq!(
            big.output_budget,
            Some(1 << 20),
            "the agent is told the budget"
        );

        let d = cr(serde_json::json!({}));
        assert_eq!(
            d.sandbox_config(Some("default:1")).expect("config").image,
            "default:1"
        );
        assert_eq!(d.sandbox_config(None), Err(CrdError::NoImage));
        let mut no_uid = d.clone();
        no_uid.metadata.uid = None;
        assert_eq!(
            no_uid.sandbox_config(Some("x")),
            Err(CrdError::Missing("metadata.uid"))
        );
    }

    #[test]
    fn durations_parse_like_go() {
        assert_eq!(parse_duration("90s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5h"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        for bad in ["", "banana", "10", "5d", "m", "1x", "-1s"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }
}
