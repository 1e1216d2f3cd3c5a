//! MCP authorization on the local Kubernetes: the real kube-apiserver trusts an OAuth
//! authorization server (a JWT issuer of its `--authentication-config`) that this test serves
//! on loopback over HTTPS with its own CA and an ES256 key; the server checks the issuer's
//! tokens with TokenReview like any other token.
//!
//! The authorization server is just enough of one for the MCP SDK's OAuth client: metadata
//! (RFC 8414 / OpenID discovery), JWKS, dynamic client registration, an authorize endpoint
//! that redirects with a code at once (PKCE S256), and a token endpoint. The apiserver's
//! configuration is rewritten once per test process and the reload awaited (a fresh token's
//! TokenReview succeeding).

mod sdk_clients;
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Form, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::rbac::v1::Subject;
use kube::api::PostParams;
use kube::Api;
use rcgen::{KeyPair, SigningKey};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::process::Command;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use cli_mcp_e2e::cluster::AUTHENTICATION_CONFIG_FILE;
use cli_mcp_e2e::testing::{self, TestCluster, TestNamespace};
use support::{Mcp, Pki, Server};

const INSTANCE: &str = "demo";
/// The audience the server expects (`--token-audience`) and the apiserver accepts.
const AUDIENCE: &str = "cli-mcp-oidc-test";
/// Another audience the apiserver accepts for the issuer (say, kubectl's): not this server's.
const OTHER_AUDIENCE: &str = "kubectl-oidc-test";
/// Username prefix of the issuer's subjects in the apiserver's claim mapping.
const PREFIX: &str = "oidc:";

// ---- certificates and keys ----

/// An ES256 signing key and its JWK.
struct JwtKey {
    key: KeyPair,
    kid: String,
}

impl JwtKey {
    fn new(kid: &str) -> JwtKey {
        JwtKey {
            key: KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key"),
            kid: kid.into(),
        }
    }

    fn jwk(&self) -> Value {
        // The uncompressed point: 0x04 || x || y.
        let point = self.key.public_key_raw();
        json!({
            "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": self.kid,
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..65]),
        })
    }

    fn sign(&self, claims: &Value) -> String {
        let header = json!({"alg": "ES256", "typ": "JWT", "kid": self.kid});
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let der = self.key.sign(input.as_bytes()).expect("sign");
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(der_to_jws(&der)))
    }
}

/// An ECDSA signature from ASN.1 DER (`SEQUENCE { r INTEGER, s INTEGER }`) to the fixed
/// 64-byte `r || s` of JWS (RFC 7518 §3.4).
fn der_to_jws(der: &[u8]) -> Vec<u8> {
    fn integer(b: &[u8]) -> (&[u8], &[u8]) {
        assert_eq!(b[0], 0x02, "an INTEGER");
        let len = b[1] as usize;
        (&b[2..2 + len], &b[2 + len..])
    }
    assert_eq!(der[0], 0x30, "a SEQUENCE");
    let (r, rest) = integer(&der[2..]);
    let (s, _) = integer(rest);
    let mut out = Vec::with_capacity(64);
    for n in [r, s] {
        let n = &n[n.iter().take_while(|b| **b == 0).count()..];
        out.extend(std::iter::repeat_n(0, 32 - n.len()));
        out.extend_from_slice(n);
    }
    out
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

// ---- the authorization server ----

#[derive(Default)]
struct AsState {
    /// code -> (PKCE challenge, the `resource` of the authorize request)
    codes: HashMap<String, (String, Option<String>)>,
    /// Every `resource` parameter received (authorize and token requests).
    resources: Vec<String>,
    /// Access tokens issued at /token.
    issued: Vec<String>,
}

struct AuthServer {
    url: String,
    key: JwtKey,
    /// The subject /authorize logs in.
    subject: String,
    state: Mutex<AsState>,
}

impl AuthServer {
    fn token(&self, sub: &str, aud: &[&str], expires_in: i64) -> String {
        self.key.sign(&json!({
            "iss": self.url, "sub": sub, "aud": aud,
            "iat": now() - 5, "nbf": now() - 5, "exp": now() + expires_in,
        }))
    }
}

fn router(s: Arc<AuthServer>) -> Router {
    Router::new()
        .route("/.well-known/openid-configuration", get(as_metadata))
        .route("/.well-known/oauth-authorization-server", get(as_metadata))
        .route("/jwks", get(jwks))
        .route("/register", post(register))
        .route("/authorize", get(authorize))
        .route("/token", post(token))
        .with_state(s)
}

async fn as_metadata(State(s): State<Arc<AuthServer>>) -> Json<Value> {
    let u = &s.url;
    Json(json!({
        "issuer": u,
        "jwks_uri": format!("{u}/jwks"),
        "authorization_endpoint": format!("{u}/authorize"),
        "token_endpoint": format!("{u}/token"),
        "registration_endpoint": format!("{u}/register"),
        "response_types_supported": ["code"],
        "grant_types_supported": ["authorization_code"],
        "code_challenge_methods_supported": ["S256"],
        "token_endpoint_auth_methods_supported": ["none"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": ["ES256"],
    }))
}

async fn jwks(State(s): State<Arc<AuthServer>>) -> Json<Value> {
    Json(json!({"keys": [s.key.jwk()]}))
}

async fn register(Json(mut client): Json<Value>) -> Response {
    client["client_id"] = json!(format!("client-{}", rand::random::<u32>()));
    client["token_endpoint_auth_method"] = json!("none");
    (StatusCode::CREATED, Json(client)).into_response()
}

async fn authorize(
    State(s): State<Arc<AuthServer>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let (Some(redirect), Some(challenge)) = (q.get("redirect_uri"), q.get("code_challenge")) else {
        return (StatusCode::BAD_REQUEST, "redirect_uri and code_challenge").into_response();
    };
    let code = format!("code-{}", rand::random::<u64>());
    {
        let mut st = s.state.lock().expect("lock");
        if let Some(r) = q.get("resource") {
            st.resources.push(r.clone());
        }
        st.codes.insert(
            code.clone(),
            (challenge.clone(), q.get("resource").cloned()),
        );
    }
    let state = q.get("state").cloned().unwrap_or_default();
    let location = reqwest::Url::parse_with_params(
        redirect,
        &[
            ("code", code.as_str()),
            ("state", state.as_str()),
            ("iss", s.url.as_str()),
        ],
    )
    .expect("redirect URL");
    (
        StatusCode::FOUND,
        [(header::LOCATION, location.to_string())],
    )
        .into_response()
}

async fn token(
    State(s): State<Arc<AuthServer>>,
    Form(f): Form<HashMap<String, String>>,
) -> Response {
    let mut st = s.state.lock().expect("lock");
    let Some((challenge, _)) = f.get("code").and_then(|c| st.codes.remove(c)) else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "invalid_grant"})),
        )
            .into_response();
    };
    let verifier = f.get("code_verifier").cloned().unwrap_or_default();
    if URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes())) != challenge {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "invalid_grant"})),
        )
            .into_response();
    }
    if let Some(r) = f.get("resource") {
        st.resources.push(r.clone());
    }
    let access = s.token(&s.subject, &[AUDIENCE], 600);
    st.issued.push(access.clone());
    Json(json!({"access_token": access, "token_type": "Bearer", "expires_in": 600})).into_response()
}

// ---- the shared world of this test process ----

/// The authorization server (on a thread of its own, so it outlives every test's runtime),
/// its PKI, and a key no one trusts.
struct World {
    auth: Arc<AuthServer>,
    pki: Pki,
    stranger: JwtKey,
}

/// Where the PKI's files go: a static is never dropped, so a `TempDir` in it was never
/// removed (one directory in /tmp per run). Under cargo's scratch directory instead, and the
/// ones earlier runs left behind are removed (an hour old: a run is minutes).
fn pki_dir() -> std::path::PathBuf {
    let scratch = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    if let Ok(entries) = std::fs::read_dir(scratch) {
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        for e in entries.flatten() {
            let stale = e.file_name().to_string_lossy().starts_with("oauth-pki-")
                && e.metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t < old);
            if stale {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    tempfile::Builder::new()
        .prefix("oauth-pki-")
        .tempdir_in(scratch)
        .expect("a directory for the test PKI")
        .keep()
}

fn world() -> &'static World {
    static WORLD: std::sync::OnceLock<World> = std::sync::OnceLock::new();
    WORLD.get_or_init(|| {
        let dir = pki_dir();
        let pki = Pki::new(&dir);
        let (cert, key) = pki.leaf("issuer");
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind issuer");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("addr");
        let auth = Arc::new(AuthServer {
            url: format!("https://{addr}"),
            key: JwtKey::new("test-key-1"),
            subject: "alice".into(),
            state: Mutex::new(AsState::default()),
        });
        let served = auth.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
                let tls = cli_mcp_server::auth::tls::server_config(
                    std::path::Path::new(&cert),
                    std::path::Path::new(&key),
                )
                .expect("issuer TLS");
                cli_mcp_server::serve::serve(
                    listener,
                    router(served),
                    Some(tls),
                    CancellationToken::new(),
                    Duration::from_secs(1),
                    cli_mcp_server::serve::ConnLimits::default(),
                )
                .await;
            });
        });
        World {
            auth,
            pki,
            stranger: JwtKey::new("stranger"),
        }
    })
}

/// Points the apiserver at the authorization server (once per test process) and waits
/// until it accepts the issuer's tokens.
async fn trust_the_issuer(cluster: &TestCluster) {
    static DONE: OnceCell<()> = OnceCell::const_new();
    DONE.get_or_init(|| async {
        let w = world();
        let path = cluster.info.run_dir.join(AUTHENTICATION_CONFIG_FILE);
        assert!(
            path.is_file(),
            "{} is missing: this cluster was started without --authentication-config; \
             restart it (cli-mcp-cluster up) with this checkout",
            path.display()
        );
        let config = json!({
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "AuthenticationConfiguration",
            "jwt": [{
                "issuer": {
                    "url": w.auth.url,
                    "audiences": [AUDIENCE, OTHER_AUDIENCE],
                    "audienceMatchPolicy": "MatchAny",
                    "certificateAuthority": w.pki.ca_pem,
                },
                "claimMappings": {"username": {"claim": "sub", "prefix": PREFIX}},
            }],
        });
        // JSON is YAML; written in place (not renamed) so the apiserver's file watch fires.
        std::fs::write(&path, serde_json::to_string_pretty(&config).expect("JSON"))
            .expect("write the authentication config");
        // The apiserver swaps in the new authenticator once it has fetched the discovery
        // document and the JWKS (its health check runs every 10 s): poll a review.
        let probe = w.auth.token("probe", &[AUDIENCE], 600);
        let reviews = Api::<TokenReview>::all(cluster.client.clone());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let review = TokenReview {
                spec: TokenReviewSpec {
                    token: probe.clone(),
                    audiences: None,
                },
                ..Default::default()
            };
            let answer = reviews.create(&PostParams::default(), &review).await;
            let status = answer.as_ref().ok().and_then(|r| r.status.clone());
            if status.as_ref().and_then(|s| s.authenticated) == Some(true) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the apiserver did not accept the issuer's tokens within 120 s after the \
                 authentication config was rewritten (last answer {answer:?}); see {}",
                cluster.info.log_dir.join("kube-apiserver.log").display()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
}

/// A Role with every verb on climcpinstances/mcp of the instance, bound to `users` (the
/// issuer's subjects, as the apiserver names them).
async fn grant(ns: &TestNamespace, users: &[&str]) {
    let subjects = users
        .iter()
        .map(|u| Subject {
            kind: "User".into(),
            name: format!("{PREFIX}{u}"),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        })
        .collect();
    support::grant_mcp(
        ns,
        "mcp-users",
        INSTANCE,
        &["create", "get", "delete"],
        subjects,
    )
    .await;
}

/// The MCP server: local sandboxes, Kubernetes auth on the test cluster, TLS from the test
/// CA, the authorization server in its metadata.
async fn mcp_server(cluster: &TestCluster, ns: &TestNamespace, extra: &[&str]) -> Server {
    support::ensure_built(false);
    let w = world();
    let (cert, key) = w.pki.leaf(&format!("mcp-{}", rand::random::<u32>()));
    let agent = support::agent_bin().display().to_string();
    let mut args = vec![
        "--backend",
        "local",
        "--agent-binary",
        &agent,
        "--auth",
        "kubernetes",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--instance",
        INSTANCE,
        "--namespace",
        &ns.name,
        "--token-audience",
        AUDIENCE,
        "--authorization-server",
        &w.auth.url,
    ];
    args.extend_from_slice(extra);
    let kubeconfig = cluster.info.kubeconfig.display().to_string();
    Server::start(&args, &[("KUBECONFIG", &kubeconfig)]).await
}

async fn setup(prefix: &str, users: &[&str]) -> (TestCluster, TestNamespace) {
    // The cluster harness too: its apiserver must have --authentication-config.
    support::ensure_built(true);
    let cluster = testing::cluster()
        .await
        .expect("the local cluster must come up (see docs/local-kubernetes.md)");
    let ns = cluster.namespace(prefix).await.expect("namespace");
    grant(&ns, users).await;
    trust_the_issuer(&cluster).await;
    (cluster, ns)
}

fn client(server: &Server, token: Option<&str>, session: &str) -> Mcp {
    Mcp {
        http: support::https(&world().pki.ca_pem),
        url: server.url("/mcp"),
        session: Some(session.into()),
        bearer: token.map(str::to_owned),
    }
}

/// POST tools/list with `authorization` header values as given; status, challenge, body.
async fn raw_post(server: &Server, authorization: &[&str]) -> (u16, String, Value) {
    let mut req = support::https(&world().pki.ca_pem)
        .post(server.url("/mcp"))
        .header("accept", support::ACCEPT)
        .header("content-type", "application/json")
        .header("x-session-id", "raw-1");
    for a in authorization {
        req = req.header(reqwest::header::AUTHORIZATION, *a);
    }
    let resp = req
        .body(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).to_string())
        .send()
        .await
        .expect("POST /mcp");
    let status = resp.status().as_u16();
    let www = resp
        .headers()
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = resp.json().await.unwrap_or(Value::Null);
    (status, www, body)
}

fn metadata_url(server: &Server) -> String {
    server.url("/.well-known/oauth-protected-resource/mcp")
}

// ---- tests ----

#[tokio::test]
async fn the_python_sdk_discovers_the_authorization_server_and_gets_a_shell() {
    let (cluster, ns) = setup("oauth-sdk", &["alice", "bob"]).await;
    let server = mcp_server(&cluster, &ns, &[]).await;
    let w = world();
    let mut cmd = Command::new(sdk_clients::python_interpreter().await);
    cmd.arg(sdk_clients::sdk_dir().join("python/oauth_client.py"))
        .args(["--url", &server.url("/mcp"), "--session", "chat-1"])
        .arg("--ca")
        .arg(&w.pki.ca_file);
    let report = sdk_clients::run_client("the Python SDK OAuth client", cmd, Some(&server)).await;
    let r = &report.json;

    // What the SDK did: a 401 pointing at the metadata, the metadata, the authorization
    // server's metadata, registration, the token, then the retried request.
    let requests = r["requests"].as_array().expect("requests");
    let first = &requests[0];
    assert_eq!(first["status"], 401, "{r}");
    let expected_challenge = format!(
        "Bearer realm=\"cli-mcp\", resource_metadata=\"{}\"",
        metadata_url(&server)
    );
    assert_eq!(
        first["www_authenticate"],
        expected_challenge.as_str(),
        "no token: no error code"
    );
    let urls: Vec<&str> = requests.iter().filter_map(|q| q["url"].as_str()).collect();
    let at = |u: &str| urls.iter().position(|x| *x == u);
    let prm = at(&metadata_url(&server)).unwrap_or_else(|| panic!("metadata not read: {urls:?}"));
    let asm = urls
        .iter()
        .position(|u| u.starts_with(&format!("{}/.well-known/", w.auth.url)))
        .unwrap_or_else(|| panic!("authorization server metadata not read: {urls:?}"));
    let tok = at(&format!("{}/token", w.auth.url)).expect("token request");
    assert!(prm < asm && asm < tok, "{urls:?}");
    assert!(
        requests[tok + 1..]
            .iter()
            .all(|q| q["status"].as_u64().is_some_and(|s| s < 400)),
        "after the token every request is admitted: {requests:?}"
    );
    // RFC 8707: the SDK asked for a token for this server, from the metadata's `resource`.
    let resources = w.auth.state.lock().expect("lock").resources.clone();
    assert!(
        resources.contains(&server.url("/mcp")),
        "resource parameters: {resources:?}"
    );

    assert_eq!(r["echo"]["structured"]["stdout"], "hi\n", "{r}");
    assert_eq!(r["read_state"]["structured"]["stdout"], "kept\n", "{r}");

    // The session belongs to the token's identity: alice lists it, bob may not use it.
    let alice = w.auth.token("alice", &[AUDIENCE], 600);
    let bob = w.auth.token("bob", &[AUDIENCE], 600);
    let list = support::https(&w.pki.ca_pem)
        .get(server.url("/sessions"))
        .bearer_auth(&alice)
        .send()
        .await
        .expect("GET /sessions");
    assert_eq!(list.status(), 200);
    let list: Value = list.json().await.expect("JSON");
    let ids: Vec<&str> = list["sessions"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["session_id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(ids, ["chat-1"], "{list}");
    let r = client(&server, Some(&bob), "chat-1").bash("echo bob").await;
    assert!(support::is_error(&r), "{r}");
    assert!(
        support::text(&r).contains("another"),
        "{}",
        support::text(&r)
    );
    let r = client(&server, Some(&bob), "bob-1").bash("echo bob").await;
    assert_eq!(support::structured(&r)["stdout"], "bob\n", "{r}");

    // Without X-Session-ID: alice's new chat handle is hers alone, whichever way bob sends it.
    let mut anon = client(&server, Some(&alice), "");
    anon.session = None;
    let r = anon.bash("echo mine").await;
    let handle = support::structured(&r)["session_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(handle.starts_with('c') && handle.len() == 49, "{r}");
    let mut as_bob = anon.clone();
    as_bob.bearer = Some(bob.clone());
    let r = as_bob
        .bash_with(json!({"command": "echo stolen", "session": handle}))
        .await;
    assert!(support::is_error(&r), "{r}");
    assert!(
        support::text(&r).contains("belongs to another identity"),
        "{r}"
    );
    for (value, needle) in [
        (handle.as_str(), "belongs to another identity"),
        ("forged-session", "is not a session handle of this server"),
    ] {
        let resp = support::https(&w.pki.ca_pem)
            .post(server.url("/mcp"))
            .bearer_auth(&bob)
            .header("accept", support::ACCEPT)
            .header("content-type", "application/json")
            .header("mcp-session-id", value)
            .body(
                json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                    "params": {"name": "bash", "arguments": {"command": "echo x"}}})
                .to_string(),
            )
            .send()
            .await
            .expect("POST /mcp");
        let body: Value = resp.json().await.expect("JSON");
        let r = &body["result"];
        assert!(support::is_error(r), "{body}");
        assert!(support::text(r).contains(needle), "{value}: {body}");
    }
    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn issuer_tokens_are_refused_unless_fresh_and_for_this_server() {
    let (cluster, ns) = setup("oauth-refuse", &["alice"]).await;
    let server = mcp_server(&cluster, &ns, &[]).await;
    let w = world();
    let good = w.auth.token("alice", &[AUDIENCE], 600);
    let (status, _, _) = raw_post(&server, &[&format!("Bearer {good}")]).await;
    assert_eq!(status, 200, "a fresh token for this server is admitted");

    let forged_iss = {
        let mut claims = json!({
            "iss": w.auth.url, "sub": "alice", "aud": [AUDIENCE],
            "iat": now(), "exp": now() + 600,
        });
        claims["iss"] = json!(format!("{}/other", w.auth.url));
        w.stranger.sign(&claims)
    };
    let wrong_key = w.stranger.sign(&json!({
        "iss": w.auth.url, "sub": "alice", "aud": [AUDIENCE], "iat": now(), "exp": now() + 600,
    }));
    for (what, token, needle) in [
        (
            "an audience the apiserver does not accept",
            w.auth.token("alice", &["nobody"], 600),
            "not accepted by the Kubernetes API",
        ),
        (
            "an audience the apiserver accepts but that is not this server's",
            w.auth.token("alice", &[OTHER_AUDIENCE], 600),
            "not for this server",
        ),
        (
            "an expired token",
            w.auth.token("alice", &[AUDIENCE], -60),
            "not accepted by the Kubernetes API",
        ),
        ("an unknown issuer", forged_iss, "not accepted"),
        ("the issuer's name, another key", wrong_key, "not accepted"),
    ] {
        let (status, www, body) = raw_post(&server, &[&format!("Bearer {token}")]).await;
        assert_eq!(status, 401, "{what}: {body}");
        assert_eq!(
            www,
            format!(
                "Bearer realm=\"cli-mcp\", resource_metadata=\"{}\", error=\"invalid_token\"",
                metadata_url(&server)
            ),
            "{what}"
        );
        let msg = body["error"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{what}: {msg}");
    }
    ns.delete().await.expect("delete namespace");
}

#[tokio::test]
async fn metadata_is_public_and_malformed_authorization_is_refused() {
    let (cluster, ns) = setup("oauth-meta", &["alice"]).await;
    let server = mcp_server(&cluster, &ns, &["--scope", "openid"]).await;
    let w = world();
    let http = support::https(&w.pki.ca_pem);
    for path in [
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
    ] {
        let resp = http.get(server.url(path)).send().await.expect("GET");
        assert_eq!(resp.status(), 200, "{path}");
        let cache = resp
            .headers()
            .get(reqwest::header::CACHE_CONTROL)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        assert!(cache.starts_with("public, max-age="), "{path}: {cache}");
        let doc: Value = resp.json().await.expect("JSON");
        assert_eq!(
            doc,
            json!({
                "resource": server.url("/mcp"),
                "authorization_servers": [w.auth.url],
                "bearer_methods_supported": ["header"],
                "scopes_supported": ["openid"],
                "resource_name": "cli-mcp",
            }),
            "{path}"
        );
    }
    let resp = http.post(metadata_url(&server)).send().await.expect("POST");
    assert_eq!(resp.status(), 405);
    let resp = http
        .get(server.url("/.well-known/oauth-protected-resource/elsewhere"))
        .send()
        .await
        .expect("GET");
    assert_eq!(resp.status(), 404);

    let good = w.auth.token("alice", &[AUDIENCE], 600);
    let huge = format!("Bearer {}", "a".repeat(20 * 1024));
    let two = [format!("Bearer {good}"), "Bearer other".to_owned()];
    for (what, headers, want_status, want_error) in [
        ("no token", vec![], 401, None),
        (
            "two Authorization headers",
            two.to_vec(),
            400,
            Some("invalid_request"),
        ),
        (
            "a token with a space",
            vec![format!("Bearer {good} x")],
            400,
            Some("invalid_request"),
        ),
        (
            "Bearer without a token",
            vec!["Bearer".to_owned()],
            400,
            Some("invalid_request"),
        ),
        (
            "Basic credentials",
            vec!["Basic YTpi".to_owned()],
            401,
            None,
        ),
        ("a huge token", vec![huge], 401, Some("invalid_token")),
    ] {
        let refs: Vec<&str> = headers.iter().map(String::as_str).collect();
        let (status, www, body) = raw_post(&server, &refs).await;
        assert_eq!(status, want_status, "{what}: {body}");
        let mut expected = format!(
            "Bearer realm=\"cli-mcp\", resource_metadata=\"{}\"",
            metadata_url(&server)
        );
        if let Some(e) = want_error {
            expected.push_str(&format!(", error=\"{e}\""));
        }
        assert_eq!(www, expected, "{what}");
        assert!(
            body["error"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {body}"
        );
    }
    ns.delete().await.expect("delete namespace");
}
