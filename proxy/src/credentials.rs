//! The tokens of kubernetes routes, read from the admin's kubeconfig and re-read when the file
//! changes.
//!
//! The kubelet updates a Secret volume by writing a new directory and swapping the `..data`
//! symlink, so the path the proxy opens resolves to a different file (another inode) after a
//! rotation. Every request stats the path (a cheap syscall on a local volume) and re-reads the
//! file when its identity changed, so the next request after a rotation carries the new token
//! and no restart is needed. Streams already open upstream (watches) keep the token they
//! started with, which is what the API server checked.
//!
//! A file that became unreadable or invalid is reported on every request (502) and by
//! `/readyz`, rather than silently serving an older token: the admin replaced it for a reason.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use http::HeaderValue;

use cli_mcp_api::kubeconfig::{self, MAX_KUBECONFIG_BYTES};
use cli_mcp_api::proxy::Domain;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CredentialError {
    #[error("the proxy has no kubeconfig (--kubeconfig) to take a token for {0} from")]
    NoKubeconfig(Domain),
    #[error("the kubeconfig Secret mounted at {path} cannot be read: {reason}")]
    Unreadable { path: String, reason: String },
    #[error("the kubeconfig Secret mounted at {path} is not usable: {reason}")]
    Invalid { path: String, reason: String },
    #[error("the kubeconfig Secret has no token for server {0}; add a user with a token for it")]
    NoToken(Domain),
}

/// Identity of the file behind a path: a rename or a symlink swap changes the inode, an
/// in-place rewrite changes the modification time or the length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    mtime: i64,
    mtime_nsec: i64,
    len: u64,
}

impl FileId {
    fn of(meta: &fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
            len: meta.len(),
        }
    }
}

/// The `Authorization` value of each server of a kubeconfig, built when the file is read, so a
/// request costs a lookup and a reference-count increment.
type Headers = BTreeMap<Domain, HeaderValue>;

struct Loaded {
    id: FileId,
    parsed: Result<Headers, CredentialError>,
}

/// Source of the tokens for kubernetes routes.
pub struct Credentials {
    path: Option<PathBuf>,
    loaded: Mutex<Option<Loaded>>,
}

impl Credentials {
    pub fn new(path: Option<PathBuf>) -> Self {
        Self {
            path,
            loaded: Mutex::new(None),
        }
    }

    /// `Bearer <token>` for `domain`, from the current content of the kubeconfig (re-read if
    /// the file changed); marked sensitive, so it is never logged.
    pub fn authorization(&self, domain: &Domain) -> Result<HeaderValue, CredentialError> {
        let Some(path) = &self.path else {
            return Err(CredentialError::NoKubeconfig(domain.clone()));
        };
        let id = fs::metadata(path)
            .map(|m| FileId::of(&m))
            .map_err(|e| unreadable(path, e))?;
        let mut slot = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let loaded = match slot.take() {
            Some(l) if l.id == id => slot.insert(l),
            previous => {
                let parsed = read(path);
                if let Err(e) = &parsed {
                    tracing::warn!(error = %e, "kubeconfig reload failed");
                } else if previous.is_some() {
                    tracing::info!(path = %path.display(), "kubeconfig changed; new tokens are used from the next request");
                }
                slot.insert(Loaded { id, parsed })
            }
        };
        match &loaded.parsed {
            Ok(headers) => headers
                .get(domain)
                .cloned()
                .ok_or_else(|| CredentialError::NoToken(domain.clone())),
            Err(e) => Err(e.clone()),
        }
    }
}

fn unreadable(path: &Path, e: std::io::Error) -> CredentialError {
    CredentialError::Unreadable {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

fn read(path: &Path) -> Result<Headers, CredentialError> {
    // Bounded read: a Secret is at most 1 MiB, but a mounted file could be anything.
    let mut text = String::new();
    fs::File::open(path)
        .and_then(|f| {
            f.take(MAX_KUBECONFIG_BYTES as u64 + 1)
                .read_to_string(&mut text)
        })
        .map_err(|e| unreadable(path, e))?;
    let invalid = |reason: String| CredentialError::Invalid {
        path: path.display().to_string(),
        reason,
    };
    let kc = kubeconfig::validate(&text).map_err(|e| invalid(e.to_string()))?;
    let mut headers = Headers::new();
    for route in kc.routes() {
        let Some(token) = kc.token_for(&route.domain) else {
            continue;
        };
        let mut value = HeaderValue::try_from(format!("Bearer {token}")).map_err(|_| {
            invalid(format!(
                "the token for server {} is not a valid HTTP header value",
                route.domain
            ))
        })?;
        value.set_sensitive(true);
        headers.insert(route.domain, value);
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    fn kubeconfig(server: &str, token: &str) -> String {
        use base64::Engine as _;
        let ca = base64::engine::general_purpose::STANDARD.encode(CA_PEM);
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"
        )
    }

    /// Writes `content` the way the kubelet's atomic writer does: a new timestamped directory,
    /// a temporary `..data` symlink renamed over the old one.
    fn publish(dir: &Path, generation: u32, content: &str) {
        let data = dir.join(format!("..{generation}"));
        fs::create_dir(&data).unwrap();
        fs::write(data.join("kubeconfig"), content).unwrap();
        let tmp = dir.join("..data_tmp");
        symlink(format!("..{generation}"), &tmp).unwrap();
        fs::rename(&tmp, dir.join("..data")).unwrap();
        if !dir.join("kubeconfig").exists() {
            symlink("..data/kubeconfig", dir.join("kubeconfig")).unwrap();
        }
    }

    #[test]
    fn a_rotated_secret_volume_is_used_on_the_next_lookup() {
        let dir = tempfile::tempdir().unwrap();
        let d = Domain::parse("10.0.0.1:6443").unwrap();
        publish(dir.path(), 1, &kubeconfig("https://10.0.0.1:6443", "first"));
        let creds = Credentials::new(Some(dir.path().join("kubeconfig")));
        assert_eq!(creds.authorization(&d).unwrap(), "Bearer first");
        publish(
            dir.path(),
            2,
            &kubeconfig("https://10.0.0.1:6443", "second"),
        );
        assert_eq!(creds.authorization(&d).unwrap(), "Bearer second");
    }

    #[test]
    fn an_invalid_replacement_is_reported_not_papered_over() {
        let dir = tempfile::tempdir().unwrap();
        let d = Domain::parse("10.0.0.1:6443").unwrap();
        publish(dir.path(), 1, &kubeconfig("https://10.0.0.1:6443", "first"));
        let creds = Credentials::new(Some(dir.path().join("kubeconfig")));
        creds.authorization(&d).unwrap();
        publish(dir.path(), 2, &kubeconfig("http://10.0.0.1:6443", "second"));
        let err = creds.authorization(&d).unwrap_err();
        assert!(matches!(err, CredentialError::Invalid { .. }), "{err}");
        assert!(err.to_string().contains("https"), "{err}");
        // A token no request could carry is the file's fault, found when it is read (and so
        // by /readyz), not left to fail each request.
        publish(
            dir.path(),
            3,
            &kubeconfig("https://10.0.0.1:6443", "\"bad\\x01token\""),
        );
        let err = creds.authorization(&d).unwrap_err();
        assert!(matches!(err, CredentialError::Invalid { .. }), "{err}");
        assert!(
            err.to_string().contains("not a valid HTTP header value"),
            "{err}"
        );
    }

    #[test]
    fn missing_file_and_missing_server_are_clear() {
        let dir = tempfile::tempdir().unwrap();
        let d = Domain::parse("10.0.0.2:6443").unwrap();
        let creds = Credentials::new(Some(dir.path().join("kubeconfig")));
        assert!(matches!(
            creds.authorization(&d).unwrap_err(),
            CredentialError::Unreadable { .. }
        ));
        publish(dir.path(), 1, &kubeconfig("https://10.0.0.1:6443", "t"));
        let err = creds.authorization(&d).unwrap_err();
        assert!(
            err.to_string()
                .contains("no token for server 10.0.0.2:6443"),
            "{err}"
        );
        let none = Credentials::new(None);
        assert!(matches!(
            none.authorization(&d).unwrap_err(),
            CredentialError::NoKubeconfig(_)
        ));
    }
}
