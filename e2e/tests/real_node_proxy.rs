//! The credential proxy on real containers: a private real-node cluster (kubelet + kube-proxy
//! on containerd/runc, CoreDNS, kube-router enforcing NetworkPolicy) with the project's
//! images, the operator from `config/default`, and an instance with `spec.proxy`: a
//! kubernetes target holding the read-only investigation identity's kubeconfig.
//!
//! What a shell in the sandbox can and cannot do, tried from inside the session as a
//! prompt-injected model would:
//! - the instance is Ready only once its proxy serves; the sandbox mounts no Secret, and the
//!   real token is in none of its env, its kubeconfig or its mounted files;
//! - `kubectl get` works (through the proxy, the token injected there);
//! - `kubectl exec` is refused by the proxy with its message;
//! - the API server cannot be reached around the proxy (the sandbox's NetworkPolicy), and a
//!   host that is no route gets the proxy's 403;
//! - the proxy accepts connections only from the instance's sandboxes;
//! - an allow-listed in-cluster HTTPS server (run by the test inside a pod's network
//!   namespace, its certificate from a CA the test makes) is reached through the proxy from
//!   the session, which verifies it: unknown to the proxy's trust store it is a 502 naming
//!   the certificate; its CA named as the target's `caConfigMap` before the ConfigMap exists,
//!   the instance is Ready=False `ProxyCaInvalid` saying so while the proxy keeps serving;
//!   once the ConfigMap exists the proxy rolls and the server answers, with the session's
//!   credentials stripped; a port of it that is no route gets the proxy's 403 and no
//!   connection;
//! - a WebSocket upgrade to that server (curl with the upgrade headers) gets the server's
//!   `101` and the frame it sends after it, without the session's credentials; the same
//!   upgrade to the API server's route is refused with 403;
//! - hostile clients in the session: an oversized header gets 431 (on CONNECT and inside a
//!   tunnel), a CONNECT to a non-route 403, a client that never finishes its head 408, and
//!   the proxy pods stay Ready with no restart;
//! - both NetworkPolicies (the sandbox's and the proxy's) deleted under the live session: the
//!   operator restores them, after which the sandbox still cannot reach the API server
//!   directly nor the server the proxy, and calls through the proxy keep working;
//! - a proxy replica killed: once it is gone from the Service, calls keep working;
//! - the token rotated in the admin's Secret and the old one revoked: the session's next
//!   calls use the new one within seconds, no sandbox or proxy pod restarted;
//! - `spec.proxy` removed: the implied proxy takes over (the same kubeconfig Secret, the
//!   kubernetes target alone): the allow-listed server is no route any more (403), and the
//!   session's `kubectl` still works through the proxy.
//!
//! Skipped, saying so, when not root or when the host cannot run the real node.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cli_mcp_api::names::label;
use cli_mcp_api::pod_state::is_ready;
use cli_mcp_e2e::addons::{in_netns, Reach};
use cli_mcp_e2e::journey::{stdout, text, Env, Mcp};
use cli_mcp_e2e::peer::{expect, peer, reach};
use cli_mcp_e2e::real_node_rig::RealNodeRig;
use cli_mcp_e2e::testing::{pod_ip, ready_pods, wait_for, wait_for_set, TIMEOUT};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

const AGENT_PORT: u16 = cli_mcp_api::wire::AGENT_PORT;
const PROXY_PORT: u16 = cli_mcp_api::proxy::PROXY_PORT;
/// How soon a rotated token must be in use: well under the kubelet's periodic pod sync
/// (about a minute), so only the operator's nudge of the proxy pods can meet it.
const ROTATION: Duration = Duration::from_secs(30);

const ROUTES_VERSION: &str = "cli-mcp.redhat.com/proxy-routes-version";

/// The route-table version a proxy pod was started with.
fn routes_version(p: &Pod) -> Option<String> {
    p.metadata
        .annotations
        .as_ref()?
        .get(ROUTES_VERSION)
        .cloned()
}

/// Waits until the proxy has rolled away from the route table `old`: two ready pods with
/// another table, and no pod with `old` left at all — not even one terminating, which serves
/// new connections for its shutdown delay while every kube-proxy drops its endpoint.
async fn proxy_rolled_from(api: Api<Pod>, selector: &str, old: &Option<String>, what: &str) {
    wait_for_set(api, selector, what, TIMEOUT, |ps: &[Pod]| {
        let new = |p: &&Pod| routes_version(p) != *old;
        ps.iter()
            .filter(new)
            .filter(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none())
            .count()
            >= 2
            && ps.iter().all(|p| new(&p))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Whether the API server accepts `token` (the admin kubeconfig's server and CA, no client
/// certificate).
async fn token_works(kubeconfig: &std::path::Path, token: &str) -> bool {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("admin kubeconfig");
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .expect("client config");
    cfg.auth_info = kube::config::AuthInfo {
        token: Some(token.to_owned().into()),
        ..Default::default()
    };
    let client = kube::Client::try_from(cfg).expect("client");
    match Api::<k8s_openapi::api::core::v1::Namespace>::all(client)
        .list(&ListParams::default().limit(1))
        .await
    {
        Ok(_) => true,
        Err(kube::Error::Api(s)) if s.code == 401 => false,
        // Authenticated but not allowed is still a working token.
        Err(kube::Error::Api(s)) if s.code == 403 => true,
        Err(e) => panic!("asking the API server with a token: {e}"),
    }
}

/// A command that must succeed; its stdout.
async fn ok(mcp: &Mcp, sid: &str, command: &str) -> String {
    let r = mcp.bash(sid, command).await;
    assert_eq!(r["isError"], false, "{command}: {}", text(&r));
    stdout(&r).to_owned()
}

/// A command's whole result text (stdout, stderr, exit code), whatever its outcome.
async fn run(mcp: &Mcp, sid: &str, command: &str) -> (Value, String) {
    let r = mcp.bash(sid, command).await;
    let t = text(&r);
    (r, t)
}

/// The allow-listed port of the test's HTTPS server, and one that is no route.
const WEB_PORT: u16 = 8443;
const UNROUTED_PORT: u16 = 9443;
const WEB_BODY: &str = "hello from the allow-listed server\n";

/// What reached the test's HTTPS server: the source of every TCP connection (by port) and
/// every request head that arrived over TLS.
#[derive(Debug, Default)]
struct WebLog {
    peers: Vec<(u16, std::net::IpAddr)>,
    heads: Vec<String>,
}

/// A CA made for this run, and a TLS acceptor presenting a leaf it signed for `host`.
fn web_tls(host: &str) -> (String, TlsAcceptor) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.distinguished_name
        .push(DnType::CommonName, "real-node web test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca, &ca_key);
    let key = KeyPair::generate().expect("leaf key");
    let leaf = CertificateParams::new(vec![host.to_owned()])
        .expect("leaf params")
        .signed_by(&key, &issuer)
        .expect("leaf certificate");
    let config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from(leaf.der().to_vec())],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .expect("server TLS config");
    (ca_cert.pem(), TlsAcceptor::from(Arc::new(config)))
}

/// Serves HTTPS on `port` inside the network namespace `netns` (a pod's: the connections
/// come to the pod's IP, through its policies), from this process. Each connection gets
/// one fixed answer, after its request head.
async fn serve_web(netns: &std::path::Path, port: u16, tls: TlsAcceptor, log: Arc<Mutex<WebLog>>) {
    let ns = netns.to_path_buf();
    let listener = tokio::task::spawn_blocking(move || {
        in_netns(&ns, move || {
            std::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
        })
    })
    .await
    .expect("join")
    .unwrap_or_else(|e| panic!("{e}"))
    .unwrap_or_else(|e| panic!("listening on {port} in the web pod: {e}"));
    listener.set_nonblocking(true).expect("non-blocking");
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
    tokio::spawn(async move {
        while let Ok((tcp, from)) = listener.accept().await {
            log.lock().expect("web log").peers.push((port, from.ip()));
            let (tls, log) = (tls.clone(), log.clone());
            tokio::spawn(async move {
                let limit = Duration::from_secs(10);
                let Ok(Ok(mut stream)) = tokio::time::timeout(limit, tls.accept(tcp)).await else {
                    return;
                };
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tokio::time::timeout(limit, stream.read(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 && head.len() < 65536 => {
                            head.extend_from_slice(&buf[..n])
                        }
                        _ => return,
                    }
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                log.lock().expect("web log").heads.push(text.clone());
                if let Some(key) = websocket_key(&text) {
                    // A WebSocket: 101, then one text frame carrying the client's key back,
                    // and a close frame.
                    let accept = websocket_accept(&key);
                    let mut reply = format!(
                        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\
                         connection: Upgrade\r\nsec-websocket-accept: {accept}\r\n\r\n"
                    )
                    .into_bytes();
                    let payload = format!("{WS_ECHO}{key}");
                    reply.extend([0x81, payload.len() as u8]);
                    reply.extend(payload.as_bytes());
                    reply.extend([0x88, 0x00]);
                    let _ = stream.write_all(&reply).await;
                    let _ = stream.shutdown().await;
                    return;
                }
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\
                     connection: close\r\n\r\n{WEB_BODY}",
                    WEB_BODY.len()
                );
                let _ = stream.write_all(reply.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
}

/// What the test server's WebSocket frame starts with, before the client's key.
const WS_ECHO: &str = "websocket echo of key ";

/// The `Sec-WebSocket-Key` of a WebSocket upgrade request head, if it is one.
fn websocket_key(head: &str) -> Option<String> {
    let lower = head.to_ascii_lowercase();
    if !lower.contains("\r\nupgrade: websocket\r\n") {
        return None;
    }
    head.split("\r\n").find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("sec-websocket-key")
            .then(|| value.trim().to_owned())
    })
}

/// `Sec-WebSocket-Accept` for `key` (RFC 6455 section 4.2.2): base64 of the SHA-1 of the key
/// and the protocol's GUID.
fn websocket_accept(key: &str) -> String {
    use base64::Engine;
    let digest = sha1(format!("{key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11").as_bytes());
    base64::engine::general_purpose::STANDARD.encode(digest)
}

/// SHA-1 (RFC 3174), only for the WebSocket handshake above.
fn sha1(data: &[u8]) -> [u8; 20] {
    let mut h: [u32; 5] = [0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend(((data.len() as u64) * 8).to_be_bytes());
    for chunk in msg.chunks(64) {
        let mut w = [0u32; 80];
        for (i, word) in chunk.chunks(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..80 {
            w[i] = (w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16]).rotate_left(1);
        }
        let [mut a, mut b, mut c, mut d, mut e] = h;
        for (i, wi) in w.iter().enumerate() {
            let (f, k) = match i {
                0..=19 => ((b & c) | (!b & d), 0x5A827999),
                20..=39 => (b ^ c ^ d, 0x6ED9EBA1),
                40..=59 => ((b & c) | (b & d) | (c & d), 0x8F1BBCDC),
                _ => (b ^ c ^ d, 0xCA62C1D6),
            };
            let t = a
                .rotate_left(5)
                .wrapping_add(f)
                .wrapping_add(e)
                .wrapping_add(k)
                .wrapping_add(*wi);
            (e, d, c, b, a) = (d, c, b.rotate_left(30), a, t);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 20];
    for (i, x) in h.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&x.to_be_bytes());
    }
    out
}

#[test]
fn the_websocket_accept_is_rfc_6455s() {
    // The example of RFC 6455 section 1.3.
    assert_eq!(
        websocket_accept("dGhlIHNhbXBsZSBub25jZQ=="),
        "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    );
}

/// The restart counts of the ready proxy pods, by name.
fn restarts(pods: &[Pod]) -> Vec<(String, i32)> {
    let mut r: Vec<(String, i32)> = pods
        .iter()
        .map(|p| {
            let n = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map(|cs| cs.iter().map(|c| c.restart_count).sum())
                .unwrap_or(0);
            (p.name_any(), n)
        })
        .collect();
    r.sort();
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sandbox_behind_the_proxy_holds_no_credential_and_cannot_get_around_it() {
    let t0 = Instant::now();
    let Some(rig) = RealNodeRig::start("real_node_proxy").await else {
        return;
    };
    let RealNodeRig {
        pc,
        info,
        socket,
        images,
        mut enforcer,
        gateway,
        run_dir: _,
    } = rig;
    assert!(
        images.names().iter().any(|n| n.contains("/cli-mcp-proxy:")),
        "the build has no proxy image ({:?}); hack/build-images.sh must build cli-mcp-proxy",
        images.names()
    );

    // --- An instance whose sandboxes reach the API through the proxy only ---------------------
    let mut env = Env::install_on(pc.test.clone(), "rn-proxy").await;
    env.investigation_kubeconfig("p").await;
    let ns = env.ns.name.clone();
    let web_host = format!("web.{ns}.svc");
    let web = format!("{web_host}:{WEB_PORT}");
    let unrouted = format!("{web_host}:{UNROUTED_PORT}");
    let mut cr = env.cr("p", 1);
    cr["spec"]["proxy"] = json!({"targets": [
        {"type": "kubernetes"},
        {"type": "allowlist", "domains": [web]},
    ]});
    cr["spec"]["sandbox"]["resources"] = json!({
        "requests": {"cpu": "5m", "memory": "64Mi"},
        "limits": {"cpu": "1", "memory": "256Mi"},
    });
    env.apply_cr(&cr).await;
    let ready = env.wait_ready("p").await;
    eprintln!("instance Ready after {:.1?}", t0.elapsed());
    let pods = env.api::<Pod>();
    let sel = |component: &str| format!("{}=p,{}={component}", label::INSTANCE, label::COMPONENT);
    let proxies = ready_pods(pods.clone(), &sel("proxy"), 2).await;
    assert!(
        ready.status.as_ref().is_some_and(|s| s.ready_replicas >= 1),
        "{ready:?}"
    );

    let token = {
        let s = env
            .api::<Secret>()
            .get("cli-mcp-investigator-token")
            .await
            .expect("the investigator's token Secret");
        let data = s.data.unwrap_or_default();
        String::from_utf8(data["token"].0.clone()).expect("token utf-8")
    };
    assert!(token.len() > 20, "a real token");

    // --- The sandbox holds no credential -----------------------------------------------------
    let mcp = env.client("p").await;
    let seen = ok(
        &mcp,
        "s1",
        "export MARK=kept; env; echo ---; cat \"$KUBECONFIG\"; echo ---; \
         ls -la /etc/cli-mcp /etc/cli-mcp/* /var/run/secrets 2>&1; echo ---; \
         cat /etc/cli-mcp/proxy-client/* 2>&1",
    )
    .await;
    assert!(
        !seen.contains(&token),
        "the real token is readable in the sandbox:\n{seen}"
    );
    assert!(
        seen.contains(cli_mcp_api::proxy::PLACEHOLDER_TOKEN),
        "the dummy kubeconfig: {seen}"
    );
    // The clients go through the agent's relay, which alone holds the way to the proxy.
    assert!(
        seen.contains("HTTPS_PROXY=http://127.0.0.1:3128"),
        "proxy env: {seen}"
    );
    let s1 = ready_pods(
        pods.clone(),
        &format!("{},{}=s1", sel("sandbox"), label::SESSION_ID),
        1,
    )
    .await
    .remove(0);
    let volumes = s1
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    // No Secret; the one projected volume is the pod's token for its proxy alone.
    assert!(
        volumes.iter().all(|v| v.secret.is_none()
            && v.projected
                .as_ref()
                .is_none_or(|p| p.sources.iter().flatten().all(|s| s
                    .service_account_token
                    .as_ref()
                    .is_some_and(|t| t.audience.as_deref()
                        == Some(&format!("cli-mcp-proxy:{}:p", env.ns.name))
                        && s.secret.is_none())))),
        "a sandbox behind the proxy mounts no Secret: {volumes:?}"
    );

    // --- kubectl works through the proxy, and exec is refused there -----------------------------
    let listed = ok(&mcp, "s1", "kubectl get ns -o name").await;
    assert!(
        listed.lines().any(|l| l == "namespace/kube-system"),
        "kubectl get ns through the proxy: {listed}"
    );
    let (r, t) = run(
        &mcp,
        "s1",
        "kubectl -n \"$POD_NAMESPACE\" exec \"$POD_NAME\" -- true",
    )
    .await;
    assert_eq!(r["isError"], true, "{t}");
    assert!(
        t.contains("the proxy never allows pods/exec"),
        "kubectl exec is refused by the proxy itself: {t}"
    );

    // --- No way around it ------------------------------------------------------------------------
    let apiserver = format!("https://{gateway}:{}/version", info.apiserver_port);
    let (r, t) = run(
        &mcp,
        "s1",
        &format!("curl -sS --noproxy '*' -k -m 3 -o /dev/null -w '%{{http_code}}' {apiserver}"),
    )
    .await;
    assert_eq!(
        r["isError"], true,
        "the API server answered the sandbox directly: {t}"
    );
    let (r, t) = run(
        &mcp,
        "s1",
        "curl -sS -m 5 -o /dev/null https://192.0.2.10/ 2>&1",
    )
    .await;
    assert_eq!(r["isError"], true, "{t}");
    assert!(
        t.contains("403"),
        "a host that is no route gets the proxy's 403: {t}"
    );

    // The same at the packet level, from the sandbox's network namespace: the API server
    // (endpoint and Service IP) is closed, the proxy's port is open.
    let sandbox = peer(&socket, "sandbox p", &s1);
    expect(&sandbox, gateway, info.apiserver_port, "apiserver", false).await;
    expect(
        &sandbox,
        Ipv4Addr::new(10, 96, 0, 1),
        443,
        "kubernetes",
        false,
    )
    .await;
    let proxy_ip: Ipv4Addr = pod_ip(&proxies[0])
        .and_then(|ip| ip.parse().ok())
        .expect("proxy pod IP");
    expect(&sandbox, proxy_ip, PROXY_PORT, "proxy", true).await;
    // Only this instance's sandboxes reach the proxy: not its server.
    let server = ready_pods(pods.clone(), &sel("server"), 1).await.remove(0);
    let server_peer = peer(&socket, "server p", &server);
    expect(&server_peer, proxy_ip, PROXY_PORT, "proxy", false).await;
    expect(&server_peer, sandbox.ip, AGENT_PORT, "sandbox p", true).await;

    // --- An allow-listed in-cluster HTTPS server, verified by the proxy -------------------------
    // A pod whose network namespace the test serves HTTPS in, behind a Service; the proxy
    // verifies unpinned allow-list upstreams against its trust store, which does not know the
    // test's CA yet.
    let sandbox_image = images
        .names()
        .into_iter()
        .find(|n| n.contains("/cli-mcp-sandbox:"))
        .expect("the sandbox image");
    let web_pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "securityContext": {
                "runAsNonRoot": true, "runAsUser": 1001, "runAsGroup": 0,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [{
                // IfNotPresent: the node pulls the project's images from its registry.
                "name": "c", "image": sandbox_image, "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "infinity"],
                "securityContext": {
                    "readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"]},
                },
            }],
        }
    }))
    .expect("web pod manifest");
    pods.create(&PostParams::default(), &web_pod)
        .await
        .expect("creating the web pod");
    let web_svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [
            {"name": "routed", "port": WEB_PORT, "targetPort": WEB_PORT},
            {"name": "unrouted", "port": UNROUTED_PORT, "targetPort": UNROUTED_PORT},
        ]}
    }))
    .expect("web Service manifest");
    env.api::<Service>()
        .create(&PostParams::default(), &web_svc)
        .await
        .expect("creating the web Service");
    let web_pod = ready_pods(pods.clone(), "app=web", 1).await.remove(0);
    let web_peer = peer(&socket, "web", &web_pod);
    let (web_ca, web_acceptor) = web_tls(&web_host);
    let web_log = Arc::new(Mutex::new(WebLog::default()));
    for port in [WEB_PORT, UNROUTED_PORT] {
        serve_web(
            web_peer.netns(),
            port,
            web_acceptor.clone(),
            web_log.clone(),
        )
        .await;
    }
    // Reachable from the sandbox's namespace only through the proxy: its policy has no rule
    // for the web pod.
    expect(&sandbox, web_peer.ip, WEB_PORT, "web", false).await;
    let proxy_ips: Vec<std::net::IpAddr> = proxies
        .iter()
        .filter_map(|p| pod_ip(p).and_then(|ip| ip.parse().ok()))
        .collect();
    // Until the node routes the new Service to the pod, connecting fails (kube-proxy rejects
    // a Service without endpoints): a 502 as well, but one that names the connection.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (_, t) = run(
            &mcp,
            "s1",
            &format!("curl -sS -m 20 -w '\\n%{{http_code}}\\n' https://{web}/untrusted 2>&1"),
        )
        .await;
        if t.contains(&format!("TLS with {web}")) {
            assert!(t.contains("\n502"), "{t}");
            break;
        }
        assert!(
            Instant::now() < deadline && t.contains(&format!("connecting to {web}")),
            "an allow-listed upstream the proxy cannot verify is a 502 naming TLS: {t}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    {
        let log = web_log.lock().expect("web log");
        assert!(
            log.peers
                .iter()
                .any(|(port, ip)| *port == WEB_PORT && proxy_ips.contains(ip)),
            "the proxy reached the allow-listed server (its NetworkPolicy allows the route's \
             port): {log:?}"
        );
        assert!(
            log.heads.is_empty(),
            "no request reached an unverified upstream: {log:?}"
        );
    }
    let (_, t) = run(
        &mcp,
        "s1",
        &format!("curl -sS -m 20 -o /dev/null https://{unrouted}/ 2>&1"),
    )
    .await;
    assert!(
        t.contains("403"),
        "a port of the server that is no route: {t}"
    );
    assert!(
        web_log
            .lock()
            .expect("web log")
            .peers
            .iter()
            .all(|(port, _)| *port != UNROUTED_PORT),
        "nothing connected to the port that is no route"
    );
    eprintln!("allow-list route: reached and verified by the proxy; a non-route port 403");

    // --- Hostile clients in the session -----------------------------------------------------------
    let connections_before = web_log.lock().expect("web log").peers.len();
    let big = "head -c 40000 /dev/zero | tr '\\0' a";
    // On the CONNECT head (curl sends --proxy-header there) and inside a tunnel.
    let (_, t) = run(
        &mcp,
        "s1",
        &format!(
            "curl -sS -m 20 -o /dev/null --proxy-header \"X-Big: $({big})\" https://{web}/ 2>&1"
        ),
    )
    .await;
    assert!(t.contains("431"), "an oversized CONNECT head: {t}");
    let code = ok(
        &mcp,
        "s1",
        &format!(
            "curl -sS -m 20 -o /dev/null -w '%{{http_code}}' -H \"X-Big: $({big})\" https://{web}/"
        ),
    )
    .await;
    assert_eq!(code.trim(), "431", "an oversized head inside the tunnel");
    assert_eq!(
        web_log.lock().expect("web log").peers.len(),
        connections_before,
        "an oversized head reached no upstream"
    );
    // A client that starts its CONNECT head and never finishes it, on bash's /dev/tcp.
    let slow = ok(
        &mcp,
        "s1",
        &format!(
            "exec 3<>/dev/tcp/cli-mcp-p-proxy.{ns}.svc/8080; \
             printf 'CONNECT {web} HTTP/1.1\\r\\nHost: {web}\\r\\nX-Slow: ' >&3; \
             start=$SECONDS; timeout 45 cat <&3; echo; echo \"closed after $((SECONDS - start))s\""
        ),
    )
    .await;
    assert!(
        slow.starts_with("HTTP/1.1 408") && slow.contains("--header-read-timeout"),
        "a client that never finishes its head gets 408: {slow}"
    );
    eprintln!("slow client: {}", slow.lines().last().unwrap_or_default());
    let after = ready_pods(pods.clone(), &sel("proxy"), 2).await;
    assert_eq!(
        restarts(&after),
        restarts(&proxies)
            .into_iter()
            .map(|(n, _)| (n, 0))
            .collect::<Vec<_>>(),
        "the proxy pods are the same, Ready and never restarted after the hostile clients"
    );
    eprintln!("hostile clients: 431 outside and inside, 403, 408; proxies Ready, no restart");

    // --- Both NetworkPolicies deleted under the live session: restored -------------------------
    let policies = env.api::<NetworkPolicy>();
    for name in ["cli-mcp-p-sandbox", "cli-mcp-p-proxy"] {
        let before = policies
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("NetworkPolicy {name}: {e}"))
            .uid();
        policies
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("deleting NetworkPolicy {name}: {e}"));
        wait_for(
            policies.clone(),
            name,
            &format!("NetworkPolicy {name} restored by the operator"),
            TIMEOUT,
            move |n: Option<&NetworkPolicy>| n.is_some_and(|n| n.uid() != before),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")));
    }
    let restored = Instant::now();
    expect(&sandbox, gateway, info.apiserver_port, "apiserver", false).await;
    expect(&server_peer, proxy_ip, PROXY_PORT, "proxy", false).await;
    let (r, t) = run(
        &mcp,
        "s1",
        &format!("curl -sS --noproxy '*' -k -m 3 -o /dev/null -w '%{{http_code}}' {apiserver}"),
    )
    .await;
    assert_eq!(
        r["isError"], true,
        "the API server answered the sandbox directly after the policies were restored: {t}"
    );
    let listed = ok(&mcp, "s1", "kubectl get ns kube-system -o name").await;
    assert_eq!(listed.trim(), "namespace/kube-system", "{listed}");
    eprintln!(
        "policies restored; enforced again {:.1?} after; calls through the proxy work",
        restored.elapsed()
    );

    // --- One proxy replica killed ---------------------------------------------------------------
    let victim = proxies[0].name_any();
    pods.delete(&victim, &DeleteParams::default().grace_period(0))
        .await
        .expect("killing one proxy replica");
    let slices: Api<EndpointSlice> = env.api();
    let gone = Instant::now() + TIMEOUT;
    loop {
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=cli-mcp-p-proxy"))
            .await
            .expect("proxy EndpointSlices");
        let serving: Vec<String> = list
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
            .flat_map(|e| e.addresses.clone())
            .collect();
        if !serving.contains(&proxy_ip.to_string()) && !serving.is_empty() {
            break;
        }
        assert!(
            Instant::now() < gone,
            "the killed proxy {victim} ({proxy_ip}) never left the Service: {serving:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Out of the EndpointSlice is not yet out of the node's rules: kube-proxy syncs on its own
    // schedule. Gone means 20 connections in a row through the Service IP all reach a live
    // replica (with the dead one still in the rules, each has an even chance to fail).
    let service_ip: Ipv4Addr = env
        .api::<Service>()
        .get("cli-mcp-p-proxy")
        .await
        .expect("the proxy Service")
        .spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .expect("the proxy Service's IP");
    let synced = Instant::now() + TIMEOUT;
    let mut in_a_row = 0;
    while in_a_row < 20 {
        if reach(&sandbox, service_ip, PROXY_PORT).await == Reach::Connected {
            in_a_row += 1;
        } else {
            in_a_row = 0;
            assert!(
                Instant::now() < synced,
                "the node still routes the proxy Service to the killed replica {victim}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    for i in 0..10 {
        let out = ok(&mcp, "s1", "kubectl get ns kube-system -o name").await;
        assert_eq!(
            out.trim(),
            "namespace/kube-system",
            "call {i} after the kill: {out}"
        );
    }
    eprintln!("calls after a proxy replica was killed: 10/10");

    // --- The allow-listed server trusted: it answers, without the session's credentials --------
    // Its CA comes from the target's caConfigMap. Named before it exists: Ready=False
    // ProxyCaInvalid saying what to create, and the running proxy keeps serving.
    let mut pinned = cr.clone();
    pinned["spec"]["proxy"]["targets"][1]["caConfigMap"] = json!("web-ca");
    env.apply_cr(&pinned).await;
    let waiting = env
        .wait_status(
            "p",
            "Ready=False ProxyCaInvalid for the missing web-ca",
            |s| {
                s.conditions.iter().any(|c| {
                    c.type_ == "Ready"
                        && c.status == "False"
                        && c.reason == "ProxyCaInvalid"
                        && c.message.contains("web-ca")
                })
            },
        )
        .await;
    let message = waiting
        .status
        .iter()
        .flat_map(|s| s.conditions.iter())
        .find(|c| c.type_ == "Ready")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(message.contains("does not exist"), "{message}");
    let listed = ok(&mcp, "s1", "kubectl get ns kube-system -o name").await;
    assert_eq!(listed.trim(), "namespace/kube-system", "{listed}");
    let trust: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "web-ca"},
        "data": {"ca.crt": web_ca},
    }))
    .expect("web-ca ConfigMap");
    env.api::<ConfigMap>()
        .create(&PostParams::default(), &trust)
        .await
        .expect("creating the web-ca ConfigMap");
    env.wait_ready("p").await;
    // The new route table rolls the proxy pods.
    proxy_rolled_from(
        pods.clone(),
        &sel("proxy"),
        &routes_version(&proxies[0]),
        "the proxy pods rolled with the web CA",
    )
    .await;
    // The rolled pods are reached through the Service once kube-proxy has them.
    let deadline = Instant::now() + TIMEOUT;
    let answered = loop {
        let (r, t) = run(
            &mcp,
            "s1",
            &format!(
                "curl -sS -m 20 -H 'Authorization: Bearer stolen' -H 'Impersonate-User: admin' \
                 https://{web}/trusted 2>&1"
            ),
        )
        .await;
        if r["isError"] == false && t.contains(WEB_BODY.trim()) {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "the trusted allow-listed server did not answer through the proxy: {t}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(answered.contains(WEB_BODY.trim()), "{answered}");
    {
        let log = web_log.lock().expect("web log");
        let head = log
            .heads
            .iter()
            .find(|h| h.starts_with("GET /trusted "))
            .unwrap_or_else(|| panic!("the request reached the server: {log:?}"));
        let lower = head.to_ascii_lowercase();
        assert!(lower.contains(&format!("host: {web}")), "{head}");
        assert!(
            !lower.contains("authorization") && !lower.contains("impersonate"),
            "the session's credentials reached the allow-listed server: {head}"
        );
    }
    eprintln!("allow-list route: trusted server answered through the proxy, credentials stripped");

    // --- A WebSocket crosses the proxy on an allow-list route, never on a kubernetes one -----
    let upgrade = "curl -sS -m 20 --http1.1 -i --suppress-connect-headers -H 'Connection: Upgrade' -H 'Upgrade: websocket' \
                   -H 'Sec-WebSocket-Version: 13' -H 'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==' \
                   -H 'Authorization: Bearer stolen'";
    // The proxy pods rolled (no old one is left, and the old ones served while they left the
    // Service): the first connection lands on a pod with the web CA.
    let ws = ok(
        &mcp,
        "s1",
        &format!("{upgrade} https://{web}/ws 2>&1 | tr -d '\\000' | cat -v"),
    )
    .await;
    assert!(
        ws.contains("HTTP/1.1 101 "),
        "the upstream's 101 reaches the sandbox: {ws}"
    );
    assert!(
        ws.to_ascii_lowercase()
            .contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{ws}"
    );
    assert!(
        ws.contains(&format!("{WS_ECHO}dGhlIHNhbXBsZSBub25jZQ==")),
        "the server's frame, echoing the key, came back after the 101: {ws}"
    );
    {
        let log = web_log.lock().expect("web log");
        let head = log
            .heads
            .iter()
            .find(|h| h.starts_with("GET /ws "))
            .unwrap_or_else(|| panic!("the upgrade reached the server: {log:?}"));
        let lower = head.to_ascii_lowercase();
        assert!(
            lower.contains("upgrade: websocket") && !lower.contains("authorization"),
            "the upgrade arrived, without the session's credentials: {head}"
        );
    }
    let api = ok(
        &mcp,
        "s1",
        "kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}'",
    )
    .await;
    let (_, t) = run(&mcp, "s1", &format!("{upgrade} {}/api 2>&1", api.trim())).await;
    assert!(
        t.contains("HTTP/1.1 403") && !t.contains("101 Switching"),
        "a kubernetes route refuses upgrades: {t}"
    );
    eprintln!(
        "WebSocket: 101 and the echoed frame through an allow-list route; refused on the API route"
    );

    // --- Token rotation mid-session --------------------------------------------------------------
    // A new token for the investigator in the admin's Secret, and the old one revoked (its
    // token Secret deleted): the session's next calls use the new one, with no restart of the
    // sandbox or of the proxy pods.
    let new_token = env.service_account_token("cli-mcp-investigator").await;
    let secrets = env.api::<Secret>();
    let mut admin = secrets
        .get("cli-mcp-p-kubeconfig")
        .await
        .expect("the admin kubeconfig Secret");
    let data = admin.data.get_or_insert_with(Default::default);
    let old_kc = String::from_utf8(data["kubeconfig"].0.clone()).expect("kubeconfig utf-8");
    assert!(old_kc.contains(&token), "the Secret holds the first token");
    data.insert(
        "kubeconfig".into(),
        k8s_openapi::ByteString(old_kc.replace(&token, &new_token).into_bytes()),
    );
    admin.metadata.managed_fields = None;
    secrets
        .replace("cli-mcp-p-kubeconfig", &PostParams::default(), &admin)
        .await
        .expect("rotating the token in the admin Secret");
    let replaced = Instant::now();
    secrets
        .delete("cli-mcp-investigator-token", &DeleteParams::default())
        .await
        .expect("revoking the first token");
    // The API server caches token reviews for a few seconds: wait until it refuses the old
    // token itself, so the sandbox's success below can only come from the new one.
    let refused = Instant::now() + TIMEOUT;
    while token_works(&info.kubeconfig, &token).await {
        assert!(
            Instant::now() < refused,
            "the API server still accepts the revoked token"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        token_works(&info.kubeconfig, &new_token).await,
        "the new token works against the API server"
    );
    let proxies_before: Vec<String> = ready_pods(pods.clone(), &sel("proxy"), 2)
        .await
        .iter()
        .map(|p| p.uid().unwrap_or_default())
        .collect();
    let rotated = Instant::now();
    let deadline = rotated + ROTATION;
    loop {
        let (r, t) = run(&mcp, "s1", "kubectl get ns kube-system -o name").await;
        if r["isError"] == false {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the rotated token was not used within {ROTATION:?}: {t}\n{}",
            env.logs("operator")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "rotated token in use {:.1?} after the Secret changed ({:.1?} after the old one was refused)",
        replaced.elapsed(),
        rotated.elapsed()
    );
    for i in 0..5 {
        let out = ok(&mcp, "s1", "kubectl get ns kube-system -o name").await;
        assert_eq!(
            out.trim(),
            "namespace/kube-system",
            "call {i} after rotation: {out}"
        );
    }
    let proxies_after: Vec<String> = ready_pods(pods.clone(), &sel("proxy"), 2)
        .await
        .iter()
        .map(|p| p.uid().unwrap_or_default())
        .collect();
    assert_eq!(
        proxies_before, proxies_after,
        "the proxy pods were not restarted by the rotation"
    );
    assert_eq!(
        ok(&mcp, "s1", "echo $MARK").await.trim(),
        "kept",
        "the session's shell was not restarted by the rotation"
    );

    // --- spec.proxy removed: the implied proxy takes over -----------------------------------------
    // The instance keeps a proxy holding the same kubeconfig Secret (the default name), with
    // the kubernetes target alone: the allow-listed server is no route any more, the API still
    // is, and the sandbox never gets the Secret.
    let with_allow_list = routes_version(&ready_pods(pods.clone(), &sel("proxy"), 2).await[0]);
    let mut without = cr.clone();
    if let Some(spec) = without["spec"].as_object_mut() {
        spec.remove("proxy");
    }
    env.apply_cr(&without).await;
    wait_for(
        env.api::<ConfigMap>(),
        "cli-mcp-p-proxy",
        "the implied proxy's route table without the allow-list",
        TIMEOUT,
        |c: Option<&ConfigMap>| {
            c.and_then(|c| c.data.as_ref())
                .and_then(|d| d.get(cli_mcp_api::proxy::ROUTES_KEY))
                .is_some_and(|routes| !routes.contains(&web_host))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.logs("operator")));
    // The proxy rolls to the new table; until its old pods are gone a tunnel may still land on
    // one of them.
    proxy_rolled_from(
        pods.clone(),
        &sel("proxy"),
        &with_allow_list,
        "the implied proxy's pods replaced the allow-list ones",
    )
    .await;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (_, t) = run(
            &mcp,
            "s1",
            &format!("curl -sS -m 20 -o /dev/null https://{web}/ 2>&1"),
        )
        .await;
        if t.contains("403") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the allow-listed server is still reached after spec.proxy was removed: {t}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let names = ok(&mcp, "s1", "echo $KUBECONFIG; kubectl get ns -o name").await;
    assert!(
        names.starts_with("/etc/cli-mcp/proxy-client/kubeconfig\n")
            && names.contains(&format!("namespace/{ns}")),
        "kubectl through the implied proxy: {names}"
    );
    eprintln!("spec.proxy removed: the implied proxy serves the API alone");

    if let Some(e) = enforcer.exited_error() {
        panic!("{e}");
    }
    eprintln!("all checks passed after {:.1?}", t0.elapsed());

    // --- Teardown --------------------------------------------------------------------------------
    drop(mcp);
    env.finish(Some("p")).await;
    enforcer.stop().await.unwrap_or_else(|e| panic!("{e}"));
    drop(pc);
}
