//! The sandbox NetworkPolicy: ingress only from this instance's server pods on the agent
//! port; egress only to cluster DNS, the instance's credential proxy pods and
//! `extraEgress`. Never to the Kubernetes API server: the sandbox holds no credential for
//! it, and reaches it only through the proxy, which injects one.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
    NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use cli_mcp_api::crd::SandboxDns;
use cli_mcp_api::names::label;
use cli_mcp_api::proxy::PROXY_PORT;
use cli_mcp_api::wire::AGENT_PORT;

use super::Inputs;

pub(super) fn port(protocol: &str, p: i32) -> NetworkPolicyPort {
    NetworkPolicyPort {
        protocol: Some(protocol.into()),
        port: Some(IntOrString::Int(p)),
        ..Default::default()
    }
}

pub(super) fn selector(labels: &[(&str, &str)]) -> LabelSelector {
    LabelSelector {
        match_labels: Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..Default::default()
    }
}

/// The address NodeLocal DNSCache listens on in every node (its documented default); pods
/// of clusters that run it have it as their only nameserver.
pub const NODE_LOCAL_DNS: &str = "169.254.20.10";

/// DNS peers: kube-dns/CoreDNS in kube-system, OpenShift's DNS daemonset, and NodeLocal
/// DNSCache on the node.
pub(super) fn dns_rule() -> NetworkPolicyEgressRule {
    NetworkPolicyEgressRule {
        to: Some(vec![
            NetworkPolicyPeer {
                namespace_selector: Some(selector(&[(
                    "kubernetes.io/metadata.name",
                    "kube-system",
                )])),
                pod_selector: Some(selector(&[("k8s-app", "kube-dns")])),
                ..Default::default()
            },
            NetworkPolicyPeer {
                namespace_selector: Some(selector(&[(
                    "kubernetes.io/metadata.name",
                    "openshift-dns",
                )])),
                pod_selector: Some(selector(&[(
                    "dns.operator.openshift.io/daemonset-dns",
                    "default",
                )])),
                ..Default::default()
            },
            ip_peer(NODE_LOCAL_DNS),
        ]),
        ports: Some(vec![
            port("UDP", 53),
            port("TCP", 53),
            port("UDP", 5353),
            port("TCP", 5353),
        ]),
    }
}

/// A peer of exactly one address.
pub(super) fn ip_peer(ip: &str) -> NetworkPolicyPeer {
    let cidr = if ip.contains(':') {
        format!("{ip}/128")
    } else {
        format!("{ip}/32")
    };
    cidr_peer(cidr)
}

pub(super) fn cidr_peer(cidr: impl Into<String>) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        ip_block: Some(IPBlock {
            cidr: cidr.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The Kubernetes API server's endpoints and Service IP on their ports (`None` when the
/// operator could not read them).
pub(super) fn api_server_rule(inp: &Inputs) -> Option<NetworkPolicyEgressRule> {
    if inp.api_server.ips.is_empty() {
        return None;
    }
    Some(NetworkPolicyEgressRule {
        to: Some(inp.api_server.ips.iter().map(|ip| ip_peer(ip)).collect()),
        ports: Some(
            inp.api_server
                .ports
                .iter()
                .map(|p| port("TCP", *p))
                .collect(),
        ),
    })
}

/// The instance's proxy pods, on the proxy port: the sandbox's only way to an API.
fn proxy_rule(n: &str) -> NetworkPolicyEgressRule {
    NetworkPolicyEgressRule {
        to: Some(vec![NetworkPolicyPeer {
            pod_selector: Some(selector(&[
                (label::INSTANCE, n),
                (label::COMPONENT, label::COMPONENT_PROXY),
            ])),
            ..Default::default()
        }]),
        ports: Some(vec![port("TCP", i32::from(PROXY_PORT))]),
    }
}

pub fn network_policy(inp: &Inputs) -> NetworkPolicy {
    let n = inp.spec.name.to_string();
    // Without DNS the sandbox reaches its proxy by the Service's ClusterIP (resolved by the
    // operator), and the proxy resolves the names it connects to.
    let mut egress = match inp.spec.sandbox_dns {
        SandboxDns::Allowed => vec![dns_rule(), proxy_rule(&n)],
        SandboxDns::Denied => vec![proxy_rule(&n)],
    };
    egress.extend(inp.spec.extra_egress.iter().cloned());
    NetworkPolicy {
        metadata: inp
            .spec
            .meta(inp.spec.name.sandbox(), label::COMPONENT_SANDBOX),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(selector(&[
                (label::INSTANCE, &n),
                (label::COMPONENT, label::COMPONENT_SANDBOX),
            ])),
            policy_types: Some(vec!["Ingress".into(), "Egress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(vec![NetworkPolicyPeer {
                    pod_selector: Some(selector(&[
                        (label::INSTANCE, &n),
                        (label::COMPONENT, label::COMPONENT_SERVER),
                    ])),
                    ..Default::default()
                }]),
                ports: Some(vec![port("TCP", i32::from(AGENT_PORT))]),
            }]),
            egress: Some(egress),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::test_support::inputs;

    #[test]
    fn sandbox_ingress_only_from_own_server_on_agent_port() {
        let np = network_policy(&inputs(serde_json::json!({})));
        let spec = np.spec.expect("spec");
        let ing = &spec.ingress.expect("ingress")[0];
        let from = &ing.from.as_ref().expect("from")[0];
        let sel = from
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .expect("labels");
        assert_eq!(sel[label::INSTANCE], "demo");
        assert_eq!(sel[label::COMPONENT], "server");
        assert!(from.namespace_selector.is_none(), "same namespace only");
        assert_eq!(
            ing.ports.as_ref().expect("ports")[0].port,
            Some(IntOrString::Int(8090))
        );
        assert_eq!(
            spec.policy_types,
            Some(vec!["Ingress".to_string(), "Egress".to_string()])
        );
    }

    #[test]
    fn dns_reaches_cluster_dns_openshift_dns_and_node_local_dns_on_53_only() {
        let rule = dns_rule();
        let peers = rule.to.as_ref().expect("peers");
        let namespaces: Vec<_> = peers
            .iter()
            .filter_map(|p| p.namespace_selector.as_ref())
            .filter_map(|s| s.match_labels.as_ref())
            .filter_map(|l| l.get("kubernetes.io/metadata.name").cloned())
            .collect();
        assert_eq!(namespaces, ["kube-system", "openshift-dns"]);
        let cidrs: Vec<_> = peers
            .iter()
            .filter_map(|p| p.ip_block.as_ref())
            .map(|b| b.cidr.as_str())
            .collect();
        assert_eq!(cidrs, ["169.254.20.10/32"]);
        let ports: Vec<_> = rule
            .ports
            .iter()
            .flatten()
            .map(|p| (p.protocol.clone().unwrap_or_default(), p.port.clone()))
            .collect();
        for (_, port) in &ports {
            assert!(
                matches!(port, Some(IntOrString::Int(53 | 5353))),
                "{ports:?}"
            );
        }
    }

    #[test]
    fn egress_is_dns_the_proxy_and_extra() {
        let np = network_policy(&inputs(
            serde_json::json!({"networkPolicy": {"extraEgress": [
                {"to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}], "ports": [{"port": 443}]}
            ]}}),
        ));
        let egress = np.spec.expect("spec").egress.expect("egress");
        assert_eq!(egress.len(), 3);
        assert_eq!(egress[1], proxy_rule("demo"));
        assert_eq!(
            egress[2].to.as_ref().expect("to")[0]
                .ip_block
                .as_ref()
                .map(|b| b.cidr.as_str()),
            Some("192.0.2.0/24")
        );
        // No rule allows everything.
        assert!(egress.iter().all(|r| r.to.is_some()));
    }

    #[test]
    fn without_dns_the_sandbox_reaches_its_proxy_and_extra_only() {
        let np = network_policy(&inputs(serde_json::json!({"networkPolicy": {
            "dns": "Denied",
            "extraEgress": [{"to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}], "ports": [{"port": 443}]}]
        }})));
        let egress = np.spec.expect("spec").egress.expect("egress");
        assert_eq!(egress.len(), 2, "{egress:?}");
        assert_eq!(egress[0], proxy_rule("demo"));
        assert!(
            !egress.contains(&dns_rule()),
            "no rule lets a DNS query out: {egress:?}"
        );
    }

    #[test]
    fn the_sandbox_reaches_the_proxy_and_never_the_api_server() {
        // With spec.proxy, and without it (the implied proxy, from the older
        // kubeconfigSecret or its default name) alike.
        for spec in [
            serde_json::json!({"proxy": {"targets": [{"type": "kubernetes"}]}}),
            serde_json::json!({}),
            serde_json::json!({"sandbox": {"kubeconfigSecret": "kc"}}),
        ] {
            the_sandbox_reaches_only_dns_and_the_proxy(spec);
        }
    }

    fn the_sandbox_reaches_only_dns_and_the_proxy(spec: serde_json::Value) {
        let np = network_policy(&inputs(spec));
        let egress = np.spec.expect("spec").egress.expect("egress");
        assert_eq!(egress.len(), 2, "DNS and the proxy: {egress:?}");
        let to = &egress[1].to.as_ref().expect("to")[0];
        let sel = to
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .expect("labels");
        assert_eq!(sel[label::COMPONENT], "proxy");
        assert_eq!(sel[label::INSTANCE], "demo");
        assert_eq!(
            egress[1].ports.as_ref().expect("ports")[0].port,
            Some(IntOrString::Int(8080))
        );
        // No address but NodeLocal DNSCache's (in the DNS rule, on DNS ports only).
        let node_dns = format!("{NODE_LOCAL_DNS}/32");
        assert!(
            egress.iter().all(|r| r
                .to
                .iter()
                .flatten()
                .all(|p| p.ip_block.as_ref().is_none_or(|b| b.cidr == node_dns))),
            "no address of the API server: {egress:?}"
        );
    }
}
