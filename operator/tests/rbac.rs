//! Least privilege, asked of the real API server as each identity: the operator (installed
//! by config/default, and by config/namespaced watching one namespace), an instance's
//! server, sandbox and client ServiceAccounts, the admin of an unrelated namespace, two
//! tenants of the instance's namespace (one with pods only, one with Deployments too) and
//! the controllers that act for the instance's Deployments.
//!
//! Both tables of docs/operations.md ("Who may do what") are read and asserted row by row:
//! the RBAC table with SelfSubjectAccessReviews made as each identity (impersonation), the
//! admission table by making each request (dryRun=All) as the identity, once with RBAC only
//! — every attack in it gets through — and once with config/admission's policies installed;
//! then once more, for the rows Pod Security refuses and every allowed row, with the
//! namespace labelled `pod-security.kubernetes.io/enforce: restricted`.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::names::{label, InstanceName, PoolSuffix};
use cli_mcp_api::sandbox::{build_sandbox_pod, SandboxConfig, SandboxProxy, SandboxRole};
use cli_mcp_api::token::Commitment;
use cli_mcp_e2e::journey::{apply_yaml, kustomize_build};
use cli_mcp_e2e::testing::{cluster, wait_for, wait_for_set, workspace_root, TestCluster};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, EnvVarSource, HostPathVolumeSource, Namespace, Pod,
    ProjectedVolumeSource, SeccompProfile, SecretKeySelector, SecretProjection, SecretVolumeSource,
    ServiceAccount, Volume, VolumeProjection,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::{json, Value};

use support::*;

const INSTANCE: &str = "rb";
/// A pod of something else in the instance's namespace.
const BYSTANDER: &str = "bystander";
/// A second instance, with `spec.proxy` (the first has the implied proxy): no sandbox of
/// either may mount a Secret.
const PROXIED: &str = "rbpx";
/// The kubeconfig Secret [`PROXIED`]'s spec names (it need not exist): the tenant policy
/// knows an instance's Secrets from its spec.
const PROXIED_KUBECONFIG: &str = "rbpx-admin-kubeconfig";
/// The label that makes Pod Security enforce its `restricted` level on a namespace.
const ENFORCE: &str = "pod-security.kubernetes.io/enforce";

/// A client that acts as `user` (the API server adds a ServiceAccount's groups itself).
async fn client_as(c: &TestCluster, user: &str) -> Client {
    let kc = Kubeconfig::read_from(&c.info.kubeconfig).expect("kubeconfig");
    let mut cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("client config");
    // kube's Config parses a kubeconfig's `as:` but does not send it; the header does.
    cfg.headers.push((
        reqwest::header::HeaderName::from_static("impersonate-user"),
        reqwest::header::HeaderValue::from_str(user).expect("header value"),
    ));
    Client::try_from(cfg).expect("client")
}

fn service_account(ns: &str, name: &str) -> String {
    format!("system:serviceaccount:{ns}:{name}")
}

/// The rows between `<!-- {marker} -->` and `<!-- /{marker} -->` of docs/operations.md,
/// cells trimmed, header and separator dropped.
fn doc_table(marker: &str) -> Vec<Vec<String>> {
    let doc = std::fs::read_to_string(workspace_root().join("docs/operations.md"))
        .expect("docs/operations.md");
    let start = format!("<!-- {marker} -->");
    let end = format!("<!-- /{marker} -->");
    let body = doc
        .split_once(&start)
        .and_then(|(_, rest)| rest.split_once(&end))
        .unwrap_or_else(|| panic!("no {start} … {end} in docs/operations.md"))
        .0;
    body.lines()
        .filter(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect()
}

/// Everything the tables' placeholders stand for in this run.
struct World {
    c: TestCluster,
    ns: String,
    other: String,
    identities: BTreeMap<&'static str, String>,
}

impl World {
    fn place(&self, text: &str) -> String {
        text.replace("`<ns>`", &self.ns)
            .replace("`<other>`", &self.other)
            .replace("`<instance>`", INSTANCE)
    }

    /// `[group/]resource[/subresource] [name]` in `where`, as the table writes it.
    fn attributes(&self, verb: &str, resource: &str, place: &str) -> ResourceAttributes {
        let resource = self.place(resource);
        let (path, name) = match resource.split_once(' ') {
            Some((p, n)) => (p.to_owned(), Some(n.to_owned())),
            None => (resource.clone(), None),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (group, rest) = if parts[0].contains('.') || parts[0] == "apps" {
            (parts[0], &parts[1..])
        } else {
            ("", &parts[..])
        };
        ResourceAttributes {
            verb: Some(verb.to_owned()),
            group: Some(group.to_owned()),
            resource: Some(rest[0].to_owned()),
            subresource: rest.get(1).map(|s| (*s).to_owned()),
            name,
            namespace: match place {
                "cluster" => None,
                p => Some(self.place(p)),
            },
            ..Default::default()
        }
    }

    async fn allowed(&self, identity: &str, attrs: ResourceAttributes) -> bool {
        let user = self
            .identities
            .get(identity)
            .unwrap_or_else(|| panic!("identity {identity:?} of the table is unknown"));
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(attrs),
                ..Default::default()
            },
            ..Default::default()
        };
        let api: Api<SelfSubjectAccessReview> = Api::all(client_as(&self.c, user).await);
        let r = api
            .create(&PostParams::default(), &review)
            .await
            .expect("SelfSubjectAccessReview");
        r.status.expect("review status").allowed
    }
}

/// The sandbox config the operator gives `instance`'s sandboxes: its credential proxy's
/// ConfigMap and no Secret.
fn sandbox_config(instance: &str, ns: &str) -> SandboxConfig {
    let mut cfg = SandboxConfig::new(
        InstanceName::parse(instance).expect("instance name"),
        ns,
        SANDBOX_IMAGE,
    );
    cfg.proxy = Some(SandboxProxy {
        url: format!("http://cli-mcp-{instance}-proxy.{ns}.svc:8080"),
        config_map: format!("cli-mcp-{instance}-proxy"),
        kubeconfig: true,
    });
    cfg
}

/// The sandbox pod the builder makes for the test instance.
fn builder_pod(ns: &str) -> Pod {
    build(&sandbox_config(INSTANCE, ns))
}

/// The sandbox pod the builder makes for instance [`PROXIED`].
fn proxied_builder_pod(ns: &str) -> Pod {
    build(&sandbox_config(PROXIED, ns))
}

/// A volume of Secret `secret`, as the builder once mounted the kubeconfig.
fn secret_volume(name: &str, secret: String) -> Volume {
    Volume {
        name: name.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret),
            default_mode: Some(0o440),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The builder's pod with every placement field an instance may set; the RuntimeClass and
/// PriorityClass named `<ns>-sandbox` exist (their admission plugins look them up).
fn placed_builder_pod(ns: &str) -> Pod {
    let mut cfg = sandbox_config(INSTANCE, ns);
    cfg.placement = serde_json::from_value(json!({
        "runtimeClassName": format!("{ns}-sandbox"),
        "nodeSelector": {"sandbox": "true"},
        "tolerations": [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [
                {"key": "sandbox", "operator": "In", "values": ["true"]}]}}]}},
        "priorityClassName": format!("{ns}-sandbox"),
        "imagePullSecrets": [{"name": "pull"}],
    }))
    .expect("placement");
    build(&cfg)
}

fn build(cfg: &SandboxConfig) -> Pod {
    let role = SandboxRole::Pool {
        suffix: PoolSuffix::from_random_bytes(*b"rbactest00"),
        assign: Commitment::of("not a real token"),
    };
    build_sandbox_pod(cfg, &role, "2026-01-01T00:00:00Z")
}

fn spec(p: &mut Pod) -> &mut k8s_openapi::api::core::v1::PodSpec {
    p.spec.as_mut().expect("pod spec")
}

fn agent(p: &mut Pod) -> &mut Container {
    &mut spec(p).containers[0]
}

/// The pod of an admission-table row that starts "the same pod …" or "a sandbox pod …".
fn attack_pod(ns: &str, request: &str) -> Pod {
    if request.starts_with("a sandbox pod of the instance with a credential proxy") {
        let mut p = proxied_builder_pod(ns);
        if request.ends_with("mounting the kubeconfig Secret") {
            spec(&mut p)
                .volumes
                .get_or_insert_with(Vec::new)
                .push(secret_volume("kubeconfig", PROXIED_KUBECONFIG.into()));
        }
        return p;
    }
    if request == "a sandbox pod as the builder makes it, with every placement field set" {
        return placed_builder_pod(ns);
    }
    let mut p = builder_pod(ns);
    match request {
        r if r.starts_with("a sandbox pod as the builder makes it") => {}
        "the same pod with a hostPath volume" => spec(&mut p)
            .volumes
            .get_or_insert_with(Vec::new)
            .push(Volume {
                name: "host".into(),
                host_path: Some(HostPathVolumeSource {
                    path: "/".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        "the same pod with hostNetwork" => spec(&mut p).host_network = Some(true),
        "the same pod with hostPID" => spec(&mut p).host_pid = Some(true),
        "the same pod running as root" => {
            let sc = spec(&mut p).security_context.as_mut().expect("context");
            sc.run_as_non_root = Some(false);
            sc.run_as_user = Some(0);
            agent(&mut p)
                .security_context
                .as_mut()
                .expect("context")
                .run_as_non_root = None;
        }
        "the same pod without a seccomp profile" => {
            let sc = spec(&mut p).security_context.as_mut().expect("context");
            sc.seccomp_profile = Some(SeccompProfile {
                type_: "Unconfined".into(),
                ..Default::default()
            });
        }
        "the same pod bound to a node by name" => {
            spec(&mut p).node_name = Some("cli-mcp-node".into());
        }
        "the same pod privileged" => {
            let sc = agent(&mut p).security_context.as_mut().expect("context");
            sc.privileged = Some(true);
            // The API refuses privileged together with allowPrivilegeEscalation=false.
            sc.allow_privilege_escalation = None;
        }
        "the same pod adding capability NET_ADMIN" => {
            let sc = agent(&mut p).security_context.as_mut().expect("context");
            sc.capabilities = Some(Capabilities {
                add: Some(vec!["NET_ADMIN".into()]),
                drop: Some(vec!["ALL".into()]),
            });
        }
        "the same pod with an init container" => {
            let a = agent(&mut p).clone();
            spec(&mut p).init_containers = Some(vec![Container {
                name: "init".into(),
                image: a.image,
                security_context: a.security_context,
                ..Default::default()
            }]);
        }
        "the same pod mounting its kubeconfig Secret" => spec(&mut p)
            .volumes
            .get_or_insert_with(Vec::new)
            .push(secret_volume(
                "kubeconfig",
                format!("cli-mcp-{INSTANCE}-kubeconfig"),
            )),
        "the same pod mounting the instance's HMAC Secret" => spec(&mut p)
            .volumes
            .get_or_insert_with(Vec::new)
            .push(secret_volume("key", format!("cli-mcp-{INSTANCE}-hmac"))),
        "the same pod with a projected volume of the instance's HMAC Secret" => spec(&mut p)
            .volumes
            .get_or_insert_with(Vec::new)
            .push(Volume {
                name: "key".into(),
                projected: Some(ProjectedVolumeSource {
                    sources: Some(vec![VolumeProjection {
                        secret: Some(SecretProjection {
                            name: format!("cli-mcp-{INSTANCE}-hmac"),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        "the same pod with an env var from a Secret" => {
            agent(&mut p).env.get_or_insert_with(Vec::new).push(EnvVar {
                name: "STOLEN".into(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: format!("cli-mcp-{INSTANCE}-hmac"),
                        key: "key".into(),
                        optional: Some(true),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
        "the same pod running as ServiceAccount default" => {
            spec(&mut p).service_account_name = Some("default".into());
            spec(&mut p).automount_service_account_token = Some(true);
        }
        "the same pod without the instance label" => {
            p.metadata
                .labels
                .as_mut()
                .expect("labels")
                .remove(label::INSTANCE);
        }
        "the same pod labelled as another instance" => {
            p.metadata
                .labels
                .as_mut()
                .expect("labels")
                .insert(label::INSTANCE.into(), "another".into());
        }
        other => panic!("no pod for admission-table row {other:?}"),
    }
    p
}

/// A pod spec of no instance that Pod Security `restricted` admits.
fn plain_spec() -> Value {
    json!({
        "securityContext": {"runAsNonRoot": true, "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "app", "image": "tenant", "securityContext": {
            "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}],
    })
}

/// A volume of Secret `secret`.
fn stolen_volume(secret: &str) -> Value {
    json!([{"name": "stolen", "secret": {"secretName": secret}}])
}

/// The pod of a tenant's admission-table row ("a plain pod …", "a privileged …"): a pod of
/// no instance that Pod Security `restricted` admits, but for what the row names.
fn tenant_pod(request: &str) -> Option<Pod> {
    let hmac = format!("cli-mcp-{INSTANCE}-hmac");
    let mut pod = json!({
        "metadata": {"name": "tenant", "labels": {"app": "tenant"}},
        "spec": plain_spec(),
    });
    match request {
        "a plain pod" => {}
        "a plain pod labelled as the instance's sandbox" => {
            let labels = &mut pod["metadata"]["labels"];
            labels[label::INSTANCE] = json!(INSTANCE);
            labels[label::COMPONENT] = json!(label::COMPONENT_SANDBOX);
        }
        "a plain pod mounting the instance's kubeconfig Secret" => {
            pod["spec"]["volumes"] = stolen_volume(&format!("cli-mcp-{INSTANCE}-kubeconfig"));
        }
        "a plain pod mounting the instance's HMAC Secret" => {
            pod["spec"]["volumes"] = stolen_volume(&hmac);
        }
        "a plain pod with a projected volume of the instance's HMAC Secret" => {
            pod["spec"]["volumes"] =
                json!([{"name": "stolen", "projected": {"sources": [{"secret": {"name": hmac}}]}}]);
        }
        "a plain pod with an env var from the instance's HMAC Secret" => {
            pod["spec"]["containers"][0]["env"] = json!([{"name": "STOLEN",
                "valueFrom": {"secretKeyRef": {"name": hmac, "key": "key"}}}]);
        }
        "a plain pod with envFrom the instance's TLS Secret" => {
            pod["spec"]["containers"][0]["envFrom"] =
                json!([{"secretRef": {"name": format!("cli-mcp-{INSTANCE}-tls")}}]);
        }
        "a plain pod mounting the kubeconfig Secret the proxied instance's spec names" => {
            pod["spec"]["volumes"] = stolen_volume(PROXIED_KUBECONFIG);
        }
        "a plain pod running as the instance's server ServiceAccount" => {
            pod["spec"]["serviceAccountName"] = json!(format!("cli-mcp-{INSTANCE}"));
        }
        "a plain pod running as the instance's client ServiceAccount" => {
            pod["spec"]["serviceAccountName"] = json!(format!("cli-mcp-{INSTANCE}-client"));
        }
        "a plain pod named like a warm pod of the instance" => {
            pod["metadata"]["name"] = json!(format!("cli-mcp-{INSTANCE}-pool-tenant0000"));
        }
        "a privileged hostPID pod mounting hostPath /" => {
            pod["spec"] = json!({
                "hostPID": true,
                "containers": [{"name": "app", "image": "tenant",
                    "securityContext": {"privileged": true}}],
                "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
            });
        }
        _ => return None,
    }
    Some(serde_json::from_value(pod).expect("tenant pod"))
}

/// The Deployment or ReplicaSet of a workload tenant's row: a plain pod template but for
/// what the row names.
fn tenant_workload(request: &str) -> Option<Value> {
    let mut workload = json!({
        "metadata": {"name": "tenant", "labels": {"app": "tenant"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "tenant"}},
            "template": {"metadata": {"labels": {"app": "tenant"}}, "spec": plain_spec()},
        },
    });
    let template = &mut workload["spec"]["template"];
    match request {
        "a plain Deployment" => {}
        "a Deployment whose pods mount the instance's HMAC Secret" => {
            template["spec"]["volumes"] = stolen_volume(&format!("cli-mcp-{INSTANCE}-hmac"));
        }
        "a Deployment whose pods are labelled as the instance's server" => {
            let labels = &mut template["metadata"]["labels"];
            labels[label::INSTANCE] = json!(INSTANCE);
            labels[label::COMPONENT] = json!(label::COMPONENT_SERVER);
        }
        "a ReplicaSet whose pods mount the instance's kubeconfig Secret" => {
            template["spec"]["volumes"] = stolen_volume(&format!("cli-mcp-{INSTANCE}-kubeconfig"));
        }
        _ => return None,
    }
    Some(workload)
}

/// The rows of the tenants and of the controllers acting for the instance's Deployments
/// (whose pods and ReplicaSets are built from what the operator made); `None` for others.
async fn tenant_attempt(
    w: &World,
    b: &Bindings,
    request: &str,
    client: &Client,
) -> Option<Result<(), kube::Error>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &w.ns);
    if let Some(pod) = tenant_pod(request) {
        return Some(pods.create(&dry_post(), &pod).await.map(drop));
    }
    if let Some(workload) = tenant_workload(request) {
        return Some(if request.starts_with("a ReplicaSet") {
            let rs: ReplicaSet = serde_json::from_value(workload).expect("ReplicaSet");
            let api: Api<ReplicaSet> = Api::namespaced(client.clone(), &w.ns);
            api.create(&dry_post(), &rs).await.map(drop)
        } else {
            let d: Deployment = serde_json::from_value(workload).expect("Deployment");
            let api: Api<Deployment> = Api::namespaced(client.clone(), &w.ns);
            api.create(&dry_post(), &d).await.map(drop)
        });
    }
    // What the operator made, read as the admin.
    let made = |name: String| async move {
        let api: Api<Deployment> = Api::namespaced(w.c.client.clone(), &w.ns);
        let d = api.get(&name).await.expect("the instance's Deployment");
        serde_json::to_value(d).expect("JSON")
    };
    Some(match request {
        "add an ephemeral container to a warm pod of the instance" => pods
            .patch_subresource(
                "ephemeralcontainers",
                &b.warm,
                &PatchParams {
                    dry_run: true,
                    ..Default::default()
                },
                &Patch::Strategic(json!({"spec": {"ephemeralContainers": [
                    {"name": "debug", "image": "tenant"}]}})),
            )
            .await
            .map(drop),
        "a proxy pod of the instance, as its Deployment's template makes it" => {
            let d = made(format!("cli-mcp-{INSTANCE}-proxy")).await;
            let t = &d["spec"]["template"];
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": format!("cli-mcp-{INSTANCE}-proxy-rbactest"),
                    "labels": t["metadata"]["labels"],
                    "annotations": t["metadata"]["annotations"]},
                "spec": t["spec"],
            }))
            .expect("proxy pod");
            pods.create(&dry_post(), &pod).await.map(drop)
        }
        "a ReplicaSet of the instance's server Deployment, as its template makes it" => {
            let d = made(format!("cli-mcp-{INSTANCE}")).await;
            let rs: ReplicaSet = serde_json::from_value(json!({
                "metadata": {"name": format!("cli-mcp-{INSTANCE}-rbactest"),
                    "labels": d["spec"]["template"]["metadata"]["labels"]},
                "spec": {"replicas": 1, "selector": d["spec"]["selector"],
                    "template": d["spec"]["template"]},
            }))
            .expect("ReplicaSet");
            let api: Api<ReplicaSet> = Api::namespaced(client.clone(), &w.ns);
            api.create(&dry_post(), &rs).await.map(drop)
        }
        _ => return None,
    })
}

fn dry_post() -> PostParams {
    PostParams {
        dry_run: true,
        ..Default::default()
    }
}

fn dry_delete() -> DeleteParams {
    DeleteParams {
        dry_run: true,
        ..Default::default()
    }
}

/// What the admission table's ClusterRoleBinding rows need.
struct Bindings {
    /// A warm pod of the test instance, made by the operator.
    warm: String,
    own: String,
    foreign: String,
    operator_role: String,
}

/// A ClusterRoleBinding that looks like the operator's for the test instance.
fn lookalike_binding(ns: &str, subject: Subject, role: &str) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(format!("cli-mcp-{ns}-{INSTANCE}-auth-delegator-ffffffff")),
            labels: Some(BTreeMap::from([
                (
                    label::APP_MANAGED_BY.to_owned(),
                    label::MANAGED_BY.to_owned(),
                ),
                (
                    label::COMPONENT.to_owned(),
                    label::COMPONENT_SERVER.to_owned(),
                ),
                (label::INSTANCE.to_owned(), INSTANCE.to_owned()),
                (
                    "cli-mcp.redhat.com/instance-namespace".to_owned(),
                    ns.to_owned(),
                ),
            ])),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(vec![subject]),
    }
}

/// Makes the request of one admission-table row as its identity; `Err` is the API's refusal.
async fn attempt(w: &World, b: &Bindings, request: &str, identity: &str) -> Result<(), String> {
    let client = client_as(&w.c, &w.identities[identity]).await;
    if let Some(r) = tenant_attempt(w, b, request, &client).await {
        return r.map_err(|e| e.to_string());
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &w.ns);
    let crbs: Api<ClusterRoleBinding> = Api::all(client);
    let dry_patch = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let r = if request == "delete a warm pod of its instance" {
        pods.delete(&b.warm, &dry_delete()).await.map(drop)
    } else if request == "delete another workload's pod in its namespace" {
        pods.delete(BYSTANDER, &dry_delete()).await.map(drop)
    } else if request.contains("a warm pod of its instance") {
        let patch = if request.starts_with("claim") {
            json!({"metadata": {
                "labels": {label::SESSION_ID: "s1", label::LAUNCH: label::LAUNCH_WARM},
                "annotations": {"cli-mcp.redhat.com/last-activity": "2026-01-01T00:00:00Z"},
            }})
        } else {
            json!({"metadata": {"labels": {label::INSTANCE: null}}})
        };
        pods.patch(&b.warm, &dry_patch, &Patch::Merge(patch))
            .await
            .map(drop)
    } else if request.contains(" pod") && !request.contains("ClusterRoleBinding") {
        pods.create(&dry_post(), &attack_pod(&w.ns, request))
            .await
            .map(drop)
    } else {
        match request {
            "patch its instance's auth-delegator ClusterRoleBinding" => crbs
                .patch(
                    &b.own,
                    &dry_patch,
                    &Patch::Merge(json!({"metadata": {"annotations": {"rbac-test": "touch"}}})),
                )
                .await
                .map(drop),
            "delete its instance's auth-delegator ClusterRoleBinding" => {
                crbs.delete(&b.own, &dry_delete()).await.map(drop)
            }
            "delete a ClusterRoleBinding it does not own" => {
                crbs.delete(&b.foreign, &dry_delete()).await.map(drop)
            }
            "label a ClusterRoleBinding it does not own as its own" => {
                let labels = lookalike_binding(&w.ns, server_subject(&w.ns), "x")
                    .metadata
                    .labels;
                crbs.patch(
                    &b.foreign,
                    &dry_patch,
                    &Patch::Merge(json!({"metadata": {"labels": labels}})),
                )
                .await
                .map(drop)
            }
            "bind its own ClusterRole to another user" => {
                let crb = ClusterRoleBinding {
                    metadata: ObjectMeta {
                        name: Some(format!("{}-escalate", w.ns)),
                        ..Default::default()
                    },
                    role_ref: RoleRef {
                        api_group: Some("rbac.authorization.k8s.io".into()),
                        kind: "ClusterRole".into(),
                        name: b.operator_role.clone(),
                    },
                    subjects: Some(vec![Subject {
                        kind: "User".into(),
                        name: "mallory".into(),
                        api_group: Some("rbac.authorization.k8s.io".into()),
                        ..Default::default()
                    }]),
                };
                crbs.create(&dry_post(), &crb).await.map(drop)
            }
            "bind system:auth-delegator, labelled as the instance's, to ServiceAccount default" => {
                let subject = Subject {
                    name: "default".into(),
                    ..server_subject(&w.ns)
                };
                let crb = lookalike_binding(&w.ns, subject, "system:auth-delegator");
                crbs.create(&dry_post(), &crb).await.map(drop)
            }
            "bind system:auth-delegator, labelled as the instance's credential proxy's, to ServiceAccount default" => {
                let subject = Subject {
                    name: "default".into(),
                    ..server_subject(&w.ns)
                };
                let mut crb = lookalike_binding(&w.ns, subject, "system:auth-delegator");
                crb.metadata.name = Some(format!(
                    "cli-mcp-{}-{INSTANCE}-proxy-auth-delegator-ffffffff",
                    w.ns
                ));
                if let Some(l) = crb.metadata.labels.as_mut() {
                    l.insert(label::COMPONENT.to_owned(), label::COMPONENT_PROXY.to_owned());
                }
                crbs.create(&dry_post(), &crb).await.map(drop)
            }
            "bind its own ClusterRole, labelled as the instance's, to the instance's server" => {
                let crb = lookalike_binding(&w.ns, server_subject(&w.ns), &b.operator_role);
                crbs.create(&dry_post(), &crb).await.map(drop)
            }
            other => panic!("no request for admission-table row {other:?}"),
        }
    };
    r.map_err(|e| e.to_string())
}

/// Waits until the admission-table row of `request` as `identity` gets what its last cell
/// says: policies, the instances they read and namespace labels reach admission
/// asynchronously.
async fn settle(w: &World, b: &Bindings, rows: &[Vec<String>], request: &str, identity: &str) {
    let cell = &rows
        .iter()
        .find(|r| r[0] == request && r[1] == identity)
        .unwrap_or_else(|| panic!("no admission-table row {request:?} as {identity}"))[3];
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let got = attempt(w, b, request, identity).await;
        if matches(cell, &got) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{request:?} as {identity}: {got:?} after {TIMEOUT:?}, the table says {cell}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A rule of a Role: `verbs` on `resources` of API group `group`.
fn rule(group: &str, resources: &[&str], verbs: &[&str]) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.to_owned()]),
        resources: Some(resources.iter().map(|r| (*r).to_owned()).collect()),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        ..Default::default()
    }
}

/// A Role `name` in `ns` with `rules`, bound to user `user`.
async fn grant(c: &TestCluster, ns: &str, name: &str, user: &str, rules: Vec<PolicyRule>) {
    let meta = ObjectMeta {
        name: Some(name.to_owned()),
        ..Default::default()
    };
    Api::<Role>::namespaced(c.client.clone(), ns)
        .create(
            &PostParams::default(),
            &Role {
                metadata: meta.clone(),
                rules: Some(rules),
            },
        )
        .await
        .expect("tenant Role");
    Api::<RoleBinding>::namespaced(c.client.clone(), ns)
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: meta,
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "Role".into(),
                    name: name.to_owned(),
                },
                subjects: Some(vec![Subject {
                    kind: "User".into(),
                    name: user.to_owned(),
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    ..Default::default()
                }]),
            },
        )
        .await
        .expect("tenant RoleBinding");
}

fn server_subject(ns: &str) -> Subject {
    Subject {
        kind: "ServiceAccount".into(),
        name: format!("cli-mcp-{INSTANCE}"),
        namespace: Some(ns.to_owned()),
        ..Default::default()
    }
}

/// Whether RBAC let a request through, as the "RBAC only" cell says it does. Admission
/// runs only after authorization and RBAC's escalation check, so a refusal by an admission
/// policy counts: another install's policies (in a cluster other tests share) may already
/// judge these pods.
fn rbac_lets_through(cell: &str, outcome: &Result<(), String>) -> bool {
    assert_eq!(
        cell, "allowed",
        "the RBAC-only column says whether RBAC allows"
    );
    match outcome {
        Ok(()) => true,
        Err(e) => e.contains("ValidatingAdmissionPolicy"),
    }
}

/// Whether a cell says Pod Security refuses the request (checked with the namespace
/// labelled `restricted`).
fn by_pod_security(cell: &str) -> bool {
    cell.starts_with("refused by Pod Security: ")
}

/// Whether an outcome is what a table cell says: `allowed`, `refused: <words of the
/// policy's message>`, or `refused by Pod Security: <words of its message>`.
fn matches(cell: &str, outcome: &Result<(), String>) -> bool {
    if let Some(words) = cell.strip_prefix("refused by Pod Security: ") {
        return matches!(outcome, Err(e) if e.contains("violates PodSecurity") && e.contains(words));
    }
    // `refused: A (or: B)`: two policies refuse the request, and the API server names either.
    match (cell.strip_prefix("refused: "), outcome) {
        (None, Ok(())) => cell == "allowed",
        (Some(words), Err(e)) => {
            let either = match words.split_once(" (or: ") {
                Some((a, b)) => vec![a, b.strip_suffix(')').unwrap_or(b)],
                None => vec![words],
            };
            e.contains("ValidatingAdmissionPolicy") && either.iter().any(|w| e.contains(w))
        }
        _ => false,
    }
}

/// The install's objects: config/default (policies included) or config/namespaced watching
/// `ns`, into `opns` under `prefix`, without the operator Deployment (the test asks for
/// permissions; an operator process runs on the host). The sandbox-pod policies' bindings
/// get a namespace selector so that they judge only this test's namespaces in a cluster
/// other tests share (the tenant policy's binding too).
fn install(base: &str, opns: &str, prefix: &str, ns: &str, other: &str) -> String {
    let namespaced = base == "namespaced";
    let watch = if namespaced {
        format!(
            "  - target: {{kind: Deployment, name: cli-mcp-operator}}
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/env/2/value
        value: {ns}
"
        )
    } else {
        String::new()
    };
    let watched = if namespaced {
        "  - ../../config/namespaced/watched-namespace\n"
    } else {
        ""
    };
    let yaml = kustomize_build(
        &format!("rbac-{prefix}"),
        &format!(
            r#"resources:
  - ../../config/{base}
namespace: {opns}
namePrefix: {prefix}
patches:
{watch}  - target: {{kind: ValidatingAdmissionPolicyBinding, labelSelector: "cli-mcp.redhat.com/policy in (sandbox-pods,sandbox-pod-deletions,tenant-pods,instance-names)"}}
    patch: |-
      - op: add
        path: /spec/matchResources
        value:
          namespaceSelector:
            matchExpressions:
              - {{key: kubernetes.io/metadata.name, operator: In, values: [{ns}, {other}]}}
transformers:
  - ../../config/rbac/apiserver-endpoints-in-default
  - ../../config/admission/operator-identity
{watched}"#
        ),
    );
    // The Deployment and the install's Namespace (renamed to `opns`, which exists) stay out.
    yaml.split("\n---\n")
        .filter(|d| {
            !d.contains("\nkind: Deployment\n")
                && !d.starts_with("apiVersion: v1\nkind: Namespace\n")
        })
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// The admission policies and their bindings of a YAML stream, or everything else.
fn documents(yaml: &str, admission: bool) -> String {
    yaml.split("\n---\n")
        .filter(|d| d.contains("\nkind: ValidatingAdmissionPolicy") == admission)
        .collect::<Vec<_>>()
        .join("\n---\n")
}

#[tokio::test]
async fn every_identity_may_do_what_the_operations_doc_says_and_no_more() {
    let c = cluster().await.expect("cluster");
    // The CRD the packages ship (not the generator's: what is installed is under test).
    let crd = std::fs::read_to_string(
        workspace_root().join("config/crd/bases/cli-mcp.redhat.com_climcpinstances.yaml"),
    )
    .expect("CRD");
    apply_crd(&c, serde_yaml::from_str(&crd).expect("CRD parses")).await;
    let ns = c.namespace("rbac").await.expect("namespace");
    let other = c.namespace("rbac-other").await.expect("namespace");
    let opns = c.namespace("rbac-op").await.expect("namespace");
    let all = format!("{}-all-", opns.name);
    let one = format!("{}-one-", opns.name);

    // RBAC of both installs first; the policies of config/default wait for the second half.
    let default_yaml = install("default", &opns.name, &all, &ns.name, &other.name);
    let namespaced_yaml = install("namespaced", &opns.name, &one, &ns.name, &other.name);
    let mut outside = apply_yaml(&c, &opns.name, &documents(&namespaced_yaml, false), |_| {}).await;
    outside.extend(apply_yaml(&c, &opns.name, &documents(&default_yaml, false), |_| {}).await);

    // An instance whose server, sandbox and client ServiceAccounts and RBAC the operator
    // makes (a host process with the admin's credentials: what it makes is under test, not
    // how it authenticates).
    let op = Operator::start(&c, &ns.name, "rbac");
    let ins = ns.clone();
    create_instance(&ins, INSTANCE, json!({"sandbox": {"warmPoolSize": 1}})).await;
    wait_ready(&ins, INSTANCE, &op).await;
    // The proxied instance only needs to exist and to have its sandbox ServiceAccount,
    // which the operator makes first; the tenant policy reads the Secret its spec names.
    ns.api::<CliMcpInstance>()
        .create(
            &PostParams::default(),
            &instance(
                PROXIED,
                json!({"proxy": {"targets": [
                    {"type": "kubernetes", "secretName": PROXIED_KUBECONFIG}]}}),
            ),
        )
        .await
        .expect("create the proxied instance");
    wait_for(
        ns.api::<ServiceAccount>(),
        &format!("cli-mcp-{PROXIED}-sandbox"),
        "the proxied instance's sandbox ServiceAccount",
        TIMEOUT,
        |o: Option<&ServiceAccount>| o.is_some(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", op.log_tail()));
    let own = InstanceName::parse(INSTANCE)
        .expect("name")
        .auth_delegator_binding(&ns.name);

    // The admin of an unrelated namespace.
    let ns_admin = format!("{}-admin", other.name);
    other
        .api::<RoleBinding>()
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: ObjectMeta {
                    name: Some("admin".into()),
                    ..Default::default()
                },
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "ClusterRole".into(),
                    name: "admin".into(),
                },
                subjects: Some(vec![Subject {
                    kind: "User".into(),
                    name: ns_admin.clone(),
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    ..Default::default()
                }]),
            },
        )
        .await
        .expect("namespace admin binding");

    // Two tenants of the instance's namespace: one may only create, read and delete pods,
    // the other also Deployments and ReplicaSets, and ephemeral containers.
    let tenant = format!("{}-tenant", ns.name);
    let workload_tenant = format!("{}-workload-tenant", ns.name);
    let pods_rule = rule("", &["pods"], &["create", "get", "delete"]);
    let workloads_rule = rule(
        "apps",
        &["deployments", "replicasets"],
        &["create", "get", "delete"],
    );
    grant(&c, &ns.name, "tenant", &tenant, vec![pods_rule.clone()]).await;
    grant(
        &c,
        &ns.name,
        "workload-tenant",
        &workload_tenant,
        vec![
            pods_rule.clone(),
            rule("", &["pods/ephemeralcontainers"], &["patch"]),
            workloads_rule.clone(),
        ],
    )
    .await;
    // Someone who may deploy into the namespace and named a ServiceAccount of their own
    // namespace like the operator's: a name proves nothing, only what RBAC grants does.
    let namesake = service_account(&other.name, "cli-mcp-operator");
    grant(
        &c,
        &ns.name,
        "operator-namesake",
        &namesake,
        vec![pods_rule.clone(), workloads_rule],
    )
    .await;
    // The server of an instance named `operator` is ServiceAccount cli-mcp-operator of the
    // namespace, with a server's rights on pods: a server like any other, not an operator.
    let operator_instance_server = service_account(&ns.name, "cli-mcp-operator");
    grant(
        &c,
        &ns.name,
        "operator-instance-server",
        &operator_instance_server,
        vec![rule("", &["pods"], &["create", "get", "delete", "patch"])],
    )
    .await;

    // Someone else's pod next to the instance's (bound to no node: it never runs).
    ns.api::<Pod>()
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": BYSTANDER, "labels": {"app": "bystander"}},
                "spec": {"nodeName": "nowhere", "containers": [{"name": "c", "image": "bystander"}]},
            }))
            .expect("pod"),
        )
        .await
        .expect("bystander pod");

    // What the placement row names.
    let classes = format!("{}-sandbox", ns.name);
    let runtime: Api<DynamicObject> = Api::all_with(
        c.client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk("node.k8s.io", "v1", "RuntimeClass")),
    );
    let priority: Api<DynamicObject> = Api::all_with(
        c.client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "scheduling.k8s.io",
            "v1",
            "PriorityClass",
        )),
    );
    for (api, obj) in [
        (
            &runtime,
            json!({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                "metadata": {"name": classes}, "handler": "runc"}),
        ),
        (
            &priority,
            json!({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                "metadata": {"name": classes}, "value": 100}),
        ),
    ] {
        let obj: DynamicObject = serde_json::from_value(obj).expect("object");
        api.create(&PostParams::default(), &obj)
            .await
            .expect("placement class");
    }

    // A binding nobody gave the operator, of the one ClusterRole it may bind (so RBAC alone
    // lets it change this binding too): another product's auth-delegator binding.
    let foreign = format!("{}-foreign", ns.name);
    let crbs: Api<ClusterRoleBinding> = Api::all(c.client.clone());
    crbs.create(
        &PostParams::default(),
        &ClusterRoleBinding {
            metadata: ObjectMeta {
                name: Some(foreign.clone()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: "system:auth-delegator".into(),
            },
            subjects: Some(vec![Subject {
                kind: "User".into(),
                name: "somebody".into(),
                api_group: Some("rbac.authorization.k8s.io".into()),
                ..Default::default()
            }]),
        },
    )
    .await
    .expect("foreign ClusterRoleBinding");

    let w = World {
        identities: BTreeMap::from([
            (
                "operator",
                service_account(&opns.name, &format!("{all}cli-mcp-operator")),
            ),
            (
                "operator, one namespace",
                service_account(&opns.name, &format!("{one}cli-mcp-operator")),
            ),
            (
                "server",
                service_account(&ns.name, &format!("cli-mcp-{INSTANCE}")),
            ),
            (
                "sandbox",
                service_account(&ns.name, &format!("cli-mcp-{INSTANCE}-sandbox")),
            ),
            (
                "client",
                service_account(&ns.name, &format!("cli-mcp-{INSTANCE}-client")),
            ),
            ("namespace admin", ns_admin),
            ("tenant", tenant),
            ("workload tenant", workload_tenant),
            ("the operator's namesake", namesake),
            (
                "server of an instance named operator",
                operator_instance_server,
            ),
            (
                "ReplicaSet controller",
                service_account("kube-system", "replicaset-controller"),
            ),
            (
                "Deployment controller",
                service_account("kube-system", "deployment-controller"),
            ),
        ]),
        c: c.clone(),
        ns: ns.name.clone(),
        other: other.name.clone(),
    };

    // The RBAC table.
    let rows = doc_table("rbac-table");
    assert!(rows.len() > 30, "the RBAC table lost its rows: {rows:?}");
    let mut wrong = Vec::new();
    for row in &rows {
        let [identity, verb, resource, place, allowed] = &row[..] else {
            panic!("RBAC table row {row:?} has not 5 cells");
        };
        let want = match allowed.as_str() {
            "yes" => true,
            "no" => false,
            other => panic!("allowed must be yes or no, not {other:?}"),
        };
        let got = w
            .allowed(identity, w.attributes(verb, resource, place))
            .await;
        if got != want {
            wrong.push(format!("{row:?}: the API server says {got}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "RBAC differs from docs/operations.md:\n{}",
        wrong.join("\n")
    );

    // The admission table, RBAC only: every request gets through.
    let warm = wait_for_set(
        ns.api::<Pod>(),
        &sandbox_selector(INSTANCE),
        "a warm pod",
        TIMEOUT,
        |pods: &[Pod]| !pods.is_empty(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", op.log_tail()));
    let b = Bindings {
        warm: warm[0].metadata.name.clone().expect("pod name"),
        own: own.clone(),
        foreign: foreign.clone(),
        operator_role: format!("{all}cli-mcp-operator-namespaced"),
    };
    let rows = doc_table("admission-table");
    assert!(
        rows.len() >= 15,
        "the admission table lost its rows: {rows:?}"
    );
    let mut wrong = Vec::new();
    for row in &rows {
        let [request, identity, without, _] = &row[..] else {
            panic!("admission table row {row:?} has not 4 cells");
        };
        let got = attempt(&w, &b, request, identity).await;
        if !rbac_lets_through(without, &got) {
            wrong.push(format!(
                "{request} as {identity}: {got:?}, the table says {without}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "without the policies:\n{}",
        wrong.join("\n")
    );

    // The policies. They take effect asynchronously (each API server loads them, and the
    // tenant policy's instances, from a watch): wait until each refuses one of its attacks,
    // and the tenant policy lets a plain pod through.
    outside.extend(apply_yaml(&c, &opns.name, &documents(&default_yaml, true), |_| {}).await);
    for (request, identity) in [
        ("the same pod with a hostPath volume", "server"),
        ("the same pod mounting the instance's HMAC Secret", "server"),
        ("delete a ClusterRoleBinding it does not own", "operator"),
        ("delete another workload's pod in its namespace", "server"),
        ("a plain pod mounting the instance's HMAC Secret", "tenant"),
        ("a plain pod", "tenant"),
    ] {
        settle(&w, &b, &rows, request, identity).await;
    }
    // Pod Security's rows wait for the namespace label: it refuses most attacks on its own,
    // before any policy sees them.
    let mut wrong = Vec::new();
    for row in &rows {
        let [request, identity, _, with] = &row[..] else {
            unreachable!("checked above");
        };
        if by_pod_security(with) {
            continue;
        }
        let got = attempt(&w, &b, request, identity).await;
        if !matches(with, &got) {
            wrong.push(format!(
                "{request} as {identity}: {got:?}, the table says {with}"
            ));
        }
    }
    assert!(wrong.is_empty(), "with the policies:\n{}", wrong.join("\n"));

    // Pod Security `restricted` enforced on the namespace, as an instance's namespace should
    // have it: its rows are refused, and every allowed row still passes.
    let namespaces: Api<Namespace> = Api::all(c.client.clone());
    namespaces
        .patch(
            &ns.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {ENFORCE: "restricted"}}})),
        )
        .await
        .expect("label the namespace restricted");
    for row in rows.iter().filter(|r| by_pod_security(&r[3])) {
        settle(&w, &b, &rows, &row[0], &row[1]).await;
    }
    let mut wrong = Vec::new();
    for row in &rows {
        let [request, identity, _, with] = &row[..] else {
            unreachable!("checked above");
        };
        if with != "allowed" && !by_pod_security(with) {
            continue;
        }
        let got = attempt(&w, &b, request, identity).await;
        if !matches(with, &got) {
            wrong.push(format!(
                "{request} as {identity}: {got:?}, the table says {with}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "with the policies and Pod Security restricted:\n{}",
        wrong.join("\n")
    );

    // Teardown under the policies: the operator (here a host process with the admin's
    // credentials) removes the binding it made.
    delete_released(&ins, PROXIED, &op).await;
    delete_released(&ins, INSTANCE, &op).await;
    wait_for(
        crbs.clone(),
        &own,
        "auth-delegator binding removed",
        TIMEOUT,
        |o: Option<&ClusterRoleBinding>| o.is_none(),
    )
    .await
    .expect("binding removed");

    let _ = crbs.delete(&foreign, &DeleteParams::default()).await;
    let _ = runtime.delete(&classes, &DeleteParams::default()).await;
    let _ = priority.delete(&classes, &DeleteParams::default()).await;
    for (api, name) in outside {
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
    for n in [ns, other, opns] {
        n.delete().await.expect("delete namespace");
    }
}
