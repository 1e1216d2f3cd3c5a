//! An OLM-style install of the bundle on the real API server has the admission policies in
//! force. OLM itself cannot run here (the Go module proxy does not serve
//! operator-lifecycle-manager), so this does what OLM does with `bundle/` for an
//! OwnNamespace OperatorGroup: the bundle's CRD; the CSV's ServiceAccount; its `permissions`
//! as a Role and RoleBinding in the namespace and its `clusterPermissions` as a ClusterRole
//! and ClusterRoleBinding; and the CSV's Deployment, its pod template annotated with
//! `olm.targetNamespaces`. The images are replaced by the local node's, as a catalog mirror
//! would replace them. A bundle cannot carry ValidatingAdmissionPolicies, so the operator
//! creates them at start with the CSV's permissions; before it runs, RBAC alone lets each
//! attack below through, after it they are refused (and a policy another version left is
//! kept as it was, and named in a warning):
//! - the operator's ServiceAccount deleting a ClusterRoleBinding it did not make, and
//!   creating a pod that is no sandbox;
//! - an instance named `operator` in the operator's namespace, whose server would run as
//!   the operator's ServiceAccount;
//! - an instance's server (which RBAC lets create any pod of the namespace) creating a pod
//!   that is no sandbox.
//!
//! It runs on a private cluster: the policies the operator creates apply to the whole
//! cluster, and other tests share theirs.

mod support;

use std::time::{Duration, Instant};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_e2e::testing::{private_cluster, wait_for, workspace_root, TestCluster};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};

use support::*;

/// A client that acts as `user` (the API server adds a ServiceAccount's groups itself).
async fn client_as(c: &TestCluster, user: &str) -> Client {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let kc = Kubeconfig::read_from(&c.info.kubeconfig).expect("kubeconfig");
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("client config");
    cfg.headers.push((
        reqwest::header::HeaderName::from_static("impersonate-user"),
        reqwest::header::HeaderValue::from_str(user).expect("header value"),
    ));
    Client::try_from(cfg).expect("client")
}

fn bundle_file(name: &str) -> Value {
    let path = workspace_root().join("bundle/manifests").join(name);
    let text = std::fs::read_to_string(&path).expect("bundle file");
    serde_yaml::from_str(&text).expect("bundle YAML")
}

/// What OLM makes of the CSV's install strategy in namespace `ns` (OwnNamespace).
async fn install_as_olm(c: &TestCluster, ns: &str, csv: &Value) -> String {
    let install = &csv["spec"]["install"]["spec"];
    let sa = install["permissions"][0]["serviceAccountName"]
        .as_str()
        .expect("serviceAccountName")
        .to_owned();
    let post = PostParams::default();
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": sa}})).expect("ServiceAccount");
    Api::<ServiceAccount>::namespaced(c.client.clone(), ns)
        .create(&post, &account)
        .await
        .expect("create the ServiceAccount");
    let subject = json!([{"kind": "ServiceAccount", "name": sa, "namespace": ns}]);
    for (i, p) in install["permissions"]
        .as_array()
        .expect("permissions")
        .iter()
        .enumerate()
    {
        let name = format!("olm-{i}");
        let role: Role =
            serde_json::from_value(json!({"metadata": {"name": name}, "rules": p["rules"]}))
                .expect("Role");
        Api::<Role>::namespaced(c.client.clone(), ns)
            .create(&post, &role)
            .await
            .expect("Role");
        let rb: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": subject,
        }))
        .expect("RoleBinding");
        Api::<RoleBinding>::namespaced(c.client.clone(), ns)
            .create(&post, &rb)
            .await
            .expect("RoleBinding");
    }
    for (i, p) in install["clusterPermissions"]
        .as_array()
        .expect("clusterPermissions")
        .iter()
        .enumerate()
    {
        let name = format!("{ns}-olm-{i}");
        let role: ClusterRole =
            serde_json::from_value(json!({"metadata": {"name": name}, "rules": p["rules"]}))
                .expect("ClusterRole");
        Api::<ClusterRole>::all(c.client.clone())
            .create(&post, &role)
            .await
            .expect("ClusterRole");
        let crb: ClusterRoleBinding = serde_json::from_value(json!({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": subject,
        }))
        .expect("ClusterRoleBinding");
        Api::<ClusterRoleBinding>::all(c.client.clone())
            .create(&post, &crb)
            .await
            .expect("ClusterRoleBinding");
    }
    sa
}

/// The CSV's Deployment as OLM creates it for an OwnNamespace OperatorGroup on `ns`, with
/// the local node's images and one replica (the test's CPU budget).
fn olm_deployment(csv: &Value, ns: &str) -> Deployment {
    let d = &csv["spec"]["install"]["spec"]["deployments"][0];
    let mut spec = d["spec"].clone();
    spec["replicas"] = json!(1);
    let template = &mut spec["template"];
    template["metadata"]["annotations"]["olm.targetNamespaces"] = json!(ns);
    template["metadata"]["annotations"]["olm.operatorNamespace"] = json!(ns);
    let container = &mut template["spec"]["containers"][0];
    container["image"] = json!("cli-mcp-operator:e2e");
    for e in container["env"].as_array_mut().expect("env") {
        let image = match e["name"].as_str().unwrap_or_default() {
            "RELATED_IMAGE_SERVER" => SERVER_IMAGE,
            "RELATED_IMAGE_SANDBOX" => SANDBOX_IMAGE,
            "RELATED_IMAGE_PROXY" => PROXY_IMAGE,
            _ => continue,
        };
        e["value"] = json!(image);
    }
    serde_json::from_value(
        json!({"metadata": {"name": d["name"], "labels": d["label"]}, "spec": spec}),
    )
    .expect("Deployment")
}

#[tokio::test]
async fn an_olm_style_install_has_the_admission_policies_in_force() {
    let pc = private_cluster("olm-install")
        .await
        .expect("private cluster");
    let c = &pc.test;
    let crd = bundle_file("cli-mcp.redhat.com_climcpinstances.yaml");
    apply_crd(c, serde_json::from_value(crd).expect("CRD")).await;
    let csv = bundle_file("cli-mcp-operator.clusterserviceversion.yaml");
    let ns = c.namespace("olm").await.expect("namespace");
    let n = ns.name.clone();
    let sa = install_as_olm(c, &n, &csv).await;
    let operator = format!("system:serviceaccount:{n}:{sa}");

    // A ClusterRoleBinding the operator did not make.
    let bystander: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("{n}-bystander")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
        "subjects": [{"kind": "User", "name": "someone", "apiGroup": "rbac.authorization.k8s.io"}],
    }))
    .expect("ClusterRoleBinding");
    Api::<ClusterRoleBinding>::all(c.client.clone())
        .create(&PostParams::default(), &bystander)
        .await
        .expect("the bystander binding");
    let as_operator = client_as(c, &operator).await;
    let plain: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "cli-mcp-shell:dev"}]},
    }))
    .expect("pod");
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let attacks = || {
        let (as_operator, plain, dry) = (as_operator.clone(), plain.clone(), dry.clone());
        let (c, n) = (c.client.clone(), n.clone());
        async move {
            let delete = Api::<ClusterRoleBinding>::all(as_operator.clone())
                .delete(
                    &format!("{n}-bystander"),
                    &DeleteParams {
                        dry_run: true,
                        ..Default::default()
                    },
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string());
            let pod = Api::<Pod>::namespaced(as_operator, &n)
                .create(&dry, &plain)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string());
            let named = Api::<CliMcpInstance>::namespaced(c, &n)
                .create(&dry, &instance("operator", json!({})))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string());
            [delete, pod, named]
        }
    };
    // RBAC alone (the CSV's permissions) lets every attack through, once the API server's
    // authorizer has seen the new Roles and bindings (it reads them from a watch).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = attacks().await;
        if got.iter().all(Result::is_ok) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "refused before any policy exists: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A policy another version left: the same rules, another message. The operator leaves
    // it (it may not change it) and says so.
    let stale = cli_mcp_operator::policies::policies(&n, &sa)
        .expect("policies")
        .into_iter()
        .find(|v| v["metadata"]["name"] == "cli-mcp-sandbox-pod-deletions")
        .map(|mut v| {
            v["spec"]["validations"][0]["message"] = json!("an older version's words");
            v
        })
        .expect("the deletions policy");
    let gvk = GroupVersionKind::gvk(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingAdmissionPolicy",
    );
    let policies = ApiResource::from_gvk_with_plural(&gvk, "validatingadmissionpolicies");
    Api::<DynamicObject>::all_with(c.client.clone(), &policies)
        .create(
            &PostParams::default(),
            &serde_json::from_value(stale).expect("object"),
        )
        .await
        .expect("the stale policy");

    Api::<Deployment>::namespaced(c.client.clone(), &n)
        .create(&PostParams::default(), &olm_deployment(&csv, &n))
        .await
        .expect("the operator Deployment");

    // The operator creates the policies; the API server enforces them once it has loaded
    // them from its watch: poll each attack until refused, with a deadline.
    let expected = [
        format!("cli-mcp-operator-cluster-role-bindings-{n}"),
        "cli-mcp-sandbox-pods".to_owned(),
        "cli-mcp-instance-names".to_owned(),
    ];
    let deadline = Instant::now() + Duration::from_secs(180);
    let refused = loop {
        let got = attacks().await;
        let all = got
            .iter()
            .zip(&expected)
            .all(|(r, policy)| matches!(r, Err(e) if e.contains(&format!("ValidatingAdmissionPolicy '{policy}'"))));
        if all {
            break got;
        }
        assert!(
            Instant::now() < deadline,
            "the policies are not in force within 180 s: {got:?}\noperator pod log:\n{}",
            c.pod_logs(&n, "operator", 40)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let words = [
        "may create, change or delete only the ClusterRoleBindings it",
        "a cli-mcp server may create only sandbox pods of its own instance",
        "cli-mcp-operator (its server) of namespace",
    ];
    for (r, w) in refused.iter().zip(words) {
        assert!(
            matches!(r, Err(e) if e.contains(w)),
            "{r:?} does not say {w:?}"
        );
    }
    // Every policy and binding of config/admission is there (none failed to be created).
    for (kind, plural) in [
        ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
        (
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
        ),
    ] {
        let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind);
        let ar = ApiResource::from_gvk_with_plural(&gvk, plural);
        let mut names: Vec<String> = Api::<DynamicObject>::all_with(c.client.clone(), &ar)
            .list(&Default::default())
            .await
            .expect("list")
            .items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "cli-mcp-instance-names".to_owned(),
                format!("cli-mcp-operator-cluster-role-bindings-{n}"),
                "cli-mcp-sandbox-pod-deletions".to_owned(),
                "cli-mcp-sandbox-pods".to_owned(),
                "cli-mcp-tenant-pods".to_owned(),
            ],
            "{kind}s"
        );
    }

    // What the API server stores of the others holds the operator's copy (its defaults
    // aside): a restarted operator finds them all current, and warns about none.
    for ours in cli_mcp_operator::policies::policies(&n, &sa).expect("policies") {
        let name = ours["metadata"]["name"].as_str().expect("name").to_owned();
        if name == "cli-mcp-sandbox-pod-deletions" && ours["kind"] == "ValidatingAdmissionPolicy" {
            continue;
        }
        let kind = ours["kind"].as_str().expect("kind");
        let plural = format!("{}s", kind.to_ascii_lowercase()).replace("policys", "policies");
        let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind);
        let ar = ApiResource::from_gvk_with_plural(&gvk, &plural);
        let stored = Api::<DynamicObject>::all_with(c.client.clone(), &ar)
            .get(&name)
            .await
            .expect("stored");
        assert!(
            cli_mcp_operator::policies::holds(&stored.data["spec"], &ours["spec"]),
            "{kind} {name} as stored does not hold the operator's copy: {:?}",
            stored.data["spec"]
        );
    }

    // The stale policy is named in a warning, and left as it was.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.pod_logs(&n, "operator", usize::MAX).contains(
        "ValidatingAdmissionPolicy cli-mcp-sandbox-pod-deletions differ from this operator's copy",
    ) {
        assert!(
            Instant::now() < deadline,
            "no warning about the stale policy:\n{}",
            c.pod_logs(&n, "operator", 40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let kept = Api::<DynamicObject>::all_with(c.client.clone(), &policies)
        .get("cli-mcp-sandbox-pod-deletions")
        .await
        .expect("the stale policy");
    assert_eq!(
        kept.data["spec"]["validations"][0]["message"],
        "an older version's words"
    );

    // The bystander is still there, and another instance name is allowed.
    Api::<ClusterRoleBinding>::all(c.client.clone())
        .get(&format!("{n}-bystander"))
        .await
        .expect("the bystander binding");
    Api::<CliMcpInstance>::namespaced(c.client.clone(), &n)
        .create(&PostParams::default(), &instance("demo", json!({})))
        .await
        .expect("another name");

    // The instance's server, with the Role the operator gives it, may create any pod of the
    // namespace as far as RBAC goes; the sandbox pod policy holds it to sandbox pods.
    wait_for(
        Api::<RoleBinding>::namespaced(c.client.clone(), &n),
        "cli-mcp-demo",
        "the server's RoleBinding",
        TIMEOUT,
        |o: Option<&RoleBinding>| o.is_some(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator pod log:\n{}", c.pod_logs(&n, "operator", 40)));
    let server = format!("system:serviceaccount:{n}:cli-mcp-demo");
    let review: SubjectAccessReview = serde_json::from_value(json!({"spec": {
        "user": server,
        "resourceAttributes": {"namespace": n, "verb": "create", "resource": "pods"},
    }}))
    .expect("SubjectAccessReview");
    let review = Api::<SubjectAccessReview>::all(c.client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("SubjectAccessReview");
    assert!(
        review.status.is_some_and(|s| s.allowed),
        "RBAC does not let the server create pods"
    );
    let r = Api::<Pod>::namespaced(client_as(c, &server).await, &n)
        .create(&dry, &plain)
        .await;
    assert!(
        matches!(&r, Err(e) if e.to_string().contains("ValidatingAdmissionPolicy 'cli-mcp-sandbox-pods'")),
        "the server's pod that is no sandbox: {r:?}"
    );
}
