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

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cli_mcp_api::kubeconfig::{self, Kubeconfig, MAX_KUBECONFIG_BYTES};
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

struct Loaded {
    id: FileId,
    parsed: Result<Arc<Kubeconfig>, CredentialError>,
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

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The token to inject for `domain`, from the current content of the kubeconfig.
    pub fn token_for(&self, domain: &Domain) -> Result<String, CredentialError> {
        let kc = self.current(domain)?;
        kc.token_for(domain)
            .map(str::to_owned)
            .ok_or_else(|| CredentialError::NoToken(domain.clone()))
    }

    /// The kubeconfig as it is now (re-read if the file changed).
    pub fn current(&self, domain: &Domain) -> Result<Arc<Kubeconfig>, CredentialError> {
        let Some(path) = &self.path else {
            return Err(CredentialError::NoKubeconfig(domain.clone()));
        };
        let shown = path.display().to_string();
        let unreadable = |e: std::io::Error| CredentialError::Unreadable {
            path: shown.clone(),
            reason: e.to_string(),
        };
        let id = FileId::of(&fs::metadata(path).map_err(unreadable)?);
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = loaded.as_ref().filter(|l| l.id == id) {
            return l.parsed.clone();
        }
        let parsed = read(path, &shown).map(Arc::new);
        if let Err(e) = &parsed {
            tracing::warn!(error = %e, "kubeconfig reload failed");
        } else if loaded.is_some() {
            tracing::info!(path = %shown, "kubeconfig changed; new tokens are used from the next request");
        }
        *loaded = Some(Loaded {
            id,
            parsed: parsed.clone(),
        });
        parsed
    }
}

fn read(path: &Path, shown: &str) -> Result<Kubeconfig, CredentialError> {
    // Bounded read: a Secret is at most 1 MiB, but a mounted file could be anything.
    use std::io::Read;
    let file = fs::File::open(path).map_err(|e| CredentialError::Unreadable {
        path: shown.to_owned(),
        reason: e.to_string(),
    })?;
    let mut text = String::new();
    file.take(MAX_KUBECONFIG_BYTES as u64 + 1)
        .read_to_string(&mut text)
        .map_err(|e| CredentialError::Unreadable {
            path: shown.to_owned(),
            reason: e.to_string(),
        })?;
    kubeconfig::validate(&text).map_err(|e| CredentialError::Invalid {
        path: shown.to_owned(),
        reason: e.to_string(),
    })
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
        assert_eq!(creds.token_for(&d).unwrap(), "first");
        publish(
            dir.path(),
            2,
            &kubeconfig("https://10.0.0.1:6443", "second"),
        );
        assert_eq!(creds.token_for(&d).unwrap(), "second");
    }

    #[test]
    fn an_invalid_replacement_is_reported_not_papered_over() {
        let dir = tempfile::tempdir().unwrap();
        let d = Domain::parse("10.0.0.1:6443").unwrap();
        publish(dir.path(), 1, &kubeconfig("https://10.0.0.1:6443", "first"));
        let creds = Credentials::new(Some(dir.path().join("kubeconfig")));
        creds.token_for(&d).unwrap();
        publish(dir.path(), 2, &kubeconfig("http://10.0.0.1:6443", "second"));
        let err = creds.token_for(&d).unwrap_err();
        assert!(matches!(err, CredentialError::Invalid { .. }), "{err}");
        assert!(err.to_string().contains("https"), "{err}");
    }

    #[test]
    fn missing_file_and_missing_server_are_clear() {
        let dir = tempfile::tempdir().unwrap();
        let d = Domain::parse("10.0.0.2:6443").unwrap();
        let creds = Credentials::new(Some(dir.path().join("kubeconfig")));
        assert!(matches!(
            creds.token_for(&d).unwrap_err(),
            CredentialError::Unreadable { .. }
        ));
        publish(dir.path(), 1, &kubeconfig("https://10.0.0.1:6443", "t"));
        let err = creds.token_for(&d).unwrap_err();
        assert!(
            err.to_string()
                .contains("no token for server 10.0.0.2:6443"),
            "{err}"
        );
        let none = Credentials::new(None);
        assert!(matches!(
            none.token_for(&d).unwrap_err(),
            CredentialError::NoKubeconfig(_)
        ));
    }
}
