//! Pure builders of every object an instance owns. Each takes [`Inputs`] and returns the
//! desired object with only the fields the operator owns set, ready for server-side apply;
//! [`build_all`] returns the whole desired set.
//!
//! A new child is one builder, one field in [`Desired`] (listed in apply order in
//! [`Desired::children`], which `apply.rs` holds: these builders import nothing of the
//! operator's steps), and — for a new kind — an [`crate::apply::Owned`] entry, a store and
//! watch in [`crate::watch`] and an RBAC rule in the packaging.

pub mod deployment;
pub mod expose;
mod inputs;
pub mod networkpolicy;
pub mod proxy;
pub mod rbac;
pub mod secrets;
pub mod service;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};

use cli_mcp_api::names::label;

pub use inputs::{ApiServerPeers, Inputs, ProxyInputs, Spec};

/// Pod-template annotation carrying a hash of the HMAC key: a new key rolls the server.
pub const HMAC_VERSION_ANNOTATION: &str = "cli-mcp.redhat.com/hmac-version";
/// Pod-template annotation carrying a hash of the serving certificate.
pub const TLS_VERSION_ANNOTATION: &str = "cli-mcp.redhat.com/tls-version";
/// Pod-template annotation naming the pods' RuntimeClass while the cluster lacks it. The
/// API server refuses those pods, and the ReplicaSet controller retries them only after its
/// own backoff (up to about 16 minutes); when the class appears the annotation goes, and
/// that template change makes the Deployment's pods at once.
pub const RUNTIME_CLASS_MISSING_ANNOTATION: &str = "cli-mcp.redhat.com/runtime-class-missing";
/// Label on the cluster-scoped ClusterRoleBinding naming the instance's namespace (the
/// instance label alone is ambiguous across namespaces).
pub const INSTANCE_NAMESPACE_LABEL: &str = "cli-mcp.redhat.com/instance-namespace";

/// Server container ports.
pub const MCP_TLS_PORT: i32 = 8443;
pub const MCP_PLAIN_PORT: i32 = 8080;
pub const HEALTH_PORT: i32 = 8081;
/// Where the server finds its mounted Secrets.
pub const HMAC_DIR: &str = "/var/run/cli-mcp/hmac";
pub const TLS_DIR: &str = "/var/run/cli-mcp/tls";

/// Every object the operator applies for one instance.
#[derive(Debug, Clone)]
pub struct Desired {
    pub server_service_account: ServiceAccount,
    pub sandbox_service_account: ServiceAccount,
    pub server_role: Role,
    pub server_role_binding: RoleBinding,
    pub auth_delegator_binding: ClusterRoleBinding,
    pub client_service_account: ServiceAccount,
    pub client_role: Role,
    pub client_role_binding: RoleBinding,
    pub service: Service,
    pub network_policy: NetworkPolicy,
    /// On OpenShift with the service CA: the ConfigMap its bundle is injected into.
    pub service_ca_config_map: Option<ConfigMap>,
    /// When there is a CA to publish: the generated one, or the injected service CA.
    pub ca_config_map: Option<ConfigMap>,
    pub deployment: Deployment,
    /// The credential proxy (every instance has one), once its inputs resolved.
    pub proxy: Option<proxy::ProxyChildren>,
    /// The Ingress, HTTPRoute or Route of `spec.server.expose`.
    pub expose: Option<expose::Exposed>,
}

/// The whole desired set of one instance. Pure.
pub fn build_all(inp: &Inputs) -> Desired {
    Desired {
        server_service_account: rbac::server_service_account(inp),
        sandbox_service_account: rbac::sandbox_service_account(inp),
        server_role: rbac::server_role(inp),
        server_role_binding: rbac::server_role_binding(inp),
        auth_delegator_binding: rbac::auth_delegator_binding(inp),
        client_service_account: rbac::client_service_account(inp),
        client_role: rbac::client_role(inp),
        client_role_binding: rbac::client_role_binding(inp),
        service: service::service(inp),
        network_policy: networkpolicy::network_policy(inp),
        service_ca_config_map: inp.spec.service_ca.then(|| {
            let name = secrets::service_ca_config_map_name(&inp.spec.name);
            secrets::service_ca_config_map(inp.spec.meta(name, label::COMPONENT_SERVER))
        }),
        ca_config_map: inp
            .ca_config_map_name()
            .zip(inp.ca_pem.as_ref())
            .map(|(name, pem)| {
                secrets::ca_config_map(inp.spec.meta(name, label::COMPONENT_SERVER), pem)
            }),
        deployment: deployment::deployment(inp),
        proxy: inp.proxy.as_ref().map(|p| proxy::build(inp, p)),
        // One the cluster cannot store is left out; the status says why.
        expose: expose::build(inp).filter(|_| inp.expose_unavailable.is_none()),
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use cli_mcp_api::crd::CliMcpInstance;

    pub fn cr(spec: serde_json::Value) -> CliMcpInstance {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "cli-mcp.redhat.com/v1alpha1",
            "kind": "CliMcpInstance",
            "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1", "generation": 1},
            "spec": spec,
        }))
        .expect("valid CR")
    }

    /// An admin kubeconfig for `https://kubernetes.default.svc` with a token.
    pub fn admin_kubeconfig() -> cli_mcp_api::kubeconfig::Kubeconfig {
        cli_mcp_api::kubeconfig::validate(
            "clusters: [{name: c, cluster: {server: 'https://kubernetes.default.svc'}}]\n\
             users: [{name: u, user: {token: admin-secret-token}}]\n\
             contexts: [{name: x, context: {cluster: c, user: u}}]\n",
        )
        .expect("valid kubeconfig")
    }

    pub fn inputs(spec: serde_json::Value) -> Inputs {
        let spec = Spec::read(
            &cr(spec),
            "cli-mcp-server:dev",
            Some("cli-mcp-agent:dev"),
            Some("cli-mcp-proxy:dev"),
        )
        .expect("spec");
        let kubeconfig = admin_kubeconfig();
        let plan = &spec.proxy;
        let proxy = Some(
            proxy::proxy_inputs(
                plan,
                spec.proxy_image.as_deref(),
                plan.kubeconfig_secret.as_ref().map(|_| &kubeconfig),
                &plan
                    .allowlist_cas
                    .values()
                    .map(|cm| (cm.clone(), format!("{cm} test CA")))
                    .collect(),
                "-----BEGIN CERTIFICATE-----\nproxy-ca\n-----END CERTIFICATE-----\n",
                "cav1",
            )
            .expect("proxy inputs"),
        );
        Inputs {
            spec,
            proxy,
            hmac_version: "hv1".into(),
            tls_version: Some("tv1".into()),
            ca_pem: Some("-----BEGIN CERTIFICATE-----\nca\n".into()),
            backend_ca: Some("-----BEGIN CERTIFICATE-----\nca\n".into()),
            api_server: ApiServerPeers {
                ips: vec!["10.0.0.1".into()],
                ports: vec![6443],
                problem: None,
            },
            expose_unavailable: None,
            briefing: None,
            missing_runtime_classes: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::inputs;
    use super::*;
    use kube::ResourceExt;
    use std::collections::BTreeMap;

    /// The whole desired set: every kind and name in apply order, and the fields that tie
    /// the children together (owner, labels, selectors, the names they refer to).
    #[test]
    fn build_all_is_the_whole_desired_set() {
        let d = build_all(&inputs(serde_json::json!({"replicas": 2})));
        let described: Vec<String> = d.children().iter().map(|c| c.describe()).collect();
        assert_eq!(
            described,
            [
                "ServiceAccount cli-mcp-demo",
                "ServiceAccount cli-mcp-demo-sandbox",
                "Role cli-mcp-demo",
                "RoleBinding cli-mcp-demo",
                "ClusterRoleBinding cli-mcp-ns1-demo-auth-delegator-08c69f66",
                "ServiceAccount cli-mcp-demo-client",
                "Role cli-mcp-demo-client",
                "RoleBinding cli-mcp-demo-client",
                "Service cli-mcp-demo",
                "NetworkPolicy cli-mcp-demo-sandbox",
                "ConfigMap cli-mcp-demo-ca",
                // Without spec.proxy: the implied credential proxy.
                "ServiceAccount cli-mcp-demo-proxy",
                "Role cli-mcp-demo-proxy",
                "RoleBinding cli-mcp-demo-proxy",
                "ClusterRoleBinding cli-mcp-ns1-demo-proxy-auth-delegator-08c69f66",
                "ConfigMap cli-mcp-demo-proxy",
                "Service cli-mcp-demo-proxy",
                "NetworkPolicy cli-mcp-demo-proxy",
                "PodDisruptionBudget cli-mcp-demo-proxy",
                "Deployment cli-mcp-demo-proxy",
                "Deployment cli-mcp-demo",
            ]
        );

        // Namespaced children: in the CR's namespace, owned by it, labelled as managed.
        let metas = [
            (&d.server_service_account.metadata, "server"),
            (&d.sandbox_service_account.metadata, "sandbox"),
            (&d.server_role.metadata, "server"),
            (&d.server_role_binding.metadata, "server"),
            (&d.client_service_account.metadata, "client"),
            (&d.client_role.metadata, "client"),
            (&d.client_role_binding.metadata, "client"),
            (&d.service.metadata, "server"),
            (&d.network_policy.metadata, "sandbox"),
            (&d.deployment.metadata, "server"),
        ];
        let ca = d.ca_config_map.as_ref().expect("CA ConfigMap");
        let p = d.proxy.as_ref().expect("the proxy's children");
        let proxy_metas = [
            (&ca.metadata, "server"),
            (&p.role.metadata, "proxy"),
            (&p.role_binding.metadata, "proxy"),
        ];
        for (m, component) in metas.into_iter().chain(proxy_metas) {
            assert_eq!(m.namespace.as_deref(), Some("ns1"), "{:?}", m.name);
            let owners = m.owner_references.as_ref().expect("owner");
            assert_eq!(owners.len(), 1);
            assert_eq!(owners[0].uid, "uid-1");
            assert_eq!(owners[0].controller, Some(true));
            let l = m.labels.as_ref().expect("labels");
            assert_eq!(l[label::INSTANCE], "demo");
            assert_eq!(l[label::COMPONENT], component, "{:?}", m.name);
            assert_eq!(l[label::APP_MANAGED_BY], label::MANAGED_BY);
        }

        // The cluster-scoped binding cannot be owned: labels map it back to the instance.
        let crb = &d.auth_delegator_binding;
        assert!(crb.metadata.owner_references.is_none());
        assert_eq!(crb.labels()[INSTANCE_NAMESPACE_LABEL], "ns1");
        assert_eq!(crb.role_ref.name, "system:auth-delegator");
        // So is the proxy's (TokenReview of the sandboxes' tokens).
        let proxy_crb = &p.auth_delegator_binding;
        assert!(proxy_crb.metadata.owner_references.is_none());
        assert_eq!(proxy_crb.labels()[INSTANCE_NAMESPACE_LABEL], "ns1");
        assert_eq!(proxy_crb.labels()[label::INSTANCE], "demo");
        assert_eq!(proxy_crb.role_ref.name, "system:auth-delegator");
        let server_sa = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
            subjects
                .as_ref()
                .map(|s| (s[0].name.clone(), s[0].namespace.clone()))
        };
        let sa = Some(("cli-mcp-demo".to_owned(), Some("ns1".to_owned())));
        assert_eq!(server_sa(&crb.subjects), sa);
        assert_eq!(server_sa(&d.server_role_binding.subjects), sa);
        assert_eq!(d.server_role_binding.role_ref.name, "cli-mcp-demo");
        assert_eq!(
            d.sandbox_service_account.automount_service_account_token,
            Some(false)
        );

        // Service, Deployment and NetworkPolicy agree on the server pods' labels.
        let server_pods = BTreeMap::from([
            (label::INSTANCE.to_owned(), "demo".to_owned()),
            (label::COMPONENT.to_owned(), "server".to_owned()),
        ]);
        let svc = d.service.spec.as_ref().expect("service spec");
        assert_eq!(svc.selector.as_ref(), Some(&server_pods));
        assert_eq!(svc.ports.as_ref().map(|p| p[0].port), Some(8443));
        let dep = &d.deployment.spec;
        assert_eq!(dep.replicas, Some(2));
        assert_eq!(dep.selector.match_labels.as_ref(), Some(&server_pods));
        let np = d.network_policy.spec.as_ref().expect("policy spec");
        let from = np.ingress.as_ref().expect("ingress")[0]
            .from
            .as_ref()
            .expect("from");
        assert_eq!(
            from[0]
                .pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref()),
            Some(&server_pods)
        );
        assert_eq!(
            np.pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .map(|l| l[label::COMPONENT].as_str()),
            Some("sandbox")
        );

        // The pod template carries the versions that roll the server and mounts what the
        // other children name.
        let tpl = &dep.template;
        let ann = tpl.metadata.as_ref().and_then(|m| m.annotations.as_ref());
        assert_eq!(
            ann.map(|a| a[HMAC_VERSION_ANNOTATION].as_str()),
            Some("hv1")
        );
        assert_eq!(ann.map(|a| a[TLS_VERSION_ANNOTATION].as_str()), Some("tv1"));
        let pod = tpl.spec.as_ref().expect("pod spec");
        assert_eq!(pod.service_account_name.as_deref(), Some("cli-mcp-demo"));
        let secrets: Vec<_> = pod
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.secret.as_ref()?.secret_name.clone())
            .collect();
        assert_eq!(secrets, ["cli-mcp-demo-hmac", "cli-mcp-demo-tls"]);
        assert!(ca
            .data
            .as_ref()
            .is_some_and(|d| d.contains_key(secrets::CA_CRT)));
    }

    /// On OpenShift the service CA's ConfigMap comes before the CA ConfigMap it is copied
    /// into, and carries only the injection annotation: the injector owns its data.
    #[test]
    fn on_openshift_the_service_ca_bundle_is_asked_for() {
        let mut inp = inputs(serde_json::json!({}));
        assert!(build_all(&inp).service_ca_config_map.is_none());
        inp.spec.use_service_ca();
        let d = build_all(&inp);
        let described: Vec<String> = d.children().iter().map(|c| c.describe()).collect();
        let at = |n: &str| described.iter().position(|d| d == n).expect(n);
        assert!(at("ConfigMap cli-mcp-demo-service-ca") < at("ConfigMap cli-mcp-demo-ca"));
        let cm = d.service_ca_config_map.expect("service CA ConfigMap");
        assert_eq!(cm.data, None);
        let ann = cm.metadata.annotations.expect("annotations");
        assert_eq!(ann[secrets::INJECT_CABUNDLE_ANNOTATION], "true");
        assert_eq!(cm.metadata.owner_references.expect("owner")[0].uid, "uid-1");
        let secrets_mounted: Vec<_> = d
            .deployment
            .spec
            .template
            .spec
            .as_ref()
            .and_then(|p| p.volumes.clone())
            .into_iter()
            .flatten()
            .filter_map(|v| v.secret?.secret_name)
            .collect();
        assert_eq!(
            secrets_mounted,
            ["cli-mcp-demo-hmac", "cli-mcp-demo-service-tls"]
        );
    }

    #[test]
    fn without_auth_there_is_no_ca_to_publish() {
        let mut inp = inputs(serde_json::json!({"server": {"auth": "None"}}));
        inp.ca_pem = None;
        inp.tls_version = None;
        let d = build_all(&inp);
        assert!(d.ca_config_map.is_none());
        // The only ConfigMap is the credential proxy's (its CA is not the server's).
        let config_maps: Vec<String> = d
            .children()
            .iter()
            .map(|c| c.describe())
            .filter(|c| c.starts_with("ConfigMap"))
            .collect();
        assert_eq!(config_maps, ["ConfigMap cli-mcp-demo-proxy"]);
        assert_eq!(
            d.service.spec.and_then(|s| s.ports).map(|p| p[0].port),
            Some(8080)
        );
    }

    /// An HTTPRoute or Route the cluster cannot store is not in the desired set; everything
    /// else is built as when it can.
    #[test]
    fn an_expose_the_cluster_cannot_store_is_left_out() {
        let spec = serde_json::json!({"server": {"expose": {"httpRoute": {
            "host": "mcp.example.com",
            "parentRefs": [{"name": "gw"}]
        }}}});
        let mut inp = inputs(spec);
        let served = build_all(&inp);
        assert!(matches!(served.expose, Some(expose::Exposed::HttpRoute(_))));
        inp.expose_unavailable = Some("no Gateway API".into());
        let unserved = build_all(&inp);
        assert!(unserved.expose.is_none());
        assert_eq!(
            format!("{:?}", unserved.deployment),
            format!("{:?}", served.deployment)
        );
    }
}
