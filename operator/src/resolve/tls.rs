//! The serving certificate (auth `Kubernetes`): the admin's, OpenShift's service CA's, or one
//! issued from the instance's own CA (`cli-mcp-<n>-tls-ca`, generated once) and renewed
//! from the same CA before it expires (clients pin the CA, so it is kept).

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Secret;
use kube::api::PostParams;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use cli_mcp_api::crd::{AuthMode, CliMcpInstance};
use cli_mcp_api::names::label;

use super::owned::{create_once, own_or_create, own_secret, Own};
use super::Problem;
use crate::children::{expose, secrets, Spec};
use crate::context::{cached, Context};
use crate::error::{Error, Result};

/// What the serving certificate gives the children and the status.
#[derive(Default)]
pub(super) struct TlsState {
    pub(super) version: Option<String>,
    pub(super) problem: Option<Problem>,
    pub(super) ca_pem: Option<String>,
    pub(super) renew_in: Option<Duration>,
    pub(super) pending: Option<String>,
    pub(super) backend_ca: Option<String>,
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

/// The serving certificate of auth `Kubernetes`: the admin's (`tlsSecretName`), OpenShift's
/// service CA's, or one generated from the instance's CA. Nothing without auth.
pub(super) async fn ensure_tls(
    ctx: &Context,
    cr: &CliMcpInstance,
    spec: &Spec,
) -> Result<TlsState> {
    if spec.auth == AuthMode::None {
        return Ok(TlsState::default());
    }
    if spec.custom_tls {
        return admin_tls(ctx, spec).await;
    }
    if spec.service_ca {
        return service_ca_tls(ctx, spec).await;
    }
    generated_tls(ctx, cr, spec).await
}

impl TlsState {
    fn problem(problem: Problem) -> Self {
        TlsState {
            problem: Some(problem),
            ..Default::default()
        }
    }
}

/// Admin-provided: only checked, never written. It is not labelled as ours, so it is not in
/// the managed-Secret cache.
async fn admin_tls(ctx: &Context, spec: &Spec) -> Result<TlsState> {
    let name = &spec.tls_secret;
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), &spec.namespace)
        .get_opt(name)
        .await
        .map_err(Error::resolving(format!(
            "Secret {}/{name} (spec.server.tlsSecretName)",
            spec.namespace
        )))?;
    Ok(match secret {
        None => TlsState::problem(Problem::Missing(format!(
            "{name} (spec.server.tlsSecretName)"
        ))),
        Some(s) => TlsState {
            version: Some(tls_version(&s)),
            problem: tls_keys_problem(name, &s),
            backend_ca: secrets::secret_value(&s, secrets::CA_CRT)
                .map(|b| String::from_utf8_lossy(b).into_owned()),
            ..Default::default()
        },
    })
}

/// The certificate generated from the instance's CA: issued when there is none, when it no
/// longer names the exposed host or lacks a key, and renewed once a third of its validity
/// is left.
async fn generated_tls(ctx: &Context, cr: &CliMcpInstance, spec: &Spec) -> Result<TlsState> {
    let name = &spec.tls_secret;
    let ca = match ensure_tls_ca(ctx, cr, spec).await? {
        Ok(ca) => ca,
        Err(problem) => return Ok(TlsState::problem(problem)),
    };
    let existing = match own_secret(ctx, cr, &spec.namespace, name).await? {
        Own::Absent => None,
        Own::Usable(s) => Some(*s),
        Own::Blocked(problem) => return Ok(TlsState::problem(problem)),
    };
    // A generated certificate also names the exposed host; a new host re-issues it.
    let hosts = expose::tls_hosts(spec);
    let now = SystemTime::now();
    let secret = match (
        reissue_reason(name, existing.as_ref(), &hosts, now),
        existing,
    ) {
        (None, Some(s)) => s,
        (why, existing) => {
            let why = why.unwrap_or("generated");
            issue(ctx, cr, spec, &ca, &hosts, existing, why).await?
        }
    };
    Ok(serving_state(name, &secret, &ca, now))
}

/// When the leaf certificate in `s` is due for renewal.
fn leaf_renew_at(s: &Secret) -> Option<SystemTime> {
    secrets::secret_value(s, secrets::TLS_CRT)
        .and_then(|c| secrets::renew_at(&String::from_utf8_lossy(c)))
}

/// Why the serving certificate must be (re-)issued now, if it must.
fn reissue_reason(
    name: &str,
    existing: Option<&Secret>,
    hosts: &[String],
    now: SystemTime,
) -> Option<&'static str> {
    match existing {
        None => Some("generated"),
        Some(s) if !expose::tls_covers(s, hosts) => Some("re-issued for the exposed host"),
        Some(s) if tls_keys_problem(name, s).is_some() => Some("re-issued (a key was missing)"),
        Some(s) => match leaf_renew_at(s) {
            None => Some("re-issued (the certificate did not parse)"),
            Some(at) if at <= now => Some("renewed"),
            Some(_) => None,
        },
    }
}

/// Issues a serving certificate from `ca` for `hosts` and writes it: created when there is
/// none, else replaced (the stored version only). Publishes what happened and `why`.
async fn issue(
    ctx: &Context,
    cr: &CliMcpInstance,
    spec: &Spec,
    ca: &secrets::CaMaterial,
    hosts: &[String],
    existing: Option<Secret>,
    why: &str,
) -> Result<Secret> {
    let (ns, name) = (&spec.namespace, &spec.tls_secret);
    let lifetime = ctx.config.tls_lifetime;
    let m = secrets::issue_serving_cert(ca, &spec.name.server(), ns, hosts, lifetime)
        .map_err(Error::generating(format!("the serving certificate {name}")))?;
    let mut meta = spec.meta(name.clone(), label::COMPONENT_SERVER);
    if !hosts.is_empty() {
        meta.annotations = Some(std::collections::BTreeMap::from([(
            expose::TLS_HOSTS_ANNOTATION.to_owned(),
            expose::tls_hosts_value(hosts),
        )]));
    }
    let mut fresh = secrets::tls_secret(meta, &m);
    let (s, written) = match existing {
        None => create_once(ctx, ns, &fresh).await?,
        Some(old) => {
            // The stored version only: a concurrent writer gets a conflict, retried.
            fresh.metadata.resource_version = old.resource_version();
            let api = Api::<Secret>::namespaced(ctx.client.clone(), ns);
            let s = api
                .replace(name, &PostParams::default(), &fresh)
                .await
                .map_err(Error::resolving(format!("replacing Secret {ns}/{name}")))?;
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
            if why == "renewed" {
                "CertificateRenewed"
            } else {
                "CertificateGenerated"
            },
            format!(
                "serving certificate {why} into Secret {name}, valid until {until}, issued by the instance's CA (published in ConfigMap {}); the server rolls",
                secrets::ca_config_map_name(&spec.name)
            ),
        )
        .await;
    }
    Ok(s)
}

/// What the children get from the generated certificate in `secret` and its CA.
fn serving_state(
    name: &str,
    secret: &Secret,
    ca: &secrets::CaMaterial,
    now: SystemTime,
) -> TlsState {
    let renew_in = leaf_renew_at(secret).map(|at| at.duration_since(now).unwrap_or_default());
    // A leaf still from another CA (made before the CA was kept, or the CA Secret was
    // deleted to rotate it): clients are given both until the leaf is renewed from the new
    // one, so whoever re-reads the ConfigMap in between never fails.
    let leaf_ca = secrets::secret_value(secret, secrets::CA_CRT)
        .map(|b| String::from_utf8_lossy(b).into_owned());
    let ca_pem = match leaf_ca {
        Some(old) if old.trim() != ca.cert_pem.trim() => {
            format!("{}\n{}", old.trim_end(), ca.cert_pem)
        }
        _ => ca.cert_pem.clone(),
    };
    TlsState {
        version: Some(tls_version(secret)),
        problem: tls_keys_problem(name, secret),
        backend_ca: Some(ca_pem.clone()),
        ca_pem: Some(ca_pem),
        renew_in,
        pending: None,
    }
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
        .await
        .map_err(Error::resolving(format!("Secret {ns}/{name}")))?;
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
            let ca = secrets::generate_tls_ca(&spec.name.server(), &spec.namespace)
                .map_err(Error::generating(format!("the serving CA {name}")))?;
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
    let fresh = secrets::generate_tls_ca(&spec.name.server(), &spec.namespace)
        .map_err(Error::generating(format!("the serving CA {name}")))?;
    let meta = spec.meta(name.clone(), label::COMPONENT_SERVER);
    let mut next = secrets::tls_ca_secret(meta, &fresh);
    next.metadata.resource_version = secret.resource_version();
    Api::<Secret>::namespaced(ctx.client.clone(), &spec.namespace)
        .replace(&name, &PostParams::default(), &next)
        .await
        .map_err(Error::resolving(format!(
            "replacing Secret {}/{name}",
            spec.namespace
        )))?;
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
