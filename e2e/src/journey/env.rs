//! [`Env`]: one test's namespace with the operator installed as a user would, its
//! instances, and the cleanup at the end.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use cli_mcp_api::crd::{CliMcpInstance, CliMcpInstanceStatus};
use cli_mcp_api::names::label;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{pinned_kind, Scope};
use kube::{Api, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::mcp::Mcp;
use super::overlay::operator_overlay;
use super::USER;
use crate::instance::{
    self, delete_instance, is_ready_for_generation, small_resources, wait_instance,
    DUMMY_KUBECONFIG,
};
use crate::runtime::SandboxRuntime;
use crate::testing::{
    cluster, wait_deployment_ready, wait_for, wait_for_set, workspace_root, TestCluster,
    TestNamespace, TIMEOUT,
};
use crate::ServiceForward;

/// helm and kustomize (`hack/build-helm-kustomize.sh`, cached).
pub fn tools() -> PathBuf {
    hack_bin_dir("build-helm-kustomize.sh")
}

/// The bin directory a cached `hack/<script>` build prints as its last line (building it
/// first when it is not cached).
pub fn hack_bin_dir(script: &str) -> PathBuf {
    let out = Command::new(workspace_root().join("hack").join(script))
        .output()
        .unwrap_or_else(|e| panic!("run hack/{script}: {e}"));
    assert!(
        out.status.success(),
        "hack/{script} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    PathBuf::from(stdout.lines().last().expect("bin dir").trim())
}

/// `kustomize build` of `kustomization` written to `.run/<dir>-<pid>-<n>/` in the workspace (kustomize
/// takes only relative resource paths); the directory is removed afterwards.
pub fn kustomize_build(dir: &str, kustomization: &str) -> String {
    // A directory of this call's own: tests run in parallel, and two of them rendering the
    // same overlay name would remove each other's directory mid-build.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = workspace_root()
        .join(".run")
        .join(format!("{dir}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("overlay dir");
    std::fs::write(dir.join("kustomization.yaml"), kustomization).expect("write overlay");
    let out = Command::new(tools().join("kustomize"))
        .arg("build")
        .arg(&dir)
        .output()
        .expect("kustomize");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "kustomize build: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// One test's world: its namespace, the operator installed into it, and what the install
/// created outside it (cluster-scoped RBAC) to delete at the end.
pub struct Env {
    pub c: TestCluster,
    pub ns: TestNamespace,
    outside: Vec<(Api<DynamicObject>, String)>,
    /// The runtime of the sandboxes of the instances [`Env::cr`] makes.
    pub sandbox_runtime: SandboxRuntime,
}

/// Server-side applies every document of `yaml` (namespaced ones into `ns` unless they name
/// another); returns the objects outside `ns` (CRDs and Namespaces excepted).
pub async fn apply_yaml(
    c: &TestCluster,
    ns: &str,
    yaml: &str,
    edit: impl Fn(&mut Value),
) -> Vec<(Api<DynamicObject>, String)> {
    let mut outside = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let mut value =
            serde_json::to_value(serde_yaml::Value::deserialize(doc).expect("YAML document"))
                .expect("JSON");
        if value.is_null() {
            continue;
        }
        edit(&mut value);
        let obj: DynamicObject = serde_json::from_value(value).expect("a Kubernetes object");
        let tm = obj.types.clone().expect("apiVersion/kind");
        let gvk = GroupVersionKind::try_from(&tm).expect("gvk");
        let (ar, caps) = pinned_kind(&c.client, &gvk).await.expect("discover kind");
        let name = obj.name_any();
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Cluster => Api::all_with(c.client.clone(), &ar),
            Scope::Namespaced => {
                let target = obj.namespace().unwrap_or_else(|| ns.to_owned());
                Api::namespaced_with(c.client.clone(), &target, &ar)
            }
        };
        api.patch(
            &name,
            &PatchParams::apply(USER).force(),
            &Patch::Apply(&obj),
        )
        .await
        .unwrap_or_else(|e| panic!("applying {} {name}: {e}", tm.kind));
        let is_outside = match caps.scope {
            Scope::Cluster => tm.kind != "CustomResourceDefinition" && tm.kind != "Namespace",
            Scope::Namespaced => obj.namespace().is_some_and(|n| n != ns),
        };
        if is_outside {
            outside.push((api, name));
        }
    }
    outside
}

/// config/rbac's Role and RoleBinding in `default` that let the operator read the API
/// server's addresses (the sandbox NetworkPolicy's API rule), for the operator installed into
/// `ns` by [`operator_overlay`]: its `namespace:` moves every namespaced object into `ns`,
/// that Role too, which then grants nothing. Applied where config/rbac puts them, with the
/// overlay's name prefix and bound to `ns`'s operator; returns them (outside `ns`).
async fn apiserver_endpoints_rbac(c: &TestCluster, ns: &str) -> Vec<(Api<DynamicObject>, String)> {
    let yaml =
        std::fs::read_to_string(workspace_root().join("config/rbac/apiserver_endpoints_role.yaml"))
            .expect("config/rbac/apiserver_endpoints_role.yaml");
    let prefixed = |v: &Value| json!(format!("{ns}-{}", v.as_str().unwrap_or_default()));
    apply_yaml(c, ns, &yaml, |v| {
        v["metadata"]["name"] = prefixed(&v["metadata"]["name"]);
        if v["kind"] == "RoleBinding" {
            v["roleRef"]["name"] = prefixed(&v["roleRef"]["name"]);
            v["subjects"][0]["name"] = prefixed(&v["subjects"][0]["name"]);
            v["subjects"][0]["namespace"] = json!(ns);
        }
    })
    .await
}

impl Env {
    /// A namespace with the operator installed from config/default: a kustomize overlay
    /// that scopes it to the namespace (WATCH_NAMESPACE, a name prefix for its cluster-wide
    /// RBAC), one replica and small requests (the CI node has 2 cores).
    pub async fn install(prefix: &str) -> Env {
        init_tracing();
        Env::install_on(cluster().await.expect("cluster"), prefix).await
    }

    /// [`Env::install`] on a given cluster (e.g. a test's private cluster).
    pub async fn install_on(c: TestCluster, prefix: &str) -> Env {
        let ns = c.namespace(prefix).await.expect("namespace");
        let n = ns.name.clone();
        let yaml = kustomize_build(&format!("journeys-{n}"), &operator_overlay(&n, true));
        let mut outside = apply_yaml(&c, &n, &yaml, |_| {}).await;
        outside.extend(apiserver_endpoints_rbac(&c, &n).await);
        let env = Env {
            c,
            ns,
            outside,
            sandbox_runtime: SandboxRuntime::Runc,
        };
        let op = format!("{n}-cli-mcp-operator");
        if let Err(e) = wait_deployment_ready(env.ns.api::<Deployment>(), &op, TIMEOUT).await {
            panic!("operator not ready: {e}\n{}", env.logs("operator"));
        }
        env.wait_policies_synced().await;
        env
    }

    /// Waits until the API server judges pods of the namespace by the admission policies just
    /// installed: until it has synced their parameter kind (the CRD installed with them), it
    /// refuses every pod there with "paramKind … not yet synced" (seen when two operators
    /// were installed at once on a loaded node). A dry-run pod create that is refused for
    /// anything else, or admitted, means it has.
    async fn wait_policies_synced(&self) {
        let probe: Pod = serde_json::from_value(json!({
            "metadata": {"name": "cli-mcp-e2e-admission-probe"},
            "spec": {"containers": [{"name": "c", "image": "probe"}]},
        }))
        .expect("probe pod");
        let dry = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            match self.api::<Pod>().create(&dry, &probe).await {
                Err(kube::Error::Api(e)) if e.message.contains("not yet synced") => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the admission policies' parameters never synced: {}",
                        e.message
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                _ => return,
            }
        }
    }

    /// An environment in namespace `ns` of `c` for an operator installed some other way and
    /// watching it (as a user installs one: `kubectl apply -k`, `helm install`).
    pub fn adopt(c: TestCluster, ns: TestNamespace) -> Env {
        init_tracing();
        Env {
            c,
            ns,
            outside: Vec::new(),
            sandbox_runtime: SandboxRuntime::Runc,
        }
    }

    /// The same environment, whose instances run their sandboxes under `rt`.
    pub fn under(mut self, rt: SandboxRuntime) -> Env {
        self.sandbox_runtime = rt;
        self
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        self.ns.api::<K>()
    }

    /// Container logs (`<container>.log`) of this namespace's pods, the last 30 lines of
    /// each, for failure messages.
    pub fn logs(&self, container: &str) -> String {
        self.c.pod_logs(&self.ns.name, container, 30)
    }

    /// A kubeconfig Secret whose token opens nothing, for the instance's credential proxy
    /// (journeys that do not use kubectl).
    pub async fn dummy_kubeconfig(&self, instance: &str) {
        self.kubeconfig_secret(instance, DUMMY_KUBECONFIG).await;
    }

    pub async fn kubeconfig_secret(&self, instance: &str, kubeconfig: &str) {
        instance::kubeconfig_secret(&self.ns, instance, kubeconfig).await;
    }

    /// The read-only investigation identity of config/samples/investigation-kubeconfig.yaml
    /// (its cluster-scoped objects renamed for this namespace) turned into the instance's
    /// kubeconfig Secret (which its credential proxy holds), with the API server address of
    /// the admin kubeconfig (reachable from every pod, the proxy's among them).
    pub async fn investigation_kubeconfig(&mut self, instance: &str) {
        let n = self.ns.name.clone();
        let yaml = std::fs::read_to_string(
            workspace_root().join("config/samples/investigation-kubeconfig.yaml"),
        )
        .expect("sample");
        let cluster_name = format!("{n}-cli-mcp-investigator");
        let outside = apply_yaml(&self.c, &n, &yaml, |v| {
            let kind = v["kind"].as_str().unwrap_or_default().to_owned();
            if kind == "ClusterRole" || kind == "ClusterRoleBinding" {
                v["metadata"]["name"] = json!(cluster_name);
            }
            if kind == "ClusterRoleBinding" {
                v["roleRef"]["name"] = json!(cluster_name);
                v["subjects"][0]["namespace"] = json!(n);
            }
        })
        .await;
        self.outside.extend(outside);
        let secret = wait_for(
            self.api::<Secret>(),
            "cli-mcp-investigator-token",
            "investigator token issued",
            TIMEOUT,
            |s: Option<&Secret>| {
                s.and_then(|s| s.data.as_ref())
                    .is_some_and(|d| d.contains_key("token") && d.contains_key("ca.crt"))
            },
        )
        .await
        .expect("token")
        .expect("secret");
        let data = secret.data.unwrap_or_default();
        let token = String::from_utf8(data["token"].0.clone()).expect("token utf-8");
        let ca = {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(&data["ca.crt"].0)
        };
        let admin = kube::config::Kubeconfig::read_from(&self.c.info.kubeconfig).expect("admin");
        let server = admin.clusters[0]
            .cluster
            .as_ref()
            .and_then(|c| c.server.clone())
            .expect("server");
        let kc = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: cluster, cluster: {{server: \"{server}\", certificate-authority-data: \"{ca}\"}}}}]\n\
             users: [{{name: investigator, user: {{token: \"{token}\"}}}}]\n\
             contexts: [{{name: investigator, context: {{cluster: cluster, user: investigator}}}}]\n\
             current-context: investigator\n"
        );
        self.kubeconfig_secret(instance, &kc).await;
    }

    /// The CR as the user writes it: the sample's spec with `spec` merged over it, small
    /// requests for sandboxes and servers.
    pub fn cr(&self, name: &str, warm: i64) -> Value {
        let yaml = std::fs::read_to_string(
            workspace_root().join("config/samples/cli-mcp_v1alpha1_climcpinstance.yaml"),
        )
        .expect("sample CR");
        let mut v: Value =
            serde_json::to_value(serde_yaml::from_str::<serde_yaml::Value>(&yaml).expect("YAML"))
                .expect("JSON");
        v["metadata"]["name"] = json!(name);
        v["spec"]["sandbox"]["warmPoolSize"] = json!(warm);
        v["spec"]["sandbox"]["resources"] = small_resources();
        v["spec"]["server"]["resources"] = small_resources();
        self.sandbox_runtime.apply_to(&mut v);
        v
    }

    /// Server-side apply of the CR with the user's field manager; returns the stored object.
    pub async fn apply_cr(&self, cr: &Value) -> CliMcpInstance {
        let name = cr["metadata"]["name"].as_str().expect("name");
        self.api::<CliMcpInstance>()
            .patch(name, &PatchParams::apply(USER), &Patch::Apply(cr))
            .await
            .expect("apply CliMcpInstance")
    }

    /// Waits until the instance is Ready for its generation with a full warm pool and its
    /// server replicas ready.
    pub async fn wait_ready(&self, name: &str) -> CliMcpInstance {
        let r = wait_instance(
            self.api::<CliMcpInstance>(),
            name,
            "instance Ready with a full pool",
            TIMEOUT,
            |o| {
                is_ready_for_generation(o)
                    && o.status.as_ref().is_some_and(|s| {
                        s.ready_replicas >= 1 && s.warm_pool.ready == s.warm_pool.desired
                    })
            },
        )
        .await;
        r.unwrap_or_else(|e| {
            panic!(
                "instance {name} not Ready: {e}\noperator:\n{}\nserver:\n{}",
                self.logs("operator"),
                self.logs("server")
            )
        })
    }

    /// The sample instance `name` with `warm` pool pods and a dummy kubeconfig Secret,
    /// applied and waited Ready (what most journeys start from).
    pub async fn ready_instance(&self, name: &str, warm: i64) -> CliMcpInstance {
        self.dummy_kubeconfig(name).await;
        self.apply_cr(&self.cr(name, warm)).await;
        self.wait_ready(name).await
    }

    /// Waits until the instance's status satisfies `ok`; panics with the operator's log.
    pub async fn wait_status(
        &self,
        name: &str,
        what: &str,
        ok: impl Fn(&CliMcpInstanceStatus) -> bool,
    ) -> CliMcpInstance {
        wait_instance(self.api::<CliMcpInstance>(), name, what, TIMEOUT, |o| {
            o.status.as_ref().is_some_and(&ok)
        })
        .await
        .unwrap_or_else(|e| panic!("{name}: {what}: {e}\n{}", self.logs("operator")))
    }

    /// resourceVersions of the instance's children other than pods (`Kind/name` → rv), to
    /// tell which of them a change touched.
    pub async fn children(&self, instance: &str) -> BTreeMap<String, String> {
        let sel = format!("{}={instance}", label::INSTANCE);
        let mut m = BTreeMap::new();
        macro_rules! put {
            ($k:ty) => {
                for o in self.list::<$k>(&sel).await {
                    let kind = <$k as kube::Resource>::kind(&());
                    m.insert(
                        format!("{kind}/{}", o.name_any()),
                        o.resource_version().unwrap_or_default(),
                    );
                }
            };
        }
        put!(Deployment);
        put!(Service);
        put!(NetworkPolicy);
        put!(Secret);
        put!(ConfigMap);
        put!(ServiceAccount);
        put!(Role);
        put!(RoleBinding);
        for o in self.cluster_bindings(instance).await {
            m.insert(
                format!("ClusterRoleBinding/{}", o.name_any()),
                o.resource_version().unwrap_or_default(),
            );
        }
        m
    }

    /// A fresh token (one hour) of ServiceAccount `sa` of the namespace.
    pub async fn service_account_token(&self, sa: &str) -> String {
        self.api::<ServiceAccount>()
            .create_token_request(
                sa,
                &PostParams::default(),
                &TokenRequest {
                    spec: Some(TokenRequestSpec {
                        expiration_seconds: Some(3600),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            )
            .await
            .unwrap_or_else(|e| panic!("a token of ServiceAccount {sa}: {e}"))
            .status
            .and_then(|s| s.token)
            .unwrap_or_else(|| panic!("no token in the TokenRequest of {sa}"))
    }

    /// The client ServiceAccount the operator made for instance `name`
    /// (`cli-mcp-<name>-client`, allowed exactly the MCP verbs on this instance), its token,
    /// the instance CA and a loopback forward to the Service.
    pub async fn client(&self, name: &str) -> Mcp {
        let n = &self.ns.name;
        let token = self
            .service_account_token(&format!("cli-mcp-{name}-client"))
            .await;
        let svc = format!("cli-mcp-{name}");
        let ca = self
            .api::<ConfigMap>()
            .get(&format!("{svc}-ca"))
            .await
            .expect("CA ConfigMap")
            .data
            .unwrap_or_default()
            .remove("ca.crt")
            .expect("ca.crt");
        let fwd = ServiceForward::start(self.c.client.clone(), n, &svc, 8443)
            .await
            .expect("forward");
        let to = fwd.local_addr();
        let mut mcp = Mcp::new(format!("{svc}.{n}.svc"), ca, token, to, true);
        mcp.fwd = Some(Arc::new(fwd));
        mcp
    }

    pub async fn list<K>(&self, selector: &str) -> Vec<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + std::fmt::Debug,
        <K as kube::Resource>::DynamicType: Default,
    {
        self.api::<K>()
            .list(&ListParams::default().labels(selector))
            .await
            .expect("list")
            .items
    }

    /// Waits until nothing labelled with `instance` is left in the namespace, of any kind
    /// the operator or the server makes, and its ClusterRoleBinding is gone too.
    pub async fn assert_nothing_left(&self, instance: &str) {
        let sel = format!("{}={instance}", label::INSTANCE);
        macro_rules! all_gone {
            ($k:ty) => {
                wait_for_set(
                    self.api::<$k>(),
                    &sel,
                    concat!("no ", stringify!($k), " left"),
                    TIMEOUT,
                    |v: &[$k]| v.is_empty(),
                )
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", self.logs("operator")));
            };
        }
        all_gone!(Pod);
        all_gone!(Deployment);
        all_gone!(ReplicaSet);
        all_gone!(Service);
        all_gone!(NetworkPolicy);
        all_gone!(Secret);
        all_gone!(ConfigMap);
        all_gone!(ServiceAccount);
        all_gone!(Role);
        all_gone!(RoleBinding);
        assert!(self.cluster_bindings(instance).await.is_empty());
    }

    /// The instance's ClusterRoleBindings (instance label, subject in this namespace).
    pub async fn cluster_bindings(&self, instance: &str) -> Vec<ClusterRoleBinding> {
        Api::<ClusterRoleBinding>::all(self.c.client.clone())
            .list(&ListParams::default().labels(&format!("{}={instance}", label::INSTANCE)))
            .await
            .expect("list CRBs")
            .items
            .into_iter()
            .filter(|b| {
                b.subjects
                    .iter()
                    .flatten()
                    .any(|s| s.namespace.as_deref() == Some(&self.ns.name))
            })
            .collect()
    }

    /// Deletes the instance (waiting for its finalizer), then the install's cluster-scoped
    /// objects and the namespace.
    pub async fn finish(self, instance: Option<&str>) {
        if let Some(name) = instance {
            let r = delete_instance(self.api::<CliMcpInstance>(), name, TIMEOUT).await;
            if let Err(e) = r {
                panic!("instance not released: {e}\n{}", self.logs("operator"));
            }
        }
        for (api, name) in &self.outside {
            let _ = api.delete(name, &DeleteParams::default()).await;
        }
        self.ns.delete().await.expect("delete namespace");
    }
}

/// Warnings of the harness (the forward's "no ready endpoints", watch errors) go to the
/// test's captured output, so a failing test shows them.
fn init_tracing() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,cli_mcp_e2e=debug"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    });
}
