//! The MCP server Deployment. The server never reads the CR: every setting is rendered here
//! as a flag (or env var), so the Deployment spec is the whole server configuration.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, EnvVar, HTTPGetAction, KeyToPath, PodSpec,
    PodTemplateSpec, Probe, SecretVolumeSource, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use cli_mcp_api::activity::stamp_gap;
use cli_mcp_api::crd::AuthMode;
use cli_mcp_api::names::label;
use cli_mcp_api::pod_security;

use super::{
    Inputs, HEALTH_PORT, HMAC_DIR, HMAC_VERSION_ANNOTATION, RUNTIME_CLASS_MISSING_ANNOTATION,
    TLS_DIR, TLS_VERSION_ANNOTATION,
};

pub const CONTAINER: &str = "server";
/// Env var carrying the serde JSON of the `SandboxConfig` (the `--sandbox-config` flag).
pub const SANDBOX_CONFIG_ENV: &str = "CLI_MCP_SANDBOX_CONFIG";
/// Env var carrying `spec.server.instructions` (the `--instructions` flag): an env var
/// rather than an argument, because the text is free-form and may span lines.
pub const INSTRUCTIONS_ENV: &str = "CLI_MCP_INSTRUCTIONS";

/// Env var carrying the generated sandbox briefing (the `--briefing` flag; see
/// `crate::briefing`), for the same reason.
pub const BRIEFING_ENV: &str = "CLI_MCP_BRIEFING";

/// The server container's environment.
fn server_env(inp: &Inputs) -> Vec<EnvVar> {
    let var = |name: &str, value: String| EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    };
    // Serialising a SandboxConfig cannot fail (plain data, string map keys).
    let sandbox_json = serde_json::to_string(&inp.spec.sandbox).unwrap_or_default();
    let mut env = vec![
        var(SANDBOX_CONFIG_ENV, sandbox_json),
        var("RUST_LOG", "info".into()),
    ];
    if let Some(text) = &inp.spec.server_instructions {
        env.push(var(INSTRUCTIONS_ENV, text.clone()));
    }
    if let Some(text) = &inp.briefing {
        env.push(var(BRIEFING_ENV, text.clone()));
    }
    env
}

/// The server's command line, rendered from the spec.
pub fn server_args(inp: &Inputs) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut flag = |k: &str, v: String| {
        a.push(k.to_owned());
        a.push(v);
    };
    flag("--listen", format!("0.0.0.0:{}", inp.spec.mcp_port()));
    flag("--health-listen", format!("0.0.0.0:{HEALTH_PORT}"));
    flag("--transport", "http".into());
    flag("--backend", "kubernetes".into());
    flag("--auth", inp.spec.auth.flag().into());
    if inp.spec.auth == AuthMode::Kubernetes {
        flag("--tls-cert", format!("{TLS_DIR}/tls.crt"));
        flag("--tls-key", format!("{TLS_DIR}/tls.key"));
    }
    flag("--instance", inp.spec.name.to_string());
    flag("--namespace", inp.spec.namespace.clone());
    flag("--hmac-key-file", format!("{HMAC_DIR}/key"));
    flag("--max-sessions", inp.spec.max_sessions.to_string());
    if let Some(n) = inp.spec.max_sessions_per_client {
        flag("--max-sessions-per-client", n.to_string());
    }
    if let Some(n) = inp.spec.new_sessions_per_minute_per_client {
        flag("--new-sessions-per-minute-per-client", n.to_string());
    }
    flag(
        "--default-timeout",
        inp.spec.default_timeout_secs.to_string(),
    );
    flag("--max-timeout", inp.spec.max_timeout_secs.to_string());
    flag("--output-budget", inp.spec.output_budget.to_string());
    // The idle GC (idle.rs) waits the same gap past idleTimeout.
    flag(
        "--activity-stamp-gap",
        stamp_gap(inp.spec.idle_timeout).as_secs().to_string(),
    );
    // One flag per value: the server also splits values on commas, which admission keeps
    // out of these lists.
    for o in &inp.spec.allowed_origins {
        flag("--allowed-origin", o.clone());
    }
    if let Some(a) = &inp.spec.authorization {
        for s in &a.servers {
            flag("--authorization-server", s.clone());
        }
        for aud in &a.audiences {
            flag("--token-audience", aud.clone());
        }
        for s in &a.scopes {
            flag("--scope", s.clone());
        }
    }
    if inp.spec.auth == AuthMode::Kubernetes {
        if let Some(url) = inp.spec.resource_url() {
            flag("--resource-url", url);
        }
    }
    a.push("--log-json".into());
    a
}

/// Volume items mounting each key under its own name (and nothing else of the source).
pub(super) fn key_items(keys: &[&str]) -> Option<Vec<KeyToPath>> {
    Some(
        keys.iter()
            .map(|k| KeyToPath {
                key: (*k).into(),
                path: (*k).into(),
                ..Default::default()
            })
            .collect(),
    )
}

pub(super) fn container_port(name: &str, port: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: port,
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

pub(super) fn secret_volume(name: &str, secret: &str, keys: &[&str]) -> Volume {
    Volume {
        name: name.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.into()),
            default_mode: Some(0o440),
            items: key_items(keys),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub(super) fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(read_only),
        ..Default::default()
    }
}

pub(super) fn http_probe(path: &str, period: i32, failure: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String("health".into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(2),
        failure_threshold: Some(failure),
        ..Default::default()
    }
}

/// The server Deployment.
pub fn deployment(inp: &Inputs) -> Deployment {
    let mut volumes = vec![
        secret_volume("hmac", &inp.spec.name.hmac_secret(), &["key"]),
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        },
    ];
    let mut mounts = vec![mount("hmac", HMAC_DIR, true), mount("tmp", "/tmp", false)];
    let mut annotations =
        BTreeMap::from([(HMAC_VERSION_ANNOTATION.to_owned(), inp.hmac_version.clone())]);
    if inp.spec.auth == AuthMode::Kubernetes {
        volumes.push(secret_volume(
            "tls",
            &inp.spec.tls_secret,
            &["tls.crt", "tls.key"],
        ));
        mounts.push(mount("tls", TLS_DIR, true));
        if let Some(v) = &inp.tls_version {
            annotations.insert(TLS_VERSION_ANNOTATION.to_owned(), v.clone());
        }
    }
    let mcp_port_name = match inp.spec.auth {
        AuthMode::Kubernetes => "https",
        AuthMode::None => "http",
    };
    let container = Container {
        name: CONTAINER.into(),
        image: Some(inp.spec.server_image.clone()),
        image_pull_policy: inp.spec.server_pull_policy.clone(),
        args: Some(server_args(inp)),
        env: Some(server_env(inp)),
        ports: Some(vec![
            container_port(mcp_port_name, inp.spec.mcp_port()),
            container_port("health", HEALTH_PORT),
        ]),
        liveness_probe: Some(http_probe("/livez", 10, 3)),
        readiness_probe: Some(http_probe("/readyz", 2, 3)),
        resources: Some(inp.spec.server_resources.clone()),
        volume_mounts: Some(mounts),
        security_context: Some(pod_security::restricted_container()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };
    let mut pod = PodSpec {
        service_account_name: Some(inp.spec.name.server()),
        automount_service_account_token: Some(true),
        containers: vec![container],
        volumes: Some(volumes),
        ..Default::default()
    };
    inp.spec.server_placement.apply_to(&mut pod);
    rolling_deployment(
        inp,
        inp.spec.name.server(),
        label::COMPONENT_SERVER,
        inp.spec.replicas,
        annotations,
        pod,
    )
}

/// What the instance's Deployments (server and proxy) share: `replicas` pods of
/// `component` under the instance's labels, rolled one new pod at a time with none
/// unavailable, `annotations` on the template (the hashes that roll it, and the pods'
/// RuntimeClass while the cluster lacks it), a restricted pod without service links; `pod`
/// says the rest.
pub(super) fn rolling_deployment(
    inp: &Inputs,
    name: String,
    component: &str,
    replicas: i32,
    mut annotations: BTreeMap<String, String>,
    pod: PodSpec,
) -> Deployment {
    // Its pods are refused while the class is missing; the annotation's going away when the
    // class appears is what starts them without waiting out the ReplicaSet's backoff. None
    // of the running pods is touched meanwhile: a new ReplicaSet is only surged to.
    if let Some(class) = pod
        .runtime_class_name
        .as_ref()
        .filter(|c| inp.missing_runtime_classes.contains(*c))
    {
        annotations.insert(RUNTIME_CLASS_MISSING_ANNOTATION.to_owned(), class.clone());
    }
    Deployment {
        metadata: inp.spec.meta(name, component),
        spec: DeploymentSpec {
            replicas: Some(replicas),
            revision_history_limit: Some(3),
            selector: LabelSelector {
                match_labels: Some(inp.spec.selector(component)),
                ..Default::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(inp.spec.labels(component)),
                    annotations: Some(annotations),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    enable_service_links: Some(false),
                    termination_grace_period_seconds: Some(30),
                    security_context: Some(pod_security::restricted_pod(None)),
                    ..pod
                }),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::test_support::inputs;

    fn arg(args: &[String], flag: &str) -> Option<String> {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    }

    fn env_value(inp: &Inputs, name: &str) -> Option<String> {
        server_env(inp)
            .into_iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value)
    }

    #[test]
    fn instructions_reach_the_server_as_they_are_written() {
        let text = "kubectl (context `prod-ro`), jq.\nRead only: never apply.";
        let inp = inputs(serde_json::json!({"server": {"instructions": text}}));
        assert_eq!(env_value(&inp, INSTRUCTIONS_ENV).as_deref(), Some(text));
        let d = deployment(&inp);
        let env = d
            .spec
            .template
            .spec
            .and_then(|p| p.containers.into_iter().next())
            .and_then(|c| c.env)
            .unwrap_or_default();
        assert!(env.iter().any(|e| e.name == INSTRUCTIONS_ENV));
        let without = inputs(serde_json::json!({}));
        assert_eq!(env_value(&without, INSTRUCTIONS_ENV), None);
        assert!(env_value(&without, SANDBOX_CONFIG_ENV).is_some());
    }

    /// The briefing travels like the admin's text, in its own variable (the server's
    /// `--briefing`); a new briefing is a new pod template, so the server rolls to it.
    #[test]
    fn the_briefing_reaches_the_server_and_a_new_one_rolls_it() {
        let mut inp = inputs(serde_json::json!({}));
        assert_eq!(env_value(&inp, BRIEFING_ENV), None);
        let template = |inp: &Inputs| serde_json::to_value(deployment(inp).spec.template).ok();
        let before = template(&inp);
        inp.briefing = Some("About this sandbox:\n- Tools: jq 1.6.".into());
        assert_eq!(
            env_value(&inp, BRIEFING_ENV).as_deref(),
            inp.briefing.as_deref()
        );
        assert_ne!(template(&inp), before);
    }

    #[test]
    fn flags_are_rendered_from_the_spec() {
        let inp = inputs(serde_json::json!({"sandbox": {"maxSessions": 7,
            "commandTimeout": {"default": "30s", "max": "2m"}}}));
        let a = server_args(&inp);
        assert_eq!(arg(&a, "--listen").as_deref(), Some("0.0.0.0:8443"));
        assert_eq!(arg(&a, "--health-listen").as_deref(), Some("0.0.0.0:8081"));
        assert_eq!(arg(&a, "--auth").as_deref(), Some("kubernetes"));
        assert_eq!(
            arg(&a, "--tls-cert").as_deref(),
            Some("/var/run/cli-mcp/tls/tls.crt")
        );
        assert_eq!(arg(&a, "--instance").as_deref(), Some("demo"));
        assert_eq!(arg(&a, "--namespace").as_deref(), Some("ns1"));
        assert_eq!(
            arg(&a, "--hmac-key-file").as_deref(),
            Some("/var/run/cli-mcp/hmac/key")
        );
        assert_eq!(arg(&a, "--max-sessions").as_deref(), Some("7"));
        assert_eq!(arg(&a, "--default-timeout").as_deref(), Some("30"));
        assert_eq!(arg(&a, "--max-timeout").as_deref(), Some("120"));
        assert!(a.contains(&"--log-json".to_string()));
        assert_eq!(
            arg(&a, "--activity-stamp-gap").as_deref(),
            Some("30"),
            "a sixtieth of the default idleTimeout (30m)"
        );
        let long = inputs(serde_json::json!({"sandbox": {"idleTimeout": "168h"}}));
        assert_eq!(
            arg(&server_args(&long), "--activity-stamp-gap").as_deref(),
            Some("60")
        );

        assert_eq!(
            arg(&a, "--max-sessions-per-client").as_deref(),
            Some("4"),
            "half of maxSessions (7) unless set: one identity cannot take every place"
        );
        assert_eq!(arg(&a, "--new-sessions-per-minute-per-client"), None);
        let quotas = inputs(serde_json::json!({"server": {"maxSessionsPerClient": 3,
            "newSessionsPerMinutePerClient": 12}}));
        let a = server_args(&quotas);
        assert_eq!(arg(&a, "--max-sessions-per-client").as_deref(), Some("3"));
        assert_eq!(
            arg(&a, "--new-sessions-per-minute-per-client").as_deref(),
            Some("12")
        );

        let none = inputs(serde_json::json!({"server": {"auth": "None"}}));
        let a = server_args(&none);
        assert_eq!(arg(&a, "--listen").as_deref(), Some("0.0.0.0:8080"));
        assert_eq!(arg(&a, "--auth").as_deref(), Some("none"));
        assert_eq!(arg(&a, "--tls-cert"), None);
    }

    fn all(args: &[String], flag: &str) -> Vec<String> {
        args.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].clone())
            .collect()
    }

    #[test]
    fn each_allowed_origin_is_its_own_flag() {
        let origins = [
            "https://app.example.com",
            "http://localhost:*",
            "http://[::1]:3000",
        ];
        let inp = inputs(serde_json::json!({"server": {"allowedOrigins": origins}}));
        let a = server_args(&inp);
        assert_eq!(all(&a, "--allowed-origin"), origins);
        let none = server_args(&inputs(serde_json::json!({})));
        assert!(
            all(&none, "--allowed-origin").is_empty(),
            "no origin unless listed: the server then lets no browser page in"
        );
    }

    #[test]
    fn authorization_is_rendered_as_the_servers_oauth_flags() {
        let inp = inputs(serde_json::json!({"server": {"authorization": {
            "servers": ["https://idp.example/realms/a", "https://idp2.example/"],
            "resourceUrl": "https://mcp.example.com/mcp",
            "audiences": ["cli-mcp"],
            "scopes": ["openid", "mcp:shell"]
        }}}));
        let a = server_args(&inp);
        assert_eq!(
            all(&a, "--authorization-server"),
            ["https://idp.example/realms/a", "https://idp2.example/"],
            "issuers as written (a trailing slash is part of the issuer)"
        );
        assert_eq!(all(&a, "--resource-url"), ["https://mcp.example.com/mcp"]);
        assert_eq!(all(&a, "--token-audience"), ["cli-mcp"]);
        assert_eq!(all(&a, "--scope"), ["openid", "mcp:shell"]);

        // No authorization, no expose: none of the OAuth flags.
        let a = server_args(&inputs(serde_json::json!({})));
        for f in [
            "--authorization-server",
            "--resource-url",
            "--token-audience",
            "--scope",
        ] {
            assert!(all(&a, f).is_empty(), "{f} in {a:?}");
        }
    }

    #[test]
    fn an_exposed_host_is_the_default_resource_url() {
        let exposed = serde_json::json!({"ingress": {"host": "mcp.example.com"}});
        let inp = inputs(serde_json::json!({"server": {
            "authorization": {"servers": ["https://idp.example"]},
            "expose": exposed
        }}));
        let a = server_args(&inp);
        assert_eq!(all(&a, "--resource-url"), ["https://mcp.example.com/mcp"]);
        // Without authorization too: the metadata's resource is right behind a proxy that
        // rewrites Host.
        let inp = inputs(serde_json::json!({"server": {"expose": exposed}}));
        assert_eq!(
            all(&server_args(&inp), "--resource-url"),
            ["https://mcp.example.com/mcp"]
        );
        // An explicit resourceUrl wins over the host.
        let inp = inputs(serde_json::json!({"server": {
            "authorization": {"servers": ["https://idp.example"], "resourceUrl": "https://gw.example/x/mcp"},
            "expose": {"httpRoute": {"host": "mcp.example.com", "parentRefs": [{"name": "gw"}]}}
        }}));
        assert_eq!(
            all(&server_args(&inp), "--resource-url"),
            ["https://gw.example/x/mcp"]
        );
    }

    fn pod_of(inp: &Inputs) -> PodSpec {
        deployment(inp).spec.template.spec.expect("pod spec")
    }

    #[test]
    fn server_pods_get_spec_servers_placement_and_sandboxes_get_spec_sandboxes() {
        let server = serde_json::json!({
            "runtimeClassName": "kata",
            "nodeSelector": {"node-role.example.com/infra": ""},
            "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}},
            "priorityClassName": "infra-high",
            "imagePullSecrets": [{"name": "server-pull"}]
        });
        let inp = inputs(serde_json::json!({
            "server": server,
            "sandbox": {"runtimeClassName": "gvisor", "imagePullSecrets": [{"name": "sandbox-pull"}]}
        }));
        let pod = pod_of(&inp);
        assert_eq!(pod.runtime_class_name.as_deref(), Some("kata"));
        assert_eq!(
            pod.node_selector
                .as_ref()
                .map(|m| m.contains_key("node-role.example.com/infra")),
            Some(true)
        );
        assert_eq!(pod.tolerations.as_ref().map(Vec::len), Some(1));
        assert!(pod
            .affinity
            .as_ref()
            .is_some_and(|a| a.pod_anti_affinity.is_some()));
        assert_eq!(pod.priority_class_name.as_deref(), Some("infra-high"));
        assert_eq!(
            pod.image_pull_secrets
                .iter()
                .flatten()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>(),
            ["server-pull"]
        );
        // The server's own settings are kept beside them.
        assert_eq!(pod.service_account_name.as_deref(), Some("cli-mcp-demo"));
        assert_eq!(pod.enable_service_links, Some(false));

        // The sandboxes' placement reaches the server (for its on-demand pods) in the
        // SandboxConfig it is given, not in its own pod.
        let env = pod.containers[0].env.clone().unwrap_or_default();
        let cfg: cli_mcp_api::sandbox::SandboxConfig = serde_json::from_str(
            env.iter()
                .find(|e| e.name == SANDBOX_CONFIG_ENV)
                .and_then(|e| e.value.as_deref())
                .expect("sandbox config"),
        )
        .expect("valid SandboxConfig JSON");
        assert_eq!(cfg.placement.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(cfg.placement.image_pull_secrets[0].name, "sandbox-pull");

        // Unset: the pod template is as before, so upgrading rolls no server.
        let plain = pod_of(&inputs(serde_json::json!({})));
        assert_eq!(plain.runtime_class_name, None);
        assert_eq!(plain.node_selector, None);
        assert_eq!(plain.tolerations, None);
        assert_eq!(plain.affinity, None);
        assert_eq!(plain.priority_class_name, None);
        assert_eq!(plain.image_pull_secrets, None);
    }

    #[test]
    fn a_placement_change_rolls_the_server() {
        let template = |spec: serde_json::Value| {
            serde_json::to_value(deployment(&inputs(spec)).spec.template).expect("json")
        };
        let base = template(serde_json::json!({}));
        for (part, field, value) in [
            ("server", "runtimeClassName", serde_json::json!("kata")),
            ("server", "priorityClassName", serde_json::json!("high")),
            ("server", "nodeSelector", serde_json::json!({"zone": "a"})),
            (
                "server",
                "tolerations",
                serde_json::json!([{"operator": "Exists"}]),
            ),
            (
                "server",
                "imagePullSecrets",
                serde_json::json!([{"name": "p"}]),
            ),
            // A sandbox placement changes the SandboxConfig the server builds pods from.
            ("sandbox", "runtimeClassName", serde_json::json!("gvisor")),
        ] {
            let changed = template(serde_json::json!({ part: { field: value } }));
            assert_ne!(changed, base, "{part}.{field} must change the pod template");
        }
    }

    /// While the cluster lacks the class the server and proxy pods name, their templates say
    /// so; once it exists the templates are as they always were (so the change that makes
    /// the pods at once is the annotation going, and a cluster that has the class never
    /// rolls for it).
    #[test]
    fn a_missing_runtime_class_marks_the_templates_that_name_it() {
        let spec = serde_json::json!({
            "server": {"runtimeClassName": "kata"},
            "proxy": {"runtimeClassName": "gvisor", "targets": [
                {"type": "kubernetes", "secretName": "admin-kc"}]},
        });
        let marks = |inp: &Inputs| {
            let d = super::super::build_all(inp);
            [Some(d.deployment), d.proxy.map(|p| p.deployment)].map(|d| {
                d.and_then(|d| d.spec.template.metadata)
                    .and_then(|m| m.annotations)
                    .and_then(|a| a.get(RUNTIME_CLASS_MISSING_ANNOTATION).cloned())
            })
        };
        let mut inp = inputs(spec.clone());
        assert_eq!(marks(&inp), [None, None]);
        inp.missing_runtime_classes = ["kata".to_owned()].into();
        assert_eq!(marks(&inp), [Some("kata".into()), None]);
        inp.missing_runtime_classes = ["kata".to_owned(), "gvisor".to_owned()].into();
        assert_eq!(marks(&inp), [Some("kata".into()), Some("gvisor".into())]);
        // A class no pod here names changes nothing.
        let mut plain = inputs(serde_json::json!({}));
        plain.missing_runtime_classes = ["kata".to_owned()].into();
        assert_eq!(marks(&plain), [None, None]);
    }

    #[test]
    fn deployment_is_locked_down_and_rolls_on_key_change() {
        let inp = inputs(serde_json::json!({"replicas": 3}));
        let d = deployment(&inp);
        let spec = &d.spec;
        assert_eq!(spec.replicas, Some(3));
        let tpl = &spec.template;
        let ann = tpl
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.clone())
            .expect("ann");
        assert_eq!(ann[HMAC_VERSION_ANNOTATION], "hv1");
        assert_eq!(ann[TLS_VERSION_ANNOTATION], "tv1");
        let pod = tpl.spec.as_ref().expect("pod");
        assert_eq!(pod.service_account_name.as_deref(), Some("cli-mcp-demo"));
        let c = &pod.containers[0];
        let sc = c.security_context.as_ref().expect("sc");
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(
            c.readiness_probe
                .as_ref()
                .and_then(|p| p.http_get.as_ref())
                .and_then(|h| h.path.clone()),
            Some("/readyz".into())
        );
        let env = c.env.as_ref().expect("env");
        let cfg: cli_mcp_api::sandbox::SandboxConfig = serde_json::from_str(
            env.iter()
                .find(|e| e.name == SANDBOX_CONFIG_ENV)
                .and_then(|e| e.value.as_deref())
                .expect("sandbox config"),
        )
        .expect("valid SandboxConfig JSON");
        assert_eq!(cfg, inp.spec.sandbox);
        assert_eq!(cfg.owner.as_ref().map(|o| o.uid.as_str()), Some("uid-1"));

        let mut other = inp.clone();
        other.hmac_version = "hv2".into();
        assert_ne!(
            serde_json::to_value(deployment(&other)).ok(),
            serde_json::to_value(d).ok()
        );
    }
}
