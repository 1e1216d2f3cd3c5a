//! The first step of a reconcile: everything the desired children depend on that is not in
//! the CR. The generate-once Secrets (HMAC key, and the CA + serving certificate unless the
//! admin gives one) are created here if absent — created, never applied, so an existing
//! Secret is never overwritten — the admin's Secrets are checked, and the API server's
//! addresses are looked up for the sandbox NetworkPolicy.

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ListParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Api, Resource, ResourceExt};

use cli_mcp_api::crd::{AuthMode, CliMcpInstance};
use cli_mcp_api::kubeconfig::{self, Kubeconfig};
use cli_mcp_api::names::label;
use cli_mcp_api::sandbox::KUBECONFIG_KEY;
use cli_mcp_api::token::HmacKey;

use crate::api_call::is_status;
use crate::children::{expose, proxy, secrets, ApiServerPeers, Inputs, ProxyInputs, Spec};
use crate::context::{cached, Context};
use crate::error::Result;

/// How long the API server addresses are cached.
const API_PEERS_TTL: Duration = Duration::from_secs(300);
/// How soon a failed lookup of the API server's addresses is tried again.
pub const API_PEERS_RETRY: Duration = Duration::from_secs(30);

/// What the cluster holds for one instance.
pub struct Resolved {
    /// The instance's HMAC key, when its Secret holds a valid one.
    pub key: Option<HmacKey>,
    /// Hash of the HMAC Secret's value.
    pub hmac_version: String,
    /// Hash of the serving certificate (auth Kubernetes).
    pub tls_version: Option<String>,
    /// The generated CA; `None` with an admin's certificate or without auth.
    pub ca_pem: Option<String>,
    /// Required Secrets that do not exist (`name (what it is for)`).
    pub missing: Vec<String>,
    /// Required Secrets whose keys are missing or unusable.
    pub invalid: Vec<String>,
    pub api_server: ApiServerPeers,
    /// The proxy's inputs, when the instance has a proxy and everything it needs is usable.
    pub proxy: Option<ProxyInputs>,
    /// Why the admin's kubeconfig cannot be used behind the proxy (`KubeconfigInvalid`).
    pub kubeconfig_invalid: Option<String>,
    /// Why an allow-list target's `caConfigMap` cannot be used (`ProxyCaInvalid`).
    pub proxy_ca_invalid: Option<String>,
    /// When the generated serving certificate is due for renewal, from now.
    pub tls_renew_in: Option<Duration>,
    /// What OpenShift's service CA has not issued or injected yet, and where to look.
    pub serving_cert_pending: Option<String>,
    /// See [`Inputs::backend_ca`].
    pub backend_ca: Option<String>,
}

impl Resolved {
    /// Why no sandbox can start (so the pool creates none), if a Secret is missing or bad.
    pub fn blocked(&self) -> Option<String> {
        if let Some(k) = self
            .kubeconfig_invalid
            .as_ref()
            .or(self.proxy_ca_invalid.as_ref())
        {
            Some(k.clone())
        } else if !self.missing.is_empty() {
            Some(format!("missing Secrets: {}", self.missing.join(", ")))
        } else if !self.invalid.is_empty() {
            Some(self.invalid.join("; "))
        } else {
            None
        }
    }

    /// The builders' inputs: the spec plus what was resolved.
    pub fn inputs(&self, spec: Spec) -> Inputs {
        Inputs {
            spec,
            hmac_version: self.hmac_version.clone(),
            tls_version: self.tls_version.clone(),
            ca_pem: self.ca_pem.clone(),
            backend_ca: self.backend_ca.clone(),
            api_server: self.api_server.clone(),
            proxy: self.proxy.clone(),
        }
    }
}

/// A required Secret that is missing or unusable.
enum Problem {
    Missing(String),
    Invalid(String),
}

#[derive(Default)]
struct TlsState {
    version: Option<String>,
    problem: Option<Problem>,
    ca_pem: Option<String>,
    renew_in: Option<Duration>,
    pending: Option<String>,
    backend_ca: Option<String>,
}

/// Resolves everything of `spec` that lives in the cluster.
pub async fn resolve(ctx: &Context, cr: &CliMcpInstance, spec: &Spec) -> Result<Resolved> {
    let api_server = api_server_peers(ctx).await;
    let (key, hmac_version, key_problem) = ensure_hmac(ctx, cr, spec).await?;
    let tls = ensure_tls(ctx, cr, spec).await?;
    let proxy = resolve_proxy(ctx, cr, spec).await?;
    let tls_renew_in = tls.renew_in;
    let (serving_cert_pending, backend_ca) = (tls.pending, tls.backend_ca);
    let mut missing = Vec::new();
    let mut invalid = Vec::new();
    for p in [key_problem, tls.problem, proxy.problem]
        .into_iter()
        .flatten()
    {
        match p {
            Problem::Missing(m) => missing.push(m),
            Problem::Invalid(m) => invalid.push(m),
        }
    }
    Ok(Resolved {
        key,
        hmac_version,
        tls_version: tls.version,
        ca_pem: tls.ca_pem,
        missing,
        invalid,
        api_server,
        proxy: proxy.inputs,
        kubeconfig_invalid: proxy.kubeconfig_invalid,
        proxy_ca_invalid: proxy.ca_invalid,
        tls_renew_in,
        serving_cert_pending,
        backend_ca,
    })
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

/// Creates `secret` unless it exists; never overwrites. Returns the stored Secret and
/// whether this call created it.
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

/// A generate-once Secret as this instance may use it.
enum Own {
    Absent,
    Usable(Box<Secret>),
    Blocked(Problem),
}

/// The UID of the instance that controls `s`, when that is not `cr`: a predecessor of the
/// same name whose garbage is not collected yet. A Secret without such an owner (made by an
/// admin, or orphaned on purpose) is not a predecessor's.
fn predecessor(s: &Secret, cr: &CliMcpInstance) -> Option<String> {
    let own = cr.uid()?;
    s.owner_references()
        .iter()
        .find(|r| r.controller == Some(true) && r.kind == CliMcpInstance::kind(&()))
        .filter(|r| r.uid != own)
        .map(|r| r.uid.clone())
}

/// Reads a generate-once Secret, never handing out one of a deleted predecessor of the same
/// name: its HMAC key would let the old instance's session tokens open the new instance's
/// sandboxes (and its certificates and CAs are the old instance's). Such a Secret is
/// deleted (UID precondition, so a new one is never hit) and generated anew; while
/// something holds it (a finalizer) the instance waits, saying so.
async fn own_secret(ctx: &Context, cr: &CliMcpInstance, ns: &str, name: &str) -> Result<Own> {
    let Some(s) = read_secret(ctx, ns, name).await? else {
        return Ok(Own::Absent);
    };
    let Some(old) = predecessor(&s, cr) else {
        return Ok(Own::Usable(Box::new(s)));
    };
    let api = Api::<Secret>::namespaced(ctx.client.clone(), ns);
    if s.metadata.deletion_timestamp.is_none() {
        let dp = crate::api_call::delete_exactly(&s, false);
        match api.delete(name, &dp).await {
            Ok(_) => {
                ctx.metrics.api_write("Secret", "delete");
                ctx.publish(
                    cr,
                    EventType::Normal,
                    "PredecessorSecretDeleted",
                    format!("deleted Secret {name} of the deleted instance of the same name (uid {old}); a new one is generated"),
                )
                .await;
            }
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => {}
            // Without `delete` on Secrets the garbage collector still removes it: wait.
            Err(e) if is_status(&e, 403) => tracing::warn!(
                "cannot delete Secret {ns}/{name} of a deleted predecessor: {e}; waiting for garbage collection"
            ),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(match api.get_opt(name).await? {
        None => Own::Absent,
        Some(s) if predecessor(&s, cr).is_none() => Own::Usable(Box::new(s)),
        Some(_) => Own::Blocked(Problem::Missing(format!(
            "{name} (still the Secret of the deleted instance of the same name, uid {old}; \
             it is being deleted and a new one is generated once it is gone)"
        ))),
    })
}

/// [`own_secret`], creating the Secret `make` builds when there is none and publishing
/// the Event `(reason, message)` when this call created it. `Err` is why the instance
/// cannot have it yet.
async fn own_or_create(
    ctx: &Context,
    cr: &CliMcpInstance,
    ns: &str,
    name: &str,
    make: impl FnOnce() -> Result<Secret>,
    created_event: (&str, String),
) -> Result<std::result::Result<Secret, Problem>> {
    match own_secret(ctx, cr, ns, name).await? {
        Own::Usable(s) => Ok(Ok(*s)),
        Own::Blocked(p) => Ok(Err(p)),
        Own::Absent => {
            let (s, created) = create_once(ctx, ns, &make()?).await?;
            // Lost a race with a Secret the cache did not show yet: judged next time.
            if predecessor(&s, cr).is_some() {
                return Ok(Err(Problem::Missing(format!(
                    "{name} (still the Secret of the deleted instance of the same name)"
                ))));
            }
            if created {
                let (reason, message) = created_event;
                ctx.publish(cr, EventType::Normal, reason, message).await;
            }
            Ok(Ok(s))
        }
    }
}

async fn ensure_hmac(
    ctx: &Context,
    cr: &CliMcpInstance,
    spec: &Spec,
) -> Result<(Option<HmacKey>, String, Option<Problem>)> {
    let name = spec.name.hmac_secret();
    let event = (
        "HmacKeyGenerated",
        format!(
            "generated a new HMAC key in Secret {name}; the server rolls and warm sandboxes \
             are replaced"
        ),
    );
    let made = own_or_create(
        ctx,
        cr,
        &spec.namespace,
        &name,
        || {
            let meta = spec.meta(name.clone(), label::COMPONENT_SERVER);
            Ok(secrets::hmac_secret(meta, &secrets::generate_hmac_key()))
        },
        event,
    )
    .await?;
    let secret = match made {
        Ok(s) => s,
        Err(problem) => return Ok((None, secrets::version_of(&[]), Some(problem))),
    };
    let raw = secrets::secret_value(&secret, secrets::HMAC_KEY);
    let version = secrets::version_of(&[raw.unwrap_or_default()]);
    let parsed = raw
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .map(|t| HmacKey::from_hex(&t));
    Ok(match parsed {
        Some(Ok(key)) => (Some(key), version, None),
        Some(Err(e)) => (
            None,
            version,
            Some(Problem::Invalid(format!(
                "Secret {name} key '{}': {e}; delete the Secret and the operator generates a new one",
                secrets::HMAC_KEY
            ))),
        ),
        None => (
            None,
            version,
            Some(Problem::Invalid(format!(
                "Secret {name} has no key '{}'; delete the Secret and the operator generates a new one",
                secrets::HMAC_KEY
            ))),
        ),
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

async fn ensure_tls(ctx: &Context, cr: &CliMcpInstance, spec: &Spec) -> Result<TlsState> {
    if spec.auth == AuthMode::None {
        return Ok(TlsState::default());
    }
    let name = spec.tls_secret.clone();
    if spec.custom_tls {
        // Admin-provided: only checked, never written. It is not labelled as ours, so it is
        // not in the managed-Secret cache.
        let secret = Api::<Secret>::namespaced(ctx.client.clone(), &spec.namespace)
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
                backend_ca: secrets::secret_value(&s, secrets::CA_CRT)
                    .map(|b| String::from_utf8_lossy(b).into_owned()),
                ..Default::default()
            },
        });
    }
    if spec.service_ca {
        return service_ca_tls(ctx, spec).await;
    }
    let ca = match ensure_tls_ca(ctx, cr, spec).await? {
        Ok(ca) => ca,
        Err(problem) => {
            return Ok(TlsState {
                problem: Some(problem),
                ..Default::default()
            })
        }
    };
    let existing = match own_secret(ctx, cr, &spec.namespace, &name).await? {
        Own::Absent => None,
        Own::Usable(s) => Some(*s),
        Own::Blocked(problem) => {
            return Ok(TlsState {
                problem: Some(problem),
                ..Default::default()
            })
        }
    };
    // A generated certificate also names the exposed host; a new host re-issues it.
    let hosts = expose::tls_hosts(spec);
    let now = SystemTime::now();
    let leaf_renew_at = |s: &Secret| {
        secrets::secret_value(s, secrets::TLS_CRT)
            .and_then(|c| secrets::renew_at(&String::from_utf8_lossy(c)))
    };
    let why = match &existing {
        None => Some("generated"),
        Some(s) if !expose::tls_covers(s, &hosts) => Some("re-issued for the exposed host"),
        Some(s) if tls_keys_problem(&name, s).is_some() => Some("re-issued (a key was missing)"),
        Some(s) => match leaf_renew_at(s) {
            None => Some("re-issued (the certificate did not parse)"),
            Some(at) if at <= now => Some("renewed"),
            Some(_) => None,
        },
    };
    let secret = match (why, existing) {
        (None, Some(s)) => s,
        (why, existing) => {
            let lifetime = ctx.config.tls_lifetime;
            let m = secrets::issue_serving_cert(
                &ca,
                &spec.name.server(),
                &spec.namespace,
                &hosts,
                lifetime,
            )?;
            let mut meta = spec.meta(name.clone(), label::COMPONENT_SERVER);
            if !hosts.is_empty() {
                meta.annotations = Some(std::collections::BTreeMap::from([(
                    expose::TLS_HOSTS_ANNOTATION.to_owned(),
                    expose::tls_hosts_value(&hosts),
                )]));
            }
            let mut fresh = secrets::tls_secret(meta, &m);
            let (s, written) = match existing {
                None => create_once(ctx, &spec.namespace, &fresh).await?,
                Some(old) => {
                    // The stored version only: a concurrent writer gets a conflict, retried.
                    fresh.metadata.resource_version = old.resource_version();
                    let api = Api::<Secret>::namespaced(ctx.client.clone(), &spec.namespace);
                    let s = api.replace(&name, &PostParams::default(), &fresh).await?;
                    ctx.metrics.api_write("Secret", "replace");
                    (s, true)
                }
            };
            if written {
                let until = secrets::validity(&m.cert_pem)
                    .map(|(_, u)| {
                        k8s_openapi::jiff::Timestamp::try_from(u)
                            .map_or_else(|_| "?".into(), |t| t.to_string())
                    })
                    .unwrap_or_else(|| "?".into());
                ctx.publish(
                    cr,
                    EventType::Normal,
                    if why == Some("renewed") {
                        "CertificateRenewed"
                    } else {
                        "CertificateGenerated"
                    },
                    format!(
                        "serving certificate {} into Secret {name}, valid until {until}, issued by the instance's CA (published in ConfigMap {}); the server rolls",
                        why.unwrap_or("generated"),
                        secrets::ca_config_map_name(&spec.name)
                    ),
                )
                .await;
            }
            s
        }
    };
    let renew_in = leaf_renew_at(&secret).map(|at| at.duration_since(now).unwrap_or_default());
    // A leaf still from another CA (made before the CA was kept, or the CA Secret was
    // deleted to rotate it): clients are given both until the leaf is renewed from the new
    // one, so whoever re-reads the ConfigMap in between never fails.
    let leaf_ca = secrets::secret_value(&secret, secrets::CA_CRT)
        .map(|b| String::from_utf8_lossy(b).into_owned());
    let ca_pem = match leaf_ca {
        Some(old) if old.trim() != ca.cert_pem.trim() => {
            format!("{}\n{}", old.trim_end(), ca.cert_pem)
        }
        _ => ca.cert_pem.clone(),
    };
    Ok(TlsState {
        version: Some(tls_version(&secret)),
        problem: tls_keys_problem(&name, &secret),
        backend_ca: Some(ca_pem.clone()),
        ca_pem: Some(ca_pem),
        renew_in,
        pending: None,
    })
}

/// On OpenShift: the certificate the service CA issued for the Service's annotation, and
/// the service CA bundle it injected into ConfigMap `cli-mcp-<n>-service-ca` (copied into
/// the CA ConfigMap under `ca.crt`). Both appear asynchronously after the Service and that
/// ConfigMap are applied, and are renewed by the service CA; neither is written here. A
/// renewed certificate changes the version, which rolls the server.
async fn service_ca_tls(ctx: &Context, spec: &Spec) -> Result<TlsState> {
    let name = &spec.tls_secret;
    let ns = &spec.namespace;
    // Not labelled as ours (the service CA writes it), so not in the managed-Secret cache.
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await?;
    let cm = secrets::service_ca_config_map_name(&spec.name);
    let bundle = cached(&ctx.stores.config_maps, ns, &cm)
        .and_then(|c| c.data.as_ref()?.get(secrets::SERVICE_CA_KEY).cloned())
        .filter(|b| !b.trim().is_empty());
    let mut waiting = Vec::new();
    if secret.is_none() {
        waiting.push(format!(
            "Secret {name} (the serving certificate it issues for Service {})",
            spec.name.server()
        ));
    }
    if bundle.is_none() {
        waiting.push(format!(
            "the service CA bundle in ConfigMap {cm} (key {})",
            secrets::SERVICE_CA_KEY
        ));
    }
    let pending = (!waiting.is_empty()).then(|| {
        let error = cached(&ctx.stores.services, ns, &spec.name.server()).and_then(|s| {
            s.annotations()
                .get(secrets::SERVING_CERT_ERROR_ANNOTATION)
                .cloned()
        });
        let mut m = format!(
            "waiting for OpenShift's service CA to provide {}",
            waiting.join(" and ")
        );
        match error {
            Some(e) => m.push_str(&format!("; it reports on the Service: {e}")),
            None => m.push_str(
                "; this takes seconds where the service-ca operator runs (oc get clusteroperator service-ca)",
            ),
        }
        m
    });
    Ok(TlsState {
        version: secret.as_ref().map(tls_version),
        problem: secret.as_ref().and_then(|s| tls_keys_problem(name, s)),
        ca_pem: bundle,
        renew_in: None,
        pending,
        backend_ca: None,
    })
}

/// The serving CA (`cli-mcp-<n>-tls-ca`), created once; its key never leaves this Secret.
async fn ensure_tls_ca(
    ctx: &Context,
    cr: &CliMcpInstance,
    spec: &Spec,
) -> Result<std::result::Result<secrets::CaMaterial, Problem>> {
    let name = secrets::tls_ca_secret_name(&spec.name);
    let made = own_or_create(
        ctx,
        cr,
        &spec.namespace,
        &name,
        || {
            let ca = secrets::generate_tls_ca(&spec.name.server(), &spec.namespace)?;
            let meta = spec.meta(name.clone(), label::COMPONENT_SERVER);
            Ok(secrets::tls_ca_secret(meta, &ca))
        },
        (
            "CaGenerated",
            format!(
                "generated the serving CA into Secret {name}; it is published in ConfigMap {}",
                secrets::ca_config_map_name(&spec.name)
            ),
        ),
    )
    .await?;
    let secret = match made {
        Ok(s) => s,
        Err(problem) => return Ok(Err(problem)),
    };
    let text =
        |k| secrets::secret_value(&secret, k).map(|b| String::from_utf8_lossy(b).into_owned());
    let (Some(cert_pem), Some(key_pem)) = (text(secrets::CA_CRT), text(secrets::CA_KEY)) else {
        return Ok(Err(Problem::Invalid(format!(
            "Secret {name} lacks {} or {}; delete it and the operator generates a new CA",
            secrets::CA_CRT,
            secrets::CA_KEY
        ))));
    };
    let ca = secrets::CaMaterial { cert_pem, key_pem };
    let until = secrets::validity(&ca.cert_pem).map(|(_, until)| until);
    let (Some(until), Ok(_)) = (until, rcgen::KeyPair::from_pem(&ca.key_pem)) else {
        return Ok(Err(Problem::Invalid(format!(
            "Secret {name} does not hold a usable CA certificate and key; delete it and the operator generates a new CA"
        ))));
    };
    // A CA that would expire before a leaf issued now is replaced. The leaf in use stays
    // valid under the old CA until its own renewal, and the ConfigMap carries both CAs
    // until then: clients have a whole renewal period to pick up the new one.
    let left = until.duration_since(SystemTime::now()).unwrap_or_default();
    if left > ctx.config.tls_lifetime {
        return Ok(Ok(ca));
    }
    let fresh = secrets::generate_tls_ca(&spec.name.server(), &spec.namespace)?;
    let meta = spec.meta(name.clone(), label::COMPONENT_SERVER);
    let mut next = secrets::tls_ca_secret(meta, &fresh);
    next.metadata.resource_version = secret.resource_version();
    Api::<Secret>::namespaced(ctx.client.clone(), &spec.namespace)
        .replace(&name, &PostParams::default(), &next)
        .await?;
    ctx.metrics.api_write("Secret", "replace");
    ctx.publish(
        cr,
        EventType::Warning,
        "CaRenewed",
        format!(
            "the serving CA in Secret {name} expires within a certificate lifetime; generated a new one. ConfigMap {} lists both until the serving certificate is renewed from it: clients that pin the CA must re-read it",
            secrets::ca_config_map_name(&spec.name)
        ),
    )
    .await;
    Ok(Ok(fresh))
}

/// What the proxy needs, resolved.
#[derive(Default)]
struct ProxyState {
    inputs: Option<ProxyInputs>,
    problem: Option<Problem>,
    kubeconfig_invalid: Option<String>,
    ca_invalid: Option<String>,
}

/// The proxy CA (created once) and the admin kubeconfig (validated) of the instance's
/// credential proxy; `ProxyState::inputs` only when both are usable.
async fn resolve_proxy(ctx: &Context, cr: &CliMcpInstance, spec: &Spec) -> Result<ProxyState> {
    let plan = &spec.proxy;
    let (ca_pem, ca_version) = match ensure_proxy_ca(ctx, cr, spec).await? {
        Ok(ca) => ca,
        Err(problem) => {
            return Ok(ProxyState {
                problem: Some(problem),
                ..Default::default()
            })
        }
    };
    let mut kubeconfig: Option<Kubeconfig> = None;
    if let Some(name) = &plan.kubeconfig_secret {
        match read_admin_kubeconfig(ctx, spec, name).await? {
            AdminKubeconfig::Valid(k) => kubeconfig = Some(k),
            AdminKubeconfig::Missing(m) => {
                return Ok(ProxyState {
                    problem: Some(Problem::Missing(m)),
                    ..Default::default()
                })
            }
            AdminKubeconfig::Invalid(m) => {
                return Ok(ProxyState {
                    kubeconfig_invalid: Some(m),
                    ..Default::default()
                })
            }
        }
    }
    let mut allowlist_cas = std::collections::BTreeMap::new();
    for name in plan.allowlist_cas.values() {
        if allowlist_cas.contains_key(name) {
            continue;
        }
        match read_allowlist_ca(ctx, spec, name).await? {
            Ok(pem) => allowlist_cas.insert(name.clone(), pem),
            Err(m) => {
                return Ok(ProxyState {
                    ca_invalid: Some(m),
                    ..Default::default()
                })
            }
        };
    }
    match proxy::proxy_inputs(
        plan,
        spec.proxy_image.as_deref(),
        kubeconfig.as_ref(),
        &allowlist_cas,
        &ca_pem,
        &ca_version,
    ) {
        Ok(inputs) => Ok(ProxyState {
            inputs: Some(inputs),
            ..Default::default()
        }),
        Err(m) => Ok(ProxyState {
            problem: Some(Problem::Invalid(m)),
            ..Default::default()
        }),
    }
}

/// The validated CA bundle of an allow-list target's `caConfigMap`, or what to fix.
async fn read_allowlist_ca(
    ctx: &Context,
    spec: &Spec,
    name: &str,
) -> Result<std::result::Result<String, String>> {
    use proxy::CA_BUNDLE_KEY;
    let cm = Api::<ConfigMap>::namespaced(ctx.client.clone(), &spec.namespace)
        .get_opt(name)
        .await?;
    let Some(cm) = cm else {
        return Ok(Err(format!(
            "ConfigMap {name} (spec.proxy.targets[].caConfigMap) does not exist; create it in namespace {} with key '{CA_BUNDLE_KEY}' holding the PEM CA of the target's upstreams",
            spec.namespace
        )));
    };
    let pem = cm
        .data
        .as_ref()
        .and_then(|d| d.get(CA_BUNDLE_KEY))
        .filter(|v| !v.trim().is_empty());
    Ok(match pem {
        Some(pem) => proxy::validate_ca_bundle(name, pem),
        None => Err(format!(
            "ConfigMap {name} (spec.proxy.targets[].caConfigMap) has no key '{CA_BUNDLE_KEY}' in data (or it is empty); put the PEM CA of the target's upstreams there"
        )),
    })
}

enum AdminKubeconfig {
    Valid(Kubeconfig),
    Missing(String),
    Invalid(String),
}

async fn read_admin_kubeconfig(ctx: &Context, spec: &Spec, name: &str) -> Result<AdminKubeconfig> {
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), &spec.namespace)
        .get_opt(name)
        .await?;
    let Some(secret) = secret else {
        return Ok(AdminKubeconfig::Missing(format!(
            "{name} (the kubeconfig the credential proxy holds, key '{KUBECONFIG_KEY}'; see config/samples)"
        )));
    };
    // A Secret this operator made (HMAC key, TLS, proxy CA — of any instance) is never a
    // kubeconfig: admission refuses the instance's own names, this covers the rest.
    if secret
        .labels()
        .get(label::APP_MANAGED_BY)
        .map(String::as_str)
        == Some(label::MANAGED_BY)
    {
        return Ok(AdminKubeconfig::Invalid(format!(
            "Secret {name} is managed by the cli-mcp operator and cannot be the proxy's kubeconfig; name the Secret holding the admin kubeconfig"
        )));
    }
    let Some(raw) = secrets::secret_value(&secret, KUBECONFIG_KEY) else {
        return Ok(AdminKubeconfig::Invalid(format!(
            "Secret {name} has no key '{KUBECONFIG_KEY}' (or it is empty)"
        )));
    };
    let text = match std::str::from_utf8(raw) {
        Ok(t) => t,
        Err(_) => {
            return Ok(AdminKubeconfig::Invalid(format!(
                "Secret {name} key '{KUBECONFIG_KEY}' is not UTF-8 text"
            )))
        }
    };
    Ok(match kubeconfig::validate(text) {
        Ok(k) => AdminKubeconfig::Valid(k),
        Err(e) => AdminKubeconfig::Invalid(format!("Secret {name} key '{KUBECONFIG_KEY}': {e}")),
    })
}

/// The proxy CA Secret, created once; `(certificate PEM, version)` or why it is unusable.
async fn ensure_proxy_ca(
    ctx: &Context,
    cr: &CliMcpInstance,
    spec: &Spec,
) -> Result<std::result::Result<(String, String), Problem>> {
    use cli_mcp_api::proxy::{CA_CERT_KEY, CA_KEY_KEY};
    let name = spec.name.proxy_ca_secret();
    let made = own_or_create(
        ctx,
        cr,
        &spec.namespace,
        &name,
        || {
            let ca = secrets::generate_proxy_ca(spec.name.as_str(), &spec.namespace)?;
            let meta = spec.meta(name.clone(), label::COMPONENT_PROXY);
            Ok(secrets::proxy_ca_secret(meta, &ca))
        },
        (
            "ProxyCaGenerated",
            format!("generated the credential proxy's CA into Secret {name}"),
        ),
    )
    .await?;
    let secret = match made {
        Ok(s) => s,
        Err(problem) => return Ok(Err(problem)),
    };
    let (Some(crt), Some(key)) = (
        secrets::secret_value(&secret, CA_CERT_KEY),
        secrets::secret_value(&secret, CA_KEY_KEY),
    ) else {
        return Ok(Err(Problem::Invalid(format!(
            "Secret {name} lacks {CA_CERT_KEY} or {CA_KEY_KEY}; delete it and the operator generates a new proxy CA"
        ))));
    };
    Ok(Ok((
        String::from_utf8_lossy(crt).into_owned(),
        secrets::version_of(&[crt, key]),
    )))
}

/// A lookup's addresses, with those of the last lookup added when this one failed in part
/// (what it did find is kept too), sorted and without repeats.
fn settle(mut peers: ApiServerPeers, last_good: Option<ApiServerPeers>) -> ApiServerPeers {
    if peers.problem.is_some() {
        if let Some(known) = last_good {
            peers.ips.extend(known.ips);
            peers.ports.extend(known.ports);
        }
    }
    peers.ips.sort();
    peers.ips.dedup();
    peers.ports.sort_unstable();
    peers.ports.dedup();
    peers
}

/// The API server's addresses as pods see them: `default/kubernetes` Service IP and its
/// EndpointSlice addresses. Cached for [`API_PEERS_TTL`]. A lookup that fails (RBAC, a
/// moment of API trouble) keeps the addresses the last good one found — an empty list would
/// give every credential proxy applied meanwhile a NetworkPolicy without the API server —
/// says so in `problem`, and is tried again after [`API_PEERS_RETRY`].
pub async fn api_server_peers(ctx: &Context) -> ApiServerPeers {
    let mut last_good = None;
    if let Ok(guard) = ctx.api_peers.lock() {
        if let Some((at, peers)) = guard.as_ref() {
            let ttl = if peers.problem.is_some() {
                API_PEERS_RETRY
            } else {
                API_PEERS_TTL
            };
            if at.elapsed() < ttl {
                return peers.clone();
            }
            last_good = Some(peers.clone());
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
        // Without these addresses the proxy's NetworkPolicy has no API server rule, so an
        // enforcing CNI cuts the proxy (and so the sandboxes) off the API: say so where an
        // admin looks (the log and the instance's Degraded condition).
        Err(e) => {
            tracing::warn!(
                "reading Service default/kubernetes: {e}; the credential proxy gets no API \
                 server egress (the operator needs config/rbac's Role in namespace default)"
            );
            peers.problem = Some(format!("cannot read Service default/kubernetes: {e}"));
        }
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
        Err(e) => {
            tracing::warn!(
                "listing EndpointSlices of default/kubernetes: {e}; the credential proxy gets no \
                 egress to the API server's endpoints (the operator needs config/rbac's Role in namespace \
                 default)"
            );
            peers.problem.get_or_insert_with(|| {
                format!("cannot list the EndpointSlices of default/kubernetes: {e}")
            });
        }
    }
    let peers = settle(peers, last_good);
    if let Ok(mut guard) = ctx.api_peers.lock() {
        *guard = Some((Instant::now(), peers.clone()));
    }
    peers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(ips: &[&str], ports: &[i32], problem: Option<&str>) -> ApiServerPeers {
        ApiServerPeers {
            ips: ips.iter().map(|s| s.to_string()).collect(),
            ports: ports.to_vec(),
            problem: problem.map(str::to_owned),
        }
    }

    #[test]
    fn a_failed_lookup_keeps_the_last_good_addresses_and_says_why() {
        let good = peers(&["10.96.0.1", "192.168.1.10"], &[443, 6443], None);
        // Both reads failed: nothing found, the last good addresses stay.
        let failed = settle(peers(&[], &[], Some("timed out")), Some(good.clone()));
        assert_eq!(
            (failed.ips.clone(), failed.ports.clone()),
            (good.ips.clone(), good.ports.clone())
        );
        assert_eq!(failed.problem.as_deref(), Some("timed out"));
        // One read failed: what the other found is added, once.
        let half = settle(
            peers(&["10.96.0.1"], &[443], Some("forbidden")),
            Some(good.clone()),
        );
        assert_eq!(half.ips, good.ips);
        assert_eq!(half.ports, good.ports);
        // A good lookup is the truth: addresses that are gone go.
        let moved = settle(
            peers(&["10.96.0.1", "192.168.1.11"], &[443, 6443], None),
            Some(good),
        );
        assert_eq!(moved.ips, ["10.96.0.1", "192.168.1.11"]);
        // No good lookup yet: nothing to keep.
        assert!(settle(peers(&[], &[], Some("forbidden")), None)
            .ips
            .is_empty());
    }
}
