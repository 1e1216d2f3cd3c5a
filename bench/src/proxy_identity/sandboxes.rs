//! Sandboxes as the proxy verifies them, made as the proxy's tests/identity.rs makes them:
//! the instance's sandbox ServiceAccount, sealed session pods that are never scheduled (their
//! status gives the IP the bench's connections come from), and tokens bound to them with the
//! audience of this instance's proxy.

use std::collections::BTreeMap;
use std::io::Read;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::authentication::v1::{
    BoundObjectReference, TokenRequest, TokenRequestSpec, TokenReview, TokenReviewSpec,
};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ServiceAccount};
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

use cli_mcp_api::names::{annotation, label, InstanceName};
use cli_mcp_api::proxy::sandbox_token_audience;
use cli_mcp_api::seal::seal;
use cli_mcp_api::token::HmacKey;
use cli_mcp_e2e::testing::{TestCluster, TestNamespace};
use cli_mcp_proxy::SandboxCheck;

pub(crate) const INSTANCE: &str = "demo";

/// One sandbox: its pod's name and uid, where it connects from, and its token.
#[derive(Clone)]
pub(crate) struct Sandbox {
    pub(crate) pod: Pod,
    pub(crate) ip: IpAddr,
    pub(crate) token: String,
}

/// The instance `demo`'s sandboxes in one namespace.
pub(crate) struct Sandboxes {
    pub(crate) namespace: String,
    client: kube::Client,
    key: HmacKey,
    key_file: PathBuf,
    /// The admin kubeconfig: a verifying proxy binary's own identity (`KUBECONFIG`).
    pub(crate) admin_kubeconfig: PathBuf,
}

impl Sandboxes {
    /// The sandbox ServiceAccount in `ns` and a fresh instance key, written to `dir`.
    pub(crate) async fn new(
        cluster: &TestCluster,
        ns: &TestNamespace,
        dir: &Path,
    ) -> anyhow::Result<Self> {
        let sa = ServiceAccount {
            metadata: ObjectMeta {
                name: Some(format!("cli-mcp-{INSTANCE}-sandbox")),
                ..Default::default()
            },
            ..Default::default()
        };
        ns.api::<ServiceAccount>()
            .create(&PostParams::default(), &sa)
            .await
            .context("the sandbox ServiceAccount")?;
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        let key = HmacKey::from_bytes(bytes);
        let key_file = dir.join("hmac-key");
        std::fs::write(&key_file, key.to_hex())?;
        Ok(Self {
            namespace: ns.name.clone(),
            client: cluster.client.clone(),
            key,
            key_file,
            admin_kubeconfig: cluster.info.kubeconfig.clone(),
        })
    }

    /// What an in-process proxy is given to verify these sandboxes.
    pub(crate) fn check(&self) -> anyhow::Result<SandboxCheck> {
        Ok(SandboxCheck::Verified {
            namespace: self.namespace.clone(),
            instance: InstanceName::parse(INSTANCE)?,
            hmac_key_file: self.key_file.clone(),
        })
    }

    /// The proxy binary's flags for the same.
    pub(crate) fn flags(&self) -> Vec<String> {
        vec![
            "--namespace".into(),
            self.namespace.clone(),
            "--instance".into(),
            INSTANCE.into(),
            "--hmac-key-file".into(),
            self.key_file.display().to_string(),
        ]
    }

    pub(crate) fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// A sealed pod `name` serving a session, at `ip`, and a token bound to it.
    pub(crate) async fn sandbox(&self, name: &str, ip: IpAddr) -> anyhow::Result<Sandbox> {
        let pod = self.pod(name, ip).await?;
        let token = self.token(&pod).await?;
        Ok(Sandbox { pod, ip, token })
    }

    async fn pod(&self, name: &str, ip: IpAddr) -> anyhow::Result<Pod> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let labels = BTreeMap::from([
            (label::INSTANCE.to_owned(), INSTANCE.to_owned()),
            (
                label::COMPONENT.to_owned(),
                label::COMPONENT_SANDBOX.to_owned(),
            ),
            (label::SESSION_ID.to_owned(), format!("s-{name}")),
        ]);
        let caller = json!({"user": "bench@example.com", "groups": ["dev"]}).to_string();
        let p = Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels),
                annotations: Some(BTreeMap::from([(annotation::CALLER.to_owned(), caller)])),
                ..Default::default()
            },
            spec: Some(PodSpec {
                service_account_name: Some(format!("cli-mcp-{INSTANCE}-sandbox")),
                automount_service_account_token: Some(false),
                // Never scheduled: no kubelet rewrites the IP given below.
                node_selector: Some(BTreeMap::from([(
                    "cli-mcp.bench/nowhere".to_owned(),
                    "true".to_owned(),
                )])),
                containers: vec![Container {
                    name: "agent".into(),
                    image: Some("example.invalid/agent:1".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let created = api
            .create(&PostParams::default(), &p)
            .await
            .with_context(|| format!("pod {name}"))?;
        let uid = created.uid().context("a uid")?;
        let ip = ip.to_string();
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"podIP": ip, "podIPs": [{"ip": ip}]}})),
        )
        .await
        .context("the pod's IP")?;
        let s = seal(&self.key, &self.namespace, name, &uid);
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {annotation::SEAL: s}}})),
        )
        .await
        .context("the seal")
    }

    /// A new token of the sandbox ServiceAccount for the proxy's audience, bound to `pod`:
    /// what the kubelet projects into it.
    pub(crate) async fn token(&self, pod: &Pod) -> anyhow::Result<String> {
        let tr = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: Some(vec![sandbox_token_audience(&self.namespace, INSTANCE)]),
                expiration_seconds: Some(600),
                bound_object_ref: Some(BoundObjectReference {
                    kind: Some("Pod".into()),
                    api_version: Some("v1".into()),
                    name: Some(pod.name_any()),
                    uid: pod.uid(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        Api::<ServiceAccount>::namespaced(self.client.clone(), &self.namespace)
            .create_token_request(
                &format!("cli-mcp-{INSTANCE}-sandbox"),
                &PostParams::default(),
                &tr,
            )
            .await
            .context("a TokenRequest")?
            .status
            .and_then(|s| s.token)
            .context("a token")
    }

    /// `n` new tokens bound to `pod`.
    pub(crate) async fn tokens(&self, pod: &Pod, n: usize) -> anyhow::Result<Vec<String>> {
        use futures::{StreamExt, TryStreamExt};
        futures::stream::iter(0..n)
            .map(|_| self.token(pod))
            .buffer_unordered(8)
            .try_collect()
            .await
    }

    /// One TokenReview of `token` for the proxy's audience, as the proxy asks it, timed.
    pub(crate) async fn review(&self, token: &str) -> anyhow::Result<Duration> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: Some(vec![sandbox_token_audience(&self.namespace, INSTANCE)]),
            },
            ..Default::default()
        };
        let start = Instant::now();
        let answer = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let took = start.elapsed();
        if answer.status.and_then(|s| s.authenticated) != Some(true) {
            anyhow::bail!("the bench's TokenReview did not authenticate the sandbox token");
        }
        Ok(took)
    }
}
