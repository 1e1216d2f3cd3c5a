//! The first step of a reconcile: everything the desired children depend on that is not in
//! the CR, so that the build of the children is complete and nothing changes the desired
//! set afterwards. The generate-once Secrets (HMAC key, and the CA + serving certificate
//! unless the admin gives one) are created here if absent — created, never applied, so an
//! existing Secret is never overwritten — the admin's Secrets are checked, the API server's
//! addresses are looked up for the proxy's NetworkPolicy, and the cluster is asked whether
//! it can store the object `spec.server.expose` asks for and whether it has the
//! RuntimeClasses the pods name.
//!
//! - `owned.rs`: the generate-once Secrets, never one of a deleted predecessor;
//! - `hmac.rs`: the HMAC key;
//! - `tls.rs`: the serving certificate and its CA;
//! - `proxy.rs`: the credential proxy's CA, the admin's kubeconfig, allow-list CAs;
//! - `api_server.rs`: the API server's addresses;
//! - `expose.rs`: whether the cluster serves the kind `spec.server.expose` asks for;
//! - `sandbox_dns.rs`: the proxy's ClusterIP, for sandboxes without DNS;
//! - `runtime_classes.rs`: the RuntimeClasses the pods name that the cluster lacks;
//! - `briefing.rs`: the sandbox briefing, with the reviews of what the kubeconfig's
//!   identity may do (made again every `--briefing-refresh`).

mod api_server;
mod briefing;
mod expose;
mod hmac;
mod owned;
mod proxy;
mod runtime_classes;
mod sandbox_dns;
mod tls;

use sandbox_dns::ProxyAddress;

use std::time::Duration;

use cli_mcp_api::crd::CliMcpInstance;
use cli_mcp_api::token::HmacKey;

use crate::children::{ApiServerPeers, Inputs, ProxyInputs, Spec};
use crate::context::Context;
use crate::error::Result;
use crate::runtime_class::{self, Named};

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
    /// The RuntimeClasses the spec names that the cluster lacks (`RuntimeClassNotFound`).
    pub runtime_classes_missing: Vec<Named>,
    /// How the sandboxes reach their proxy.
    proxy_address: ProxyAddress,
}

impl Resolved {
    /// Why no sandbox can start (so the pool creates none): a Secret is missing or bad, or
    /// the sandboxes' RuntimeClass does not exist.
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
            // The API server would refuse every pool pod: none is sent.
            runtime_class::sandbox_message(&self.runtime_classes_missing)
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
            missing_runtime_classes: self
                .runtime_classes_missing
                .iter()
                .map(|n| n.class.clone())
                .collect(),
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
    let runtime_classes_missing = runtime_classes::missing(ctx, spec).await;
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
        runtime_classes_missing,
        proxy_address,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a cluster that has everything resolves to, but for `missing` RuntimeClasses.
    fn resolved(missing: Vec<Named>) -> Resolved {
        Resolved {
            key: None,
            hmac_version: String::new(),
            tls_version: None,
            ca_pem: None,
            missing: Vec::new(),
            invalid: Vec::new(),
            api_server: ApiServerPeers::default(),
            proxy: None,
            kubeconfig_invalid: None,
            proxy_ca_invalid: None,
            tls_renew_in: None,
            serving_cert_pending: None,
            backend_ca: None,
            expose_unavailable: None,
            briefing: None,
            briefing_due_in: None,
            runtime_classes_missing: missing,
            proxy_address: ProxyAddress::ByName,
        }
    }

    fn named(field: &'static str, class: &str) -> Named {
        Named {
            field,
            class: class.into(),
        }
    }

    #[test]
    fn a_missing_sandbox_class_holds_the_pool_and_marks_only_the_classes_missing() {
        assert_eq!(resolved(Vec::new()).blocked(), None);
        let sandbox = resolved(vec![named(runtime_class::SANDBOX_FIELD, "gvisor")]);
        let why = sandbox.blocked().expect("the pool is held back");
        assert!(why.contains("RuntimeClass \"gvisor\" not found"), "{why}");
        // A server's class does not hold the sandboxes, but its Deployment is marked.
        let server = resolved(vec![named("spec.server.runtimeClassName", "kata")]);
        assert_eq!(server.blocked(), None);
        let spec = Spec::read(
            &crate::children::test_support::cr(serde_json::json!({})),
            "server:1",
            Some("sandbox:1"),
            Some("proxy:1"),
        )
        .expect("spec");
        let inputs = server.inputs(spec);
        assert_eq!(
            inputs.missing_runtime_classes,
            ["kata".to_owned()].into_iter().collect()
        );
        // A missing Secret is said first: it is what the admin must create to go on at all.
        let mut both = resolved(vec![named(runtime_class::SANDBOX_FIELD, "gvisor")]);
        both.missing = vec!["kc (sandbox kubeconfig)".into()];
        assert!(both
            .blocked()
            .is_some_and(|w| w.contains("missing Secrets")));
    }
}
