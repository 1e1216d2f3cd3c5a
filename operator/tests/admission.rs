//! Invalid CliMcpInstances are rejected by the apiserver (CRD bounds, enums and CEL rules),
//! with a message that says what to fix. No operator needed.

mod support;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::testing::cluster;
use kube::api::{DynamicObject, PostParams};
use kube::Api;
use serde_json::json;

use support::{install_crd, instance, rejected};

#[tokio::test]
async fn invalid_instances_are_rejected_with_a_clear_message() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("admission").await.expect("namespace");

    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "replicas0",
            json!({"replicas": 0}),
            "spec.replicas must be between 1 and 50",
        ),
        (
            "replicas51",
            json!({"replicas": 51}),
            "spec.replicas must be between 1 and 50",
        ),
        (
            "pool1000",
            json!({"sandbox": {"warmPoolSize": 1000}}),
            "spec.sandbox.warmPoolSize must be between 0 and 200",
        ),
        (
            "banana",
            json!({"sandbox": {"idleTimeout": "banana"}}),
            "spec.sandbox.idleTimeout must be a duration",
        ),
        (
            "tooshort",
            json!({"sandbox": {"idleTimeout": "30s"}}),
            "between 1m and 168h",
        ),
        (
            "pullpolicy",
            json!({"sandbox": {"imagePullPolicy": "Sometimes"}}),
            "supported values: \"Always\", \"IfNotPresent\", \"Never\"",
        ),
        (
            "secretenv",
            json!({"sandbox": {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}}),
            "valueFrom.secretKeyRef is not allowed",
        ),
        (
            "reservedenv",
            json!({"sandbox": {"env": [{"name": "KUBECONFIG", "value": "/x"}]}}),
            "are set by the operator",
        ),
        (
            "cpu",
            json!({"sandbox": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}}),
            "requests.cpu must not exceed limits.cpu",
        ),
        (
            "timeouts",
            json!({"sandbox": {"commandTimeout": {"default": "200s", "max": "100s"}}}),
            "commandTimeout.default must not exceed commandTimeout.max",
        ),
        (
            "auth",
            json!({"server": {"auth": "Basic"}}),
            "supported values: \"Kubernetes\", \"None\"",
        ),
        (
            "clientns",
            json!({"server": {"clients": [{"kind": "User", "name": "alice", "namespace": "x"}]}}),
            "namespace is only for kind ServiceAccount",
        ),
        (
            "clientkind",
            json!({"server": {"clients": [{"kind": "Robot", "name": "r2"}]}}),
            "supported values: \"User\", \"Group\", \"ServiceAccount\"",
        ),
        (
            "twokube",
            json!({"proxy": {"targets": [{"type": "kubernetes"}, {"type": "kubernetes", "secretName": "b"}]}}),
            "at most one target of type kubernetes",
        ),
        (
            "kubedomains",
            json!({"proxy": {"targets": [{"type": "kubernetes", "domains": ["a.example"]}]}}),
            "remove domains or use type allowlist",
        ),
        (
            "allowsecret",
            json!({"proxy": {"targets": [{"type": "allowlist", "secretName": "s", "domains": ["a.example"]}]}}),
            "secretName belongs to a kubernetes target",
        ),
        (
            "allownodomains",
            json!({"proxy": {"targets": [{"type": "allowlist"}]}}),
            "an allowlist target needs domains",
        ),
        (
            "wildcard",
            json!({"proxy": {"targets": [{"type": "allowlist", "domains": ["*.example.com"]}]}}),
            "without '*'",
        ),
        (
            "notargets",
            json!({"proxy": {"targets": []}}),
            "at least 1 items",
        ),
        (
            "ownhmac",
            json!({"proxy": {"targets": [{"type": "kubernetes", "secretName": "cli-mcp-ownhmac-hmac"}]}}),
            "must not name the instance's own HMAC, TLS or proxy CA Secret",
        ),
        (
            "ownca",
            json!({"proxy": {"targets": [{"type": "kubernetes", "secretName": "cli-mcp-ownca-proxy-ca"}]}}),
            "must not name the instance's own HMAC, TLS or proxy CA Secret",
        ),
        (
            "ownservicetls",
            json!({"proxy": {"targets": [{"type": "kubernetes", "secretName": "cli-mcp-ownservicetls-service-tls"}]}}),
            "must not name the instance's own HMAC, TLS or proxy CA Secret",
        ),
        (
            "oldhmac",
            json!({"sandbox": {"kubeconfigSecret": "cli-mcp-oldhmac-hmac"}}),
            "spec.sandbox.kubeconfigSecret must not name the instance's own HMAC",
        ),
        (
            "both",
            json!({"sandbox": {"kubeconfigSecret": "kc"}, "proxy": {"targets": [{"type": "kubernetes"}]}}),
            "set either spec.proxy or the older spec.sandbox.kubeconfigSecret",
        ),
        (
            "reservedproxyenv",
            json!({"sandbox": {"env": [{"name": "https_proxy", "value": "http://evil:1"}]}, "proxy": {"targets": [{"type": "kubernetes"}]}}),
            "the proxy and CA variables",
        ),
        (
            "authhttp",
            json!({"server": {"authorization": {"servers": ["http://idp.example"], "resourceUrl": "https://mcp.example.com/mcp"}}}),
            "spec.server.authorization.servers: each entry is an issuer URL",
        ),
        (
            "authfragment",
            json!({"server": {"authorization": {"servers": ["https://idp.example/#x"], "resourceUrl": "https://mcp.example.com/mcp"}}}),
            "no user@, query (?), fragment (#)",
        ),
        (
            "authcomma",
            json!({"server": {"authorization": {"servers": ["https://a.example,https://b.example"], "audiences": ["x"]}}}),
            "spaces or commas",
        ),
        (
            "authnoaud",
            json!({"server": {"authorization": {"servers": ["https://idp.example"]}}}),
            "spec.server.authorization needs resourceUrl",
        ),
        (
            "authnone",
            json!({"server": {"auth": "None", "authorization": {"servers": ["https://idp.example"], "audiences": ["x"]}}}),
            "spec.server.authorization needs auth: Kubernetes",
        ),
        (
            "authresource",
            json!({"server": {"authorization": {"servers": ["https://idp.example"], "resourceUrl": "http://mcp.example.com/mcp"}}}),
            "spec.server.authorization.resourceUrl must be the public https URL",
        ),
        (
            "authresfrag",
            json!({"server": {"authorization": {"servers": ["https://idp.example"], "resourceUrl": "https://mcp.example.com/mcp#top"}}}),
            "spec.server.authorization.resourceUrl must be the public https URL",
        ),
        (
            "authscope",
            json!({"server": {"authorization": {"servers": ["https://idp.example"], "audiences": ["x"], "scopes": ["has space"]}}}),
            "each entry is an OAuth scope",
        ),
        (
            "authnoservers",
            json!({"server": {"authorization": {"servers": [], "audiences": ["x"]}}}),
            "at least 1 items",
        ),
        (
            "exposeboth",
            json!({"server": {"expose": {"ingress": {"host": "a.example.com"}, "httpRoute": {"host": "a.example.com", "parentRefs": [{"name": "gw"}]}}}}),
            "set either ingress or httpRoute, not both",
        ),
        (
            "exposeempty",
            json!({"server": {"expose": {}}}),
            "spec.server.expose needs ingress, httpRoute or route",
        ),
        (
            "routeandingress",
            json!({"server": {"expose": {"route": {}, "ingress": {"host": "a.example.com"}}}}),
            "set route alone, without ingress or httpRoute",
        ),
        (
            "routeandhttproute",
            json!({"server": {"expose": {"route": {}, "httpRoute": {"host": "a.example.com", "parentRefs": [{"name": "gw"}]}}}}),
            "set route alone, without ingress or httpRoute",
        ),
        (
            "routenoauth",
            json!({"server": {"auth": "None", "expose": {"route": {}}}}),
            "spec.server.expose needs auth: Kubernetes",
        ),
        (
            "routehost",
            json!({"server": {"expose": {"route": {"host": "https://mcp.apps.example.com"}}}}),
            "spec.server.expose.route.host must be a lowercase DNS name",
        ),
        (
            "routeallow",
            json!({"server": {"expose": {"route": {"insecureEdgeTerminationPolicy": "Allow"}}}}),
            "supported values: \"Redirect\", \"None\"",
        ),
        (
            "exposenone",
            json!({"server": {"auth": "None", "expose": {"ingress": {"host": "a.example.com"}}}}),
            "spec.server.expose needs auth: Kubernetes",
        ),
        (
            "exposewild",
            json!({"server": {"expose": {"ingress": {"host": "*.example.com"}}}}),
            "spec.server.expose.ingress.host must be a lowercase DNS name",
        ),
        (
            "exposenoparent",
            json!({"server": {"expose": {"httpRoute": {"host": "a.example.com", "parentRefs": []}}}}),
            "at least 1 items",
        ),
        (
            "originnoturl",
            json!({"server": {"allowedOrigins": ["not a url"]}}),
            "spec.server.allowedOrigins: each entry is a browser origin scheme://host[:port]",
        ),
        (
            "originpath",
            json!({"server": {"allowedOrigins": ["https://app.example.com/"]}}),
            "spec.server.allowedOrigins: each entry is a browser origin",
        ),
        (
            "originscheme",
            json!({"server": {"allowedOrigins": ["ftp://app.example.com"]}}),
            "spec.server.allowedOrigins: each entry is a browser origin",
        ),
        (
            "originport",
            json!({"server": {"allowedOrigins": ["https://app.example.com:65536"]}}),
            "spec.server.allowedOrigins: each entry is a browser origin",
        ),
        (
            "originuser",
            json!({"server": {"allowedOrigins": ["https://me@app.example.com"]}}),
            "spec.server.allowedOrigins: each entry is a browser origin",
        ),
        (
            "origincomma",
            json!({"server": {"allowedOrigins": ["https://a.example,https://b.example"]}}),
            "spec.server.allowedOrigins: each entry is a browser origin",
        ),
        (
            "originmany",
            json!({"server": {"allowedOrigins": (0..17).map(|i| format!("https://a{i}.example")).collect::<Vec<_>>()}}),
            "must have at most 16 items",
        ),
        (
            "origintwice",
            json!({"server": {"allowedOrigins": ["https://a.example", "https://a.example"]}}),
            "Duplicate value",
        ),
    ];
    for (name, spec, want) in cases {
        let msg = rejected(&c, &ns, name, spec).await;
        assert!(
            msg.contains(want),
            "{name}: {msg:?} should contain {want:?}"
        );
    }

    let long = "a".repeat(45);
    let msg = rejected(&c, &ns, &long, json!({})).await;
    assert!(msg.contains("at most 44 characters"), "{msg}");

    // A name that ends as another instance's derived name does: instance `web-proxy`'s
    // server would be instance `web`'s credential proxy (Deployment, ServiceAccount, Role),
    // `web-client`'s the client Role, `web-sandbox`'s the sandbox ServiceAccount,
    // `web-service`'s CA ConfigMap and TLS Secret those of `web`'s serving certificate.
    for suffix in ["proxy", "sandbox", "client", "service"] {
        let msg = rejected(&c, &ns, &format!("web-{suffix}"), json!({})).await;
        assert!(
            msg.contains("must not end with -proxy, -sandbox"),
            "{suffix}: {msg}"
        );
    }

    // The boundaries themselves are accepted.
    let ok = instance(
        &"b".repeat(44),
        json!({"replicas": 50, "sandbox": {"warmPoolSize": 200, "idleTimeout": "168h"}}),
    );
    ns.api::<CliMcpInstance>()
        .create(&PostParams::default(), &ok)
        .await
        .expect("limits are valid");
    let d = ns
        .api::<CliMcpInstance>()
        .create(&PostParams::default(), &instance("defaults", json!({})))
        .await
        .expect("empty spec is valid");
    assert_eq!(d.spec.replicas, 1);
    assert_eq!(d.spec.sandbox.idle_timeout, "30m");
    assert_eq!(d.spec.sandbox.max_sessions, 100);
    let p = ns
        .api::<CliMcpInstance>()
        .create(
            &PostParams::default(),
            &instance(
                "proxied",
                json!({"proxy": {"targets": [
                    {"type": "kubernetes", "secretName": "admin-kubeconfig"},
                    {"type": "allowlist", "domains": ["pypi.org", "files.pythonhosted.org:443", "[2001:db8::1]:8443"]}
                ]}}),
            ),
        )
        .await
        .expect("a kubernetes target plus an allow-list is valid");
    let authorized = ns
        .api::<CliMcpInstance>()
        .create(
            &PostParams::default(),
            &instance(
                "authorized",
                json!({"server": {
                    "authorization": {"servers": ["https://idp.example.com/realms/dev/"], "scopes": ["openid", "mcp:use"]},
                    "expose": {"httpRoute": {"host": "mcp.example.com", "parentRefs": [{"name": "gw", "namespace": "infra", "sectionName": "https"}]}}
                }}),
            ),
        )
        .await
        .expect("an issuer with an exposed host (the default resourceUrl) is valid");
    assert_eq!(
        authorized
            .spec
            .server
            .expose
            .as_ref()
            .and_then(|e| e.host()),
        Some("mcp.example.com")
    );
    // Every form the server's --allowed-origin accepts that a browser sends.
    let origins = [
        "https://app.example.com",
        "HTTPS://App.Example.com:8443",
        "http://localhost:*",
        "http://[::1]:3000",
        "http://192.168.1.10",
        "https://a.example:65535",
    ];
    let o = ns
        .api::<CliMcpInstance>()
        .create(
            &PostParams::default(),
            &instance("origins", json!({"server": {"allowedOrigins": origins}})),
        )
        .await
        .expect("valid origins are accepted");
    assert_eq!(o.spec.server.allowed_origins, origins);
    // A Route may leave its host to the router; the edge policy defaults to Redirect.
    let routed = ns
        .api::<CliMcpInstance>()
        .create(
            &PostParams::default(),
            &instance("routed", json!({"server": {"expose": {"route": {}}}})),
        )
        .await
        .expect("a Route without a host is valid");
    let route = routed
        .spec
        .server
        .expose
        .and_then(|e| e.route)
        .expect("route kept");
    assert_eq!(
        (route.host, route.insecure_edge_termination_policy.as_str()),
        (None, "Redirect")
    );
    let proxy = p.spec.proxy.expect("proxy kept");
    assert_eq!(proxy.replicas, 2, "defaulted");
    // No operator runs here, so nothing holds a finalizer: the namespace goes away cleanly.
    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn placement_fields_are_checked_at_admission() {
    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c.namespace("admission-placement").await.expect("namespace");

    let mut cases: Vec<(String, serde_json::Value, String)> = Vec::new();
    for part in ["sandbox", "server", "proxy"] {
        let mut case = |name: &str, mut fields: serde_json::Value, want: &str| {
            if part == "proxy" {
                fields["targets"] = json!([{"type": "kubernetes"}]);
            }
            cases.push((
                format!("{part}-{name}"),
                json!({ part: fields }),
                want.replace("PART", part),
            ));
        };
        case(
            "rcupper",
            json!({"runtimeClassName": "gVisor"}),
            "spec.PART.runtimeClassName must be the name of a RuntimeClass",
        );
        case(
            "rcempty",
            json!({"runtimeClassName": ""}),
            "should be at least 1 chars long",
        );
        case(
            "rclong",
            json!({"runtimeClassName": "a".repeat(254)}),
            "may not be more than 253 bytes",
        );
        case(
            "pcslash",
            json!({"priorityClassName": "high/prio"}),
            "spec.PART.priorityClassName must be the name of a PriorityClass",
        );
        case(
            "nskey",
            json!({"nodeSelector": {"bad key": "x"}}),
            "spec.PART.nodeSelector: each key is a node label key",
        );
        case(
            "nsprefix",
            json!({"nodeSelector": {"Example.COM/arch": "amd64"}}),
            "spec.PART.nodeSelector: each key is a node label key",
        );
        case(
            "nsvalue",
            json!({"nodeSelector": {"kubernetes.io/arch": "-amd64"}}),
            "spec.PART.nodeSelector: each value is a label value",
        );
        case(
            "nsvaluelong",
            json!({"nodeSelector": {"zone": "a".repeat(64)}}),
            "may not be more than 63 bytes",
        );
        let many: serde_json::Map<String, serde_json::Value> =
            (0..33).map(|i| (format!("k{i}"), json!("v"))).collect();
        case(
            "nsmany",
            json!({"nodeSelector": many}),
            "must have at most 32 items",
        );
        case(
            "tolop",
            json!({"tolerations": [{"key": "k", "operator": "Equals", "value": "v"}]}),
            "spec.PART.tolerations[].operator must be Exists, Equal (the default), Lt or Gt",
        );
        case(
            "toleffect",
            json!({"tolerations": [{"key": "k", "effect": "NoScheduling"}]}),
            "spec.PART.tolerations[].effect must be NoSchedule, PreferNoSchedule or NoExecute",
        );
        case(
            "tolexists",
            json!({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
            "operator Exists matches every value of the key; remove value",
        );
        case(
            "tolnokey",
            json!({"tolerations": [{"value": "v"}]}),
            "a toleration without key needs operator Exists",
        );
        case(
            "tolseconds",
            json!({"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}]}),
            "tolerationSeconds applies only to effect NoExecute",
        );
        case(
            "psempty",
            json!({"imagePullSecrets": [{"name": ""}]}),
            "spec.PART.imagePullSecrets: each entry is {name: <Secret>}",
        );
        case(
            "psnoname",
            json!({"imagePullSecrets": [{}]}),
            "spec.PART.imagePullSecrets[0].name: Required value",
        );
        case(
            "psbad",
            json!({"imagePullSecrets": [{"name": "Reg_Cred"}]}),
            "spec.PART.imagePullSecrets: each entry is {name: <Secret>}",
        );
        case(
            "affinity",
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}}),
            "nodeSelectorTerms: Required value",
        );
    }
    for (name, spec, want) in cases {
        let msg = rejected(&c, &ns, &name, spec).await;
        assert!(
            msg.contains(&want),
            "{name}: {msg:?} should contain {want:?}"
        );
    }

    // Everything set, at its bounds, is valid and read back as written.
    let placement = json!({
        "runtimeClassName": "gvisor.example.com",
        "priorityClassName": "system-node-critical",
        "nodeSelector": {"kubernetes.io/arch": "amd64", "example.com/pool": "", "Zone_A.1": "EU-1_a"},
        "tolerations": [
            {"key": "sandbox", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
            {"operator": "Exists"},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
        ],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]
        }}},
        "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror.example"}]
    });
    let mut proxy = placement.clone();
    proxy["targets"] = json!([{"type": "kubernetes"}]);
    let ok = ns
        .api::<CliMcpInstance>()
        .create(
            &PostParams::default(),
            &instance(
                "placed",
                json!({"sandbox": placement.clone(), "server": placement, "proxy": proxy}),
            ),
        )
        .await
        .expect("valid placement is accepted");
    let proxy = ok.spec.proxy.as_ref().expect("proxy").placement();
    for p in [
        ok.spec.sandbox.placement(),
        ok.spec.server.placement(),
        proxy,
    ] {
        assert_eq!(p.runtime_class_name.as_deref(), Some("gvisor.example.com"));
        assert_eq!(p.node_selector.len(), 3);
        assert_eq!(p.tolerations.len(), 3);
        assert!(p.affinity.is_some());
        assert_eq!(p.image_pull_secrets[1].name, "mirror.example");
    }
    ns.delete().await.expect("delete namespace");
}

/// A client that acts as `user` (the API server adds a ServiceAccount's groups itself).
async fn client_as(c: &cli_mcp_e2e::testing::TestCluster, user: &str) -> kube::Client {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let kc = Kubeconfig::read_from(&c.info.kubeconfig).expect("kubeconfig");
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("client config");
    // kube's Config parses a kubeconfig's `as:` but does not send it; the header does.
    cfg.headers.push((
        reqwest::header::HeaderName::from_static("impersonate-user"),
        reqwest::header::HeaderValue::from_str(user).expect("header value"),
    ));
    kube::Client::try_from(cfg).expect("client")
}

/// A Role `name` in `ns` with `rules` (RBAC JSON), bound to each of `users`.
async fn grant(
    ns: &cli_mcp_e2e::testing::TestNamespace,
    name: &str,
    rules: serde_json::Value,
    users: &[String],
) {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let role: Role =
        serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules})).expect("Role");
    ns.api::<Role>()
        .create(&PostParams::default(), &role)
        .await
        .expect("create Role");
    let subjects: Vec<_> = users
        .iter()
        .map(|u| json!({"kind": "User", "name": u, "apiGroup": "rbac.authorization.k8s.io"}))
        .collect();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": subjects,
    }))
    .expect("RoleBinding");
    ns.api::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await
        .expect("create RoleBinding");
}

/// The sandbox ServiceAccount of `instance` that its pods name (the ServiceAccount
/// admission plugin looks it up).
async fn sandbox_account(ns: &cli_mcp_e2e::testing::TestNamespace, instance: &str) {
    use k8s_openapi::api::core::v1::ServiceAccount;
    let sa: ServiceAccount = serde_json::from_value(
        json!({"metadata": {"name": format!("cli-mcp-{instance}-sandbox")}}),
    )
    .expect("ServiceAccount");
    ns.api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await
        .expect("sandbox ServiceAccount");
}

/// config/admission's pod policies named in `policies` (their `cli-mcp.redhat.com/policy`
/// label) and their bindings, applied with the names prefixed by namespace `n` (parallel
/// runs do not collide) and the bindings limited to `n` (other tests share the cluster; the
/// other policies judge cluster-scoped objects, which a namespace selector does not
/// confine). Returns what to delete afterwards.
async fn scoped_policies(
    c: &cli_mcp_e2e::testing::TestCluster,
    n: &str,
    policies: &[&str],
) -> Vec<(Api<DynamicObject>, String)> {
    use cli_mcp_e2e::journey::{apply_yaml, kustomize_build};
    let yaml = kustomize_build(
        &format!("admission-{n}"),
        &format!(
            r#"resources:
  - ../../config/admission
namePrefix: {n}-
patches:
  - target: {{kind: ValidatingAdmissionPolicyBinding}}
    patch: |-
      - op: add
        path: /spec/matchResources
        value:
          namespaceSelector:
            matchExpressions:
              - {{key: kubernetes.io/metadata.name, operator: In, values: [{n}]}}
"#
        ),
    );
    let chosen: Vec<&str> = yaml
        .split("\n---\n")
        .filter(|d| {
            policies
                .iter()
                .any(|p| d.contains(&format!("cli-mcp.redhat.com/policy: {p}\n")))
        })
        .collect();
    assert_eq!(
        chosen.len(),
        2 * policies.len(),
        "each policy and its binding:\n{yaml}"
    );
    apply_yaml(c, n, &chosen.join("\n---\n"), |_| {}).await
}

/// No Secret ever reaches a sandbox: config/admission's sandbox pod policy (bound to this
/// test's namespace only) refuses a sandbox pod with a Secret volume or a projected Secret,
/// whichever Secret it names — the instance's HMAC key that forges session tokens, the
/// kubeconfig the proxy holds — when a server (or the operator) makes it. The one token a
/// sandbox holds is a projected ServiceAccount token for its own instance's proxy: one of
/// another audience (another instance's proxy, the API server's, or none, which is the API
/// server's too) is refused, and so is the right token projected together with anything
/// else. The pod the builder makes, its proxy token included, passes. Requests are dry runs
/// made as the server's ServiceAccount.
#[tokio::test]
async fn the_sandbox_pod_policy_refuses_any_secret_or_foreign_token_in_a_sandbox() {
    use cli_mcp_api::names::{InstanceName, PoolSuffix};
    use cli_mcp_api::proxy::{sandbox_token_audience, SANDBOX_TOKEN_VOLUME};
    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxProxy, SandboxRole};
    use cli_mcp_api::token::Commitment;
    use k8s_openapi::api::core::v1::{
        ConfigMapProjection, DownwardAPIProjection, DownwardAPIVolumeFile, ObjectFieldSelector,
        Pod, ProjectedVolumeSource, SecretProjection, SecretVolumeSource,
        ServiceAccountTokenProjection, Volume, VolumeProjection,
    };
    use kube::api::DeleteParams;
    use std::time::{Duration, Instant};

    const INSTANCE: &str = "adm";
    let c = cluster().await.expect("cluster");
    let ns = c.namespace("admission-pods").await.expect("namespace");
    let server = format!("system:serviceaccount:{}:cli-mcp-{INSTANCE}", ns.name);

    // The sandbox ServiceAccount the pods name, and the server's RBAC on pods, as its Role
    // grants it.
    sandbox_account(&ns, INSTANCE).await;
    grant(
        &ns,
        "server",
        json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}]),
        std::slice::from_ref(&server),
    )
    .await;
    let n = &ns.name;
    let outside = scoped_policies(&c, n, &["sandbox-pods"]).await;

    let mut cfg = SandboxConfig::new(
        InstanceName::parse(INSTANCE).expect("instance name"),
        n,
        "cli-mcp-agent:dev",
    );
    cfg.proxy = Some(SandboxProxy {
        url: format!("http://cli-mcp-{INSTANCE}-proxy.{n}.svc:8080"),
        config_map: format!("cli-mcp-{INSTANCE}-proxy"),
        kubeconfig: true,
    });
    let builder_pod = build_sandbox_pod(
        &cfg,
        &SandboxRole::Pool {
            suffix: PoolSuffix::from_random_bytes(*b"admission0"),
            assign: Commitment::of("not a real token"),
        },
        "2026-01-01T00:00:00Z",
    );
    let with_volume = |v: Volume| {
        let mut p = builder_pod.clone();
        if let Some(spec) = p.spec.as_mut() {
            spec.volumes.get_or_insert_with(Vec::new).push(v);
        }
        p
    };
    let secret = |name: &str, secret: String| Volume {
        name: name.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret),
            ..Default::default()
        }),
        ..Default::default()
    };
    let projected = |secret: String| Volume {
        name: "key".into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![VolumeProjection {
                secret: Some(SecretProjection {
                    name: secret,
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let attacks: Vec<(&str, Pod)> = vec![
        (
            "the instance's HMAC Secret",
            with_volume(secret("key", format!("cli-mcp-{INSTANCE}-hmac"))),
        ),
        (
            "the HMAC Secret as the old kubeconfig volume",
            with_volume(secret("kubeconfig", format!("cli-mcp-{INSTANCE}-hmac"))),
        ),
        (
            "the kubeconfig the proxy holds",
            with_volume(secret(
                "kubeconfig",
                format!("cli-mcp-{INSTANCE}-kubeconfig"),
            )),
        ),
        (
            "a projected HMAC Secret",
            with_volume(projected(format!("cli-mcp-{INSTANCE}-hmac"))),
        ),
    ];

    let pods: Api<Pod> = Api::namespaced(client_as(&c, &server).await, n);
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    // The policy takes effect asynchronously (the API server loads it from a watch): wait
    // until it refuses the first attack.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match pods.create(&dry, &attacks[0].1).await {
            Err(e) if e.to_string().contains("mounts no Secret") => break,
            other => assert!(
                Instant::now() < deadline,
                "the sandbox pod policy did not take effect within 60 s: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    pods.create(&dry, &builder_pod)
        .await
        .expect("the builder's pod, its proxy token included, passes the policy");
    for (what, pod) in &attacks {
        let e = pods
            .create(&dry, pod)
            .await
            .expect_err(&format!("a sandbox pod mounting {what} must be refused"))
            .to_string();
        assert!(
            e.contains("cli-mcp-sandbox-pods")
                && e.contains("a cli-mcp sandbox pod mounts no Secret"),
            "{what}: {e}"
        );
    }

    // The proxy token: the builder's volume, one projection of this instance's proxy's
    // audience. Each refusal names the volume and says which audience, or what alone, a
    // projected volume may hold.
    let own = sandbox_token_audience(n, INSTANCE);
    let token_volume = builder_pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .and_then(|v| v.iter().find(|v| v.name == SANDBOX_TOKEN_VOLUME))
        .expect("the builder mounts the proxy token");
    assert_eq!(
        token_volume
            .projected
            .as_ref()
            .and_then(|p| p.sources.as_ref())
            .map(|s| s
                .iter()
                .map(|s| s.service_account_token.as_ref()?.audience.clone())
                .collect::<Vec<_>>()),
        Some(vec![Some(own.clone())]),
        "the builder's proxy token: one projection, this instance's proxy's audience"
    );
    let token = |audience: Option<&str>| VolumeProjection {
        service_account_token: Some(ServiceAccountTokenProjection {
            audience: audience.map(str::to_owned),
            expiration_seconds: Some(600),
            path: "token".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let projected_volume = |name: &str, sources: Vec<VolumeProjection>| Volume {
        name: name.into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(sources),
            ..Default::default()
        }),
        ..Default::default()
    };
    // The builder's pod with its proxy-token volume's sources replaced.
    let with_token_sources = |sources: Vec<VolumeProjection>| {
        let mut p = builder_pod.clone();
        let volumes = p
            .spec
            .as_mut()
            .and_then(|s| s.volumes.as_mut())
            .expect("volumes");
        let v = volumes
            .iter_mut()
            .find(|v| v.name == SANDBOX_TOKEN_VOLUME)
            .expect("proxy-token volume");
        *v = projected_volume(SANDBOX_TOKEN_VOLUME, sources);
        p
    };
    let other = format!("cli-mcp-proxy:{n}:other");
    let wrong_audience = format!(
        "a cli-mcp sandbox pod projects ServiceAccount tokens only for its credential proxy, \
         with audience {own} "
    );
    let only = format!(
        "a cli-mcp sandbox pod mounts only emptyDirs, its downward-API annotations, ConfigMap \
         cli-mcp-{INSTANCE}-proxy and projected volumes of nothing but ServiceAccount tokens \
         of audience {own}; not "
    );
    let token_attacks: Vec<(&str, Pod, Vec<String>)> = vec![
        (
            "a token for another instance's proxy",
            with_token_sources(vec![token(Some(&other))]),
            vec![
                wrong_audience.clone(),
                format!("; not {SANDBOX_TOKEN_VOLUME} (audience {other})"),
            ],
        ),
        (
            "a token without an audience (the API server's)",
            with_volume(projected_volume("token", vec![token(None)])),
            vec![wrong_audience.clone(), "; not token (no audience)".into()],
        ),
        (
            "a token for the API server",
            with_volume(projected_volume(
                "token",
                vec![token(Some("https://kubernetes.default.svc"))],
            )),
            vec![
                wrong_audience.clone(),
                "; not token (audience https://kubernetes.default.svc)".into(),
            ],
        ),
        (
            "the proxy's token next to a token for the API server",
            with_token_sources(vec![
                token(Some(&own)),
                VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        audience: Some("https://kubernetes.default.svc".into()),
                        expiration_seconds: Some(600),
                        path: "admin".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ]),
            vec![
                wrong_audience.clone(),
                format!("; not {SANDBOX_TOKEN_VOLUME} (audience https://kubernetes.default.svc)"),
            ],
        ),
        (
            "the proxy's token projected with the proxy ConfigMap",
            with_token_sources(vec![
                token(Some(&own)),
                VolumeProjection {
                    config_map: Some(ConfigMapProjection {
                        name: format!("cli-mcp-{INSTANCE}-proxy"),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ]),
            vec![format!("{only}{SANDBOX_TOKEN_VOLUME}")],
        ),
        (
            "the proxy's token projected with the pod's labels",
            with_token_sources(vec![
                token(Some(&own)),
                VolumeProjection {
                    downward_api: Some(DownwardAPIProjection {
                        items: Some(vec![DownwardAPIVolumeFile {
                            path: "labels".into(),
                            field_ref: Some(ObjectFieldSelector {
                                field_path: "metadata.labels".into(),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }]),
                    }),
                    ..Default::default()
                },
            ]),
            vec![format!("{only}{SANDBOX_TOKEN_VOLUME}")],
        ),
        (
            "the proxy's token projected with the instance's HMAC Secret",
            with_token_sources(vec![
                token(Some(&own)),
                VolumeProjection {
                    secret: Some(SecretProjection {
                        name: format!("cli-mcp-{INSTANCE}-hmac"),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ]),
            vec![
                "a cli-mcp sandbox pod mounts no Secret, not even projected".into(),
                format!("; not {SANDBOX_TOKEN_VOLUME}"),
            ],
        ),
        (
            "an empty projected volume",
            with_token_sources(vec![]),
            vec![format!("{only}{SANDBOX_TOKEN_VOLUME}")],
        ),
    ];
    for (what, pod, wants) in &token_attacks {
        let e = pods
            .create(&dry, pod)
            .await
            .expect_err(&format!("a sandbox pod with {what} must be refused"))
            .to_string();
        assert!(e.contains("cli-mcp-sandbox-pods"), "{what}: {e}");
        for want in wants {
            assert!(
                e.contains(want.as_str()),
                "{what}: {e:?} should contain {want:?}"
            );
        }
    }

    for (api, name) in outside {
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
    ns.delete().await.expect("delete namespace");
}

/// The tenant policy lets a server through by its exact name only: `cli-mcp-<instance>` of
/// the namespace, on pods labelled as that instance's. So every server, the one of an
/// instance named `operator` (ServiceAccount `cli-mcp-operator`) included, is refused
/// another instance's sandbox pod and Deployments labelled as an instance's or mounting its
/// HMAC Secret, and so is any other `cli-mcp-*` ServiceAccount (the instance's sandbox one
/// here): before, the tenant policy let every `cli-mcp-*` ServiceAccount of the namespace
/// through, and the sandbox pod policy judges no Deployments. The operator (recognised by
/// the RBAC that lets it write the instances' status) still makes the sandbox pods and the
/// server Deployment of both instances. Requests are dry runs made by impersonation, each
/// identity holding the RBAC for them, so that admission alone decides.
#[tokio::test]
async fn the_tenant_policy_lets_a_server_through_by_exact_name_on_its_own_pods_only() {
    use cli_mcp_api::names::{InstanceName, PoolSuffix};
    use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxRole};
    use cli_mcp_api::token::Commitment;
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::DeleteParams;
    use std::time::{Duration, Instant};

    let c = cluster().await.expect("cluster");
    // The tenant policy's parameters are CliMcpInstances.
    install_crd(&c).await;
    let ns = c.namespace("admission-names").await.expect("namespace");
    let n = ns.name.clone();

    // Two instances (no operator runs: they are only the tenant policy's parameters), and
    // the sandbox ServiceAccounts their pods name.
    for name in ["adm", "operator"] {
        ns.api::<CliMcpInstance>()
            .create(
                &PostParams::default(),
                &instance(name, json!({"sandbox": {"warmPoolSize": 1}})),
            )
            .await
            .expect("create CliMcpInstance");
        sandbox_account(&ns, name).await;
    }

    // The policies know an operator by the RBAC below (it may write the instances' status),
    // not by its name.
    let operator = format!("system:serviceaccount:{n}-op:cli-mcp-operator");
    let server = |instance: &str| format!("system:serviceaccount:{n}:cli-mcp-{instance}");
    let sandbox_account = format!("system:serviceaccount:{n}:cli-mcp-adm-sandbox");
    let tenant = format!("{n}-tenant");
    // Everyone may create pods and Deployments here, the operator also write the instances'
    // status (what makes it the operator to the policies): RBAC lets every request below
    // through.
    let everyone = [
        operator.clone(),
        server("adm"),
        server("operator"),
        sandbox_account.clone(),
        tenant.clone(),
    ];
    grant(
        &ns,
        "everything",
        json!([
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "patch", "delete"]},
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]},
        ]),
        &everyone,
    )
    .await;
    grant(
        &ns,
        "operator",
        json!([{"apiGroups": ["cli-mcp.redhat.com"], "resources": ["climcpinstances/status"],
                "verbs": ["get", "patch"]}]),
        std::slice::from_ref(&operator),
    )
    .await;

    let outside = scoped_policies(
        &c,
        &n,
        &["sandbox-pods", "sandbox-pod-deletions", "tenant-pods"],
    )
    .await;

    let builder_pod = |instance: &str| {
        build_sandbox_pod(
            &SandboxConfig::new(
                InstanceName::parse(instance).expect("instance name"),
                &n,
                "cli-mcp-agent:dev",
            ),
            &SandboxRole::Pool {
                suffix: PoolSuffix::from_random_bytes(*b"admission1"),
                assign: Commitment::of("not a real token"),
            },
            "2026-01-01T00:00:00Z",
        )
    };
    // A server Deployment of an instance as the operator makes it, in the parts the tenant
    // policy reads: its name, labels and pod template.
    let server_deployment = |instance: &str, volumes: serde_json::Value| -> Deployment {
        let labels = json!({
            "cli-mcp.redhat.com/instance": instance,
            "cli-mcp.redhat.com/component": "server",
        });
        serde_json::from_value(json!({
            "metadata": {"name": format!("cli-mcp-{instance}"), "labels": labels},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": format!("cli-mcp-{instance}"),
                        "containers": [{"name": "server", "image": "cli-mcp-server:dev"}],
                        "volumes": volumes,
                    },
                },
            },
        }))
        .expect("Deployment")
    };
    // A Deployment with no product label at all, whose pods mount `volumes`.
    let plain_deployment = |volumes: serde_json::Value| -> Deployment {
        let labels = json!({"app": "plain"});
        serde_json::from_value(json!({
            "metadata": {"name": "plain"},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [{"name": "c", "image": "plain"}],
                        "volumes": volumes,
                    },
                },
            },
        }))
        .expect("Deployment")
    };
    let hmac = json!([{"name": "key", "secret": {"secretName": "cli-mcp-adm-hmac"}}]);
    let plain_with_hmac: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain"},
        "spec": {
            "containers": [{"name": "c", "image": "plain"}],
            "volumes": hmac,
        },
    }))
    .expect("pod");

    let plain: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "plain"}]},
    }))
    .expect("pod");

    // What only the sandbox pod policy refuses, a server's own sandbox pod reaching the host.
    let with_host_path = |mut pod: Pod| {
        if let Some(spec) = pod.spec.as_mut() {
            spec.volumes.get_or_insert_with(Vec::new).push(
                serde_json::from_value(json!({"name": "host", "hostPath": {"path": "/"}}))
                    .expect("volume"),
            );
        }
        pod
    };
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let create_pod = |user: String, pod: Pod| {
        let c = c.clone();
        let n = n.clone();
        let dry = dry.clone();
        async move {
            let pods: Api<Pod> = Api::namespaced(client_as(&c, &user).await, &n);
            pods.create(&dry, &pod)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    };
    let create_deployment = |user: String, d: Deployment| {
        let c = c.clone();
        let n = n.clone();
        let dry = dry.clone();
        async move {
            let api: Api<Deployment> = Api::namespaced(client_as(&c, &user).await, &n);
            api.create(&dry, &d)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    };

    // The policies take effect asynchronously (the API server loads them, and the tenant
    // policy's parameters, from watches): wait until each refuses what it always refused.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sandbox = create_pod(server("adm"), with_host_path(builder_pod("adm"))).await;
        let tenant_pod = create_pod(tenant.clone(), plain_with_hmac.clone()).await;
        let on = |r: &Result<(), String>, policy: &str| matches!(r, Err(e) if e.contains(&format!("{n}-cli-mcp-{policy}")));
        if on(&sandbox, "sandbox-pods") && on(&tenant_pod, "tenant-pods") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pod policies did not take effect within 60 s: {sandbox:?} {tenant_pod:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // (what, outcome, the words of a refusal, any of them; none: allowed). Where two
    // policies refuse a request, the API server names either.
    let own = "a cli-mcp server may create only sandbox pods of its own instance";
    let labelled =
        "may create or change Deployments (or their pod templates) labelled cli-mcp.redhat.com/";
    let labelled_pod = "may create or change pods labelled cli-mcp.redhat.com/";
    let hmac_refused = "may not mount, project or take environment from the instance's Secrets";
    let mut checks: Vec<(String, Result<(), String>, Vec<&str>)> = Vec::new();
    for (instance, other) in [("adm", "operator"), ("operator", "adm")] {
        let who = format!("the server of instance {instance}");
        checks.push((
            format!("{who}: a sandbox pod of its own instance"),
            create_pod(server(instance), builder_pod(instance)).await,
            vec![],
        ));
        checks.push((
            format!("{who}: a sandbox pod of instance {other}"),
            create_pod(server(instance), builder_pod(other)).await,
            vec![own, labelled_pod],
        ));
        checks.push((
            format!("{who}: a pod that is no sandbox"),
            create_pod(server(instance), plain.clone()).await,
            vec![own],
        ));
        checks.push((
            format!("{who}: a Deployment whose pods are labelled as its instance's server"),
            create_deployment(server(instance), server_deployment(instance, json!([]))).await,
            vec![labelled],
        ));
        checks.push((
            format!("{who}: a Deployment whose pods are labelled as instance adm's and mount its HMAC Secret"),
            create_deployment(server(instance), server_deployment("adm", hmac.clone())).await,
            vec![labelled],
        ));
        checks.push((
            format!("{who}: an unlabelled Deployment whose pods mount instance adm's HMAC Secret"),
            create_deployment(server(instance), plain_deployment(hmac.clone())).await,
            vec![hmac_refused],
        ));
    }
    for instance in ["adm", "operator"] {
        checks.push((
            format!("the operator: a sandbox pod of instance {instance}"),
            create_pod(operator.clone(), builder_pod(instance)).await,
            vec![],
        ));
        checks.push((
            format!("the operator: the server Deployment of instance {instance}"),
            create_deployment(operator.clone(), server_deployment(instance, json!([]))).await,
            vec![],
        ));
    }
    checks.push((
        "the instance's sandbox ServiceAccount: a Deployment whose pods mount the HMAC Secret"
            .into(),
        create_deployment(sandbox_account.clone(), plain_deployment(hmac.clone())).await,
        vec![hmac_refused],
    ));
    checks.push((
        "the instance's sandbox ServiceAccount: the server Deployment of instance adm".into(),
        create_deployment(sandbox_account.clone(), server_deployment("adm", json!([]))).await,
        vec![labelled],
    ));
    let wrong: Vec<String> = checks
        .iter()
        .filter(|(_, got, want)| match got {
            Ok(()) => !want.is_empty(),
            Err(e) => {
                !(e.contains("ValidatingAdmissionPolicy") && want.iter().any(|w| e.contains(w)))
            }
        })
        .map(|(what, got, want)| {
            let want = if want.is_empty() {
                "allowed".to_owned()
            } else {
                format!("refused: {}", want.join(" | "))
            };
            format!("{what}: {got:?}, expected {want}")
        })
        .collect();

    for (api, name) in outside {
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
    ns.delete().await.expect("delete namespace");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// An instance may not be named so that one of its ServiceAccounts is an operator's: in the
/// namespace an operator runs in (config/default's, an OLM OwnNamespace install), an
/// instance named `operator` would have a server ServiceAccount and Deployment named exactly
/// like the operator's (`cli-mcp-operator`), so the server would run with the operator's
/// rights and the operator would apply the server over itself. config/admission's
/// instance-names policy (bound to this test's namespace only) refuses it, knowing the
/// operator by what RBAC grants it here — writing the instances' status — as the pod
/// policies do; other names are allowed. The instances are made (dry runs) by an editor who
/// may create instances there and nothing else. And whatever its name, a server is refused a
/// ClusterRoleBinding, as every server is: its Role grants none, and the ClusterRoleBinding
/// policy knows the operator by its exact username only.
#[tokio::test]
async fn an_instance_may_not_be_named_after_an_operator_of_its_namespace() {
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    use kube::api::DeleteParams;
    use std::time::{Duration, Instant};

    let c = cluster().await.expect("cluster");
    install_crd(&c).await;
    let ns = c
        .namespace("admission-operator-name")
        .await
        .expect("namespace");
    let n = ns.name.clone();
    // An operator installed into this namespace (its ServiceAccount cli-mcp-operator may
    // write the instances' status); one of a Helm release named cli-mcp, whose
    // ServiceAccount cli-mcp-cli-mcp-operator an instance named cli-mcp-operator would
    // have for its server; and one whose sandbox ServiceAccount would be an operator's
    // under an odd install name.
    let operator = format!("system:serviceaccount:{n}:cli-mcp-operator");
    let release = format!("system:serviceaccount:{n}:cli-mcp-cli-mcp-operator");
    let odd = format!("system:serviceaccount:{n}:cli-mcp-ops-sandbox");
    grant(
        &ns,
        "operator",
        json!([{"apiGroups": ["cli-mcp.redhat.com"], "resources": ["climcpinstances/status"],
                "verbs": ["get", "patch"]}]),
        &[operator.clone(), release, odd],
    )
    .await;
    let outside = scoped_policies(&c, &n, &["instance-names"]).await;

    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    // Whoever tries it needs no more than `create` on instances here (an editor of the
    // namespace): RBAC lets every request below through, admission alone decides.
    let editor = format!("{n}-editor");
    grant(
        &ns,
        "editor",
        json!([{"apiGroups": ["cli-mcp.redhat.com"], "resources": ["climcpinstances"],
                "verbs": ["create"]}]),
        std::slice::from_ref(&editor),
    )
    .await;
    let as_editor = client_as(&c, &editor).await;
    let create = |name: &'static str| {
        let api: Api<CliMcpInstance> = Api::namespaced(as_editor.clone(), &n);
        let dry = dry.clone();
        async move {
            api.create(&dry, &instance(name, json!({})))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    };
    // The policy takes effect asynchronously: wait until it refuses the first name.
    let deadline = Instant::now() + Duration::from_secs(60);
    let refused = loop {
        match create("operator").await {
            Err(e) if e.contains(&format!("{n}-cli-mcp-instance-names")) => break e,
            other => assert!(
                Instant::now() < deadline,
                "instance `operator` was not refused within 60 s: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        refused.contains("cli-mcp-operator (its server) of namespace")
            && refused.contains("choose another name"),
        "{refused}"
    );
    let suffix = create("cli-mcp-operator").await;
    assert!(
        matches!(&suffix, Err(e) if e.contains("cli-mcp-cli-mcp-operator (its server) of namespace")),
        "{suffix:?}"
    );
    let odd_name = create("ops").await;
    assert!(
        matches!(&odd_name, Err(e) if e.contains("cli-mcp-ops-sandbox (its sandboxes) of namespace")),
        "{odd_name:?}"
    );
    for allowed in ["adm", "operators", "cli-mcp"] {
        let r = create(allowed).await;
        assert!(r.is_ok(), "instance {allowed}: {r:?}");
    }

    // Every server, the one of an instance named `operator` in a namespace whose
    // cli-mcp-operator is a server and no operator included, is refused a ClusterRoleBinding
    // (here: binding system:auth-delegator to itself, labelled as the operator labels them).
    for server in ["operator", "adm"] {
        let user = format!("system:serviceaccount:{n}-other:cli-mcp-{server}");
        let crbs: Api<ClusterRoleBinding> = Api::all(client_as(&c, &user).await);
        let crb: ClusterRoleBinding = serde_json::from_value(json!({
            "metadata": {"name": format!("cli-mcp-{n}-other-{server}-auth-delegator-x"),
                         "labels": {"app.kubernetes.io/managed-by": "cli-mcp-operator",
                                    "cli-mcp.redhat.com/component": "server",
                                    "cli-mcp.redhat.com/instance": server,
                                    "cli-mcp.redhat.com/instance-namespace": format!("{n}-other")}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:auth-delegator"},
            "subjects": [{"kind": "ServiceAccount", "name": format!("cli-mcp-{server}"),
                          "namespace": format!("{n}-other")}]
        }))
        .expect("ClusterRoleBinding");
        let r = crbs.create(&dry, &crb).await;
        assert!(
            matches!(&r, Err(kube::Error::Api(s)) if s.code == 403),
            "the server of instance {server}: {r:?}"
        );
    }

    for (api, name) in outside {
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
    ns.delete().await.expect("delete namespace");
}
