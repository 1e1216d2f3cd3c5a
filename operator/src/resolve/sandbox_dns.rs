//! Where a sandbox without DNS reaches its credential proxy: the proxy Service's ClusterIP.
//!
//! With `spec.networkPolicy.dns: Denied` the sandbox NetworkPolicy lets no DNS query out, so
//! a sandbox cannot resolve `cli-mcp-<n>-proxy.<ns>.svc`. Its agent's relay dials the
//! ClusterIP instead, which the operator reads from the Service it made (the first
//! reconcile creates the Service, its watch brings the next one with the address). A
//! ClusterIP lasts as long as the Service; if the Service is recreated, the address changes,
//! the sandbox configuration with it, and the warm pool is replaced.

use cli_mcp_api::crd::SandboxDns;
use cli_mcp_api::proxy::PROXY_PORT;

use crate::children::Spec;
use crate::context::{cached, Context};

/// What a DNS-less sandbox dials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyAddress {
    /// The sandbox may use DNS: the Service's name, as always.
    ByName,
    /// `http://<ClusterIP>:<port>`.
    ByIp(String),
    /// DNS is denied and the Service has no ClusterIP yet: no sandbox can reach the proxy.
    Pending(String),
}

pub fn proxy_address(ctx: &Context, spec: &Spec) -> ProxyAddress {
    if spec.sandbox_dns == SandboxDns::Allowed {
        return ProxyAddress::ByName;
    }
    let name = spec.name.proxy();
    let ip = cached(&ctx.stores.services, &spec.namespace, &name)
        .and_then(|s| s.spec.as_ref().and_then(|s| s.cluster_ip.clone()));
    address_of(ip.as_deref(), &name)
}

fn address_of(cluster_ip: Option<&str>, service: &str) -> ProxyAddress {
    match cluster_ip.and_then(|ip| ip.parse::<std::net::IpAddr>().ok()) {
        Some(std::net::IpAddr::V4(ip)) => ProxyAddress::ByIp(format!("http://{ip}:{PROXY_PORT}")),
        Some(std::net::IpAddr::V6(ip)) => ProxyAddress::ByIp(format!("http://[{ip}]:{PROXY_PORT}")),
        None => ProxyAddress::Pending(format!(
            "spec.networkPolicy.dns is Denied and the proxy Service {service} has no ClusterIP \
             yet: sandboxes reach their proxy by it, so none starts until it has one"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_ip_is_the_address_and_none_holds_the_sandboxes() {
        assert_eq!(
            address_of(Some("10.96.0.12"), "s"),
            ProxyAddress::ByIp("http://10.96.0.12:8080".into())
        );
        assert_eq!(
            address_of(Some("fd00::c"), "s"),
            ProxyAddress::ByIp("http://[fd00::c]:8080".into())
        );
        // Headless (None) or not assigned yet.
        assert!(
            matches!(address_of(Some("None"), "s"), ProxyAddress::Pending(m) if m.contains("ClusterIP"))
        );
        assert!(matches!(address_of(None, "s"), ProxyAddress::Pending(_)));
    }
}
