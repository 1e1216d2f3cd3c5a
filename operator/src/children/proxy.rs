//! The credential proxy's children: ServiceAccount, Role and RoleBinding (read pods) and a
//! ClusterRoleBinding to `system:auth-delegator` (TokenReview) — its own identity, with
//! which it verifies the sandboxes' tokens —, ConfigMap (route table, the sandboxes' dummy
//! kubeconfig and the proxy CA certificate), Deployment, Service, PodDisruptionBudget and
//! NetworkPolicy.
//!
//! The proxy is the only pod that mounts the admin's kubeconfig, and only its `kubeconfig`
//! key; the sandboxes see the ConfigMap's client half. It also mounts the instance's HMAC
//! key, to check a sandbox pod's seal. Its NetworkPolicy lets in only this instance's
//! sandboxes and lets out only DNS, the API server and the routes' destinations.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, EmptyDirVolumeSource, PodAffinityTerm,
    PodAntiAffinity, PodSpec, Service, ServiceAccount, ServicePort, ServiceSpec, Volume,
    VolumeMount, WeightedPodAffinityTerm,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
    NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use cli_mcp_api::crd::{AuthMode, ProxyPlan};
use cli_mcp_api::kubeconfig::Kubeconfig;
use cli_mcp_api::names::label;
use cli_mcp_api::pod_security;
use cli_mcp_api::proxy::{
    Domain, Injector, Route, RouteIdentity, RouteTable, ADMIN_KUBECONFIG_DIR, CA_CERT_KEY, CA_DIR,
    CA_KEY_KEY, PROXY_HEALTH_PORT, PROXY_PORT, ROUTES_DIR, ROUTES_KEY,
};
use cli_mcp_api::sandbox::{KUBECONFIG_KEY, PROXY_CA_KEY};

use super::deployment::{
    container_port, http_probe, key_items, mount, rolling_deployment, secret_volume,
};
use super::networkpolicy::{api_server_rule, cidr_peer, dns_rule, ip_peer, port, selector};
use super::{rbac, Inputs, ProxyInputs, HMAC_DIR, HMAC_VERSION_ANNOTATION};

pub const CONTAINER: &str = "proxy";
/// Pod-template annotation with a hash of the route table: a new table rolls the proxy.
pub const ROUTES_VERSION_ANNOTATION: &str = "cli-mcp.redhat.com/proxy-routes-version";
/// Pod-template annotation with a hash of the proxy CA: a new CA rolls the proxy.
pub const CA_VERSION_ANNOTATION: &str = "cli-mcp.redhat.com/proxy-ca-version";

/// Host names of the `kubernetes` Service in `default`: a route to one of them is a route to
/// the API server's endpoints, which is what the proxy's egress must allow (after the
/// Service's address translation the packets go to the endpoints, not the Service IP).
const KUBERNETES_SERVICE_HOSTS: &[&str] = &[
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];

/// Key of an allow-list target's CA bundle in its `caConfigMap`.
pub const CA_BUNDLE_KEY: &str = "ca.crt";
/// Most bytes of one CA bundle, and most certificates in it: the bundle travels in the
/// route table (one ConfigMap) and is parsed by every proxy replica at start.
pub const MAX_CA_BUNDLE_BYTES: usize = 64 * 1024;
pub const MAX_CA_BUNDLE_CERTS: usize = 32;

/// The CA bundle of an allow-list target's `caConfigMap` as the proxy pins it, or what to
/// fix. Every PEM block must be a CA certificate: the proxy trusts these alone for the
/// target's domains, and a server's own certificate cannot anchor a chain. Pure.
pub fn validate_ca_bundle(config_map: &str, pem: &str) -> Result<String, String> {
    let what =
        format!("ConfigMap {config_map} key '{CA_BUNDLE_KEY}' (spec.proxy.targets[].caConfigMap)");
    if pem.len() > MAX_CA_BUNDLE_BYTES {
        return Err(format!(
            "{what} is {} bytes; at most {MAX_CA_BUNDLE_BYTES}: keep only the CA certificates of the target's upstreams",
            pem.len()
        ));
    }
    let mut count = 0;
    for (i, block) in x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes()).enumerate() {
        let n = i + 1;
        let block = block.map_err(|e| format!("{what}: PEM block {n} is malformed ({e})"))?;
        if block.label != "CERTIFICATE" {
            return Err(format!(
                "{what}: PEM block {n} is a {}, not a CERTIFICATE; give the CA certificates only",
                block.label
            ));
        }
        let cert = block
            .parse_x509()
            .map_err(|e| format!("{what}: certificate {n} is not valid X.509 ({e})"))?;
        let is_ca = cert
            .basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|b| b.value.ca);
        if !is_ca {
            return Err(format!(
                "{what}: certificate {n} ({}) is not a CA (no basicConstraints CA:TRUE); give the CA that issued the upstream's certificate, not the certificate itself",
                cert.subject()
            ));
        }
        count = n;
        if count > MAX_CA_BUNDLE_CERTS {
            return Err(format!(
                "{what} holds more than {MAX_CA_BUNDLE_CERTS} certificates; keep only the CAs of the target's upstreams"
            ));
        }
    }
    if count == 0 {
        return Err(format!(
            "{what} holds no PEM certificate; put the upstream's CA certificate there, between -----BEGIN CERTIFICATE----- and -----END CERTIFICATE-----"
        ));
    }
    Ok(pem.to_owned())
}

/// Refuses `impersonateCaller` without a caller to impersonate: with `spec.server.auth:
/// None` no session has one, and the proxy would refuse every request of the target (it
/// never falls back to the shared identity). Pure.
pub fn check_identity(plan: &ProxyPlan, auth: AuthMode) -> Result<(), String> {
    if plan.kubernetes_identity == RouteIdentity::ImpersonateCaller && auth == AuthMode::None {
        return Err(
            "spec.proxy.targets[].identity impersonateCaller needs spec.server.auth Kubernetes: with auth None a session has no caller to impersonate, so the proxy would refuse every request; use identity shared or turn auth on".to_owned(),
        );
    }
    Ok(())
}

/// The proxy's resolved inputs, or why there are none yet. `allowlist_cas`: each
/// `caConfigMap` the plan names, with its validated bundle. Pure.
pub fn proxy_inputs(
    plan: &ProxyPlan,
    image: Option<&str>,
    kubeconfig: Option<&Kubeconfig>,
    allowlist_cas: &BTreeMap<String, String>,
    ca_pem: &str,
    ca_version: &str,
) -> Result<ProxyInputs, String> {
    let image = image.filter(|i| !i.is_empty()).ok_or(
        "no proxy image: set the operator's RELATED_IMAGE_PROXY (every instance runs the credential proxy)",
    )?;
    // Every route of the kubernetes target carries its identity.
    let mut routes: Vec<Route> = kubeconfig
        .map(Kubeconfig::routes)
        .unwrap_or_default()
        .into_iter()
        .map(|r| Route {
            identity: plan.kubernetes_identity,
            ..r
        })
        .collect();
    for d in &plan.allowlist {
        if routes.iter().any(|r| &r.domain == d) {
            return Err(format!(
                "spec.proxy.targets: allowlist domain {d} is also a server of the kubeconfig; remove it from the allowlist"
            ));
        }
        let ca_cert = match plan.allowlist_cas.get(d) {
            Some(cm) => Some(allowlist_cas.get(cm).cloned().ok_or_else(|| {
                format!("ConfigMap {cm} (the CA of allowlist domain {d}) has not been read")
            })?),
            None => None,
        };
        routes.push(Route {
            domain: d.clone(),
            injector: Injector::None,
            ca_cert,
            // Nothing is injected, so there is no identity to choose.
            identity: RouteIdentity::Shared,
        });
    }
    let routes = RouteTable::new(routes).map_err(|e| format!("spec.proxy.targets: {e}"))?;
    Ok(ProxyInputs {
        image: image.to_owned(),
        replicas: plan.replicas,
        resources: plan.resources.clone(),
        placement: plan.placement.clone(),
        routes,
        dummy_kubeconfig: kubeconfig.map(|k| k.dummy(ca_pem)),
        kubeconfig_secret: plan.kubeconfig_secret.clone(),
        ca_pem: ca_pem.to_owned(),
        ca_version: ca_version.to_owned(),
        kubeconfig_version: kubeconfig.map(kubeconfig_version),
    })
}

/// A hash of each server with its token: changes exactly when a token (or server) does.
fn kubeconfig_version(k: &Kubeconfig) -> String {
    let parts: Vec<String> = k
        .routes()
        .iter()
        .map(|r| {
            format!(
                "{}={}",
                r.domain,
                k.token_for(&r.domain).unwrap_or_default()
            )
        })
        .collect();
    let bytes: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
    super::secrets::version_of(&bytes)
}

/// Every proxy child of one instance.
#[derive(Debug, Clone)]
pub struct ProxyChildren {
    pub service_account: ServiceAccount,
    /// Pods get/list/watch in the instance's namespace.
    pub role: Role,
    pub role_binding: RoleBinding,
    /// `system:auth-delegator`: TokenReview of the sandboxes' tokens.
    pub auth_delegator_binding: ClusterRoleBinding,
    pub config_map: ConfigMap,
    pub service: Service,
    pub network_policy: NetworkPolicy,
    pub pod_disruption_budget: PodDisruptionBudget,
    pub deployment: Deployment,
}

pub fn build(inp: &Inputs, p: &ProxyInputs) -> ProxyChildren {
    ProxyChildren {
        service_account: service_account(inp),
        role: rbac::proxy_role(inp),
        role_binding: rbac::proxy_role_binding(inp),
        auth_delegator_binding: rbac::proxy_auth_delegator_binding(inp),
        config_map: config_map(inp, p),
        service: service(inp),
        network_policy: network_policy(inp, p),
        pod_disruption_budget: pod_disruption_budget(inp),
        deployment: deployment(inp, p),
    }
}

fn meta(inp: &Inputs) -> ObjectMeta {
    inp.spec.meta(inp.spec.name.proxy(), label::COMPONENT_PROXY)
}

/// Its token is mounted: the proxy talks to the Kubernetes API as itself (TokenReview of a
/// sandbox's token, a watch of this instance's sandbox pods), with only what its Role and
/// its `system:auth-delegator` binding grant. The admin's credential stays in its own mount.
pub fn service_account(inp: &Inputs) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(inp),
        automount_service_account_token: Some(true),
        ..Default::default()
    }
}

pub fn config_map(inp: &Inputs, p: &ProxyInputs) -> ConfigMap {
    let mut data = BTreeMap::from([
        (ROUTES_KEY.to_owned(), p.routes.to_json()),
        (PROXY_CA_KEY.to_owned(), p.ca_pem.clone()),
    ]);
    if let Some(k) = &p.dummy_kubeconfig {
        data.insert(KUBECONFIG_KEY.to_owned(), k.clone());
    }
    ConfigMap {
        metadata: meta(inp),
        data: Some(data),
        ..Default::default()
    }
}

pub fn service(inp: &Inputs) -> Service {
    Service {
        metadata: meta(inp),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(inp.spec.selector(label::COMPONENT_PROXY)),
            ports: Some(vec![ServicePort {
                name: Some("proxy".into()),
                port: i32::from(PROXY_PORT),
                target_port: Some(IntOrString::String("proxy".into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One pod may be evicted at a time: with two or more replicas one always serves, with one
/// a drain is not blocked forever.
pub fn pod_disruption_budget(inp: &Inputs) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta(inp),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(inp.spec.selector(label::COMPONENT_PROXY)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Where a route's packets go, as a NetworkPolicy can say it; `None` for a route to the
/// API server whose addresses the operator could not read.
fn route_egress(inp: &Inputs, d: &Domain) -> Option<NetworkPolicyEgressRule> {
    if KUBERNETES_SERVICE_HOSTS.contains(&d.host())
        || inp.api_server.ips.iter().any(|ip| ip == d.host())
    {
        return api_server_rule(inp);
    }
    let to = match d.ip() {
        Some(ip) => vec![ip_peer(&ip.to_string())],
        // A DNS name: a NetworkPolicy cannot name it, so any address on that port. The
        // proxy itself connects only to the route's host.
        None => vec![cidr_peer("0.0.0.0/0"), cidr_peer("::/0")],
    };
    Some(NetworkPolicyEgressRule {
        to: Some(to),
        ports: Some(vec![port("TCP", i32::from(d.port()))]),
    })
}

/// Ingress only from this instance's sandboxes, on the proxy port; egress only to DNS, the
/// API server (the proxy's own TokenReviews and pod watch) and the routes' destinations, on
/// their ports.
pub fn network_policy(inp: &Inputs, p: &ProxyInputs) -> NetworkPolicy {
    let n = inp.spec.name.to_string();
    let mut egress = vec![dns_rule()];
    for rule in api_server_rule(inp).into_iter().chain(
        p.routes
            .routes()
            .iter()
            .filter_map(|r| route_egress(inp, &r.domain)),
    ) {
        if !egress.contains(&rule) {
            egress.push(rule);
        }
    }
    NetworkPolicy {
        metadata: meta(inp),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(selector(&[
                (label::INSTANCE, &n),
                (label::COMPONENT, label::COMPONENT_PROXY),
            ])),
            policy_types: Some(vec!["Ingress".into(), "Egress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(vec![NetworkPolicyPeer {
                    pod_selector: Some(selector(&[
                        (label::INSTANCE, &n),
                        (label::COMPONENT, label::COMPONENT_SANDBOX),
                    ])),
                    ..Default::default()
                }]),
                ports: Some(vec![port("TCP", i32::from(PROXY_PORT))]),
            }]),
            egress: Some(egress),
        }),
    }
}

pub fn proxy_args(inp: &Inputs, p: &ProxyInputs) -> Vec<String> {
    let mut a = vec![
        "--instance".to_owned(),
        inp.spec.name.to_string(),
        "--namespace".to_owned(),
        inp.spec.namespace.clone(),
        "--hmac-key-file".to_owned(),
        format!("{HMAC_DIR}/key"),
        "--routes".to_owned(),
        format!("{ROUTES_DIR}/{ROUTES_KEY}"),
        "--ca-cert".to_owned(),
        format!("{CA_DIR}/{CA_CERT_KEY}"),
        "--ca-key".to_owned(),
        format!("{CA_DIR}/{CA_KEY_KEY}"),
    ];
    if p.kubeconfig_secret.is_some() {
        a.push("--kubeconfig".into());
        a.push(format!("{ADMIN_KUBECONFIG_DIR}/{KUBECONFIG_KEY}"));
    }
    a.push("--listen".into());
    a.push(format!("0.0.0.0:{PROXY_PORT}"));
    a.push("--health-listen".into());
    a.push(format!("0.0.0.0:{PROXY_HEALTH_PORT}"));
    a.push("--log-json".into());
    a
}

/// The proxy pod's volumes and the container's mounts of them: its route table, its CA,
/// the instance's HMAC key (to check a sandbox pod's seal) and the admin's kubeconfig —
/// each only the keys it needs, read-only.
fn volumes(inp: &Inputs, p: &ProxyInputs) -> (Vec<Volume>, Vec<VolumeMount>) {
    let mut volumes = vec![
        Volume {
            name: "routes".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: inp.spec.name.proxy(),
                items: key_items(&[ROUTES_KEY]),
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        },
        secret_volume(
            "proxy-ca",
            &inp.spec.name.proxy_ca_secret(),
            &[CA_CERT_KEY, CA_KEY_KEY],
        ),
        // Where the server mounts it: the proxy's --hmac-key-file default.
        secret_volume("hmac", &inp.spec.name.hmac_secret(), &["key"]),
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        },
    ];
    let mut mounts = vec![
        mount("routes", ROUTES_DIR, true),
        mount("proxy-ca", CA_DIR, true),
        mount("hmac", HMAC_DIR, true),
        mount("tmp", "/tmp", false),
    ];
    if let Some(secret) = &p.kubeconfig_secret {
        // Only the one key: whatever else the admin's Secret holds stays out of the pod.
        volumes.push(secret_volume("admin-kubeconfig", secret, &[KUBECONFIG_KEY]));
        mounts.push(mount("admin-kubeconfig", ADMIN_KUBECONFIG_DIR, true));
    }
    (volumes, mounts)
}

/// Replicas on different nodes when there are several: one node lost, one proxy left.
fn spread(inp: &Inputs) -> PodAntiAffinity {
    PodAntiAffinity {
        preferred_during_scheduling_ignored_during_execution: Some(vec![WeightedPodAffinityTerm {
            weight: 100,
            pod_affinity_term: PodAffinityTerm {
                label_selector: Some(LabelSelector {
                    match_labels: Some(inp.spec.selector(label::COMPONENT_PROXY)),
                    ..Default::default()
                }),
                topology_key: "kubernetes.io/hostname".into(),
                ..Default::default()
            },
        }]),
        ..Default::default()
    }
}

pub fn deployment(inp: &Inputs, p: &ProxyInputs) -> Deployment {
    let (volumes, mounts) = volumes(inp, p);
    // A new route table, proxy CA or HMAC key (rotated: the seals change with it) rolls the
    // proxy.
    let annotations = BTreeMap::from([
        (
            ROUTES_VERSION_ANNOTATION.to_owned(),
            super::secrets::version_of(&[p.routes.to_json().as_bytes()]),
        ),
        (CA_VERSION_ANNOTATION.to_owned(), p.ca_version.clone()),
        (HMAC_VERSION_ANNOTATION.to_owned(), inp.hmac_version.clone()),
    ]);
    let container = Container {
        name: CONTAINER.into(),
        image: Some(p.image.clone()),
        args: Some(proxy_args(inp, p)),
        ports: Some(vec![
            container_port("proxy", i32::from(PROXY_PORT)),
            container_port("health", i32::from(PROXY_HEALTH_PORT)),
        ]),
        readiness_probe: Some(http_probe("/readyz", 2, 3)),
        liveness_probe: Some(http_probe("/healthz", 10, 3)),
        resources: Some(p.resources.clone()),
        volume_mounts: Some(mounts),
        security_context: Some(pod_security::restricted_container()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };
    let mut pod = PodSpec {
        service_account_name: Some(inp.spec.name.proxy()),
        // The proxy verifies each sandbox's token with a TokenReview and watches this
        // instance's sandbox pods, as itself: its own token, which its Role and
        // auth-delegator binding limit to exactly that. The admin's kubeconfig is a separate
        // mount, used only for the routes.
        automount_service_account_token: Some(true),
        containers: vec![container],
        volumes: Some(volumes),
        // The proxy's own defaults fit in it with a margin: after SIGTERM it keeps accepting
        // for 5 s (its endpoint leaves the Service meanwhile), then open requests get 20 s.
        termination_grace_period_seconds: Some(30),
        ..Default::default()
    };
    p.placement.apply_to(&mut pod);
    // An admin's own podAntiAffinity replaces the spread; their node and pod affinity are
    // kept beside it.
    let mut affinity = pod.affinity.take().unwrap_or_default();
    affinity
        .pod_anti_affinity
        .get_or_insert_with(|| spread(inp));
    pod.affinity = Some(affinity);
    rolling_deployment(
        inp,
        inp.spec.name.proxy(),
        label::COMPONENT_PROXY,
        p.replicas,
        annotations,
        pod,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::test_support::inputs;

    fn proxied() -> Inputs {
        inputs(serde_json::json!({"proxy": {"targets": [
            {"type": "kubernetes", "secretName": "admin-kc"},
            {"type": "allowlist", "domains": ["pypi.org", "192.0.2.7:8443"]}
        ]}}))
    }

    fn proxy(inp: &Inputs) -> &ProxyInputs {
        inp.proxy.as_ref().expect("proxy inputs")
    }

    /// The keys a pod mounts of Secret `name`.
    fn secret_keys(pod: &PodSpec, name: &str) -> Vec<String> {
        pod.volumes
            .iter()
            .flatten()
            .find_map(|v| {
                v.secret
                    .as_ref()
                    .filter(|s| s.secret_name.as_deref() == Some(name))
            })
            .unwrap_or_else(|| panic!("a volume of Secret {name}"))
            .items
            .iter()
            .flatten()
            .map(|i| i.key.clone())
            .collect()
    }

    #[test]
    fn only_the_proxy_mounts_the_admin_kubeconfig_and_only_its_one_key() {
        let inp = proxied();
        let d = deployment(&inp, proxy(&inp));
        let pod = d.spec.template.spec.expect("pod");
        // Its own token: TokenReviews and the sandbox pod watch, as itself.
        assert_eq!(pod.automount_service_account_token, Some(true));
        assert_eq!(
            service_account(&inp).automount_service_account_token,
            Some(true)
        );
        assert_eq!(
            pod.service_account_name.as_deref(),
            Some("cli-mcp-demo-proxy")
        );
        assert_eq!(secret_keys(&pod, "admin-kc"), ["kubeconfig"]);
        // ...and of the instance's HMAC key, only the key, where the server has it.
        assert_eq!(secret_keys(&pod, "cli-mcp-demo-hmac"), ["key"]);
        let mounts = pod.containers[0].volume_mounts.clone().unwrap_or_default();
        let hmac = mounts
            .iter()
            .find(|m| m.name == "hmac")
            .expect("hmac mount");
        assert_eq!(hmac.mount_path, HMAC_DIR);
        assert_eq!(hmac.read_only, Some(true));
        let args = &pod.containers[0].args.clone().unwrap_or_default();
        let flag = |f: &str| args.windows(2).find(|w| w[0] == f).map(|w| w[1].as_str());
        assert_eq!(
            flag("--kubeconfig"),
            Some("/etc/cli-mcp/admin-kubeconfig/kubeconfig")
        );
        assert_eq!(flag("--instance"), Some("demo"));
        assert_eq!(flag("--namespace"), Some("ns1"));
        assert_eq!(flag("--hmac-key-file"), Some("/var/run/cli-mcp/hmac/key"));
        let sc = pod.containers[0]
            .security_context
            .clone()
            .expect("restricted");
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(d.metadata.name.as_deref(), Some("cli-mcp-demo-proxy"));
    }

    #[test]
    fn two_replicas_spread_with_a_budget_and_no_surprise_downtime() {
        let inp = proxied();
        let d = deployment(&inp, proxy(&inp));
        let spec = d.spec;
        assert_eq!(spec.replicas, Some(2));
        let ru = spec
            .strategy
            .and_then(|s| s.rolling_update)
            .expect("rolling update");
        assert_eq!(ru.max_unavailable, Some(IntOrString::Int(0)));
        let pdb = pod_disruption_budget(&inp).spec.expect("pdb");
        assert_eq!(pdb.max_unavailable, Some(IntOrString::Int(1)));
        assert!(spec
            .template
            .spec
            .and_then(|p| p.affinity)
            .and_then(|a| a.pod_anti_affinity)
            .is_some());
    }

    #[test]
    fn proxy_pods_get_spec_proxys_placement_and_nothing_of_the_others() {
        let inp = inputs(serde_json::json!({
            "proxy": {
                "targets": [{"type": "kubernetes"}],
                "runtimeClassName": "kata",
                "nodeSelector": {"node-role.example.com/infra": ""},
                "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [
                        {"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
                "priorityClassName": "infra-high",
                "imagePullSecrets": [{"name": "proxy-pull"}]
            },
            "sandbox": {"runtimeClassName": "gvisor", "priorityClassName": "sandbox-low"},
            "server": {"nodeSelector": {"server": "only"}}
        }));
        let pod = deployment(&inp, proxy(&inp))
            .spec
            .template
            .spec
            .expect("pod");
        assert_eq!(pod.runtime_class_name.as_deref(), Some("kata"));
        assert_eq!(
            pod.node_selector
                .expect("nodeSelector")
                .keys()
                .collect::<Vec<_>>(),
            ["node-role.example.com/infra"]
        );
        assert_eq!(
            pod.tolerations.expect("tolerations")[0].key.as_deref(),
            Some("infra")
        );
        assert_eq!(pod.priority_class_name.as_deref(), Some("infra-high"));
        assert_eq!(
            pod.image_pull_secrets.expect("imagePullSecrets")[0].name,
            "proxy-pull"
        );
        let affinity = pod.affinity.expect("affinity");
        assert!(
            affinity.node_affinity.is_some(),
            "the admin's node affinity"
        );
        assert!(
            affinity.pod_anti_affinity.is_some(),
            "the replicas still prefer different nodes"
        );
        // Placement never loosens the lockdown.
        assert_eq!(
            pod.service_account_name.as_deref(),
            Some("cli-mcp-demo-proxy")
        );
        assert_eq!(
            pod.containers[0]
                .security_context
                .as_ref()
                .and_then(|c| c.allow_privilege_escalation),
            Some(false)
        );

        // An admin's own podAntiAffinity replaces the default spread.
        let inp = inputs(serde_json::json!({"proxy": {
            "targets": [{"type": "kubernetes"}],
            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "topology.kubernetes.io/zone"}]}}
        }}));
        let anti = deployment(&inp, proxy(&inp))
            .spec
            .template
            .spec
            .and_then(|p| p.affinity)
            .and_then(|a| a.pod_anti_affinity)
            .expect("anti-affinity");
        assert_eq!(
            anti.preferred_during_scheduling_ignored_during_execution,
            None
        );
        assert_eq!(
            anti.required_during_scheduling_ignored_during_execution
                .expect("required")[0]
                .topology_key,
            "topology.kubernetes.io/zone"
        );

        // Nothing set: only the default spread.
        let plain = proxied();
        let pod = deployment(&plain, proxy(&plain))
            .spec
            .template
            .spec
            .expect("pod");
        assert_eq!(pod.runtime_class_name, None);
        assert_eq!(pod.node_selector, None);
        assert_eq!(pod.tolerations, None);
        assert_eq!(pod.priority_class_name, None);
        assert_eq!(pod.image_pull_secrets, None);
        let affinity = pod.affinity.expect("affinity");
        assert!(affinity.node_affinity.is_none() && affinity.pod_anti_affinity.is_some());
    }

    #[test]
    fn the_config_map_holds_routes_dummy_and_ca_and_never_the_token() {
        let inp = proxied();
        let p = proxy(&inp);
        let cm = config_map(&inp, p);
        let data = cm.data.expect("data");
        let routes = RouteTable::from_json(&data[ROUTES_KEY]).expect("routes parse back");
        let domains: Vec<_> = routes.routes().iter().map(|r| r.domain.as_str()).collect();
        assert_eq!(
            domains,
            [
                "192.0.2.7:8443",
                "kubernetes.default.svc:443",
                "pypi.org:443"
            ]
        );
        assert!(data[KUBECONFIG_KEY].contains("cli-mcp-proxy-managed"));
        for v in data.values() {
            assert!(!v.contains("admin-secret-token"), "{v}");
        }
        assert!(data[PROXY_CA_KEY].contains("BEGIN CERTIFICATE"));
    }

    #[test]
    fn proxy_egress_is_dns_the_api_server_and_the_route_destinations_only() {
        let inp = proxied();
        let np = network_policy(&inp, proxy(&inp));
        let spec = np.spec.expect("spec");
        let ingress = &spec.ingress.expect("ingress")[0];
        let from = ingress.from.as_ref().expect("from")[0]
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .expect("labels");
        assert_eq!(from[label::COMPONENT], "sandbox");
        let egress = spec.egress.expect("egress");
        let cidrs = |r: &NetworkPolicyEgressRule| -> Vec<String> {
            r.to.iter()
                .flatten()
                .filter_map(|p| p.ip_block.as_ref().map(|b| b.cidr.clone()))
                .collect()
        };
        let ports = |r: &NetworkPolicyEgressRule| -> Vec<IntOrString> {
            r.ports
                .iter()
                .flatten()
                .filter_map(|p| p.port.clone())
                .collect()
        };
        // The API server (the proxy's own TokenReviews and pod watch; kubernetes.default.svc
        // is a route to it too): its endpoints and ports, once.
        let api = |r: &NetworkPolicyEgressRule| {
            cidrs(r) == ["10.0.0.1/32"] && ports(r) == [IntOrString::Int(6443)]
        };
        assert_eq!(egress.iter().filter(|r| api(r)).count(), 1);
        // An IP literal → that address and port only.
        assert!(egress
            .iter()
            .any(|r| cidrs(r) == ["192.0.2.7/32"] && ports(r) == [IntOrString::Int(8443)]));
        // A DNS name → any address, but only its port.
        assert!(egress
            .iter()
            .any(|r| cidrs(r).contains(&"0.0.0.0/0".to_owned())
                && ports(r) == [IntOrString::Int(443)]));
        assert!(egress.iter().all(|r| r.to.is_some() && r.ports.is_some()));
        assert_eq!(egress.len(), 4, "DNS, API server, IP, DNS name: {egress:?}");

        // Without a kubernetes target the proxy still reaches the API server, as itself.
        let inp = inputs(serde_json::json!({"proxy": {"targets": [
            {"type": "allowlist", "domains": ["pypi.org"]}
        ]}}));
        let egress = network_policy(&inp, proxy(&inp))
            .spec
            .and_then(|s| s.egress)
            .expect("egress");
        assert_eq!(egress.iter().filter(|r| api(r)).count(), 1);
        // Addresses the operator could not read: no API rule, and nothing wider instead.
        let mut blind = inp.clone();
        blind.api_server.ips.clear();
        let egress = network_policy(&blind, proxy(&blind))
            .spec
            .and_then(|s| s.egress)
            .expect("egress");
        assert!(!egress.iter().any(api));
        assert_eq!(egress.len(), 2, "DNS and pypi.org: {egress:?}");
    }

    #[test]
    fn the_kubernetes_targets_identity_is_on_each_of_its_routes_only() {
        let inp = inputs(serde_json::json!({"proxy": {"targets": [
            {"type": "kubernetes", "identity": "impersonateCaller"},
            {"type": "allowlist", "domains": ["pypi.org"]}
        ]}}));
        let p = proxy(&inp);
        let identity = |d: &str| {
            p.routes
                .get(&Domain::parse(d).expect("domain"))
                .expect("route")
                .identity
        };
        assert_eq!(
            identity("kubernetes.default.svc:443"),
            RouteIdentity::ImpersonateCaller
        );
        assert_eq!(identity("pypi.org:443"), RouteIdentity::Shared);
        // The proxy reads it from its route table, and a change rolls it.
        let json = config_map(&inp, p).data.expect("data")[ROUTES_KEY].clone();
        assert!(json.contains("impersonateCaller"), "{json}");
        let shared = proxied();
        let version = |inp: &Inputs| {
            deployment(inp, proxy(inp))
                .spec
                .template
                .metadata
                .and_then(|m| m.annotations)
                .map(|a| a[ROUTES_VERSION_ANNOTATION].clone())
        };
        assert_ne!(version(&inp), version(&shared));
        // Without identity: shared, as before the field.
        let shared_routes = &proxy(&shared).routes;
        assert!(shared_routes
            .routes()
            .iter()
            .all(|r| r.identity == RouteIdentity::Shared));
    }

    #[test]
    fn impersonating_needs_a_caller() {
        let plan = |identity: &str| {
            inputs(serde_json::json!({"proxy": {"targets": [
                {"type": "kubernetes", "identity": identity}
            ]}}))
            .spec
            .proxy
        };
        let e = check_identity(&plan("impersonateCaller"), AuthMode::None).expect_err("no caller");
        assert!(e.contains("spec.server.auth"), "{e}");
        assert_eq!(
            check_identity(&plan("impersonateCaller"), AuthMode::Kubernetes),
            Ok(())
        );
        assert_eq!(check_identity(&plan("shared"), AuthMode::None), Ok(()));
    }

    #[test]
    fn a_new_hmac_key_rolls_the_proxy() {
        let inp = proxied();
        let ann = |inp: &Inputs| {
            deployment(inp, proxy(inp))
                .spec
                .template
                .metadata
                .and_then(|m| m.annotations)
                .expect("annotations")
        };
        assert_eq!(ann(&inp)[HMAC_VERSION_ANNOTATION], "hv1");
        let mut rotated = inp.clone();
        rotated.hmac_version = "hv2".into();
        assert_eq!(ann(&rotated)[HMAC_VERSION_ANNOTATION], "hv2");
    }

    #[test]
    fn the_kubeconfig_version_follows_the_token_and_nothing_else() {
        let inp = proxied();
        let plan = inp.spec.proxy.clone();
        let p = proxy(&inp);
        let version = |token: &str| {
            let k = cli_mcp_api::kubeconfig::validate(&format!(
                "clusters: [{{name: c, cluster: {{server: 'https://kubernetes.default.svc'}}}}]\n\
                 users: [{{name: u, user: {{token: {token}}}}}]\n\
                 contexts: [{{name: x, context: {{cluster: c, user: u, namespace: a}}}}]\n"
            ))
            .expect("valid");
            proxy_inputs(&plan, Some("i"), Some(&k), &BTreeMap::new(), &p.ca_pem, "v")
                .expect("inputs")
                .kubeconfig_version
                .expect("a version")
        };
        assert_eq!(version("t1"), version("t1"));
        assert_ne!(version("t1"), version("t2"));
        // A rotated token changes no part of the pod template: no roll, open watches stay.
        let k = super::super::test_support::admin_kubeconfig();
        let a =
            proxy_inputs(&plan, Some("i"), Some(&k), &BTreeMap::new(), &p.ca_pem, "v").expect("a");
        let mut b = a.clone();
        b.kubeconfig_version = Some("other".into());
        assert_eq!(
            serde_json::to_value(deployment(&inp, &a)).expect("json"),
            serde_json::to_value(deployment(&inp, &b)).expect("json")
        );
    }

    /// A CA (or, with `ca: false`, a leaf) certificate in PEM.
    fn cert_pem(ca: bool) -> String {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["web.example".to_owned()]).expect("params");
        if ca {
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        }
        params.self_signed(&key).expect("certificate").pem()
    }

    #[test]
    fn an_allowlist_target_with_a_ca_pins_its_domains_to_that_ca_alone() {
        let inp = inputs(serde_json::json!({"proxy": {"targets": [
            {"type": "kubernetes"},
            {"type": "allowlist", "domains": ["web.example:8443"], "caConfigMap": "web-ca"},
            {"type": "allowlist", "domains": ["pypi.org"]}
        ]}}));
        let plan = inp.spec.proxy.clone();
        let ca = cert_pem(true);
        let bundle = validate_ca_bundle("web-ca", &ca).expect("a CA is accepted");
        let kc = crate::children::test_support::admin_kubeconfig();
        let cas = BTreeMap::from([("web-ca".to_owned(), bundle)]);
        let p = proxy_inputs(&plan, Some("i"), Some(&kc), &cas, "proxy-ca", "v").expect("inputs");
        let ca_of = |d: &str| {
            p.routes
                .get(&Domain::parse(d).expect("domain"))
                .expect("route")
                .ca_cert
                .clone()
        };
        assert_eq!(ca_of("web.example:8443"), Some(ca.clone()));
        assert_eq!(ca_of("pypi.org:443"), None, "the system roots");
        // The CA travels in the route table, which only the proxy mounts.
        let cm = config_map(&inp, &p);
        assert!(cm.data.expect("data")[ROUTES_KEY].contains("BEGIN CERTIFICATE"));
        // Not read (yet): no inputs, rather than a route silently on the system roots.
        let e = proxy_inputs(&plan, Some("i"), Some(&kc), &BTreeMap::new(), "p", "v")
            .expect_err("unread CA");
        assert!(e.contains("web-ca"), "{e}");
    }

    #[test]
    fn a_ca_bundle_is_refused_with_what_to_fix() {
        let err = |pem: &str| validate_ca_bundle("web-ca", pem).expect_err("refused");
        let e = err("");
        assert!(
            e.contains("holds no PEM certificate") && e.contains("web-ca"),
            "{e}"
        );
        let e = err("not pem at all");
        assert!(e.contains("holds no PEM certificate"), "{e}");
        let e = err(&cert_pem(false));
        assert!(
            e.contains("is not a CA"),
            "a leaf cannot anchor a chain: {e}"
        );
        let e = err("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
        assert!(e.contains("not a CERTIFICATE"), "{e}");
        let e = err("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        assert!(e.contains("not valid X.509"), "{e}");
        let e = err("-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n");
        assert!(e.contains("certificate 1") || e.contains("block 1"), "{e}");
        let big = cert_pem(true).repeat(MAX_CA_BUNDLE_BYTES / 500);
        let e = err(&big);
        assert!(e.contains("bytes; at most"), "{e}");
        let many = cert_pem(true).repeat(MAX_CA_BUNDLE_CERTS + 1);
        assert!(
            many.len() <= MAX_CA_BUNDLE_BYTES,
            "the count is what is refused"
        );
        let e = err(&many);
        assert!(e.contains("more than 32 certificates"), "{e}");
        // Two CAs are fine.
        let two = format!("{}{}", cert_pem(true), cert_pem(true));
        assert_eq!(validate_ca_bundle("web-ca", &two), Ok(two.clone()));
    }

    #[test]
    fn a_missing_image_or_a_clash_is_a_clear_error() {
        let inp = proxied();
        let p = proxy(&inp);
        let plan = inp.spec.proxy.clone();
        let e = proxy_inputs(&plan, None, None, &BTreeMap::new(), &p.ca_pem, "v")
            .expect_err("no image");
        assert!(e.contains("RELATED_IMAGE_PROXY"), "{e}");
        let kc = super::super::test_support::admin_kubeconfig();
        let mut clash = plan.clone();
        clash.allowlist = vec![Domain::parse("kubernetes.default.svc:443").expect("d")];
        let e = proxy_inputs(
            &clash,
            Some("i"),
            Some(&kc),
            &BTreeMap::new(),
            &p.ca_pem,
            "v",
        )
        .expect_err("clash");
        assert!(e.contains("also a server of the kubeconfig"), "{e}");
    }
}
