//! The first step of a reconcile: everything the desired children depend on that is not in
//! the CR, so that the build of the children is complete and nothing changes the desired
//! set afterwards. The generate-once Secrets (HMAC key, and the CA + serving certificate
//! unless the admin gives one) are created here if absent — created, never applied, so an
//! existing Secret is never overwritten — the admin's Secrets are checked, the API server's
//! addresses are looked up for the proxy's NetworkPolicy, and the cluster is asked whether
//! it can store the object `spec.server.expose` asks for.
//!
//! - `owned.rs`: the generate-once Secrets, never one of a deleted predecessor;
//! - `hmac.rs`: the HMAC key;
//! - `tls.rs`: the serving certificate and its CA;
//! - `proxy.rs`: the credential proxy's CA, the admin's kubeconfig, allow-list CAs;
//! - `api_server.rs`: the API server's addresses;
//! - `expose.rs`: whether the cluster serves the kind `spec.server.expose` asks for;
//! - `sandbox_dns.rs`: the proxy's ClusterIP, for sandboxes without DNS;
//! - `briefing.rs`: the sandbox briefing, with the reviews of what the kubeconfig's
//!   identity may do (made again every `--briefing-refresh`).

mod api_server;
mod briefing;
mod expose;
mod hmac;
mod owned;
mod proxy;
mod sandbox_dns;
mod tls;

use sandbox_dns::ProxyAddress;

use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::token::HmacKey;

use crate::children::{ApiServerPeers, Inputs, ProxyInputs, Spec};
use crate::context::Context;
use crate::error::Result;

pub use api_server::{api_server_peers, API_PEERS_RETRY};

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
    /// Why the object `spec.server.expose` asks for cannot be stored here (see
    /// [`Inputs::expose_unavailable`]).
    pub expose_unavailable: Option<String>,
    /// The sandbox briefing (see [`Inputs::briefing`]).
    pub briefing: Option<String>,
    /// When the reviews behind the briefing are due again, from now.
    pub briefing_due_in: Option<Duration>,
    /// How the sandboxes reach their proxy.
    proxy_address: ProxyAddress,
}

impl Resolved {
    /// Why no sandbox can start (so the pool creates none), if a Secret is missing or bad.
    pub fn blocked(&self) -> Option<String> {
        if let ProxyAddress::Pending(why) = &self.proxy_address {
            Some(why.clone())
        } else if let Some(k) = self
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
    pub fn inputs(&self, mut spec: Spec) -> Inputs {
        if let (ProxyAddress::ByIp(url), Some(proxy)) =
            (&self.proxy_address, spec.sandbox.proxy.as_mut())
        {
            proxy.url = url.clone();
        }
        Inputs {
            spec,
            hmac_version: self.hmac_version.clone(),
            tls_version: self.tls_version.clone(),
            ca_pem: self.ca_pem.clone(),
            backend_ca: self.backend_ca.clone(),
            api_server: self.api_server.clone(),
            proxy: self.proxy.clone(),
            expose_unavailable: self.expose_unavailable.clone(),
            briefing: self.briefing.clone(),
        }
    }
}

/// A required Secret that is missing or unusable.
enum Problem {
    Missing(String),
    Invalid(String),
}

/// Resolves everything of `spec` that lives in the cluster, one call per part (each asks
/// the caches or the API server).
pub async fn resolve(ctx: &Context, cr: &CliMcpInstance, spec: &Spec) -> Result<Resolved> {
    let api_server = api_server::api_server_peers(ctx).await;
    let (key, hmac_version, key_problem) = hmac::ensure_hmac(ctx, cr, spec).await?;
    let tls = tls::ensure_tls(ctx, cr, spec).await?;
    let proxy = proxy::resolve_proxy(ctx, cr, spec).await?;
    let briefing = briefing::briefing(ctx, spec, proxy.kubeconfig_text.as_ref()).await;
    let expose_unavailable = expose::expose_unavailable(ctx, spec).await;
    let proxy_address = sandbox_dns::proxy_address(ctx, spec);
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
        expose_unavailable,
        briefing: briefing.text,
        briefing_due_in: briefing.due_in,
        proxy_address,
    })
}
