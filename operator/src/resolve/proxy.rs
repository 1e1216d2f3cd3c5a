//! The credential proxy's inputs: its CA (generated once), the admin's kubeconfig (read and
//! validated) and the CA bundles of allow-list targets.

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::{Api, ResourceExt};

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::kubeconfig::{self, Kubeconfig};
use cli_mcp_api::names::label;
use cli_mcp_api::sandbox::KUBECONFIG_KEY;

use super::owned::own_or_create;
use super::Problem;
use crate::children::{proxy, secrets, ProxyInputs, Spec};
use crate::context::Context;
use crate::error::{Error, Result};

/// The admin kubeconfig's text, for the briefing's reviews. `Debug` never shows it: it
/// holds tokens.
pub(super) struct KubeconfigText(pub(super) String);

impl std::fmt::Debug for KubeconfigText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeconfigText(..)")
    }
}

/// What the proxy needs, resolved.
#[derive(Default)]
pub(super) struct ProxyState {
    pub(super) inputs: Option<ProxyInputs>,
    /// The validated admin kubeconfig, with a kubernetes target.
    pub(super) kubeconfig_text: Option<KubeconfigText>,
    pub(super) problem: Option<Problem>,
    pub(super) kubeconfig_invalid: Option<String>,
    pub(super) ca_invalid: Option<String>,
}

/// The proxy CA (created once) and the admin kubeconfig (validated) of the instance's
/// credential proxy; `ProxyState::inputs` only when both are usable.
pub(super) async fn resolve_proxy(
    ctx: &Context,
    cr: &CliMcpInstance,
    spec: &Spec,
) -> Result<ProxyState> {
    let plan = &spec.proxy;
    if let Err(m) = proxy::check_identity(plan, spec.auth) {
        return Ok(ProxyState {
            problem: Some(Problem::Invalid(m)),
            ..Default::default()
        });
    }
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
    let mut kubeconfig_text = None;
    if let Some(name) = &plan.kubeconfig_secret {
        match read_admin_kubeconfig(ctx, spec, name).await? {
            AdminKubeconfig::Valid(k, text) => {
                kubeconfig = Some(k);
                kubeconfig_text = Some(KubeconfigText(text));
            }
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
            kubeconfig_text,
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
        .await
        .map_err(Error::resolving(format!(
            "ConfigMap {}/{name} (spec.proxy.targets[].caConfigMap)",
            spec.namespace
        )))?;
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

/// The admin's kubeconfig Secret, as the proxy may hold it (valid: with its text).
enum AdminKubeconfig {
    Valid(Kubeconfig, String),
    Missing(String),
    Invalid(String),
}

async fn read_admin_kubeconfig(ctx: &Context, spec: &Spec, name: &str) -> Result<AdminKubeconfig> {
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), &spec.namespace)
        .get_opt(name)
        .await
        .map_err(Error::resolving(format!(
            "Secret {}/{name} (the proxy's kubeconfig)",
            spec.namespace
        )))?;
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
        Ok(k) => AdminKubeconfig::Valid(k, text.to_owned()),
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
            let ca = secrets::generate_proxy_ca(spec.name.as_str(), &spec.namespace)
                .map_err(Error::generating(format!("the proxy CA {name}")))?;
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
