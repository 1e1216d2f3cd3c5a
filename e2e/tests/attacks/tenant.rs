//! A tenant of the instance's namespace: a ServiceAccount allowed only to create, get, list
//! and delete pods there (no Secrets, no workloads), acting with a token of its own, as a
//! person with that Role would. Before: it read the investigation token and the HMAC key
//! through a pod, got the next session of someone else into a pod it planted, and ran a
//! privileged hostPath pod beside the instance.

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{
    EnvVar, EnvVarSource, HostPathVolumeSource, Pod, ProjectedVolumeSource, SecretKeySelector,
    SecretProjection, SecretVolumeSource, SecurityContext, ServiceAccount, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::config::{AuthInfo, KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use super::{remove_pod, run_pod, sleeper, Outcome, Target};

const TENANT: &str = "attack-tenant";

pub async fn run(t: &Target) -> Vec<Outcome> {
    let tenant = tenant_client(t).await;
    // Positive control: the tenant's token works, and it may create a plain pod.
    run_pod(&tenant, &t.ns, &sleeper("tenant-plain", &t.image, &[])).await;
    remove_pod(&tenant, &t.ns, "tenant-plain").await;
    let mut out = mount_secrets(t, &tenant).await;
    out.push(plant_a_warm_pod(t, &tenant).await);
    out.push(privileged_pod(t, &tenant).await);
    out
}

/// The tenant's ServiceAccount, Role and RoleBinding, and a client with a token of its own.
async fn tenant_client(t: &Target) -> Client {
    let ns = &t.ns;
    let meta = || ObjectMeta {
        name: Some(TENANT.into()),
        ..Default::default()
    };
    let pp = PostParams::default();
    let sa = ServiceAccount {
        metadata: meta(),
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(t.admin.clone(), ns)
        .create(&pp, &sa)
        .await
        .expect("the tenant's ServiceAccount");
    let role = Role {
        metadata: meta(),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".into()]),
            verbs: ["create", "get", "list", "watch", "delete"]
                .map(String::from)
                .to_vec(),
            ..Default::default()
        }]),
    };
    Api::<Role>::namespaced(t.admin.clone(), ns)
        .create(&pp, &role)
        .await
        .expect("the tenant's Role");
    let binding = RoleBinding {
        metadata: meta(),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: TENANT.into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: TENANT.into(),
            namespace: Some(ns.clone()),
            ..Default::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(t.admin.clone(), ns)
        .create(&pp, &binding)
        .await
        .expect("the tenant's RoleBinding");
    let token = Api::<ServiceAccount>::namespaced(t.admin.clone(), ns)
        .create_token_request(TENANT, &pp, &TokenRequest::default())
        .await
        .expect("a token for the tenant")
        .status
        .and_then(|s| s.token)
        .expect("a token in the TokenRequest's status");
    let kc = Kubeconfig::read_from(&t.info.kubeconfig).expect("kubeconfig");
    let mut cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("client config");
    cfg.auth_info = AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    };
    Client::try_from(cfg).expect("the tenant's client")
}

/// Creates `pod` as the tenant and returns the API's refusal; panics (after removing it)
/// when the pod was admitted.
async fn refused(t: &Target, tenant: &Client, pod: &Pod, what: &str) -> String {
    let api = Api::<Pod>::namespaced(tenant.clone(), &t.ns);
    match api.create(&PostParams::default(), pod).await {
        Ok(p) => {
            let name = p.metadata.name.unwrap_or_default();
            remove_pod(&t.admin, &t.ns, &name).await;
            panic!("the tenant got {what} admitted (pod {name})");
        }
        Err(kube::Error::Api(s)) => s.message,
        Err(e) => panic!("{what}: not an API refusal: {e}"),
    }
}

fn with_volume(mut pod: Pod, volume: Volume) -> Pod {
    if let Some(spec) = pod.spec.as_mut() {
        spec.containers[0].volume_mounts = Some(vec![VolumeMount {
            name: volume.name.clone(),
            mount_path: "/stolen".into(),
            read_only: Some(true),
            ..Default::default()
        }]);
        spec.volumes = Some(vec![volume]);
    }
    pod
}

async fn mount_secrets(t: &Target, tenant: &Client) -> Vec<Outcome> {
    let kubeconfig = format!("cli-mcp-{}-kubeconfig", t.instance);
    let hmac = format!("cli-mcp-{}-hmac", t.instance);
    let base = || sleeper("tenant-thief", &t.image, &[]);
    let secret_volume = with_volume(
        base(),
        Volume {
            name: "stolen".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(kubeconfig.clone()),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let projected = with_volume(
        base(),
        Volume {
            name: "stolen".into(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![VolumeProjection {
                    secret: Some(SecretProjection {
                        name: hmac.clone(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let mut env = base();
    if let Some(spec) = env.spec.as_mut() {
        spec.containers[0].env = Some(vec![EnvVar {
            name: "KEY".into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: hmac.clone(),
                    key: "key".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]);
    }
    let mut out = Vec::new();
    for (attack, pod, secret) in [
        (
            "tenant mounts the instance's kubeconfig Secret into a pod",
            secret_volume,
            &kubeconfig,
        ),
        (
            "tenant projects the instance's HMAC Secret into a pod",
            projected,
            &hmac,
        ),
        (
            "tenant takes the HMAC key into a pod's environment",
            env,
            &hmac,
        ),
    ] {
        let why = refused(t, tenant, &pod, attack).await;
        assert!(
            why.contains(secret.as_str()),
            "{attack}: refused, but not for the Secret: {why}"
        );
        out.push(Outcome::new(attack, format!("admission: {why}")));
    }
    out
}

/// The tenant deletes a warm pod at once and creates its namesake with the same labels,
/// annotations and spec, plus a marker; then someone's new session must not see the marker.
async fn plant_a_warm_pod(t: &Target, tenant: &Client) -> Outcome {
    let attack = "tenant replaces a warm pod with its own namesake";
    let pods = Api::<Pod>::namespaced(tenant.clone(), &t.ns);
    let selector = format!(
        "cli-mcp.redhat.com/instance={},cli-mcp.redhat.com/component=sandbox,\
         !cli-mcp.redhat.com/session-id",
        t.instance
    );
    let warm = pods
        .list(&ListParams::default().labels(&selector))
        .await
        .expect("the tenant lists the warm pods")
        .items
        .into_iter()
        .next()
        .expect("a warm pod to replace");
    let name = warm.metadata.name.clone().unwrap_or_default();
    pods.delete(&name, &DeleteParams::default().grace_period(0))
        .await
        .expect("the tenant may delete pods");
    let mut plant = Pod {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: warm.metadata.labels.clone(),
            annotations: warm.metadata.annotations.clone(),
            ..Default::default()
        },
        spec: warm.spec.clone(),
        status: None,
    };
    if let Some(spec) = plant.spec.as_mut() {
        spec.node_name = None;
        let env = spec.containers[0].env.get_or_insert_with(Vec::new);
        env.push(EnvVar {
            name: "PLANTED".into(),
            value: Some("by-the-tenant".into()),
            ..Default::default()
        });
    }
    // The deleted pod may linger a moment (its name is taken until the kubelet confirms):
    // a refusal must come from admission, not from the name.
    let mut why = String::new();
    for _ in 0..200 {
        why = refused(t, tenant, &plant, attack).await;
        if !why.contains("already exists") && !why.contains("being deleted") {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(
        !why.contains("already exists"),
        "{attack}: refused only because the name was taken: {why}"
    );
    let victim = t.bash("attack-victim", "echo \"[${PLANTED:-}]\"").await;
    assert_eq!(
        victim.stdout, "[]\n",
        "a new session ran in a planted pod: {}",
        victim.text
    );
    t.end("attack-victim").await;
    Outcome::new(
        attack,
        format!("admission: {why}; the next new session got a pod of the operator's"),
    )
}

async fn privileged_pod(t: &Target, tenant: &Client) -> Outcome {
    let attack = "tenant runs a privileged, hostPID, hostPath:/ pod in the namespace";
    let mut pod = with_volume(
        sleeper("tenant-root", &t.image, &[]),
        Volume {
            name: "host".into(),
            host_path: Some(HostPathVolumeSource {
                path: "/".into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    if let Some(spec) = pod.spec.as_mut() {
        spec.host_pid = Some(true);
        spec.security_context = None;
        spec.containers[0].security_context = Some(SecurityContext {
            privileged: Some(true),
            run_as_user: Some(0),
            ..Default::default()
        });
    }
    let why = refused(t, tenant, &pod, attack).await;
    assert!(
        why.contains("PodSecurity"),
        "{attack}: refused, but not by Pod Security: {why}"
    );
    Outcome::new(attack, format!("Pod Security restricted: {why}"))
}
