//! The one reconcile entry: [`reconcile`] runs the finalizer helper, which calls
//! [`apply_instance`] for live instances and [`crate::teardown::cleanup`] for deleted ones.
//!
//! `apply_instance` order: generate-once Secrets → resolve inputs → apply children (SSA) →
//! warm pool → idle GC → status (written only when it changed) → requeue at the soonest
//! deadline (idle expiry, pool backoff) or the resync period.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::finalizer::{finalizer, Event as FinalizerEvent};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};

use cli_mcp_api::crd::{AuthMode, CliMcpInstance, CliMcpInstanceStatus};
use cli_mcp_api::names::{label, FIELD_MANAGER, FINALIZER};
use cli_mcp_api::sandbox::KUBECONFIG_KEY;
use cli_mcp_api::token::HmacKey;

use crate::apply::apply_noting;
use crate::children::{deployment, networkpolicy, rbac, secrets, service, ApiServerPeers, Inputs};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::pool::{self, is_status};
use crate::status::{self, DeploymentState, Observed};
use crate::{idle, teardown};

/// How long the API server addresses are cached.
const API_PEERS_TTL: Duration = Duration::from_secs(300);
/// Re-check period while a required Secret is missing (its watch usually wakes us first).
const MISSING_SECRET_RECHECK: Duration = Duration::from_secs(60);

pub async fn reconcile(cr: Arc<CliMcpInstance>, ctx: Arc<Context>) -> Result<Action> {
    let start = Instant::now();
    let ns = cr
        .namespace()
        .ok_or_else(|| Error::NoNamespace(cr.name_any()))?;
    let api: Api<CliMcpInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let result = finalizer(&api, FINALIZER, cr, |event| async {
        match event {
            FinalizerEvent::Apply(cr) => apply_instance(cr, &ctx).await,
            FinalizerEvent::Cleanup(cr) => teardown::cleanup(cr, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    let label = match &result {
        Ok(_) => "ok",
        Err(e) => e.metric_label(),
    };
    ctx.metrics.reconciled(label, start.elapsed());
    result
}

pub fn error_policy(cr: Arc<CliMcpInstance>, err: &Error, _ctx: Arc<Context>) -> Action {
    if err.is_waiting() {
        tracing::debug!(instance = %cr.name_any(), "{err}");
        return Action::requeue(Duration::from_secs(2));
    }
    tracing::warn!(
        namespace = %cr.namespace().unwrap_or_default(),
        instance = %cr.name_any(),
        error = %err,
        "reconcile failed; retrying in 10s"
    );
    Action::requeue(Duration::from_secs(10))
}

/// A required Secret that is missing or unusable.
enum Problem {
    Missing(String),
    Invalid(String),
}

struct KeyState {
    key: Option<HmacKey>,
    version: String,
    problem: Option<Problem>,
}

#[derive(Default)]
struct TlsState {
    version: Option<String>,
    problem: Option<Problem>,
    ca_config_map: Option<String>,
    ca_pem: Option<String>,
}

fn cached<K>(store: &Store<K>, ns: &str, name: &str) -> Option<Arc<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    store.get(&ObjectRef::new(name).within(ns))
}

async fn publish(ctx: &Context, cr: &CliMcpInstance, type_: EventType, reason: &str, note: String) {
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &cr.object_ref(&())).await {
        tracing::debug!("publishing event {reason}: {e}");
    }
}

/// Reads a Secret from the managed-Secret cache, falling back to the API.
async fn read_secret(ctx: &Context, ns: &str, name: &str) -> Result<Option<Secret>> {
    if let Some(s) = cached(&ctx.stores.secrets, ns, name) {
        return Ok(Some((*s).clone()));
    }
    Ok(Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await?)
}

/// Creates `secret` unless it exists; never overwrites. Returns the stored Secret.
async fn create_once(ctx: &Context, ns: &str, secret: &Secret) -> Result<(Secret, bool)> {
    let api = Api::<Secret>::namespaced(ctx.client.clone(), ns);
    match api.create(&PostParams::default(), secret).await {
        Ok(s) => {
            ctx.metrics.api_write("Secret", "create");
            Ok((s, true))
        }
        Err(e) if is_status(&e, 409) => {
            let name = secret.name_any();
            let s = api.get(&name).await?;
            Ok((s, false))
        }
        Err(e) => Err(e.into()),
    }
}

async fn ensure_hmac(ctx: &Context, cr: &CliMcpInstance, inp: &Inputs) -> Result<KeyState> {
    let name = inp.name.hmac_secret();
    let secret = match read_secret(ctx, &inp.namespace, &name).await? {
        Some(s) => s,
        None => {
            let meta = inp.meta(name.clone(), label::COMPONENT_SERVER);
            let (s, created) = create_once(
                ctx,
                &inp.namespace,
                &secrets::hmac_secret(meta, &secrets::generate_hmac_key()),
            )
            .await?;
            if created {
                publish(
                    ctx,
                    cr,
                    EventType::Normal,
                    "HmacKeyGenerated",
                    format!("generated a new HMAC key in Secret {name}; the server rolls and warm sandboxes are replaced"),
                )
                .await;
            }
            s
        }
    };
    let raw = secrets::secret_value(&secret, secrets::HMAC_KEY);
    let version = secrets::version_of(&[raw.unwrap_or_default()]);
    let parsed = raw
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .map(|t| HmacKey::from_hex(&t));
    Ok(match parsed {
        Some(Ok(key)) => KeyState { key: Some(key), version, problem: None },
        Some(Err(e)) => KeyState {
            key: None,
            version,
            problem: Some(Problem::Invalid(format!(
                "Secret {name} key '{}': {e}",
                secrets::HMAC_KEY
            ))),
        },
        None => KeyState {
            key: None,
            version,
            problem: Some(Problem::Invalid(format!(
                "Secret {name} has no key '{}'; delete the Secret and the operator generates a new one",
                secrets::HMAC_KEY
            ))),
        },
    })
}

fn tls_keys_problem(name: &str, s: &Secret) -> Option<Problem> {
    let missing: Vec<&str> = [secrets::TLS_CRT, secrets::TLS_KEY]
        .into_iter()
        .filter(|k| secrets::secret_value(s, k).is_none())
        .collect();
    (!missing.is_empty())
        .then(|| Problem::Invalid(format!("Secret {name} lacks {}", missing.join(" and "))))
}

fn tls_version(s: &Secret) -> String {
    secrets::version_of(&[
        secrets::secret_value(s, secrets::TLS_CRT).unwrap_or_default(),
        secrets::secret_value(s, secrets::TLS_KEY).unwrap_or_default(),
    ])
}

async fn ensure_tls(ctx: &Context, cr: &CliMcpInstance, inp: &Inputs) -> Result<TlsState> {
    if inp.auth == AuthMode::None {
        return Ok(TlsState::default());
    }
    let name = inp.tls_secret.clone();
    if cr.spec.server.tls_secret_name.is_some() {
        // Admin-provided: only checked, never written.
        let secret = Api::<Secret>::namespaced(ctx.client.clone(), &inp.namespace)
            .get_opt(&name)
            .await?;
        return Ok(match secret {
            None => TlsState {
                problem: Some(Problem::Missing(format!(
                    "{name} (spec.server.tlsSecretName)"
                ))),
                ..Default::default()
            },
            Some(s) => TlsState {
                version: Some(tls_version(&s)),
                problem: tls_keys_problem(&name, &s),
                ..Default::default()
            },
        });
    }
    let secret = match read_secret(ctx, &inp.namespace, &name).await? {
        Some(s) => s,
        None => {
            let m = secrets::generate_tls(&inp.name.server(), &inp.namespace)?;
            let meta = inp.meta(name.clone(), label::COMPONENT_SERVER);
            let (s, created) =
                create_once(ctx, &inp.namespace, &secrets::tls_secret(meta, &m)).await?;
            if created {
                publish(
                    ctx,
                    cr,
                    EventType::Normal,
                    "CertificateGenerated",
                    format!(
                        "generated a CA and a serving certificate into Secret {name}; the CA is in ConfigMap {}",
                        secrets::ca_config_map_name(&inp.name)
                    ),
                )
                .await;
            }
            s
        }
    };
    let ca_pem = secrets::secret_value(&secret, secrets::CA_CRT)
        .map(|b| String::from_utf8_lossy(b).into_owned());
    Ok(TlsState {
        version: Some(tls_version(&secret)),
        problem: tls_keys_problem(&name, &secret),
        ca_config_map: ca_pem
            .as_ref()
            .map(|_| secrets::ca_config_map_name(&inp.name)),
        ca_pem,
    })
}

async fn check_kubeconfig(ctx: &Context, cr: &CliMcpInstance, ns: &str) -> Result<Option<Problem>> {
    let name = cr.kubeconfig_secret()?;
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .get_opt(&name)
        .await?;
    Ok(match secret {
        None => Some(Problem::Missing(format!(
            "{name} (the sandbox kubeconfig, key '{KUBECONFIG_KEY}'; see config/samples)"
        ))),
        Some(s) if secrets::secret_value(&s, KUBECONFIG_KEY).is_none() => Some(Problem::Invalid(
            format!("Secret {name} has no key '{KUBECONFIG_KEY}'"),
        )),
        Some(_) => None,
    })
}

/// The API server's addresses as pods see them: `default/kubernetes` Service IP and its
/// EndpointSlice addresses. Cached; a lookup failure (e.g. RBAC) yields what was found.
pub async fn api_server_peers(ctx: &Context) -> ApiServerPeers {
    if let Ok(guard) = ctx.api_peers.lock() {
        if let Some((at, peers)) = guard.as_ref() {
            if at.elapsed() < API_PEERS_TTL {
                return peers.clone();
            }
        }
    }
    let mut peers = ApiServerPeers::default();
    match Api::<Service>::namespaced(ctx.client.clone(), "default")
        .get_opt("kubernetes")
        .await
    {
        Ok(Some(svc)) => {
            if let Some(spec) = svc.spec {
                peers.ips.extend(spec.cluster_ip.filter(|ip| ip != "None"));
                peers
                    .ports
                    .extend(spec.ports.into_iter().flatten().map(|p| p.port));
            }
        }
        Ok(None) => {}
        Err(e) => tracing::debug!("reading Service default/kubernetes: {e}"),
    }
    let lp = ListParams::default().labels("kubernetes.io/service-name=kubernetes");
    match Api::<EndpointSlice>::namespaced(ctx.client.clone(), "default")
        .list(&lp)
        .await
    {
        Ok(list) => {
            for slice in list.items {
                for ep in slice.endpoints.into_iter().flatten() {
                    peers.ips.extend(ep.addresses);
                }
                peers
                    .ports
                    .extend(slice.ports.into_iter().flatten().filter_map(|p| p.port));
            }
        }
        Err(e) => tracing::debug!("listing EndpointSlices of default/kubernetes: {e}"),
    }
    peers.ips.sort();
    peers.ips.dedup();
    peers.ports.sort_unstable();
    peers.ports.dedup();
    if let Ok(mut guard) = ctx.api_peers.lock() {
        *guard = Some((Instant::now(), peers.clone()));
    }
    peers
}

/// Applies every SSA-managed child; returns the first error (the others are still tried).
async fn apply_children(ctx: &Context, inp: &Inputs, tls: &TlsState) -> Option<String> {
    let s = &ctx.stores;
    let (c, ns) = (&ctx.client, inp.namespace.as_str());
    let mut errors: Vec<String> = Vec::new();
    let e = &mut errors;
    let sa = rbac::server_service_account(inp);
    apply_noting(
        ctx,
        &Api::namespaced(c.clone(), ns),
        &s.service_accounts,
        &sa,
        e,
    )
    .await;
    let sa = rbac::sandbox_service_account(inp);
    apply_noting(
        ctx,
        &Api::namespaced(c.clone(), ns),
        &s.service_accounts,
        &sa,
        e,
    )
    .await;
    apply_noting(
        ctx,
        &Api::namespaced(c.clone(), ns),
        &s.roles,
        &rbac::server_role(inp),
        e,
    )
    .await;
    let rb = rbac::server_role_binding(inp);
    apply_noting(
        ctx,
        &Api::namespaced(c.clone(), ns),
        &s.role_bindings,
        &rb,
        e,
    )
    .await;
    let crb = rbac::auth_delegator_binding(inp);
    let cluster = Api::all(c.clone());
    apply_noting(ctx, &cluster, &s.cluster_role_bindings, &crb, e).await;
    apply_noting(
        ctx,
        &Api::namespaced(c.clone(), ns),
        &s.services,
        &service::service(inp),
        e,
    )
    .await;
    let np = networkpolicy::network_policy(inp);
    apply_noting(
        ctx,
        &Api::namespaced(c.clone(), ns),
        &s.network_policies,
        &np,
        e,
    )
    .await;
    if let (Some(name), Some(pem)) = (&tls.ca_config_map, &tls.ca_pem) {
        let meta: ObjectMeta = inp.meta(name.clone(), label::COMPONENT_SERVER);
        let cm = secrets::ca_config_map(meta, pem);
        apply_noting(ctx, &Api::namespaced(c.clone(), ns), &s.config_maps, &cm, e).await;
    }
    let deploy = deployment::deployment(inp);
    apply_noting(
        ctx,
        &Api::namespaced(c.clone(), ns),
        &s.deployments,
        &deploy,
        e,
    )
    .await;
    errors.into_iter().next()
}

fn deployment_state(d: &Deployment) -> DeploymentState {
    let st = d.status.clone().unwrap_or_default();
    let current = st.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0);
    let conds = st.conditions.unwrap_or_default();
    let available = conds
        .iter()
        .any(|c| c.type_.as_deref() == Some("Available") && c.status.as_deref() == Some("True"));
    let message = conds
        .iter()
        .find(|c| c.status.as_deref() == Some("False"))
        .and_then(|c| c.message.clone())
        .unwrap_or_default();
    DeploymentState {
        replicas: st.replicas.unwrap_or(0),
        ready: st.ready_replicas.unwrap_or(0),
        available: current && available && st.ready_replicas.unwrap_or(0) >= 1,
        message,
    }
}

fn sorted(s: &CliMcpInstanceStatus) -> CliMcpInstanceStatus {
    let mut s = s.clone();
    s.conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
    s
}

fn now_time() -> Time {
    let now = k8s_openapi::jiff::Timestamp::now();
    Time(now.round(k8s_openapi::jiff::Unit::Second).unwrap_or(now))
}

async fn write_status(ctx: &Context, cr: &CliMcpInstance, obs: &Observed) -> Result<()> {
    let prev = cr.status.as_ref();
    let next = status::compute(prev, obs, now_time());
    if prev.map(sorted) == Some(sorted(&next)) {
        return Ok(());
    }
    let ns = cr.namespace().unwrap_or_default();
    let api: Api<CliMcpInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = serde_json::json!({
        "apiVersion": CliMcpInstance::api_version(&()),
        "kind": CliMcpInstance::kind(&()),
        "status": next,
    });
    api.patch_status(
        &cr.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    ctx.metrics.api_write("CliMcpInstance", "apply-status");
    for t in status::transitions(prev, &next) {
        let type_ = if t.healthy {
            EventType::Normal
        } else {
            EventType::Warning
        };
        publish(
            ctx,
            cr,
            type_,
            &t.reason,
            format!("{} is {}: {}", t.type_, t.status, t.message),
        )
        .await;
    }
    Ok(())
}

/// Reconciles a live instance.
pub async fn apply_instance(cr: Arc<CliMcpInstance>, ctx: &Context) -> Result<Action> {
    let ns = cr
        .namespace()
        .ok_or_else(|| Error::NoNamespace(cr.name_any()))?;
    let peers = api_server_peers(ctx).await;
    let inp = Inputs::from_cr(
        &cr,
        &ctx.config.server_image,
        ctx.config.sandbox_image.as_deref(),
        String::new(),
        None,
        peers,
    );
    let mut inp = match inp {
        Ok(i) => i,
        Err(e) => {
            // Only objects that bypassed admission (or a missing default image) land here.
            let obs = Observed {
                generation: cr.meta().generation,
                spec_error: Some(e.to_string()),
                ..Default::default()
            };
            write_status(ctx, &cr, &obs).await?;
            return Ok(Action::requeue(ctx.config.resync));
        }
    };
    let key = ensure_hmac(ctx, &cr, &inp).await?;
    inp.hmac_version = key.version.clone();
    let tls = ensure_tls(ctx, &cr, &inp).await?;
    inp.tls_version = tls.version.clone();
    let kubeconfig = check_kubeconfig(ctx, &cr, &ns).await?;

    let apply_error = apply_children(ctx, &inp, &tls).await;

    let mut missing = Vec::new();
    let mut invalid = Vec::new();
    for p in [key.problem, tls.problem, kubeconfig].into_iter().flatten() {
        match p {
            Problem::Missing(m) => missing.push(m),
            Problem::Invalid(m) => invalid.push(m),
        }
    }
    let blocked = if !missing.is_empty() {
        Some(format!("missing Secrets: {}", missing.join(", ")))
    } else if !invalid.is_empty() {
        Some(invalid.join("; "))
    } else {
        None
    };

    let uid = cr.uid().unwrap_or_default();
    let pool = pool::reconcile(
        ctx,
        &uid,
        &inp.sandbox,
        cr.spec.sandbox.warm_pool_size,
        key.key.as_ref(),
        blocked,
    )
    .await?;

    let pods = pool::instance_pods(&ctx.stores.pods.state(), &ns, &inp.name);
    let idle_timeout = cr.spec.sandbox.idle_timeout()?;
    let idle = idle::collect(ctx, &pods, &ns, idle_timeout, key.key.as_ref()).await?;

    let obs = Observed {
        generation: cr.meta().generation,
        spec_error: None,
        missing_secrets: missing,
        invalid_secrets: invalid,
        apply_error: apply_error.clone(),
        deployment: cached(&ctx.stores.deployments, &ns, &inp.name.server())
            .map(|d| deployment_state(&d)),
        pool: pool.clone(),
        active_sessions: idle.active,
        image: Some(inp.sandbox.image.clone()),
        endpoint: Some(inp.endpoint()),
        ca_config_map: tls.ca_config_map.clone(),
        selector: Some(inp.name.server_selector()),
    };
    write_status(ctx, &cr, &obs).await?;

    let mut next = ctx.config.resync;
    let mut consider = |d: Option<Duration>| {
        if let Some(d) = d {
            next = next.min(d);
        }
    };
    consider(pool.requeue);
    // A little slack so the expiry has passed when we look again.
    consider(idle.next_expiry.map(|d| d + Duration::from_millis(500)));
    if !obs.missing_secrets.is_empty() || !obs.invalid_secrets.is_empty() {
        consider(Some(MISSING_SECRET_RECHECK));
    }
    if apply_error.is_some() {
        consider(Some(Duration::from_secs(10)));
    }
    Ok(Action::requeue(next))
}
