//! The sandbox pod builder: the one function both pod writers use (the operator for warm
//! pool pods, the server for on-demand session pods), so a warm pod and a cold pod of the
//! same instance can never differ except in their role.
//!
//! It is pure: everything it needs (config, role, clock) comes in as arguments. This file
//! holds what the builder is given ([`SandboxConfig`], [`SandboxRole`]) and what a built pod
//! is read back for (its key, nonce and token); the building itself is in `sandbox/pod.rs`.
//! What bounds a sandbox's processes, disk and termination log on its node is in [`limits`].

pub mod limits;
mod pod;

pub use pod::build_sandbox_pod;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, Pod, PodSpec, ResourceRequirements, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::names::{annotation, InstanceName, PoolSuffix};
use crate::token::{Commitment, HmacKey, SandboxNonce, Token};
use crate::SessionId;

pub use crate::wire::{
    ENV_ASSIGN_SHA256, ENV_RELAY_LISTEN, ENV_RELAY_TOKEN_FILE, ENV_RELAY_UPSTREAM,
    ENV_TOKEN_SHA256, PODINFO_ANNOTATIONS, PODINFO_DIR,
};
pub const WORKSPACE_DIR: &str = "/workspace";
/// Key of the kubeconfig in the admin's Secret and in the proxy ConfigMap (the dummy).
pub const KUBECONFIG_KEY: &str = "kubeconfig";
/// Where a sandbox finds what it needs to use the credential proxy: the dummy kubeconfig
/// and the proxy CA certificate (from ConfigMap `cli-mcp-<n>-proxy`; nothing secret).
pub const PROXY_CLIENT_DIR: &str = "/etc/cli-mcp/proxy-client";
/// Key of the proxy CA certificate in the proxy ConfigMap.
pub const PROXY_CA_KEY: &str = "ca.crt";
/// `NO_PROXY` of a sandbox: only its own loopback bypasses the proxy.
pub const SANDBOX_NO_PROXY: &str = "localhost,127.0.0.1,::1";
/// Env names pointing TLS clients at the proxy CA bundle (OpenSSL, curl, Python requests,
/// Node.js, git).
pub const PROXY_CA_ENV: &[&str] = &[
    "SSL_CERT_FILE",
    "CURL_CA_BUNDLE",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
];
/// Env names of the proxy itself, upper and lower case as tools differ.
pub const PROXY_ENV: &[&str] = &[
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "NO_PROXY",
    "no_proxy",
    "ALL_PROXY",
    "all_proxy",
];
/// User and group every sandbox runs as (non-root; matches the sandbox image).
pub const SANDBOX_UID: i64 = 1001;
pub const CONTAINER_NAME: &str = "agent";

/// Env names the builder sets itself; the same names in `SandboxConfig::env` are dropped so
/// an instance's env can never impersonate the agent's auth or point KUBECONFIG elsewhere.
/// Names that change how bash starts or what it runs are dropped too.
pub const RESERVED_ENV: &[&str] = &[
    ENV_TOKEN_SHA256,
    ENV_ASSIGN_SHA256,
    "KUBECONFIG",
    "HOME",
    "POD_NAME",
    "POD_NAMESPACE",
    "SHELLOPTS",
    "BASHOPTS",
    "BASH_ENV",
    "ENV",
    "PROMPT_COMMAND",
];

/// Prefixes of reserved env names: the agent's own flags, and exported bash functions
/// (which could shadow the builtins the agent's protocol uses).
pub const RESERVED_ENV_PREFIXES: &[&str] = &["CLI_MCP_AGENT_", "BASH_FUNC_"];

/// Whether an instance may set this env var on its sandboxes. Secrets never reach bash
/// through the CR: `secretKeyRef` is dropped here as well as refused at admission,
/// so objects stored before the admission rule existed cannot carry one through.
pub fn allowed_sandbox_env(e: &EnvVar) -> bool {
    !RESERVED_ENV.contains(&e.name.as_str())
        && !RESERVED_ENV_PREFIXES.iter().any(|p| e.name.starts_with(p))
        && e.value_from
            .as_ref()
            .is_none_or(|v| v.secret_key_ref.is_none())
}

/// Whether `name` is one of the variables the builder sets for the credential proxy.
pub fn is_proxy_env(name: &str) -> bool {
    PROXY_ENV.contains(&name) || PROXY_CA_ENV.contains(&name)
}

/// Everything about a sandbox pod that does not depend on its role (CRD-agnostic: the
/// operator fills it from the CR, the server from the flags the operator rendered).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxConfig {
    pub instance: InstanceName,
    pub namespace: String,
    pub image: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// The container's resources; the builder adds `ephemeral-storage` where they set none
    /// ([`limits`]).
    pub resources: ResourceRequirements,
    #[serde(default)]
    pub env: Vec<EnvVar>,
    /// The credential proxy the sandbox reaches everything through. Every instance has
    /// one (the operator always sets it); `None` only for configs made without an instance
    /// (the server's local development backend, tests), whose sandboxes then reach nothing
    /// through a proxy. No config mounts a Secret: a sandbox never holds a real credential.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<SandboxProxy>,
    /// `sizeLimit` of `/workspace`, on the node's disk.
    pub workspace_size_limit: Quantity,
    /// `sizeLimit` of `/tmp`, memory-backed: it counts against the memory limit.
    pub tmp_size_limit: Quantity,
    pub termination_grace_period_seconds: i64,
    /// The owning `CliMcpInstance`, so Kubernetes GC removes sandboxes with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerReference>,
    /// Bytes of each stream the agent keeps per command (`--output-budget`), when not the
    /// agent's default: the server cuts to its own budget again, but can only return what
    /// the agent kept. Absent for the default, so existing configs keep their hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_budget: Option<usize>,
    /// Where and under which runtime sandboxes run, and the pull Secrets of their image.
    /// Absent when nothing is set, so existing configs keep their hash.
    #[serde(default, skip_serializing_if = "Placement::is_empty")]
    pub placement: Placement,
    /// The platform assigns each pod's user and group: OpenShift's `restricted-v2` SCC gives
    /// a UID from the namespace's range and refuses any other, so the pod fixes no user,
    /// group or fsGroup (the image works under any UID with group 0). Elsewhere the sandbox
    /// runs as [`SANDBOX_UID`] whatever user the image names. Absent when false, so existing
    /// configs keep their hash.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub platform_assigns_uid: bool,
}

/// The pod-level scheduling, runtime and image-pull settings an instance gives its pods
/// (the sandboxes from `spec.sandbox`, the server from `spec.server`). Each field is
/// omitted from JSON when unset, so a config that sets none hashes as before they existed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

impl Placement {
    /// Nothing set: the pod keeps the cluster's defaults.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// Sets these fields on `spec`; the ones this placement leaves unset are cleared, so
    /// the API server's defaults apply.
    pub fn apply_to(&self, spec: &mut PodSpec) {
        spec.runtime_class_name = self.runtime_class_name.clone();
        spec.node_selector = (!self.node_selector.is_empty()).then(|| self.node_selector.clone());
        spec.tolerations = (!self.tolerations.is_empty()).then(|| self.tolerations.clone());
        spec.affinity = self.affinity.clone();
        spec.priority_class_name = self.priority_class_name.clone();
        spec.image_pull_secrets =
            (!self.image_pull_secrets.is_empty()).then(|| self.image_pull_secrets.clone());
    }
}

/// How a sandbox uses its instance's credential proxy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxProxy {
    /// `HTTPS_PROXY`/`HTTP_PROXY`: `http://cli-mcp-<n>-proxy.<ns>.svc:8080`.
    pub url: String,
    /// ConfigMap with the proxy CA certificate (`ca.crt`) and the dummy kubeconfig.
    pub config_map: String,
    /// Whether the ConfigMap carries a dummy kubeconfig (a kubernetes target exists), so
    /// `KUBECONFIG` points at it.
    pub kubeconfig: bool,
}

impl SandboxConfig {
    /// The product defaults for everything but the instance, namespace and image.
    pub fn new(
        instance: InstanceName,
        namespace: impl Into<String>,
        image: impl Into<String>,
    ) -> Self {
        let q = |s: &str| Quantity(s.to_owned());
        Self {
            instance,
            namespace: namespace.into(),
            image: image.into(),
            image_pull_policy: None,
            // The instance's defaults: one definition for the CRD and the builder.
            resources: crate::crd::SandboxSpec::default().resources,
            env: Vec::new(),
            proxy: None,
            workspace_size_limit: q("1Gi"),
            tmp_size_limit: q("256Mi"),
            termination_grace_period_seconds: 30,
            owner: None,
            output_budget: None,
            placement: Placement::default(),
            platform_assigns_uid: false,
        }
    }

    /// Hash of everything that shapes a pod; a warm pod whose `sandbox-hash` differs from
    /// the current config's is stale and gets replaced. 16 hex characters.
    pub fn hash(&self) -> String {
        // serde_json writes struct fields in declaration order and maps sorted (BTreeMap),
        // so the same config always gives the same bytes.
        let bytes = serde_json::to_vec(self).unwrap_or_default();
        hex::encode(Sha256::digest(&bytes))[..16].to_owned()
    }
}

/// What a sandbox pod is for.
#[derive(Debug, Clone)]
pub enum SandboxRole {
    /// An unassigned warm pod waiting for `/assign`.
    Pool {
        suffix: PoolSuffix,
        /// Commitment of `assign_token(pod name)`.
        assign: Commitment,
    },
    /// A pod created on demand for one session (`launch=cold`).
    Session {
        sid: SessionId,
        /// The nonce this sandbox's token is bound to.
        nonce: SandboxNonce,
        /// Commitment of `session_token(sid, nonce)`.
        token: Commitment,
        /// Hash of the caller identity, when auth is on.
        owner: Option<String>,
    },
}

impl SandboxRole {
    /// A session's own pod whose token is `key.session_token(sid, nonce)`.
    pub fn session(
        key: &HmacKey,
        sid: SessionId,
        nonce: SandboxNonce,
        owner: Option<String>,
    ) -> Self {
        let token = key.session_token(&sid, &nonce).commitment();
        SandboxRole::Session {
            sid,
            nonce,
            token,
            owner,
        }
    }
}

/// Whether `pod` was made to be assigned under `key`: its `ASSIGN_SHA256` is the commitment
/// of `key.assign_token(<pod name>)`. A pool pod made under another key refuses this key's
/// `/assign` (the operator replaces it; a server skips it).
pub fn made_for_key(pod: &Pod, key: &HmacKey) -> bool {
    let expected = key
        .assign_token(&pod.metadata.name.clone().unwrap_or_default())
        .commitment()
        .to_hex();
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.env.as_ref())
        .and_then(|env| env.iter().find(|e| e.name == ENV_ASSIGN_SHA256))
        .and_then(|e| e.value.as_deref())
        == Some(expected.as_str())
}

/// The nonce `pod`'s session token is bound to; `None` when the annotation is missing or
/// malformed (a pod of an older version, or tampered with), which no token opens.
pub fn sandbox_nonce(pod: &Pod) -> Option<SandboxNonce> {
    sandbox_nonce_meta(&pod.metadata)
}

fn sandbox_nonce_meta(m: &ObjectMeta) -> Option<SandboxNonce> {
    m.annotations
        .as_ref()
        .and_then(|a| a.get(annotation::SANDBOX_NONCE))
        .and_then(|n| SandboxNonce::parse(n).ok())
}

/// The bearer token of session `sid` on `pod` under `key`, when the pod was made for exactly
/// that: its nonce is well formed and its `token-sha256` commits to the token derived from
/// it. `None` means the pod was made under another key, by an older version, or for another
/// session, and must be replaced rather than talked to.
pub fn session_token_of(pod: &Pod, sid: &SessionId, key: &HmacKey) -> Option<Token> {
    session_token_of_meta(&pod.metadata, sid, key)
}

/// [`session_token_of`] of a pod's metadata alone (a cache that keeps no more of a pod).
pub fn session_token_of_meta(m: &ObjectMeta, sid: &SessionId, key: &HmacKey) -> Option<Token> {
    let nonce = sandbox_nonce_meta(m)?;
    let token = key.session_token(sid, &nonce);
    let committed = m
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotation::TOKEN_SHA256))?;
    (Commitment::parse(committed).ok()? == token.commitment()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::pod::plain_env;
    use super::*;
    use crate::names::label;
    use crate::token::HmacKey;
    use k8s_openapi::api::core::v1::{EnvVarSource, ObjectFieldSelector};

    fn cfg() -> SandboxConfig {
        SandboxConfig::new(
            InstanceName::parse("demo").expect("valid"),
            "ns1",
            "quay.io/x/cli-mcp-sandbox:1",
        )
    }

    fn key() -> HmacKey {
        HmacKey::from_bytes([7; 32])
    }

    fn nonce() -> SandboxNonce {
        SandboxNonce::from_bytes([9; crate::token::NONCE_LEN])
    }

    fn session_pod(cfg: &SandboxConfig) -> Pod {
        let sid = SessionId::parse("s1").expect("valid");
        build_sandbox_pod(
            cfg,
            &SandboxRole::session(&key(), sid, nonce(), Some("ownerhash".into())),
            "2026-11-30T00:00:00Z",
        )
    }

    fn env_of(pod: &Pod) -> Vec<EnvVar> {
        pod.spec.as_ref().expect("spec").containers[0]
            .env
            .clone()
            .expect("env")
    }

    fn env_value(pod: &Pod, name: &str) -> Option<String> {
        env_of(pod)
            .into_iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value)
    }

    #[test]
    fn session_pod_has_spec_labels_and_annotations() {
        let pod = session_pod(&cfg());
        let m = &pod.metadata;
        let labels = m.labels.as_ref().expect("labels");
        assert_eq!(labels[label::INSTANCE], "demo");
        assert_eq!(labels[label::COMPONENT], "sandbox");
        assert_eq!(labels[label::SESSION_ID], "s1");
        assert_eq!(labels[label::LAUNCH], "cold");
        let ann = m.annotations.as_ref().expect("annotations");
        let sid = SessionId::parse("s1").expect("valid");
        let token = key().session_token(&sid, &nonce());
        let commitment = token.commitment().to_hex();
        assert_eq!(ann[annotation::TOKEN_SHA256], commitment);
        assert_eq!(ann[annotation::SANDBOX_NONCE], nonce().to_hex());
        assert_eq!(session_token_of(&pod, &sid, &key()), Some(token));
        assert_eq!(ann[annotation::LAST_ACTIVITY], "2026-11-30T00:00:00Z");
        assert_eq!(ann[annotation::OWNER], "ownerhash");
        assert_eq!(ann[annotation::SANDBOX_HASH], cfg().hash());
        assert_eq!(env_value(&pod, ENV_TOKEN_SHA256), Some(commitment));
        assert_eq!(env_value(&pod, ENV_ASSIGN_SHA256), None);
        assert!(
            !made_for_key(&pod, &key()),
            "a session pod takes no /assign"
        );
        assert!(m
            .name
            .as_deref()
            .expect("name")
            .starts_with("cli-mcp-demo-s-s1-"));
    }

    #[test]
    fn a_session_pod_opens_only_with_the_token_of_its_own_nonce_key_and_session() {
        let sid = SessionId::parse("s1").expect("valid");
        let pod = session_pod(&cfg());
        assert!(session_token_of(&pod, &sid, &key()).is_some());
        let other_sid = SessionId::parse("s2").expect("valid");
        assert_eq!(
            session_token_of(&pod, &other_sid, &key()),
            None,
            "another session"
        );
        assert_eq!(
            session_token_of(&pod, &sid, &HmacKey::from_bytes([8; 32])),
            None,
            "another key"
        );
        let set = |ann: &str, value: Option<&str>| {
            let mut p = pod.clone();
            let a = p.metadata.annotations.get_or_insert_with(Default::default);
            match value {
                Some(v) => a.insert(ann.to_owned(), v.to_owned()),
                None => a.remove(ann),
            };
            p
        };
        for (what, p) in [
            (
                "no nonce (an older version's pod)",
                set(annotation::SANDBOX_NONCE, None),
            ),
            (
                "malformed nonce",
                set(annotation::SANDBOX_NONCE, Some("xyz")),
            ),
            (
                "another sandbox's nonce",
                set(annotation::SANDBOX_NONCE, Some(&"07".repeat(16))),
            ),
            ("no commitment", set(annotation::TOKEN_SHA256, None)),
        ] {
            assert_eq!(session_token_of(&p, &sid, &key()), None, "{what}");
        }
    }

    #[test]
    fn the_uid_is_fixed_unless_the_platform_assigns_it() {
        let ids = |cfg: &SandboxConfig| {
            let sc = session_pod(cfg)
                .spec
                .expect("spec")
                .security_context
                .expect("pod security context");
            assert_eq!(sc.run_as_non_root, Some(true));
            (sc.run_as_user, sc.run_as_group, sc.fs_group)
        };
        let fixed = Some(SANDBOX_UID);
        assert_eq!(ids(&cfg()), (fixed, fixed, fixed));
        let openshift = SandboxConfig {
            platform_assigns_uid: true,
            ..cfg()
        };
        assert_eq!(ids(&openshift), (None, None, None));
        // Only a platform that assigns UIDs changes the hash (existing pools stay).
        assert_ne!(openshift.hash(), cfg().hash());
        assert!(!serde_json::to_string(&cfg())
            .expect("json")
            .contains("platformAssignsUid"));
    }

    #[test]
    fn pool_pod_waits_for_assign_and_has_no_session() {
        let suffix = PoolSuffix::from_random_bytes([1; 10]);
        let name = cfg().instance.pool_pod(&suffix);
        let assign = key().assign_token(&name).commitment();
        let pod = build_sandbox_pod(
            &cfg(),
            &SandboxRole::Pool {
                suffix,
                assign: assign.clone(),
            },
            "t",
        );
        assert_eq!(pod.metadata.name.as_deref(), Some(name.as_str()));
        let labels = pod.metadata.labels.as_ref().expect("labels");
        assert!(!labels.contains_key(label::SESSION_ID));
        assert!(!labels.contains_key(label::LAUNCH));
        let ann = pod.metadata.annotations.as_ref().expect("annotations");
        assert!(!ann.contains_key(annotation::TOKEN_SHA256));
        assert!(!ann.contains_key(annotation::LAST_ACTIVITY));
        assert_eq!(env_value(&pod, ENV_ASSIGN_SHA256), Some(assign.to_hex()));
        assert!(made_for_key(&pod, &key()));
        assert!(!made_for_key(&pod, &HmacKey::from_bytes([9; 32])));
        assert_eq!(env_value(&pod, ENV_TOKEN_SHA256), None);
    }

    #[test]
    fn pod_is_locked_down() {
        let pod = session_pod(&cfg());
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("cli-mcp-demo-sandbox")
        );
        let psc = spec
            .security_context
            .as_ref()
            .expect("pod security context");
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(
            psc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
            Some("RuntimeDefault")
        );
        let sc = spec.containers[0]
            .security_context
            .as_ref()
            .expect("container security context");
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(
            sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
            Some(vec!["ALL".to_string()])
        );
        let ws = spec
            .volumes
            .as_ref()
            .expect("volumes")
            .iter()
            .find(|v| v.name == "workspace")
            .expect("workspace volume");
        assert_eq!(
            ws.empty_dir.as_ref().and_then(|e| e.size_limit.clone()),
            Some(Quantity("1Gi".into()))
        );
        let probe = spec.containers[0]
            .readiness_probe
            .as_ref()
            .expect("readiness");
        assert_eq!(
            probe.http_get.as_ref().and_then(|h| h.path.as_deref()),
            Some("/healthz")
        );
    }

    #[test]
    fn a_proxied_sandbox_gets_the_dummy_kubeconfig_and_proxy_env_and_no_secret() {
        let mut c = cfg();
        c.proxy = Some(SandboxProxy {
            url: "http://cli-mcp-demo-proxy.ns1.svc:8080".into(),
            config_map: "cli-mcp-demo-proxy".into(),
            kubeconfig: true,
        });
        c.env = vec![
            plain_env("KUBECONFIG", "/evil"),
            plain_env("TOKEN_SHA256", "0"),
            plain_env("HTTPS_PROXY", "http://evil:1"),
            plain_env("no_proxy", "*"),
            plain_env("SSL_CERT_FILE", "/evil"),
            plain_env("FOO", "bar"),
        ];
        let pod = session_pod(&c);
        let env = env_of(&pod);
        let one = |name: &str| {
            let found: Vec<_> = env.iter().filter(|e| e.name == name).collect();
            assert_eq!(found.len(), 1, "{name}: {found:?}");
            found[0].value.clone().unwrap_or_default()
        };
        assert_eq!(one("KUBECONFIG"), "/etc/cli-mcp/proxy-client/kubeconfig");
        // Clients go through the agent's relay; the agent alone dials the proxy.
        for n in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
            assert_eq!(one(n), "http://127.0.0.1:3128");
        }
        assert_eq!(one(ENV_RELAY_LISTEN), "127.0.0.1:3128");
        assert_eq!(one(ENV_RELAY_UPSTREAM), "cli-mcp-demo-proxy.ns1.svc:8080");
        assert_eq!(
            one(ENV_RELAY_TOKEN_FILE),
            "/var/run/secrets/cli-mcp/proxy/token"
        );
        assert_eq!(one("NO_PROXY"), SANDBOX_NO_PROXY);
        assert_eq!(one("no_proxy"), SANDBOX_NO_PROXY);
        assert_eq!(one("SSL_CERT_FILE"), "/etc/cli-mcp/proxy-client/ca.crt");
        assert_eq!(env.iter().filter(|e| e.name == "TOKEN_SHA256").count(), 1);
        assert_eq!(env_value(&pod, "FOO").as_deref(), Some("bar"));
        let spec = pod.spec.as_ref().expect("spec");
        let volumes = spec.volumes.as_ref().expect("volumes");
        assert!(
            volumes.iter().all(|v| v.secret.is_none()),
            "a sandbox mounts no Secret: {volumes:?}"
        );
        // The one projected volume: a token for this instance's proxy alone, bound to the pod.
        let projected: Vec<_> = volumes
            .iter()
            .filter_map(|v| v.projected.as_ref())
            .collect();
        assert_eq!(projected.len(), 1, "{volumes:?}");
        let sources = projected[0].sources.as_deref().unwrap_or_default();
        assert_eq!(sources.len(), 1);
        let token = sources[0]
            .service_account_token
            .as_ref()
            .expect("a SA token");
        assert_eq!(token.audience.as_deref(), Some("cli-mcp-proxy:ns1:demo"));
        assert_eq!(token.expiration_seconds, Some(600));
        assert!(sources[0].secret.is_none() && sources[0].config_map.is_none());
        let cm = volumes
            .iter()
            .find_map(|v| v.config_map.as_ref())
            .expect("proxy ConfigMap volume");
        assert_eq!(cm.name, "cli-mcp-demo-proxy");
        let keys: Vec<_> = cm.items.iter().flatten().map(|i| i.key.as_str()).collect();
        assert_eq!(
            keys,
            ["ca.crt", "kubeconfig"],
            "only the client half is mounted"
        );

        // Without a kubernetes target: the proxy, but no KUBECONFIG.
        c.proxy = c.proxy.map(|p| SandboxProxy {
            kubeconfig: false,
            ..p
        });
        let pod = session_pod(&c);
        assert!(env_of(&pod).iter().all(|e| e.name != "KUBECONFIG"));
        // A config made without an instance (the server's local backend): no KUBECONFIG,
        // and the proxy variables are the config's own.
        c.proxy = None;
        let pod = session_pod(&c);
        assert!(env_of(&pod).iter().all(|e| e.name != "KUBECONFIG"));
        assert_eq!(
            env_value(&pod, "HTTPS_PROXY").as_deref(),
            Some("http://evil:1")
        );
    }

    #[test]
    fn env_that_could_subvert_bash_or_leak_secrets_is_dropped() {
        let mut c = cfg();
        c.env = vec![
            plain_env("CLI_MCP_AGENT_OUTPUT_BUDGET", "10000000000"),
            plain_env("BASH_FUNC_builtin%%", "() { :; }"),
            plain_env("BASH_ENV", "/tmp/x"),
            EnvVar {
                name: "DB_PASSWORD".into(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(k8s_openapi::api::core::v1::SecretKeySelector {
                        name: "db".into(),
                        key: "password".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
            plain_env("KEEP", "1"),
        ];
        let pod = session_pod(&c);
        let names: Vec<String> = env_of(&pod).into_iter().map(|e| e.name).collect();
        for dropped in [
            "CLI_MCP_AGENT_OUTPUT_BUDGET",
            "BASH_FUNC_builtin%%",
            "BASH_ENV",
            "DB_PASSWORD",
        ] {
            assert!(
                !names.iter().any(|n| n == dropped),
                "{dropped} must be dropped: {names:?}"
            );
        }
        assert!(names.iter().any(|n| n == "KEEP"));
    }

    #[test]
    fn the_agent_keeps_the_instances_output_budget() {
        let args = |c: &SandboxConfig| {
            let suffix = PoolSuffix::from_random_bytes([1; 10]);
            let assign = key()
                .assign_token(&c.instance.pool_pod(&suffix))
                .commitment();
            let pod = build_sandbox_pod(c, &SandboxRole::Pool { suffix, assign }, "t");
            pod.spec
                .and_then(|s| s.containers.into_iter().next())
                .and_then(|c| c.args)
        };
        let default = cfg();
        assert_eq!(
            args(&default).expect("args"),
            [
                "--listen",
                "0.0.0.0:8090",
                "--max-processes",
                "512",
                "--nproc-rlimit",
                "false"
            ],
            "the default budget adds nothing"
        );
        let mut big = cfg();
        big.output_budget = Some(1 << 20);
        assert_eq!(
            args(&big).expect("args"),
            [
                "--listen",
                "0.0.0.0:8090",
                "--max-processes",
                "512",
                "--nproc-rlimit",
                "false",
                "--output-budget",
                "1048576"
            ]
        );
        assert_ne!(
            default.hash(),
            big.hash(),
            "warm pods of the old budget are replaced"
        );
    }

    fn placement() -> Placement {
        serde_json::from_value(serde_json::json!({
            "runtimeClassName": "gvisor",
            "nodeSelector": {"kubernetes.io/arch": "amd64"},
            "tolerations": [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "pool", "operator": "In", "values": ["sandboxes"]}]}]}}},
            "priorityClassName": "sandbox-low",
            "imagePullSecrets": [{"name": "regcred"}]
        }))
        .expect("placement")
    }

    #[test]
    fn placement_lands_in_pool_and_session_pods_alike() {
        let mut c = cfg();
        c.placement = placement();
        let suffix = PoolSuffix::from_random_bytes([1; 10]);
        let assign = key()
            .assign_token(&c.instance.pool_pod(&suffix))
            .commitment();
        let pool = build_sandbox_pod(&c, &SandboxRole::Pool { suffix, assign }, "t");
        for pod in [pool, session_pod(&c)] {
            let spec = pod.spec.expect("spec");
            assert_eq!(spec.runtime_class_name.as_deref(), Some("gvisor"));
            assert_eq!(
                spec.node_selector.expect("nodeSelector")["kubernetes.io/arch"],
                "amd64"
            );
            let t = spec.tolerations.expect("tolerations");
            assert_eq!(t.len(), 1);
            assert_eq!(t[0].key.as_deref(), Some("sandbox"));
            assert_eq!(spec.affinity, c.placement.affinity);
            assert_eq!(spec.priority_class_name.as_deref(), Some("sandbox-low"));
            assert_eq!(
                spec.image_pull_secrets.expect("imagePullSecrets")[0].name,
                "regcred"
            );
            // Placement never loosens the lockdown.
            assert_eq!(spec.automount_service_account_token, Some(false));
        }

        // Nothing set: none of the fields appear, so the cluster's defaults apply.
        let spec = session_pod(&cfg()).spec.expect("spec");
        assert_eq!(spec.runtime_class_name, None);
        assert_eq!(spec.node_selector, None);
        assert_eq!(spec.tolerations, None);
        assert_eq!(spec.affinity, None);
        assert_eq!(spec.priority_class_name, None);
        assert_eq!(spec.image_pull_secrets, None);
    }

    #[test]
    fn an_unset_placement_keeps_the_hash_and_each_field_changes_it() {
        // Configs written before placement existed carry no such key; one that sets
        // nothing must serialise (and hash) exactly like them, or an upgrade would
        // recycle every warm pool.
        let json = serde_json::to_value(cfg()).expect("json");
        assert!(json.get("placement").is_none(), "{json}");
        let old: SandboxConfig = serde_json::from_value(json).expect("old config reads");
        assert_eq!(old.hash(), cfg().hash());

        let full = placement();
        let base = cfg().hash();
        let mut seen = std::collections::BTreeSet::from([base.clone()]);
        let one = |f: &dyn Fn(&mut Placement)| {
            let mut c = cfg();
            f(&mut c.placement);
            assert!(!c.placement.is_empty());
            c.hash()
        };
        let variants: [&dyn Fn(&mut Placement); 6] = [
            &|p| p.runtime_class_name = full.runtime_class_name.clone(),
            &|p| p.node_selector = full.node_selector.clone(),
            &|p| p.tolerations = full.tolerations.clone(),
            &|p| p.affinity = full.affinity.clone(),
            &|p| p.priority_class_name = full.priority_class_name.clone(),
            &|p| p.image_pull_secrets = full.image_pull_secrets.clone(),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert!(seen.insert(one(*v)), "field {i} must change the hash");
        }
        // The config travels to the server as JSON: the placement survives the trip.
        let mut c = cfg();
        c.placement = full;
        let back: SandboxConfig =
            serde_json::from_str(&serde_json::to_string(&c).expect("json")).expect("parse");
        assert_eq!(back, c);
        assert_eq!(back.hash(), c.hash());
    }

    #[test]
    fn hash_changes_with_config_and_is_stable() {
        let a = cfg();
        assert_eq!(a.hash(), cfg().hash());
        assert_eq!(a.hash().len(), 16);
        let mut b = cfg();
        b.image = "other:2".into();
        assert_ne!(a.hash(), b.hash());
    }

    /// Every path in `v` (a pod as JSON) that refers to a Secret: a Secret volume, a
    /// projected Secret source, `valueFrom.secretKeyRef`, `envFrom[].secretRef`.
    fn secret_refs(v: &serde_json::Value, path: &str, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    let p = format!("{path}.{k}");
                    if matches!(k.as_str(), "secret" | "secretKeyRef" | "secretRef") {
                        out.push(p.clone());
                    }
                    secret_refs(v, &p, out);
                }
            }
            serde_json::Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    secret_refs(v, &format!("{path}[{i}]"), out);
                }
            }
            _ => {}
        }
    }

    fn arb_env() -> impl proptest::strategy::Strategy<Value = EnvVar> {
        use k8s_openapi::api::core::v1::{ConfigMapKeySelector, SecretKeySelector};
        use proptest::prelude::*;
        let name = prop::sample::select(vec![
            "FOO",
            "KUBECONFIG",
            "HTTPS_PROXY",
            "DB_PASSWORD",
            "SSL_CERT_FILE",
            "CLI_MCP_AGENT_X",
        ]);
        (name, 0..4u8).prop_map(|(name, kind)| EnvVar {
            name: name.into(),
            value: (kind == 0).then(|| "v".into()),
            value_from: match kind {
                1 => Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: "admin-kubeconfig".into(),
                        key: "kubeconfig".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                2 => Some(EnvVarSource {
                    config_map_key_ref: Some(ConfigMapKeySelector {
                        name: "cm".into(),
                        key: "k".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                3 => Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        field_path: "metadata.name".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                _ => None,
            },
        })
    }

    proptest::proptest! {
        /// Whatever the config (proxy with or without a kubeconfig, none, env from Secrets,
        /// placement with pull Secrets, any role), a sandbox pod refers to no Secret: no
        /// Secret volume, no projected Secret, no env or envFrom from a Secret.
        #[test]
        fn no_sandbox_config_yields_a_secret_in_the_pod(
            proxy in proptest::option::of(proptest::bool::ANY),
            env in proptest::collection::vec(arb_env(), 0..6),
            placed in proptest::bool::ANY,
            platform in proptest::bool::ANY,
            budget in proptest::option::of(1024usize..1 << 24),
            pool in proptest::bool::ANY,
        ) {
            let mut c = cfg();
            c.proxy = proxy.map(|kubeconfig| SandboxProxy {
                url: "http://cli-mcp-demo-proxy.ns1.svc:8080".into(),
                config_map: "cli-mcp-demo-proxy".into(),
                kubeconfig,
            });
            c.env = env;
            if placed {
                c.placement = placement();
            }
            c.platform_assigns_uid = platform;
            c.output_budget = budget;
            let pod = if pool {
                let suffix = PoolSuffix::from_random_bytes([1; 10]);
                let assign = key().assign_token(&c.instance.pool_pod(&suffix)).commitment();
                build_sandbox_pod(&c, &SandboxRole::Pool { suffix, assign }, "t")
            } else {
                session_pod(&c)
            };
            let spec = pod.spec.as_ref().expect("spec");
            for v in spec.volumes.iter().flatten() {
                proptest::prop_assert!(v.secret.is_none(), "Secret volume {v:?}");
                let projected = v.projected.iter().flat_map(|p| p.sources.iter().flatten());
                for src in projected {
                    proptest::prop_assert!(src.secret.is_none(), "projected Secret {v:?}");
                }
            }
            let containers = spec.containers.iter().chain(spec.init_containers.iter().flatten());
            for ct in containers {
                for e in ct.env.iter().flatten() {
                    let from_secret = e.value_from.as_ref().is_some_and(|f| f.secret_key_ref.is_some());
                    proptest::prop_assert!(!from_secret, "env from a Secret {e:?}");
                }
                for e in ct.env_from.iter().flatten() {
                    proptest::prop_assert!(e.secret_ref.is_none(), "envFrom a Secret {e:?}");
                }
            }
            // And nothing else in the pod names a Secret (a field added later included).
            let json = serde_json::to_value(&pod).expect("json");
            let mut refs = Vec::new();
            secret_refs(&json, "pod", &mut refs);
            proptest::prop_assert!(refs.is_empty(), "refers to a Secret: {refs:?}");
        }
    }
}
