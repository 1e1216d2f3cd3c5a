//! The test run's real API server as a kubernetes route's upstream: an admin identity, its
//! kubeconfig, and the cluster CA.

use std::path::Path;

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use kube::api::{ObjectMeta, PostParams};

use cli_mcp_e2e::testing::TestNamespace;

/// A ServiceAccount bound to `cluster-admin` in the test namespace, and a token of it.
pub async fn admin_token(ns: &TestNamespace, name: &str) -> String {
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let _ = ns
        .api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await;
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: "cluster-admin".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: name.into(),
            namespace: Some(ns.name.clone()),
            ..Default::default()
        }]),
    };
    let _ = ns
        .api::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await;
    let tr = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    ns.api::<ServiceAccount>()
        .create_token_request(name, &PostParams::default(), &tr)
        .await
        .expect("TokenRequest")
        .status
        .expect("token status")
        .token
        .expect("a token")
}

pub fn admin_kubeconfig(apiserver: &str, ca_pem: &str, token: &str, ns: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {apiserver}\n    certificate-authority-data: {ca}\nusers:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: admin\n  context: {{cluster: test, user: admin, namespace: {ns}}}\ncurrent-context: admin\n"
    )
}

/// The cluster CA, from the run's admin kubeconfig.
pub fn cluster_ca(kubeconfig: &Path) -> String {
    let text = std::fs::read_to_string(kubeconfig).expect("the cluster kubeconfig");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("YAML");
    let data = doc["clusters"][0]["cluster"]["certificate-authority-data"]
        .as_str()
        .expect("certificate-authority-data");
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(data)
            .expect("base64"),
    )
    .expect("PEM")
}
