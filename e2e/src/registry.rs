//! The real node's image mirror: a read-only registry on a loopback port that answers from
//! the node's own containerd, so a pull (what the kubelet does for `imagePullPolicy:
//! Always`, or for an image it lacks) succeeds for an
//! image imported into the node and fails at once, on loopback, for any other.
//!
//! containerd's CRI sends every pull here ([`write_hosts`]: `hosts.toml` files naming this
//! mirror as the only server, for `docker.io` and for every other registry through
//! `_default`), so no pull ever leaves the host. The mirror serves the Docker Registry HTTP
//! API v2 read paths: `GET /v2/`, `HEAD`/`GET /v2/<name>/manifests/<tag or digest>` (the
//! tag is looked up with `ctr images list`, the manifest read from containerd's content
//! store) and `HEAD`/`GET /v2/<name>/blobs/<digest>` (from the content store).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use axum::http::{HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;

use crate::error::{Error, Result};

/// The mirror, serving until dropped.
#[derive(Debug)]
pub struct Mirror {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

/// Where a mirror finds what it serves.
#[derive(Debug, Clone)]
pub struct Store {
    /// containerd's socket (`ctr --address`).
    pub socket: PathBuf,
    /// containerd's `root` (its content store is `io.containerd.content.v1.content` there).
    pub root: PathBuf,
    /// The containerd namespace the kubelet uses.
    pub namespace: String,
}

impl Store {
    fn blob(&self, digest: &str) -> Option<PathBuf> {
        let hex = digest.strip_prefix("sha256:")?;
        let valid = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit());
        valid.then(|| {
            self.root
                .join("io.containerd.content.v1.content/blobs/sha256")
                .join(hex)
        })
    }

    /// The media type and digest of the image `reference` (normalised, `host/repo:tag`).
    async fn lookup(&self, reference: &str) -> Option<(String, String)> {
        let out = tokio::process::Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .arg("--namespace")
            .arg(&self.namespace)
            .args(["images", "list"])
            .arg(format!("name=={reference}"))
            .output()
            .await
            .ok()?;
        if !out.status.success() {
            tracing::warn!(
                reference,
                "image mirror: ctr images list: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        parse_images_list(&String::from_utf8_lossy(&out.stdout), reference)
    }
}

/// The `TYPE` and `DIGEST` columns of `reference`'s line in `ctr images list` output.
pub fn parse_images_list(text: &str, reference: &str) -> Option<(String, String)> {
    text.lines().skip(1).find_map(|l| {
        let mut cols = l.split_whitespace();
        (cols.next()? == reference).then_some(())?;
        let media_type = cols.next()?.to_owned();
        let digest = cols.next()?.to_owned();
        Some((media_type, digest))
    })
}

/// One request the mirror understands.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// `/v2/`: the API version check.
    Base,
    /// `/v2/<name>/manifests/<reference>`, with the registry of `?ns=` (default docker.io).
    Manifest {
        image: String,
        reference: String,
    },
    /// `/v2/<name>/blobs/<digest>`.
    Blob {
        digest: String,
    },
    NotFound,
}

/// Routes a request target (path and query).
pub fn route(target: &str) -> Route {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let ns = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("ns="))
        .filter(|ns| !ns.is_empty())
        .unwrap_or("docker.io");
    let Some(rest) = path.strip_prefix("/v2") else {
        return Route::NotFound;
    };
    if rest.is_empty() || rest == "/" {
        return Route::Base;
    }
    let rest = rest.trim_start_matches('/');
    if let Some((name, reference)) = rest.rsplit_once("/manifests/") {
        if !name.is_empty() && !reference.is_empty() && !reference.contains('/') {
            return Route::Manifest {
                image: format!("{ns}/{name}"),
                reference: reference.to_owned(),
            };
        }
    }
    if let Some((name, digest)) = rest.rsplit_once("/blobs/") {
        if !name.is_empty() && !digest.is_empty() && !digest.contains('/') {
            return Route::Blob {
                digest: digest.to_owned(),
            };
        }
    }
    Route::NotFound
}

/// The media type a manifest names, for a manifest asked for by digest.
fn media_type_of(manifest: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(manifest).unwrap_or_default();
    match v["mediaType"].as_str() {
        Some(t) => t.to_owned(),
        None if v.get("manifests").is_some() => "application/vnd.oci.image.index.v1+json".into(),
        None => "application/vnd.oci.image.manifest.v1+json".into(),
    }
}

impl Mirror {
    /// Listens on a free loopback port and serves `store` until dropped.
    pub async fn start(store: Store) -> Result<Mirror> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(|e| Error::Other(format!("image mirror: binding a loopback port: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Other(format!("image mirror: local address: {e}")))?;
        // One fallback handler: the registry API's paths are routed by `route`, which the
        // unit tests pin; axum does the HTTP (and answers HEAD as GET without the body).
        let app = axum::Router::new().fallback(move |method: Method, uri: Uri| {
            let store = store.clone();
            async move { serve(&store, &method, &uri).await }
        });
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!("image mirror stopped: {e}");
            }
        });
        tracing::debug!(%addr, "image mirror listening");
        Ok(Mirror { addr, task })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Writes containerd's registry host configuration into `certs_dir` (the CRI plugin's
/// `registry.config_path`): the mirror at `url` is the only server of `docker.io` and, via
/// `_default`, of any other registry.
pub fn write_hosts(certs_dir: &Path, url: &str) -> Result<()> {
    for host in ["docker.io", "_default"] {
        let dir = certs_dir.join(host);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
        let file = dir.join("hosts.toml");
        std::fs::write(&file, hosts_toml(url)).map_err(|e| Error::io("writing", &file, e))?;
    }
    Ok(())
}

/// A `hosts.toml` whose only server is `url` (no fallback to the registry itself).
pub fn hosts_toml(url: &str) -> String {
    format!(
        "# Written by the cli-mcp e2e harness: pulls go to the node's loopback image mirror.\n\
         server = \"{url}\"\n\n[host.\"{url}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
    )
}

async fn serve(store: &Store, method: &Method, uri: &Uri) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return reply(StatusCode::METHOD_NOT_ALLOWED, &[], Vec::new());
    }
    let target = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let (media_type, digest) = match route(target) {
        Route::Base => return reply(StatusCode::OK, &[], b"{}".to_vec()),
        Route::NotFound => return not_found(),
        Route::Blob { digest } => ("application/octet-stream".to_owned(), digest),
        Route::Manifest { image, reference } if reference.starts_with("sha256:") => {
            let Some(body) = read_blob(store, &reference).await else {
                return not_found();
            };
            let media_type = media_type_of(&body);
            tracing::debug!(image, "image mirror: manifest by digest");
            return reply(
                StatusCode::OK,
                &[
                    ("content-type", media_type),
                    ("docker-content-digest", reference),
                ],
                body,
            );
        }
        Route::Manifest { image, reference } => {
            match store.lookup(&format!("{image}:{reference}")).await {
                Some(found) => found,
                None => {
                    tracing::info!(
                        image = %format!("{image}:{reference}"),
                        "image mirror: not in the node's containerd (import it first)"
                    );
                    return not_found();
                }
            }
        }
    };
    let Some(body) = read_blob(store, &digest).await else {
        return not_found();
    };
    reply(
        StatusCode::OK,
        &[
            ("content-type", media_type),
            ("docker-content-digest", digest),
        ],
        body,
    )
}

async fn read_blob(store: &Store, digest: &str) -> Option<Vec<u8>> {
    tokio::fs::read(store.blob(digest)?).await.ok()
}

fn not_found() -> Response {
    let body =
        br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"not in this node's containerd"}]}"#;
    reply(
        StatusCode::NOT_FOUND,
        &[("content-type", "application/json".to_owned())],
        body.to_vec(),
    )
}

/// A response with the registry API's version header; `Content-Length` comes from the body
/// (axum keeps it for HEAD, which containerd reads for blob sizes).
fn reply(status: StatusCode, headers: &[(&'static str, String)], body: Vec<u8>) -> Response {
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        "docker-distribution-api-version",
        HeaderValue::from_static("registry/2.0"),
    );
    for (k, v) in headers {
        if let Ok(v) = HeaderValue::from_str(v) {
            h.insert(*k, v);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_the_read_paths_of_the_registry_api() {
        assert_eq!(route("/v2/"), Route::Base);
        assert_eq!(route("/v2"), Route::Base);
        assert_eq!(
            route("/v2/library/cli-mcp-server/manifests/latest?ns=docker.io"),
            Route::Manifest {
                image: "docker.io/library/cli-mcp-server".into(),
                reference: "latest".into()
            }
        );
        assert_eq!(
            route("/v2/x/y/manifests/1.0"),
            Route::Manifest {
                image: "docker.io/x/y".into(),
                reference: "1.0".into()
            }
        );
        assert_eq!(
            route("/v2/app/manifests/2?ns=quay.io"),
            Route::Manifest {
                image: "quay.io/app".into(),
                reference: "2".into()
            }
        );
        assert_eq!(
            route("/v2/library/a/blobs/sha256:00"),
            Route::Blob {
                digest: "sha256:00".into()
            }
        );
        assert_eq!(route("/v2/library/a/tags/list"), Route::NotFound);
        assert_eq!(route("/v1/_ping"), Route::NotFound);
    }

    #[test]
    fn blob_paths_accept_only_sha256_digests() {
        let s = Store {
            socket: "/s".into(),
            root: "/r".into(),
            namespace: "k8s.io".into(),
        };
        let hex = "a".repeat(64);
        assert_eq!(
            s.blob(&format!("sha256:{hex}")),
            Some(PathBuf::from(format!(
                "/r/io.containerd.content.v1.content/blobs/sha256/{hex}"
            )))
        );
        assert_eq!(s.blob("sha256:../../etc/passwd"), None);
        assert_eq!(s.blob(&format!("sha512:{hex}")), None);
    }

    #[test]
    fn parses_ctr_images_list() {
        let out = "REF TYPE DIGEST SIZE PLATFORMS LABELS\n\
            docker.io/library/cli-mcp-server:latest application/vnd.oci.image.manifest.v1+json sha256:e9b8 32.1 MiB linux/amd64 -\n";
        assert_eq!(
            parse_images_list(out, "docker.io/library/cli-mcp-server:latest"),
            Some((
                "application/vnd.oci.image.manifest.v1+json".into(),
                "sha256:e9b8".into()
            ))
        );
        assert_eq!(parse_images_list(out, "docker.io/library/other:1"), None);
    }

    /// The read paths over HTTP, from a content store laid out as containerd's.
    #[tokio::test]
    async fn serves_manifests_and_blobs_by_digest_and_refuses_the_rest() {
        use sha2::Digest as _;
        let root = std::env::temp_dir().join(format!("cli-mcp-mirror-{}", std::process::id()));
        let blobs = root.join("io.containerd.content.v1.content/blobs/sha256");
        std::fs::create_dir_all(&blobs).expect("mkdir");
        let manifest =
            br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}"#;
        let hex = hex::encode(sha2::Sha256::digest(manifest));
        std::fs::write(blobs.join(&hex), manifest).expect("blob");
        let mirror = Mirror::start(Store {
            socket: root.join("no-containerd.sock"),
            root: root.clone(),
            namespace: "k8s.io".into(),
        })
        .await
        .expect("mirror");
        let http = reqwest::Client::new();
        let get = |path: &str| http.get(format!("{}{path}", mirror.url())).send();

        let base = get("/v2/").await.expect("GET /v2/");
        assert_eq!(base.status(), 200);
        assert_eq!(
            base.headers()["docker-distribution-api-version"],
            "registry/2.0"
        );

        let digest = format!("sha256:{hex}");
        let m = get(&format!("/v2/library/x/manifests/{digest}?ns=docker.io"))
            .await
            .expect("GET manifest");
        assert_eq!(m.status(), 200);
        assert_eq!(
            m.headers()["content-type"],
            "application/vnd.oci.image.manifest.v1+json"
        );
        assert_eq!(m.headers()["docker-content-digest"], digest.as_str());
        assert_eq!(m.bytes().await.expect("body").as_ref(), manifest);

        let head = http
            .head(format!("{}/v2/library/x/blobs/{digest}", mirror.url()))
            .send()
            .await
            .expect("HEAD blob");
        assert_eq!(head.status(), 200);
        assert_eq!(
            head.headers()["content-length"],
            manifest.len().to_string().as_str()
        );

        let missing = format!("sha256:{}", "0".repeat(64));
        for path in [
            format!("/v2/library/x/blobs/{missing}"),
            "/v2/library/x/blobs/sha256:..%2F..%2Fetc%2Fpasswd".into(),
            "/v2/_catalog".into(),
        ] {
            let r = get(&path).await.expect("GET");
            assert_eq!(r.status(), 404, "{path}");
        }
        let put = http
            .put(format!("{}/v2/library/x/blobs/uploads/", mirror.url()))
            .send()
            .await
            .expect("PUT");
        assert_eq!(put.status(), 405, "read-only");
        drop(mirror);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn hosts_toml_has_only_the_mirror() {
        let t = hosts_toml("http://127.0.0.1:5000");
        assert!(t.contains("server = \"http://127.0.0.1:5000\""), "{t}");
        assert!(!t.contains("docker.io"), "{t}");
    }
}
