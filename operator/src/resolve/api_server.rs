//! The API server's addresses as pods see them, for the credential proxy's NetworkPolicy:
//! looked up now and then, and kept through a failed lookup.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use kube::Api;

use crate::children::ApiServerPeers;
use crate::context::Context;

/// How long the API server addresses are cached.
const API_PEERS_TTL: Duration = Duration::from_secs(300);
/// How soon a failed lookup of the API server's addresses is tried again.
pub const API_PEERS_RETRY: Duration = Duration::from_secs(30);

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
/// EndpointSlice addresses. Cached for `API_PEERS_TTL`. A lookup that fails (RBAC, a
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
