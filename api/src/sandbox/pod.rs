//! Building the sandbox pod from a [`SandboxConfig`] and a [`SandboxRole`]: its name, labels
//! and annotations by role, the agent's environment with the volumes and mounts that go with
//! it, the agent container, and the pod spec around it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, ContainerPort, DownwardAPIVolumeFile,
    DownwardAPIVolumeSource, EnvVar, EnvVarSource, HTTPGetAction, KeyToPath, ObjectFieldSelector,
    Pod, PodSpec, Probe, ProjectedVolumeSource, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{
    allowed_sandbox_env, is_proxy_env, limits, SandboxConfig, SandboxProxy, SandboxRole,
    CONTAINER_NAME, ENV_ASSIGN_SHA256, ENV_RELAY_LISTEN, ENV_RELAY_TOKEN_FILE, ENV_RELAY_UPSTREAM,
    ENV_TOKEN_SHA256, KUBECONFIG_KEY, PODINFO_DIR, PROXY_CA_ENV, PROXY_CA_KEY, PROXY_CLIENT_DIR,
    SANDBOX_NO_PROXY, SANDBOX_UID, WORKSPACE_DIR,
};
use crate::names::{annotation, label, InstanceName};
use crate::proxy::{
    sandbox_token_audience, RELAY_LISTEN, SANDBOX_TOKEN_DIR, SANDBOX_TOKEN_EXPIRATION_SECONDS,
    SANDBOX_TOKEN_KEY, SANDBOX_TOKEN_VOLUME,
};
use crate::wire::AGENT_PORT;

/// Builds the sandbox pod for `role`. `now` is the RFC 3339 creation time stamped into the
/// `created-at` (and, for sessions, `last-activity`) annotations.
pub fn build_sandbox_pod(cfg: &SandboxConfig, role: &SandboxRole, now: &str) -> Pod {
    let identity = Identity::of(cfg, role, now);
    let mut files = AgentFiles::new(cfg, identity.auth_env);
    if let Some(proxy) = &cfg.proxy {
        files.use_proxy(cfg, proxy);
    }
    files.add_instance_env(cfg);
    let agent = agent_container(cfg, files.env, files.mounts);
    let mut spec = PodSpec {
        containers: vec![agent],
        volumes: Some(files.volumes),
        service_account_name: Some(cfg.instance.sandbox()),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        restart_policy: Some("Always".into()),
        termination_grace_period_seconds: Some(cfg.termination_grace_period_seconds),
        security_context: Some(crate::pod_security::restricted_pod(
            (!cfg.platform_assigns_uid).then_some(SANDBOX_UID),
        )),
        ..Default::default()
    };
    cfg.placement.apply_to(&mut spec);
    Pod {
        metadata: ObjectMeta {
            name: Some(identity.name),
            namespace: Some(cfg.namespace.clone()),
            labels: Some(identity.labels),
            annotations: Some(identity.annotations),
            owner_references: cfg.owner.clone().map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(spec),
        ..Default::default()
    }
}

/// What a pod's role decides: its name, labels and annotations, and the variable the agent
/// checks the assign or session token against.
struct Identity {
    name: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    auth_env: EnvVar,
}

impl Identity {
    fn of(cfg: &SandboxConfig, role: &SandboxRole, now: &str) -> Self {
        let n = &cfg.instance;
        let mut labels = sandbox_labels(n);
        let mut annotations = BTreeMap::from([
            (annotation::CREATED_AT.to_owned(), now.to_owned()),
            (annotation::SANDBOX_HASH.to_owned(), cfg.hash()),
        ]);
        let (name, auth_env) = match role {
            SandboxRole::Pool { suffix, assign } => (
                n.pool_pod(suffix),
                plain_env(ENV_ASSIGN_SHA256, &assign.to_hex()),
            ),
            SandboxRole::Session {
                sid,
                nonce,
                token,
                owner,
            } => {
                labels.insert(label::SESSION_ID.to_owned(), sid.to_string());
                labels.insert(label::LAUNCH.to_owned(), label::LAUNCH_COLD.to_owned());
                annotations.insert(annotation::LAST_ACTIVITY.to_owned(), now.to_owned());
                annotations.insert(annotation::TOKEN_SHA256.to_owned(), token.to_hex());
                annotations.insert(annotation::SANDBOX_NONCE.to_owned(), nonce.to_hex());
                if let Some(owner) = owner {
                    annotations.insert(annotation::OWNER.to_owned(), owner.clone());
                }
                (
                    n.session_pod(sid),
                    plain_env(ENV_TOKEN_SHA256, &token.to_hex()),
                )
            }
        };
        Identity {
            name,
            labels,
            annotations,
            auth_env,
        }
    }
}

/// The labels every sandbox pod of instance `n` carries, whatever its role.
fn sandbox_labels(n: &InstanceName) -> BTreeMap<String, String> {
    BTreeMap::from([
        (label::INSTANCE.to_owned(), n.to_string()),
        (
            label::COMPONENT.to_owned(),
            label::COMPONENT_SANDBOX.to_owned(),
        ),
        (label::APP_NAME.to_owned(), "cli-mcp-sandbox".to_owned()),
        (label::APP_INSTANCE.to_owned(), n.to_string()),
        (
            label::APP_COMPONENT.to_owned(),
            label::COMPONENT_SANDBOX.to_owned(),
        ),
        (label::APP_PART_OF.to_owned(), label::PART_OF.to_owned()),
        (
            label::APP_MANAGED_BY.to_owned(),
            label::MANAGED_BY.to_owned(),
        ),
    ])
}

/// The agent container's environment, the pod's volumes and the container's mounts of them,
/// built up together: the proxy adds to all three. Their order is the pod's, so it stays
/// the same for the same config.
struct AgentFiles {
    env: Vec<EnvVar>,
    volumes: Vec<Volume>,
    mounts: Vec<VolumeMount>,
}

impl AgentFiles {
    /// The token variable, home, the pod's own name and namespace, the scratch volumes
    /// (workspace, `/tmp`) and the pod's annotations as a file.
    fn new(cfg: &SandboxConfig, auth_env: EnvVar) -> Self {
        let env = vec![
            auth_env,
            plain_env("HOME", WORKSPACE_DIR),
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
        ];
        let [workspace, tmp] = limits::scratch_volumes(cfg);
        let volumes = vec![workspace, tmp, podinfo_volume()];
        let mounts = vec![
            mount("workspace", WORKSPACE_DIR),
            mount("tmp", "/tmp"),
            VolumeMount {
                read_only: Some(true),
                ..mount("podinfo", PODINFO_DIR)
            },
        ];
        AgentFiles {
            env,
            volumes,
            mounts,
        }
    }

    /// Points every client at the credential proxy: the dummy kubeconfig (with a kubernetes
    /// target), the proxy variables, and the proxy CA for the TLS clients, from the proxy's
    /// ConfigMap.
    fn use_proxy(&mut self, cfg: &SandboxConfig, proxy: &SandboxProxy) {
        self.use_relay(cfg, proxy);
        let mut items = vec![key_to_path(PROXY_CA_KEY)];
        if proxy.kubeconfig {
            self.env.push(plain_env(
                "KUBECONFIG",
                &format!("{PROXY_CLIENT_DIR}/{KUBECONFIG_KEY}"),
            ));
            items.push(key_to_path(KUBECONFIG_KEY));
        }
        // The clients reach the proxy through the agent's relay, which adds the pod's proof
        // of identity to each CONNECT.
        let relay = format!("http://{RELAY_LISTEN}");
        for name in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
            self.env.push(plain_env(name, &relay));
        }
        for name in ["NO_PROXY", "no_proxy"] {
            self.env.push(plain_env(name, SANDBOX_NO_PROXY));
        }
        for name in PROXY_CA_ENV {
            self.env.push(plain_env(
                name,
                &format!("{PROXY_CLIENT_DIR}/{PROXY_CA_KEY}"),
            ));
        }
        self.volumes.push(Volume {
            name: "proxy-client".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: proxy.config_map.clone(),
                items: Some(items),
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        });
        self.mounts.push(VolumeMount {
            read_only: Some(true),
            ..mount("proxy-client", PROXY_CLIENT_DIR)
        });
    }

    /// The agent's relay to the proxy, and the projected ServiceAccount token it proves the
    /// pod with: audience this instance's proxy alone, the shortest lifetime, bound to the
    /// pod (a TokenReview fails once the pod is gone).
    fn use_relay(&mut self, cfg: &SandboxConfig, proxy: &SandboxProxy) {
        let upstream = proxy
            .url
            .trim_start_matches("http://")
            .trim_end_matches('/');
        self.env.extend([
            plain_env(ENV_RELAY_LISTEN, RELAY_LISTEN),
            plain_env(ENV_RELAY_UPSTREAM, upstream),
            plain_env(
                ENV_RELAY_TOKEN_FILE,
                &format!("{SANDBOX_TOKEN_DIR}/{SANDBOX_TOKEN_KEY}"),
            ),
        ]);
        self.volumes.push(Volume {
            name: SANDBOX_TOKEN_VOLUME.into(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        audience: Some(sandbox_token_audience(
                            &cfg.namespace,
                            cfg.instance.as_str(),
                        )),
                        expiration_seconds: Some(SANDBOX_TOKEN_EXPIRATION_SECONDS),
                        path: SANDBOX_TOKEN_KEY.into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        });
        self.mounts.push(VolumeMount {
            read_only: Some(true),
            ..mount(SANDBOX_TOKEN_VOLUME, SANDBOX_TOKEN_DIR)
        });
    }

    /// The instance's own variables, after ours, without the reserved ones.
    fn add_instance_env(&mut self, cfg: &SandboxConfig) {
        // With a proxy, its variables are ours: an instance's env cannot route around it.
        let proxied = cfg.proxy.is_some();
        self.env.extend(
            cfg.env
                .iter()
                .filter(|e| allowed_sandbox_env(e) && !(proxied && is_proxy_env(&e.name)))
                .cloned(),
        );
    }
}

/// The downward-API volume with the pod's annotations, which the agent reads its
/// assignment from.
fn podinfo_volume() -> Volume {
    Volume {
        name: "podinfo".into(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(vec![DownwardAPIVolumeFile {
                path: "annotations".into(),
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.annotations".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The agent container, with this environment and these mounts.
fn agent_container(cfg: &SandboxConfig, env: Vec<EnvVar>, mounts: Vec<VolumeMount>) -> Container {
    Container {
        name: CONTAINER_NAME.into(),
        image: Some(cfg.image.clone()),
        image_pull_policy: cfg.image_pull_policy.clone(),
        args: Some(agent_args(cfg)),
        ports: Some(vec![ContainerPort {
            name: Some("agent".into()),
            container_port: i32::from(AGENT_PORT),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        env: Some(env),
        resources: Some(limits::container_resources(cfg)),
        volume_mounts: Some(mounts),
        working_dir: Some(WORKSPACE_DIR.into()),
        readiness_probe: Some(healthz_probe(1, 1)),
        liveness_probe: Some(healthz_probe(10, 2)),
        security_context: Some(crate::pod_security::restricted_container()),
        termination_message_path: Some(limits::TERMINATION_MESSAGE_PATH.into()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    }
}

/// A probe of the agent's `/healthz` every `period` seconds, failing after three misses.
fn healthz_probe(period: i32, timeout: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/healthz".into()),
            port: IntOrString::Int(i32::from(AGENT_PORT)),
            ..Default::default()
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(timeout),
        failure_threshold: Some(3),
        ..Default::default()
    }
}

/// The agent's command line in a sandbox pod.
fn agent_args(cfg: &SandboxConfig) -> Vec<String> {
    let mut args = vec!["--listen".into(), format!("0.0.0.0:{AGENT_PORT}")];
    args.extend(limits::agent_process_args());
    if let Some(budget) = cfg.output_budget {
        args.extend(["--output-budget".into(), budget.to_string()]);
    }
    args
}

pub(super) fn plain_env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn key_to_path(key: &str) -> KeyToPath {
    KeyToPath {
        key: key.into(),
        path: key.into(),
        mode: None,
        user: None,
    }
}

fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        ..Default::default()
    }
}
