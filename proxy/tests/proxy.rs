//! The proxy on loopback against a recording HTTPS upstream: what gets through, what is
//! refused, and that a hostile client cannot make it hold more than its limits.

mod support;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use cli_mcp_api::proxy::{Domain, Injector, Route};
use cli_mcp_proxy::Config;
use support::*;

const TOKEN: &str = "real-admin-token";

/// An upstream on an allow-list route, and a proxy configuration without a kubeconfig.
async fn allow_list_setup() -> (Upstream, Inputs, Config) {
    let up = Upstream::start().await;
    let inputs = Inputs::new(vec![up.route(Injector::None)]);
    let mut config = inputs.config();
    config.kubeconfig = None;
    (up, inputs, config)
}

/// An upstream routed as a Kubernetes API server, with a kubeconfig holding [`TOKEN`].
async fn kubernetes_setup() -> (Upstream, Inputs) {
    let up = Upstream::start().await;
    let inputs = Inputs::new(vec![up.route(Injector::Kubernetes)]);
    inputs.publish_kubeconfig(&kubeconfig(
        &format!("https://{}", up.addr),
        &up.ca.cert_pem,
        TOKEN,
    ));
    (up, inputs)
}

#[tokio::test]
async fn connect_to_a_domain_without_a_route_is_403_and_reaches_nothing() {
    let routed = Upstream::start().await;
    let other = Upstream::start().await;
    let inputs = Inputs::new(vec![routed.route(Injector::None)]);
    let proxy = Running::start(inputs.config()).await;

    let target = other.addr.to_string();
    let reply = raw(
        proxy.addr,
        format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
    assert!(
        reply.contains(&format!("domain {target} is not allowed")),
        "{reply}"
    );
    assert!(reply.contains("spec.proxy.targets"), "{reply}");
    // A spelling of a routed domain that canonicalises differently is just as unknown.
    let reply = raw(
        proxy.addr,
        format!("CONNECT localhost:{} HTTP/1.1\r\n\r\n", routed.addr.port()).as_bytes(),
    )
    .await;
    assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
    for bad in ["*.example.com:443", "example.com", "[::1", "a b:1"] {
        let reply = raw(
            proxy.addr,
            format!("CONNECT {bad} HTTP/1.1\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(reply.starts_with("HTTP/1.1 4"), "{bad}: {reply}");
    }
    assert_eq!(other.accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(routed.accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
    let m = proxy.metrics().await;
    assert!(
        metric(
            &m,
            "cli_mcp_proxy_refusals_total{reason=\"domain_not_allowed\"}"
        ) >= 2.0,
        "{m}"
    );
}

#[tokio::test]
async fn plain_http_proxy_requests_are_refused() {
    let (up, _inputs, config) = allow_list_setup().await;
    let proxy = Running::start(config).await;
    let reply = raw(
        proxy.addr,
        format!(
            "GET http://{}/ HTTP/1.1\r\nHost: {}\r\n\r\n",
            up.addr, up.addr
        )
        .as_bytes(),
    )
    .await;
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    assert!(reply.contains("use HTTPS through CONNECT"), "{reply}");
    assert_eq!(up.accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_clients_credentials_never_reach_upstream_and_the_routes_token_does() {
    let (up, inputs) = kubernetes_setup().await;
    let proxy = Running::start(inputs.config()).await;
    let client = client(&proxy, &inputs.ca);
    let resp = client
        .get(format!(
            "https://{}/api/v1/namespaces/default/pods?limit=5",
            up.addr
        ))
        .header("Authorization", "Bearer cli-mcp-proxy-managed")
        .header("Impersonate-User", "system:admin")
        .header("Impersonate-Group", "system:masters")
        .header("Impersonate-Extra-Scopes", "all")
        .header("X-Api-Key", "k")
        .header("X-Forwarded-For", "10.1.2.3")
        .header("Forwarded", "for=10.1.2.3")
        .header("Via", "1.1 sandbox")
        .header("Proxy-Authorization", "Basic eA==")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("PodList"));
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    let h = &seen[0].headers;
    assert_eq!(seen[0].uri, "/api/v1/namespaces/default/pods?limit=5");
    let auth: Vec<_> = h.get_all("authorization").iter().collect();
    assert_eq!(auth, vec![&format!("Bearer {TOKEN}")]);
    for gone in [
        "impersonate-user",
        "impersonate-group",
        "impersonate-extra-scopes",
        "x-api-key",
        "x-forwarded-for",
        "forwarded",
        "via",
        "proxy-authorization",
    ] {
        assert!(!h.contains_key(gone), "{gone} reached the upstream");
    }
}

#[tokio::test]
async fn an_allow_list_route_gets_no_credential_at_all() {
    let (up, inputs, config) = allow_list_setup().await;
    let proxy = Running::start(config).await;
    let resp = client(&proxy, &inputs.ca)
        .post(format!("https://{}/upload", up.addr))
        .header("Authorization", "Bearer stolen")
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let seen = up.seen();
    assert_eq!(seen[0].method, "POST");
    assert_eq!(&seen[0].body[..], b"payload");
    assert!(!seen[0].headers.contains_key("authorization"));
}

#[tokio::test]
async fn a_rotated_kubeconfig_is_used_for_the_next_request_on_the_same_tunnel() {
    let (up, inputs) = kubernetes_setup().await;
    let proxy = Running::start(inputs.config()).await;
    let client = client(&proxy, &inputs.ca);
    let url = format!("https://{}/api/v1/pods", up.addr);
    client.get(&url).send().await.unwrap();
    inputs.publish_kubeconfig(&kubeconfig(
        &format!("https://{}", up.addr),
        &up.ca.cert_pem,
        "rotated-token",
    ));
    client.get(&url).send().await.unwrap();
    let seen = up.seen();
    assert_eq!(seen[0].headers["authorization"], format!("Bearer {TOKEN}"));
    assert_eq!(seen[1].headers["authorization"], "Bearer rotated-token");
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "cli_mcp_proxy_tunnels"),
        1.0,
        "one tunnel carried both requests: {m}"
    );
}

#[tokio::test]
async fn a_kubeconfig_without_a_token_for_the_server_is_a_502_that_says_so() {
    let (up, inputs) = kubernetes_setup().await;
    inputs.publish_kubeconfig(&kubeconfig("https://10.9.9.9:6443", &up.ca.cert_pem, TOKEN));
    let proxy = Running::start(inputs.config()).await;
    let resp = client(&proxy, &inputs.ca)
        .get(format!("https://{}/api/v1/pods", up.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    let body = resp.text().await.unwrap();
    assert!(
        body.contains(&format!(
            "kubeconfig Secret has no token for server {}",
            up.addr
        )),
        "{body}"
    );
    assert!(up.seen().is_empty());
    assert_eq!(proxy.health_get("/readyz").await.status(), 503);
}

#[tokio::test]
async fn workload_subresources_are_refused_with_the_proxys_message() {
    let (up, inputs) = kubernetes_setup().await;
    let proxy = Running::start(inputs.config()).await;
    let client = client(&proxy, &inputs.ca);
    for (path, what) in [
        (
            "/api/v1/namespaces/default/pods/p/exec?command=sh&stdin=true",
            "pods/exec",
        ),
        ("/api/v1/namespaces/default/pods/p/attach", "pods/attach"),
        (
            "/api/v1/namespaces/default/pods/p/portforward",
            "pods/portforward",
        ),
        (
            "/api/v1/namespaces/default/pods/p/ephemeralcontainers",
            "pods/ephemeralcontainers",
        ),
        (
            "/api/v1/namespaces/default/services/s:80/proxy/",
            "services/proxy",
        ),
        ("/api/v1/nodes/n/proxy/logs", "nodes/proxy"),
    ] {
        let resp = client
            .post(format!("https://{}{path}", up.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 403, "{path}");
        let status: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(status["kind"], "Status", "{path}");
        assert_eq!(status["reason"], "Forbidden", "{path}");
        let msg = status["message"].as_str().unwrap();
        assert!(
            msg.contains(what) && msg.contains("never allows"),
            "{path}: {msg}"
        );
    }
    assert!(up.seen().is_empty(), "nothing refused reached the upstream");
}

/// Requests written byte for byte (an HTTP client library would normalise them).
#[tokio::test]
async fn encoded_dot_parameter_and_double_slash_tricks_are_refused() {
    let (up, inputs) = kubernetes_setup().await;
    let proxy = Running::start(inputs.config()).await;
    let host = up.addr.to_string();
    for path in [
        "/api/v1/namespaces/default/pods/p/%65xec",
        "/api/v1/namespaces/default/pods/p%2Fexec",
        "/api/v1/namespaces/default/pods/p/./exec",
        "/api/v1/namespaces/default/pods/x/../p/exec",
        "/api/v1/namespaces/default/pods/p/%2e%2e/p/exec",
        "/api/v1/namespaces/default/pods/p//exec",
        "//api/v1/namespaces/default/pods/p/exec",
        "/api/v1/namespaces/default/pods/p/exec;v=1",
        "/api/v1/namespaces/default/pods/p;x/exec",
        "/api/v1/namespaces/default/pods/p/%252Fexec",
        "/api/v1/proxy/namespaces/default/pods/p",
        "/api/v1/watch/namespaces/default/pods/p/attach",
    ] {
        let head = tunnel_request(
            proxy.addr,
            &host,
            &inputs.ca,
            &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n"),
        )
        .await;
        assert!(
            head.starts_with("HTTP/1.1 403") || head.starts_with("HTTP/1.1 400"),
            "{path}: {head}"
        );
    }
    assert!(up.seen().is_empty(), "{:?}", up.seen());
}

#[tokio::test]
async fn upgrades_are_refused_on_kubernetes_routes() {
    let (up, inputs) = kubernetes_setup().await;
    let proxy = Running::start(inputs.config()).await;
    let host = up.addr.to_string();
    let request = format!(
        "GET /api/v1/namespaces/default/pods HTTP/1.1\r\nHost: {host}\r\n\
         Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    );
    let head = tunnel_request(proxy.addr, &host, &inputs.ca, &request).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert!(up.seen().is_empty());
}

fn websocket_request(host: &str, path: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Authorization: Bearer stolen\r\nImpersonate-User: admin\r\n\r\n"
    )
}

#[tokio::test]
async fn websockets_on_allow_list_routes_carry_bytes_both_ways_without_credentials() {
    let (up, inputs, config) = allow_list_setup().await;
    let proxy = Running::start(config).await;
    let host = up.addr.to_string();
    let mut tls = tunnel(proxy.addr, &host, None, &inputs.ca).await.unwrap();
    tls.write_all(websocket_request(&host, "/ws").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut tls).await.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    assert!(head.contains("connection: upgrade"), "{head}");
    // More than one read buffer of the copy, so it has to loop and hold back.
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let (mut read, mut write) = tokio::io::split(tls);
    let sent = payload.clone();
    let writer = tokio::spawn(async move {
        write.write_all(&sent).await.unwrap();
        write
    });
    let mut echoed = vec![0u8; payload.len()];
    tokio::time::timeout(DEADLINE, read.read_exact(&mut echoed))
        .await
        .expect("the echo in time")
        .unwrap();
    assert!(echoed == payload, "the echo differs from what was sent");
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "cli_mcp_proxy_tunnels"), 1.0, "{m}");
    // The client's close reaches the upstream, whose close comes back.
    let mut write = writer.await.unwrap();
    write.shutdown().await.unwrap();
    let rest = read_to_close(&mut read).await;
    assert_eq!(rest, "");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    let h = &seen[0].headers;
    assert_eq!(h["upgrade"], "websocket");
    assert_eq!(h["connection"], "upgrade");
    assert_eq!(h["sec-websocket-key"], "dGhlIHNhbXBsZSBub25jZQ==");
    assert!(!h.contains_key("authorization"), "{h:?}");
    assert!(!h.contains_key("impersonate-user"), "{h:?}");
}

#[tokio::test]
async fn an_idle_websocket_is_closed_at_the_idle_timeout() {
    let (up, inputs, mut config) = allow_list_setup().await;
    config.limits.idle_timeout = Duration::from_millis(300);
    let proxy = Running::start(config).await;
    let host = up.addr.to_string();
    let mut tls = tunnel(proxy.addr, &host, None, &inputs.ca).await.unwrap();
    tls.write_all(websocket_request(&host, "/ws").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    tls.write_all(b"one").await.unwrap();
    let mut echo = [0u8; 3];
    tls.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"one");
    // Then nothing either way: the proxy closes it.
    assert_eq!(read_to_close(&mut tls).await, "");
}

/// An upstream that answers a WebSocket request without switching: the answer is passed on
/// and the tunnel serves its next request as usual.
#[tokio::test]
async fn a_websocket_request_the_upstream_does_not_switch_leaves_the_tunnel_usable() {
    let (up, inputs, config) = allow_list_setup().await;
    let proxy = Running::start(config).await;
    let host = up.addr.to_string();
    let mut tls = tunnel(proxy.addr, &host, None, &inputs.ca).await.unwrap();
    tls.write_all(websocket_request(&host, "/plain").as_bytes())
        .await
        .unwrap();
    let (head, _) = read_response(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    tls.write_all(format!("GET /next HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let uris: Vec<String> = up.seen().into_iter().map(|s| s.uri).collect();
    assert_eq!(uris, ["/plain", "/next"]);
}

#[tokio::test]
async fn upgrades_other_than_websocket_are_not_forwarded() {
    let (up, inputs, config) = allow_list_setup().await;
    let proxy = Running::start(config).await;
    let host = up.addr.to_string();
    for request in [
        format!("GET /ws HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"),
        format!("GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n\r\n"),
        format!(
            "GET /ws HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
             Upgrade: SPDY/3.1\r\n\r\n"
        ),
    ] {
        let head = tunnel_request(proxy.addr, &host, &inputs.ca, &request).await;
        assert!(head.starts_with("HTTP/1.1 501"), "{request}: {head}");
    }
    assert!(up.seen().is_empty(), "{:?}", up.seen());
    // An upstream that switches to something else than what was asked for gets no hand-over.
    let head = tunnel_request(
        proxy.addr,
        &host,
        &inputs.ca,
        &websocket_request(&host, "/ws-other"),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
}

#[tokio::test]
async fn a_host_other_than_the_connect_authority_is_refused() {
    let (up, inputs) = kubernetes_setup().await;
    let other = Upstream::start().await;
    let proxy = Running::start(inputs.config()).await;
    let host = up.addr.to_string();
    let head = tunnel_request(
        proxy.addr,
        &host,
        &inputs.ca,
        &format!("GET /api/v1/pods HTTP/1.1\r\nHost: {}\r\n\r\n", other.addr),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 421"), "{head}");
    // Absolute form naming another authority, with the right Host.
    let head = tunnel_request(
        proxy.addr,
        &host,
        &inputs.ca,
        &format!(
            "GET https://{}/api/v1/pods HTTP/1.1\r\nHost: {host}\r\n\r\n",
            other.addr
        ),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 421"), "{head}");
    // Two Host headers.
    let head = tunnel_request(
        proxy.addr,
        &host,
        &inputs.ca,
        &format!(
            "GET /api/v1/pods HTTP/1.1\r\nHost: {host}\r\nHost: {}\r\n\r\n",
            other.addr
        ),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    assert!(up.seen().is_empty());
    assert_eq!(other.accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
    // Absolute form naming the CONNECT authority is forwarded, in origin form.
    let head = tunnel_request(
        proxy.addr,
        &host,
        &inputs.ca,
        &format!("GET https://{host}/api/v1/pods?limit=1 HTTP/1.1\r\nHost: {host}\r\n\r\n"),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(up.seen()[0].uri, "/api/v1/pods?limit=1");
}

#[tokio::test]
async fn an_sni_other_than_the_connect_host_gets_no_tls() {
    let inputs = Inputs::new(vec![Route {
        domain: Domain::parse("localhost:9").unwrap(),
        injector: Injector::None,
        ca_cert: None,
        identity: Default::default(),
    }]);
    let mut config = inputs.config();
    config.kubeconfig = None;
    let proxy = Running::start(config).await;
    let err = tunnel(
        proxy.addr,
        "localhost:9",
        Some("kubernetes.default.svc"),
        &inputs.ca,
    )
    .await;
    assert!(err.is_err(), "a TLS session with a mismatched SNI");
    let ok = tunnel(proxy.addr, "localhost:9", Some("localhost"), &inputs.ca).await;
    assert!(ok.is_ok(), "{:?}", ok.err());
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "cli_mcp_proxy_refusals_total{reason=\"sni_mismatch\"}"),
        1.0,
        "{m}"
    );
}

/// CL+TE: hyper takes Transfer-Encoding, drops Content-Length and closes the connection after
/// the response (RFC 9112 section 6.3), so a request hidden in the body is never read as one.
#[tokio::test]
async fn a_request_smuggled_with_content_length_and_chunked_never_reaches_upstream() {
    let (up, inputs) = kubernetes_setup().await;
    let proxy = Running::start(inputs.config()).await;
    let host = up.addr.to_string();
    let mut tls = tunnel(proxy.addr, &host, None, &inputs.ca).await.unwrap();
    let smuggled =
        format!("GET /api/v1/namespaces/default/pods/p/exec HTTP/1.1\r\nHost: {host}\r\n\r\n");
    let req = format!(
        "POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\nHost: {host}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n{smuggled}"
    );
    tls.write_all(req.as_bytes()).await.unwrap();
    let reply = read_to_close(&mut tls).await;
    assert_eq!(reply.matches("HTTP/1.1 ").count(), 1, "{reply}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].uri, "/api/v1/namespaces/default/configmaps");
    assert_eq!(&seen[0].body[..], b"{}");
    // The reverse order of the headers, and a non-chunked Transfer-Encoding.
    let mut tls = tunnel(proxy.addr, &host, None, &inputs.ca).await.unwrap();
    tls.write_all(
        format!("POST /api/v1/x HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{{}}").as_bytes(),
    )
    .await
    .unwrap();
    let reply = read_to_close(&mut tls).await;
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    assert_eq!(up.seen().len(), 1);
}

#[tokio::test]
async fn oversized_headers_get_431_outside_and_inside_the_tunnel() {
    let (up, inputs) = kubernetes_setup().await;
    // The default limit, and heads that arrive in one piece: the limit must hold however
    // much a single read brings.
    let limit = cli_mcp_proxy::Limits::default().max_header_bytes;
    let proxy = Running::start(inputs.config()).await;
    let host = up.addr.to_string();
    let big = "a".repeat(limit + 100);
    let reply = raw(
        proxy.addr,
        format!("CONNECT {host} HTTP/1.1\r\nHost: {host}\r\nX-Big: {big}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
    let mut tls = tunnel(proxy.addr, &host, None, &inputs.ca).await.unwrap();
    tls.write_all(
        format!("GET /api/v1/pods HTTP/1.1\r\nHost: {host}\r\nX-Big: {big}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let reply = read_to_close(&mut tls).await;
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
    assert!(up.seen().is_empty());
    // Just under the limit is a request like any other.
    let fits = "a".repeat(limit - 200);
    let head = tunnel_request(
        proxy.addr,
        &host,
        &inputs.ca,
        &format!("GET /api/v1/pods HTTP/1.1\r\nHost: {host}\r\nX-Fits: {fits}\r\n\r\n"),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(up.seen().len(), 1);
}

#[tokio::test]
async fn a_slowloris_client_gets_408_at_the_header_read_timeout() {
    let (up, inputs, mut config) = allow_list_setup().await;
    config.limits.header_read_timeout = Duration::from_millis(300);
    config.limits.idle_timeout = Duration::from_millis(400);
    let proxy = Running::start(config).await;
    // Outside: a CONNECT head that never ends.
    let mut tcp = TcpStream::connect(proxy.addr).await.unwrap();
    tcp.write_all(format!("CONNECT {} HTTP/1.1\r\nX-A: ", up.addr).as_bytes())
        .await
        .unwrap();
    let reply = read_to_close(&mut tcp).await;
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(
        reply.contains("did not arrive within 300ms (--header-read-timeout)"),
        "{reply}"
    );
    // Inside: a tunnel whose request head never ends, after one request answered.
    let host = up.addr.to_string();
    let mut tls = tunnel(proxy.addr, &host, None, &inputs.ca).await.unwrap();
    tls.write_all(format!("GET /first HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let (head, _) = read_response(&mut tls).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    tls.write_all(b"GET /second HTTP/1.1\r\nX-A: ")
        .await
        .unwrap();
    let reply = read_to_close(&mut tls).await;
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("400ms (--idle-timeout)"), "{reply}");
    assert_eq!(up.seen().len(), 1, "{:?}", up.seen());
    // A tunnel merely idle after its request is closed without a 408: a keep-alive client
    // sending its next request at that moment would take the 408 for its answer.
    let mut tls = tunnel(proxy.addr, &host, None, &inputs.ca).await.unwrap();
    tls.write_all(format!("GET /only HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let rest = read_to_close(&mut tls).await;
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest}");
    assert!(!rest.contains("408"), "{rest}");
    // So is a connection that never sent a byte.
    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(read_to_close(&mut silent).await, "");
    let m = proxy.metrics().await;
    assert!(
        metric(
            &m,
            "cli_mcp_proxy_refusals_total{reason=\"header_read_timeout\"}"
        ) >= 2.0,
        "{m}"
    );
}

/// One client (one sandbox pod, one address) holding its share of connections gets 429 for
/// more, and another client still gets through: a flooding sandbox cannot starve the rest.
#[tokio::test]
async fn one_client_cannot_take_the_connections_of_the_others() {
    let (up, _inputs, mut config) = allow_list_setup().await;
    config.limits.max_connections_per_client = 3;
    let proxy = Running::start(config).await;
    let from = |ip: &str| {
        let ip: std::net::IpAddr = ip.parse().unwrap();
        let addr = proxy.addr;
        async move {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind((ip, 0).into()).unwrap();
            socket.connect(addr).await.unwrap()
        }
    };
    let mut flood = Vec::new();
    for _ in 0..3 {
        flood.push(from("127.0.0.1").await);
    }
    for _ in 0..20 {
        let mut extra = from("127.0.0.1").await;
        let reply = read_to_close(&mut extra).await;
        assert!(reply.starts_with("HTTP/1.1 429"), "{reply}");
        assert!(reply.contains("--max-connections-per-client"), "{reply}");
    }
    // Another sandbox, at another address: served as if nothing happened.
    let mut other = from("127.0.0.2").await;
    let host = up.addr.to_string();
    other
        .write_all(format!("CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut other).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // A closed connection gives its slot back.
    drop(flood.pop());
    let mut again = None;
    for _ in 0..100 {
        let mut tcp = from("127.0.0.1").await;
        tcp.write_all(format!("CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let head = read_head(&mut tcp).await;
        if head.starts_with("HTTP/1.1 200") {
            again = Some(tcp);
            break;
        }
        // The proxy may not have seen the close yet.
        tokio::task::yield_now().await;
    }
    assert!(again.is_some(), "the slot came back");
    let m = proxy.metrics().await;
    assert!(
        metric(
            &m,
            "cli_mcp_proxy_refusals_total{reason=\"client_connection_limit\"}"
        ) >= 20.0,
        "{m}"
    );
}

/// Idle connections beyond `--max-connections` are turned away at once: the proxy holds at
/// most that many, whatever a client opens.
#[tokio::test]
async fn connections_beyond_the_limit_are_refused_and_not_held() {
    let (up, _inputs, mut config) = allow_list_setup().await;
    config.limits.max_connections = 8;
    let proxy = Running::start(config).await;
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(TcpStream::connect(proxy.addr).await.unwrap());
    }
    // Each extra connection gets the 503 and is closed, however many there are.
    for _ in 0..50 {
        let mut extra = TcpStream::connect(proxy.addr).await.unwrap();
        let reply = read_to_close(&mut extra).await;
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("--max-connections"), "{reply}");
    }
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "cli_mcp_proxy_connections"), 8.0, "{m}");
    assert_eq!(
        metric(
            &m,
            "cli_mcp_proxy_refusals_total{reason=\"connection_limit\"}"
        ),
        50.0,
        "{m}"
    );
    // A tunnel counts against the same limit.
    drop(idle.pop());
    let host = up.addr.to_string();
    let mut opened = None;
    for _ in 0..100 {
        let mut tcp = TcpStream::connect(proxy.addr).await.unwrap();
        tcp.write_all(format!("CONNECT {host} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let head = read_head(&mut tcp).await;
        if head.starts_with("HTTP/1.1 200") {
            opened = Some(tcp);
            break;
        }
        // The freed slot is released when the proxy sees the close; try again.
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    }
    assert!(
        opened.is_some(),
        "a slot freed by a closed connection is reused"
    );
}

#[tokio::test]
async fn streaming_responses_arrive_before_they_end() {
    let (up, inputs, config) = allow_list_setup().await;
    let proxy = Running::start(config).await;
    let mut resp = client(&proxy, &inputs.ca)
        .get(format!("https://{}/stream", up.addr))
        .send()
        .await
        .unwrap();
    let first = tokio::time::timeout(DEADLINE, resp.chunk())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        &first[..],
        b"first\n",
        "the first chunk came through on its own"
    );
    up.release();
    let second = tokio::time::timeout(DEADLINE, resp.chunk())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(&second[..], b"second\n");
}

#[tokio::test]
async fn an_upstream_that_does_not_present_the_pinned_ca_gets_no_request() {
    let up = Upstream::start().await;
    let wrong = TestCa::new("some other CA");
    let inputs = Inputs::new(vec![Route {
        domain: up.domain(),
        injector: Injector::None,
        ca_cert: Some(wrong.cert_pem.clone()),
        identity: Default::default(),
    }]);
    let mut config = inputs.config();
    config.kubeconfig = None;
    let proxy = Running::start(config).await;
    let resp = client(&proxy, &inputs.ca)
        .get(format!("https://{}/", up.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    let body = resp.text().await.unwrap();
    assert!(body.contains("TLS with"), "{body}");
    assert!(up.seen().is_empty());
}

#[tokio::test]
async fn health_readiness_and_metrics() {
    let (up, inputs) = kubernetes_setup().await;
    let proxy = Running::start(inputs.config()).await;
    let get = |p| proxy.health_get(p);
    assert_eq!(get("/healthz").await.status(), 200);
    assert_eq!(get("/readyz").await.status(), 200);
    client(&proxy, &inputs.ca)
        .get(format!("https://{}/api/v1/pods", up.addr))
        .send()
        .await
        .unwrap();
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "cli_mcp_proxy_requests_total{outcome=\"forwarded\"}"),
        1.0,
        "{m}"
    );
    assert!(!m.contains(TOKEN));
    // A kubeconfig replaced by something unusable makes the proxy unready.
    inputs.publish_kubeconfig("users: [");
    let r = get("/readyz").await;
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap().contains("not usable"));
}

#[tokio::test]
async fn sigterm_drains_the_request_in_flight_and_stops_accepting() {
    let (up, inputs, config) = allow_list_setup().await;
    let mut proxy = Running::start(config).await;
    let client = client(&proxy, &inputs.ca);
    let url = format!("https://{}/slow", up.addr);
    let in_flight = tokio::spawn(async move { client.get(url).send().await?.text().await });
    // Wait until the request is upstream, so the stop comes while it is in flight.
    up.wait_seen(1).await;
    proxy.stop();
    // New connections are no longer accepted once the listener is closed.
    let refused = tokio::time::timeout(DEADLINE, async {
        loop {
            if TcpStream::connect(proxy.addr).await.is_err() {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(refused.is_ok(), "the listener was closed");
    up.release();
    let body = in_flight.await.unwrap().unwrap();
    assert_eq!(body, "done\n");
    tokio::time::timeout(DEADLINE, proxy.done.take().unwrap())
        .await
        .expect("serve returned after draining")
        .unwrap();
}

/// Kubernetes removes a terminating pod from its Service only after the pod got SIGTERM, so
/// for a while new connections still arrive: they are served, not refused, while `/readyz`
/// already fails; after the shutdown delay the listener closes.
#[tokio::test]
async fn sigterm_keeps_serving_new_connections_for_the_shutdown_delay() {
    let (up, inputs, mut config) = allow_list_setup().await;
    config.shutdown_delay = Duration::from_secs(5);
    let mut proxy = Running::start(config).await;
    proxy.stop();
    let lame_duck = tokio::time::timeout(DEADLINE, async {
        loop {
            let r = proxy.health_get("/readyz").await;
            if r.status() == 503 {
                break r.text().await.unwrap();
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("/readyz fails once the stop signal came");
    assert!(lame_duck.contains("shutting down"), "{lame_duck}");
    // A new connection (a new client) after the signal is still proxied.
    let body = client(&proxy, &inputs.ca)
        .get(format!("https://{}/after-sigterm", up.addr))
        .send()
        .await
        .expect("a connection made during the shutdown delay is served")
        .text()
        .await
        .unwrap();
    assert!(!body.is_empty());
    assert_eq!(up.seen().len(), 1);
    tokio::time::timeout(DEADLINE, proxy.done.take().unwrap())
        .await
        .expect("serve returned after the shutdown delay")
        .unwrap();
    assert!(
        TcpStream::connect(proxy.addr).await.is_err(),
        "the listener is closed after the delay"
    );
}

#[tokio::test]
async fn bad_inputs_stop_the_start_with_a_clear_error() {
    let up = Upstream::start().await;
    let inputs = Inputs::new(vec![up.route(Injector::Kubernetes)]);
    let mut config = inputs.config();
    config.kubeconfig = None;
    let err = cli_mcp_proxy::Proxy::bind(&config).await.err().unwrap();
    assert!(err.to_string().contains("no --kubeconfig"), "{err}");
    std::fs::write(
        inputs.dir.path().join("routes.json"),
        "{\"routes\": [{\"domain\": \"x\"}]}",
    )
    .unwrap();
    let err = cli_mcp_proxy::Proxy::bind(&inputs.config())
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("route table"), "{err}");
    inputs.write_routes(vec![up.route(Injector::None)]);
    std::fs::write(inputs.dir.path().join("ca.key"), TestCa::new("x").key_pem).unwrap();
    let err = cli_mcp_proxy::Proxy::bind(&inputs.config())
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("does not belong"), "{err}");
}
