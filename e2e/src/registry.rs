//! The real node's image registry: CNCF distribution's `registry`, built from the Go module
//! proxy by `hack/build-registry.sh` (with go-containerregistry's `crane`, its client), run by
//! the cluster on a loopback port over TLS. Its serving certificate is signed by the cluster
//! CA, which the node's containerd trusts for that host alone (`hosts.toml` `ca`).
//!
//! The project's images are pushed to it as the cluster starts ([`RegistryInfo::push`] of the
//! OCI archives `hack/build-images.sh` writes), and the kubelet pulls them from it like from
//! any registry: `<host>/cli-mcp/cli-mcp-<name>@sha256:…` by digest, as the manifests
//! `make publish` writes name them. Short names (`cli-mcp-server:dev`, which the tests'
//! operators use) are `docker.io/library/…` to containerd; the node's `hosts.toml` for
//! `docker.io` names this registry as that registry's only server (an air-gapped mirror), so
//! they are pushed under `library/` too. Every other registry goes, through `_default`, to a
//! loopback port that closes each connection at once ([`Refuser`]): no pull leaves the host,
//! and a name the run did not push fails at once instead of masquerading as a local image.
//!
//! Loopback keeps the registry out of reach of pods (their 127.0.0.1 is their own); it
//! accepts pushes from anyone on this host, as the cluster's apiserver accepts the admin.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::process::{run_ok, Component};

/// Environment variable naming a directory with prebuilt `registry` and `crane`.
pub const REGISTRY_BIN_ENV: &str = "CLI_MCP_REGISTRY_BIN";
/// The repository path the project's images are pushed under (`<host>/cli-mcp/cli-mcp-<name>`).
pub const PROJECT_PATH: &str = "cli-mcp";

/// What a client of the running registry needs; part of `cluster.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RegistryInfo {
    /// `127.0.0.1:<port>`: the registry part of an image reference.
    pub host: String,
    /// The CA that signed its serving certificate (the cluster CA).
    pub ca: PathBuf,
    /// go-containerregistry's `crane`, built with the registry.
    pub crane: PathBuf,
}

impl RegistryInfo {
    /// `crane ARGS` trusting the registry's CA. Go reads `SSL_CERT_FILE` as the only roots,
    /// so this crane trusts nothing else: it cannot reach a registry off this host over TLS.
    fn crane(&self) -> Command {
        let mut cmd = Command::new(&self.crane);
        cmd.env("SSL_CERT_FILE", &self.ca).stdin(Stdio::null());
        cmd
    }

    /// Pushes the OCI archive `archive` (an image layout in a tar, as `hack/build-images.sh`
    /// writes it) as `reference` (`<host>/<repo>:<tag>`); returns the manifest's digest.
    /// crane reads a layout from a directory only, so the archive is unpacked into a
    /// temporary directory under `work` first (removed afterwards).
    pub fn push(&self, archive: &Path, reference: &str, work: &Path) -> Result<String> {
        std::fs::create_dir_all(work).map_err(|e| Error::io("creating", work, e))?;
        let layout = tempfile::Builder::new()
            .prefix("layout-")
            .tempdir_in(work)
            .map_err(|e| Error::io("creating a directory in", work, e))?;
        run_ok(
            Command::new("tar")
                .arg("-xf")
                .arg(archive)
                .arg("-C")
                .arg(layout.path()),
        )?;
        let out = run_ok(self.crane().arg("push").arg(layout.path()).arg(reference))?;
        pushed_digest(&out).ok_or_else(|| Error::Command {
            command: format!("crane push {} {reference}", archive.display()),
            detail: format!("no digest in its output {:?}", out.trim()),
        })
    }

    /// Copies the image `source` (a reference by digest) to `target` within the registry
    /// (its blobs are mounted, not uploaded again).
    pub fn copy(&self, source: &str, target: &str) -> Result<()> {
        run_ok(self.crane().args(["copy", source, target])).map(drop)
    }

    /// The manifest digest the registry holds for `reference`.
    pub fn digest(&self, reference: &str) -> Result<String> {
        Ok(run_ok(self.crane().args(["digest", reference]))?
            .trim()
            .to_owned())
    }
}

/// The digest in `crane push`'s stdout (`<host>/<repo>@sha256:<hex>`).
pub fn pushed_digest(stdout: &str) -> Option<String> {
    let (_, digest) = stdout.trim().rsplit_once('@')?;
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then(|| digest.to_owned())
}

/// The directory with `registry` and `crane`: `$CLI_MCP_REGISTRY_BIN`, else the last line of
/// `hack/build-registry.sh` (at once when cached; about a minute cold). Dropping the future
/// stops a build in progress.
pub async fn locate_async() -> Result<PathBuf> {
    let dir = match std::env::var_os(REGISTRY_BIN_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let script = crate::workspace::workspace_root().join("hack/build-registry.sh");
            let mut cmd = tokio::process::Command::new("bash");
            cmd.arg(&script).stderr(Stdio::inherit());
            crate::build_scripts::bin_dir_from_cancellable(&script, cmd, REGISTRY_BIN_ENV).await?
        }
    };
    for bin in ["registry", "crane"] {
        if !dir.join(bin).is_file() {
            return Err(Error::Prerequisite(format!(
                "{} is missing; run hack/build-registry.sh (or point ${REGISTRY_BIN_ENV} at its bin dir)",
                dir.join(bin).display()
            )));
        }
    }
    Ok(dir)
}

/// What [`Registry::start`] needs.
pub struct RegistryStart<'a> {
    /// Where its configuration, certificate and storage go (`<node dir>/registry`).
    pub dir: &'a Path,
    /// The directory with `registry` and `crane` ([`locate_async`]).
    pub bin_dir: &'a Path,
    pub ca_cert: &'a Path,
    pub ca_cert_pem: &'a str,
    pub ca_key_pem: &'a str,
    pub log_dir: &'a Path,
    pub deadline: Instant,
}

/// The running registry. Dropping it stops the process and removes its storage.
#[derive(Debug)]
pub struct Registry {
    process: Component,
    info: RegistryInfo,
    storage: PathBuf,
}

impl Registry {
    /// Writes its configuration and serving certificate, starts it on a free loopback port
    /// and waits until `GET /v2/` answers over TLS with the cluster CA.
    pub async fn start(s: RegistryStart<'_>) -> Result<Registry> {
        let dir = s.dir;
        let storage = dir.join("storage");
        std::fs::create_dir_all(&storage).map_err(|e| Error::io("creating", &storage, e))?;
        let ip = Ipv4Addr::LOCALHOST;
        let port = crate::net::free_port(ip)?;
        let (cert, key) = serving_cert(s.ca_cert_pem, s.ca_key_pem, IpAddr::V4(ip))?;
        let (cert_path, key_path) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert_path, cert).map_err(|e| Error::io("writing", &cert_path, e))?;
        crate::node::write_private(&key_path, &key)?;
        let config = dir.join("config.yml");
        let addr = SocketAddr::from((ip, port));
        let text = config_yaml(addr, &storage, &cert_path, &key_path);
        std::fs::write(&config, text).map_err(|e| Error::io("writing", &config, e))?;
        let process = Component::start(
            "registry",
            &s.bin_dir.join("registry"),
            &["serve".into(), config.display().to_string()],
            &[],
            &s.log_dir.join("registry.log"),
            Duration::from_secs(5),
            false,
        )?;
        let mut registry = Registry {
            process,
            info: RegistryInfo {
                host: addr.to_string(),
                ca: s.ca_cert.to_path_buf(),
                crane: s.bin_dir.join("crane"),
            },
            storage,
        };
        registry.wait_ready(s.ca_cert_pem, s.deadline).await?;
        Ok(registry)
    }

    /// Polls `GET https://<host>/v2/` (the process offers nothing to wait on) until it
    /// answers 200, the process exits, or `deadline` passes.
    async fn wait_ready(&mut self, ca_pem: &str, deadline: Instant) -> Result<()> {
        let ca = reqwest::Certificate::from_pem(ca_pem.as_bytes())
            .map_err(|e| Error::Other(format!("the cluster CA for the registry: {e}")))?;
        let http = reqwest::Client::builder()
            .add_root_certificate(ca)
            .tls_built_in_root_certs(false)
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| Error::Other(format!("an HTTP client for the registry: {e}")))?;
        let url = format!("https://{}/v2/", self.info.host);
        let started = Instant::now();
        loop {
            if let Some(e) = self.process.exited_error() {
                return Err(e);
            }
            let last = match http.get(&url).send().await {
                Ok(r) if r.status().is_success() => return Ok(()),
                Ok(r) => format!("HTTP {}", r.status()),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("the image registry at {url} (last: {last})"),
                    elapsed: started.elapsed(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn info(&self) -> &RegistryInfo {
        &self.info
    }

    /// An error if the registry exited (it runs for the cluster's life).
    pub fn exited_error(&mut self) -> Option<Error> {
        self.process.exited_error()
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// Stops the process and removes what was pushed (the images live on in containerd).
    pub fn stop(&mut self) {
        self.process.stop();
        if let Err(e) = std::fs::remove_dir_all(&self.storage) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("removing {}: {e}", self.storage.display());
            }
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// distribution's configuration: filesystem storage, TLS on `addr`, deletes refused, no
/// auth (loopback only), no debug server, no proxying to another registry.
pub fn config_yaml(addr: SocketAddr, storage: &Path, cert: &Path, key: &Path) -> String {
    format!(
        "# Written by the cli-mcp e2e harness: the real node's image registry.\n\
         version: 0.1\n\
         log:\n  level: info\n  formatter: text\n\
         storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: false\n\
         http:\n  addr: {addr}\n  tls:\n    certificate: {cert}\n    key: {key}\n",
        storage = storage.display(),
        cert = cert.display(),
        key = key.display(),
    )
}

/// A serving certificate for `ip` signed by the cluster CA: `(cert, key)` PEMs.
fn serving_cert(ca_cert_pem: &str, ca_key_pem: &str, ip: IpAddr) -> Result<(String, String)> {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, SanType};
    let issuer = Issuer::from_ca_cert_pem(ca_cert_pem, KeyPair::from_pem(ca_key_pem)?)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2099, 12, 31);
    params
        .distinguished_name
        .push(DnType::CommonName, "cli-mcp-registry");
    params.subject_alt_names = vec![SanType::IpAddress(ip)];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Writes containerd's registry host configuration into `certs_dir` (the CRI plugin's
/// `registry.config_path`): the registry at `host` trusted with `ca`, the same registry as
/// `docker.io`'s only server, and `_default` (any other registry) sent to `refused`.
pub fn write_hosts(certs_dir: &Path, host: &str, ca: &Path, refused: SocketAddr) -> Result<()> {
    let registry = format!("https://{host}");
    for (dir, server, ca) in [
        (host, registry.as_str(), Some(ca)),
        ("docker.io", registry.as_str(), Some(ca)),
        ("_default", &format!("https://{refused}"), None),
    ] {
        let dir = certs_dir.join(dir);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
        let file = dir.join("hosts.toml");
        std::fs::write(&file, hosts_toml(server, ca))
            .map_err(|e| Error::io("writing", &file, e))?;
    }
    Ok(())
}

/// A `hosts.toml` whose only server is `server` (no fallback to the registry named in the
/// image), trusted with `ca` when given.
pub fn hosts_toml(server: &str, ca: Option<&Path>) -> String {
    let ca = ca
        .map(|ca| format!("  ca = \"{}\"\n", ca.display()))
        .unwrap_or_default();
    format!(
        "# Written by the cli-mcp e2e harness: pulls go to the node's own registry only.\n\
         server = \"{server}\"\n\n[host.\"{server}\"]\n  capabilities = [\"pull\", \"resolve\"]\n{ca}"
    )
}

/// A loopback port that accepts each connection and closes it at once: where containerd's
/// pulls of any registry but the node's own go, so they fail on this host in milliseconds
/// (a closed port could be taken by something else later; this one stays ours).
#[derive(Debug)]
pub struct Refuser {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Refuser {
    pub async fn start() -> Result<Refuser> {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(|e| Error::Other(format!("binding a loopback port: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Other(format!("the refusing port's address: {e}")))?;
        let task = tokio::spawn(async move {
            while let Ok((conn, peer)) = listener.accept().await {
                tracing::debug!(%peer, "a pull of an image from another registry: refused");
                drop(conn);
            }
        });
        Ok(Refuser { addr, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Refuser {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_send_docker_io_to_the_registry_and_the_rest_to_the_refuser() {
        let dir = tempfile::tempdir().expect("tempdir");
        let refused: SocketAddr = "127.0.0.1:1234".parse().expect("addr");
        write_hosts(
            dir.path(),
            "127.0.0.1:5000",
            Path::new("/p/ca.crt"),
            refused,
        )
        .expect("write");
        let read = |d: &str| std::fs::read_to_string(dir.path().join(d).join("hosts.toml"));
        for d in ["127.0.0.1:5000", "docker.io"] {
            let t = read(d).expect("hosts.toml");
            assert!(t.contains("server = \"https://127.0.0.1:5000\""), "{t}");
            assert!(t.contains("[host.\"https://127.0.0.1:5000\"]"), "{t}");
            assert!(t.contains("ca = \"/p/ca.crt\""), "{t}");
            assert!(!t.contains("push"), "pull and resolve only: {t}");
        }
        let t = read("_default").expect("_default");
        assert!(t.contains("server = \"https://127.0.0.1:1234\""), "{t}");
        assert!(!t.contains("ca ="), "{t}");
    }

    /// What a pull of another registry meets: a connection closed at once, no TLS, no wait.
    #[tokio::test]
    async fn the_refuser_closes_every_connection_at_once() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let refuser = Refuser::start().await.expect("refuser");
        for _ in 0..2 {
            let mut conn = tokio::net::TcpStream::connect(refuser.addr())
                .await
                .expect("connect");
            // A TLS ClientHello's first bytes; the answer is the end of the stream.
            let _ = conn.write_all(&[0x16, 0x03, 0x01]).await;
            let mut buf = [0u8; 16];
            let read = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
                .await
                .expect("closed within 5 s, not left hanging");
            assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        }
        assert!(refuser.addr().ip().is_loopback(), "{}", refuser.addr());
    }

    #[test]
    fn the_digest_comes_from_cranes_output_or_not_at_all() {
        let hex = "e7".repeat(32);
        assert_eq!(
            pushed_digest(&format!("127.0.0.1:5000/cli-mcp/x@sha256:{hex}\n")),
            Some(format!("sha256:{hex}"))
        );
        assert_eq!(pushed_digest(""), None);
        assert_eq!(pushed_digest("127.0.0.1:5000/x@sha256:abc"), None);
        assert_eq!(pushed_digest("pushed blob: sha256:00"), None);
    }

    #[test]
    fn config_serves_tls_on_the_address_and_refuses_deletes() {
        let c = config_yaml(
            "127.0.0.1:5000".parse().expect("addr"),
            Path::new("/r/storage"),
            Path::new("/r/tls.crt"),
            Path::new("/r/tls.key"),
        );
        let v: serde_yaml::Value = serde_yaml::from_str(&c).expect("yaml");
        assert_eq!(v["http"]["addr"], "127.0.0.1:5000");
        assert_eq!(v["http"]["tls"]["certificate"], "/r/tls.crt");
        assert_eq!(v["http"]["tls"]["key"], "/r/tls.key");
        assert_eq!(v["storage"]["filesystem"]["rootdirectory"], "/r/storage");
        assert_eq!(v["storage"]["delete"]["enabled"], false);
        assert!(v.get("proxy").is_none(), "never a pull-through cache: {c}");
    }

    /// The registry as the node runs it: TLS with a certificate of the cluster CA, a push
    /// of an OCI archive answered with its manifest's digest, a copy under `library/`, and
    /// a client that does not trust the CA refused.
    #[tokio::test]
    async fn a_pushed_archive_is_served_by_digest_over_tls() {
        let bin_dir = locate_async().await.expect("hack/build-registry.sh");
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = crate::pki::Pki::generate(&dir.path().join("pki"), &[]).expect("pki");
        let ca_key = std::fs::read_to_string(&pki.ca_key).expect("ca key");
        let reg_dir = dir.path().join("registry");
        std::fs::create_dir_all(&reg_dir).expect("mkdir");
        let registry = Registry::start(RegistryStart {
            dir: &reg_dir,
            bin_dir: &bin_dir,
            ca_cert: &pki.ca_cert,
            ca_cert_pem: &pki.ca_cert_pem,
            ca_key_pem: &ca_key,
            log_dir: dir.path(),
            deadline: Instant::now() + Duration::from_secs(30),
        })
        .await
        .expect("registry");
        let info = registry.info().clone();
        let (archive, digest) = tiny_archive(dir.path());
        let target = format!("{}/{PROJECT_PATH}/tiny:1", info.host);
        let pushed = info.push(&archive, &target, dir.path()).expect("push");
        assert_eq!(pushed, digest, "the registry keeps the archive's manifest");
        let by_digest = format!("{}/{PROJECT_PATH}/tiny@{digest}", info.host);
        info.copy(&by_digest, &format!("{}/library/tiny:dev", info.host))
            .expect("copy");
        let copied = format!("{}/library/tiny:dev", info.host);
        assert_eq!(info.digest(&copied).expect("digest"), digest);
        let untrusted = Command::new(&info.crane)
            .args(["digest", &copied])
            .env("SSL_CERT_FILE", "/dev/null")
            .output()
            .expect("crane");
        assert!(!untrusted.status.success(), "TLS without the CA must fail");
        let storage = reg_dir.join("storage");
        drop(registry);
        assert!(!storage.exists(), "storage removed with the registry");
    }

    /// A one-layer OCI archive (`crate::node::build_image_archive` writes docker-archives,
    /// which crane cannot push as a layout) and its manifest digest.
    fn tiny_archive(dir: &Path) -> (PathBuf, String) {
        use sha2::Digest as _;
        let layout = dir.join("layout");
        let blobs = layout.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).expect("mkdir");
        let put = |bytes: &[u8]| -> (String, usize) {
            let hex = hex::encode(sha2::Sha256::digest(bytes));
            std::fs::write(blobs.join(&hex), bytes).expect("blob");
            (format!("sha256:{hex}"), bytes.len())
        };
        let layer = {
            let src = dir.join("layer-src");
            std::fs::create_dir_all(&src).expect("mkdir");
            std::fs::write(src.join("hello"), "hi\n").expect("file");
            let tar = dir.join("layer.tar");
            run_ok(
                Command::new("tar")
                    .arg("-cf")
                    .arg(&tar)
                    .arg("-C")
                    .arg(&src)
                    .arg("hello"),
            )
            .expect("tar");
            std::fs::read(&tar).expect("layer")
        };
        let (layer_digest, layer_size) = put(&layer);
        let config = serde_json::json!({"architecture": "amd64", "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]}, "config": {}});
        let (config_digest, config_size) = put(config.to_string().as_bytes());
        let manifest = serde_json::json!({"schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": config_size},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": layer_digest, "size": layer_size}]});
        let (digest, size) = put(manifest.to_string().as_bytes());
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest, "size": size}]});
        std::fs::write(layout.join("index.json"), index.to_string()).expect("index");
        std::fs::write(
            layout.join("oci-layout"),
            r#"{"imageLayoutVersion":"1.0.0"}"#,
        )
        .expect("oci-layout");
        let archive = dir.join("tiny.tar");
        run_ok(
            Command::new("tar")
                .arg("-cf")
                .arg(&archive)
                .arg("-C")
                .arg(&layout)
                .arg("."),
        )
        .expect("tar");
        (archive, digest)
    }
}
