//! TLS for the MCP listener: a rustls server config from PEM files (read once at startup;
//! a new certificate rolls the Deployment, see docs/server.md).

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the TLS certificate {path}: {detail}; check --tls-cert (a PEM file)")]
    Cert { path: String, detail: String },
    #[error("cannot read the TLS private key {path}: {detail}; check --tls-key (a PEM file)")]
    Key { path: String, detail: String },
    #[error("the TLS certificate and key do not form a usable pair: {0}")]
    Config(String),
}

/// Builds the server config (HTTP/2 and HTTP/1.1 by ALPN, no client certificates).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| TlsError::Cert {
            path: cert.display().to_string(),
            detail: e.to_string(),
        })?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Cert {
            path: cert.display().to_string(),
            detail: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Cert {
            path: cert.display().to_string(),
            detail: "no CERTIFICATE block found".into(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key {
        path: key.display().to_string(),
        detail: e.to_string(),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_files_name_the_flag() {
        let e = server_config(
            Path::new("/nonexistent/c.pem"),
            Path::new("/nonexistent/k.pem"),
        )
        .expect_err("missing");
        assert!(e.to_string().contains("--tls-cert"), "{e}");
    }
}
