//! Cluster DNS of the process kubelet: CoreDNS as a host process on the pod gateway,
//! behind a `kube-dns` Service without a selector whose EndpointSlice points at it.

use std::fs;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

use super::ipv4_net::Ipv4Net;
use super::{CLUSTER_DOMAIN, DNS_SERVICE_IP};
use crate::cluster_info::ClusterInfo;
use crate::error::{Error, Result};
use crate::process::Component;

/// What CoreDNS of one cluster needs.
#[derive(Debug, Clone)]
pub struct DnsConfig {
    pub coredns: PathBuf,
    pub kubeconfig: PathBuf,
    /// Address CoreDNS binds (the pod gateway: pods reach it, other clusters use others).
    pub listen: Ipv4Addr,
    pub port: u16,
    /// `health` and `ready` listen on 127.0.0.1 at these ports.
    pub health_port: u16,
    pub ready_port: u16,
    pub domain: String,
}

/// The Corefile: one server for the cluster domain and the reverse zones, answered from
/// the Kubernetes API only. No `forward` plugin (it is not even linked into the binary):
/// a name outside these zones matches no server block and gets REFUSED, without a packet
/// leaving the machine.
pub fn corefile(cfg: &DnsConfig) -> String {
    let p = cfg.port;
    let d = &cfg.domain;
    format!(
        r#"{d}:{p} in-addr.arpa:{p} ip6.arpa:{p} {{
    bind {listen}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes {d} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods disabled
        ttl 5
    }}
    cache 5
}}
"#,
        listen = cfg.listen,
        health = cfg.health_port,
        ready = cfg.ready_port,
        kubeconfig = cfg.kubeconfig.display(),
    )
}

/// The `kube-dns` Service (ClusterIP [`DNS_SERVICE_IP`], no selector) and its
/// EndpointSlice pointing at CoreDNS on the host, so that a kube-proxy routes the ClusterIP
/// to it and CoreDNS itself answers `kube-dns.kube-system.svc`.
pub fn kube_dns_objects(endpoint: Ipv4Addr, port: u16) -> (Service, EndpointSlice) {
    let labels = std::collections::BTreeMap::from([
        ("k8s-app".to_string(), "kube-dns".to_string()),
        ("kubernetes.io/name".to_string(), "CoreDNS".to_string()),
    ]);
    let svc_port = |name: &str, proto: &str| ServicePort {
        name: Some(name.into()),
        protocol: Some(proto.into()),
        port: 53,
        target_port: Some(
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i32::from(port)),
        ),
        ..Default::default()
    };
    let service = Service {
        metadata: ObjectMeta {
            name: Some("kube-dns".into()),
            namespace: Some("kube-system".into()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(DNS_SERVICE_IP.to_string()),
            ports: Some(vec![svc_port("dns", "UDP"), svc_port("dns-tcp", "TCP")]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let ep_port = |name: &str, proto: &str| EndpointPort {
        name: Some(name.into()),
        protocol: Some(proto.into()),
        port: Some(i32::from(port)),
        ..Default::default()
    };
    let slice = EndpointSlice {
        metadata: ObjectMeta {
            name: Some("kube-dns-host".into()),
            namespace: Some("kube-system".into()),
            labels: Some(std::collections::BTreeMap::from([
                (
                    "kubernetes.io/service-name".to_string(),
                    "kube-dns".to_string(),
                ),
                (
                    "endpointslice.kubernetes.io/managed-by".to_string(),
                    "cli-mcp-e2e".to_string(),
                ),
            ])),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: Some(vec![Endpoint {
            addresses: vec![endpoint.to_string()],
            ..Default::default()
        }]),
        ports: Some(vec![ep_port("dns", "UDP"), ep_port("dns-tcp", "TCP")]),
    };
    (service, slice)
}

async fn create_or_keep<K>(api: Api<K>, obj: &K) -> Result<()>
where
    K: Clone + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned,
{
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// CoreDNS of one cluster on the host. Dropping it stops CoreDNS.
#[derive(Debug)]
pub struct ClusterDns {
    component: Component,
    addr: SocketAddrV4,
}

impl ClusterDns {
    /// Start CoreDNS for `info`'s cluster on its pod gateway, port 53, wait until it is
    /// ready (its Kubernetes caches synced), and create the `kube-dns` Service.
    pub async fn start(info: &ClusterInfo, bin_dir: &Path) -> Result<ClusterDns> {
        let pod_cidr = Ipv4Net::parse(&info.pod_cidr).ok_or_else(|| {
            Error::Other(format!(
                "pod CIDR {:?} is not an IPv4 network",
                info.pod_cidr
            ))
        })?;
        let cfg = DnsConfig {
            coredns: bin_dir.join("coredns"),
            kubeconfig: info.kubeconfig.clone(),
            listen: pod_cidr.first_host(),
            port: 53,
            health_port: crate::net::free_port(Ipv4Addr::LOCALHOST)?,
            ready_port: crate::net::free_port(Ipv4Addr::LOCALHOST)?,
            domain: CLUSTER_DOMAIN.into(),
        };
        let dir = info.run_dir.join("addons");
        fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
        let conf = dir.join("Corefile");
        fs::write(&conf, corefile(&cfg)).map_err(|e| Error::io("writing", &conf, e))?;
        let log = info.log_dir.join("coredns.log");
        let mut component = Component::start(
            "coredns",
            &cfg.coredns,
            &["-conf".to_string(), conf.display().to_string()],
            &[],
            &log,
            Duration::from_secs(10),
            true,
        )?;
        let ready = format!("http://127.0.0.1:{}/ready", cfg.ready_port);
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| Error::Other(format!("building an HTTP client: {e}")))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(e) = component.exited_error() {
                return Err(e);
            }
            if http
                .get(&ready)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!("CoreDNS ready at {ready} (log {})", log.display()),
                    elapsed: Duration::from_secs(60),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let client = info.client().await?;
        let (svc, slice) = kube_dns_objects(cfg.listen, cfg.port);
        create_or_keep(
            Api::<Service>::namespaced(client.clone(), "kube-system"),
            &svc,
        )
        .await?;
        create_or_keep(
            Api::<EndpointSlice>::namespaced(client, "kube-system"),
            &slice,
        )
        .await?;
        Ok(ClusterDns {
            component,
            addr: SocketAddrV4::new(cfg.listen, cfg.port),
        })
    }

    /// Why CoreDNS is not running any more, if it exited.
    pub fn exited_error(&mut self) -> Option<Error> {
        self.component.exited_error()
    }

    /// Where pods reach CoreDNS directly (the pod gateway, port 53).
    pub fn addr(&self) -> SocketAddrV4 {
        self.addr
    }

    /// Path of CoreDNS's log.
    pub fn log(&self) -> &Path {
        self.component.log()
    }

    /// Stop CoreDNS.
    pub async fn stop(mut self) {
        self.component.stop_async().await;
    }
}

/// The cluster DNS address the process kubelet writes into pods' resolv.conf: the pod
/// gateway, where [`ClusterDns`] binds port 53. `None` when something on the host already
/// holds port 53 on that address (a local resolver on all addresses): pods would reach the
/// host's resolver there, so `Cluster::up` refuses to start.
pub fn process_cluster_dns(gateway: Ipv4Addr) -> Option<Ipv4Addr> {
    let free = UdpSocket::bind((gateway, 53)).is_ok()
        && std::net::TcpListener::bind((gateway, 53)).is_ok();
    free.then_some(gateway)
}

/// The `kube-dns` Service of a cluster, if it exists.
pub async fn kube_dns_service(client: Client) -> Result<Option<Service>> {
    Ok(Api::<Service>::namespaced(client, "kube-system")
        .get_opt("kube-dns")
        .await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dns() -> DnsConfig {
        DnsConfig {
            coredns: PathBuf::from("/bin/coredns"),
            kubeconfig: PathBuf::from("/run/kc"),
            listen: Ipv4Addr::new(10, 244, 3, 1),
            port: 53,
            health_port: 4001,
            ready_port: 4002,
            domain: CLUSTER_DOMAIN.into(),
        }
    }

    #[test]
    fn the_corefile_answers_cluster_names_only_and_forwards_nothing() {
        let c = corefile(&dns());
        assert!(
            c.starts_with("cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {"),
            "{c}"
        );
        assert!(c.contains("bind 10.244.3.1\n"));
        assert!(c.contains("kubernetes cluster.local in-addr.arpa ip6.arpa {"));
        assert!(c.contains("kubeconfig /run/kc\n"));
        assert!(c.contains("pods disabled\n"));
        assert!(c.contains("health 127.0.0.1:4001\n") && c.contains("ready 127.0.0.1:4002\n"));
        assert!(c.contains("errors\n"));
        for absent in ["forward", "proxy", "fallthrough", ".:53", "\n. "] {
            assert!(!c.contains(absent), "{absent:?} in {c}");
        }
    }

    #[test]
    fn process_pods_get_no_cluster_dns_where_port_53_is_taken() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: binding port 53 needs root");
            return;
        }
        // Loopback addresses no cluster uses (every pod gateway is in 10.244.0.0/16).
        let free = Ipv4Addr::new(127, 77, 0, 1);
        assert_eq!(process_cluster_dns(free), Some(free));
        let taken = Ipv4Addr::new(127, 77, 0, 2);
        let _resolver = UdpSocket::bind((taken, 53)).expect("holding UDP 53");
        assert_eq!(process_cluster_dns(taken), None, "a resolver holds UDP 53");
        let tcp_only = Ipv4Addr::new(127, 77, 0, 3);
        let _listener = std::net::TcpListener::bind((tcp_only, 53)).expect("holding TCP 53");
        assert_eq!(
            process_cluster_dns(tcp_only),
            None,
            "a resolver holds TCP 53"
        );
    }

    #[test]
    fn kube_dns_service_points_at_coredns() {
        let (svc, slice) = kube_dns_objects(Ipv4Addr::new(10, 244, 3, 1), 53);
        let spec = svc.spec.expect("spec");
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(spec.selector, None);
        assert_eq!(spec.ports.expect("ports").len(), 2);
        assert_eq!(
            slice.endpoints.expect("endpoints")[0].addresses,
            vec!["10.244.3.1".to_string()]
        );
        assert_eq!(
            slice.metadata.labels.expect("labels")["kubernetes.io/service-name"],
            "kube-dns"
        );
    }
}
