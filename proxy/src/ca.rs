//! The instance's proxy CA and the leaf certificates the proxy presents inside a tunnel.
//!
//! A sandbox trusts only this CA for the hosts it reaches through the proxy (its dummy
//! kubeconfig embeds it), so the proxy can terminate TLS, rewrite headers and inject the real
//! credential. Leaves are minted per CONNECT host, short-lived, and kept in a bounded LRU so a
//! hostile sandbox cannot grow memory by asking for many hosts (only routed hosts get a leaf
//! at all, and the cache evicts beyond its capacity).

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use lru::LruCache;
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ECDSA_P256_SHA256,
};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{self, ServerConfig};

/// Why the CA cannot be used, or a leaf cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("the CA certificate is not PEM of one X.509 certificate: {0}")]
    CertPem(String),
    #[error("the CA certificate cannot be parsed: {0}")]
    CertParse(String),
    #[error("the CA certificate is not a CA (basicConstraints CA:TRUE is missing)")]
    NotCa,
    #[error("the CA key is not a PEM private key (PKCS#8 \"PRIVATE KEY\" or SEC1 \"EC PRIVATE KEY\"): {0}")]
    KeyPem(String),
    #[error("the CA key must be ECDSA P-256: {0}")]
    KeyAlgorithm(String),
    #[error("the CA key does not belong to the CA certificate (their public keys differ)")]
    KeyMismatch,
    #[error("minting a leaf certificate for {host}: {source}")]
    Mint { host: String, source: rcgen::Error },
    #[error("building the TLS configuration for {host}: {source}")]
    Tls { host: String, source: rustls::Error },
}

/// How long a minted leaf is valid. Short, because nothing revokes it; a cached leaf is
/// replaced after half of this.
pub const LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// Backdating of `notBefore`, for clients whose clock is a little behind ours.
const CLOCK_SKEW: Duration = Duration::from_secs(3600);

pub struct CertAuthority {
    issuer: Issuer<'static, KeyPair>,
    ca_der: CertificateDer<'static>,
    provider: Arc<rustls::crypto::CryptoProvider>,
    cache: Mutex<LruCache<String, (Arc<ServerConfig>, Instant)>>,
}

impl CertAuthority {
    /// Loads and checks the CA: a CA certificate, an ECDSA P-256 key, and the key matching the
    /// certificate. `cache` bounds the number of leaves kept.
    pub fn from_pem(
        cert_pem: &str,
        key_pem: &str,
        cache: NonZeroUsize,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Self, CaError> {
        let ca_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| CaError::CertPem(e.to_string()))?;
        let (_, x509) = x509_parser::parse_x509_certificate(&ca_der)
            .map_err(|e| CaError::CertParse(e.to_string()))?;
        if !x509.is_ca() {
            return Err(CaError::NotCa);
        }
        let key = load_key(key_pem)?;
        if key.public_key_raw() != x509.public_key().subject_public_key.data.as_ref() {
            return Err(CaError::KeyMismatch);
        }
        let issuer = Issuer::from_ca_cert_der(&ca_der, key)
            .map_err(|e| CaError::CertParse(e.to_string()))?;
        Ok(Self {
            issuer,
            ca_der: ca_der.into_owned(),
            provider,
            cache: Mutex::new(LruCache::new(cache)),
        })
    }

    /// The TLS configuration presenting a leaf for `host` (a DNS name or an IP address,
    /// without brackets), from the cache when it is fresh.
    pub fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, CaError> {
        if let Some((config, minted)) = self.lock().get(host) {
            if minted.elapsed() < LEAF_VALIDITY / 2 {
                return Ok(config.clone());
            }
        }
        let config = Arc::new(self.mint(host)?);
        self.lock()
            .put(host.to_owned(), (config.clone(), Instant::now()));
        Ok(config)
    }

    /// Number of leaves held (for tests of the bound).
    pub fn cached(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<String, (Arc<ServerConfig>, Instant)>> {
        // A panic while holding the lock cannot leave the cache inconsistent (puts are
        // single calls), so a poisoned lock is still usable.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mint(&self, host: &str) -> Result<ServerConfig, CaError> {
        let mint_err = |source| CaError::Mint {
            host: host.to_owned(),
            source,
        };
        let mut params = CertificateParams::new(vec![host.to_owned()]).map_err(mint_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        let now = SystemTime::now();
        params.not_before = (now - CLOCK_SKEW).into();
        params.not_after = (now + LEAF_VALIDITY).into();
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(mint_err)?;
        let leaf = params.signed_by(&key, &self.issuer).map_err(mint_err)?;
        let tls_err = |source| CaError::Tls {
            host: host.to_owned(),
            source,
        };
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(tls_err)?
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone(), self.ca_der.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .map_err(tls_err)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// Reads a P-256 key as PKCS#8, or as SEC1 (`EC PRIVATE KEY`, what `openssl ecparam -genkey`
/// writes) wrapped into PKCS#8 for the crypto library.
fn load_key(pem: &str) -> Result<KeyPair, CaError> {
    let der = PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| CaError::KeyPem(e.to_string()))?;
    let pkcs8 = match der {
        PrivateKeyDer::Pkcs8(k) => k.secret_pkcs8_der().to_vec(),
        PrivateKeyDer::Sec1(k) => sec1_to_pkcs8(k.secret_sec1_der()),
        PrivateKeyDer::Pkcs1(_) => {
            return Err(CaError::KeyAlgorithm("the key is RSA (PKCS#1)".into()))
        }
        _ => return Err(CaError::KeyPem("an unknown private key format".into())),
    };
    KeyPair::from_pkcs8_der_and_sign_algo(&PrivatePkcs8KeyDer::from(pkcs8), &PKCS_ECDSA_P256_SHA256)
        .map_err(|e| CaError::KeyAlgorithm(e.to_string()))
}

/// `PrivateKeyInfo { version 0, AlgorithmIdentifier { id-ecPublicKey, prime256v1 },
/// OCTET STRING { ECPrivateKey } }` (RFC 5208, RFC 5915).
fn sec1_to_pkcs8(sec1: &[u8]) -> Vec<u8> {
    const VERSION: &[u8] = &[0x02, 0x01, 0x00];
    const ALGORITHM: &[u8] = &[
        0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a, 0x86,
        0x48, 0xce, 0x3d, 0x03, 0x01, 0x07,
    ];
    let octets = der_tlv(0x04, sec1);
    let mut body = Vec::with_capacity(VERSION.len() + ALGORITHM.len() + octets.len());
    body.extend_from_slice(VERSION);
    body.extend_from_slice(ALGORITHM);
    body.extend_from_slice(&octets);
    der_tlv(0x30, &body)
}

fn der_tlv(tag: u8, value: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = value.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes: Vec<u8> = len
            .to_be_bytes()
            .into_iter()
            .skip_while(|b| *b == 0)
            .collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend_from_slice(&bytes);
    }
    out.extend_from_slice(value);
    out
}

/// A CA for tests and the benchmark: ECDSA P-256, PEM certificate and PKCS#8 key.
pub fn generate_ca(common_name: &str) -> Result<(String, String), rcgen::Error> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn ca(cache: usize) -> CertAuthority {
        let (cert, key) = generate_ca("test CA").unwrap();
        CertAuthority::from_pem(&cert, &key, NonZeroUsize::new(cache).unwrap(), provider()).unwrap()
    }

    #[test]
    fn leaves_are_cached_and_bounded() {
        let ca = ca(2);
        let a = ca.server_config("a.example").unwrap();
        let a2 = ca.server_config("a.example").unwrap();
        assert!(Arc::ptr_eq(&a, &a2), "a fresh leaf is reused");
        ca.server_config("10.0.0.1").unwrap();
        ca.server_config("::1").unwrap();
        assert_eq!(ca.cached(), 2);
        assert_eq!(a.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let (cert, _) = generate_ca("one").unwrap();
        let (_, other_key) = generate_ca("two").unwrap();
        let err = CertAuthority::from_pem(&cert, &other_key, NonZeroUsize::MIN, provider())
            .err()
            .unwrap();
        assert!(matches!(err, CaError::KeyMismatch), "{err}");
    }

    #[test]
    fn a_non_ca_certificate_is_refused() {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = CertificateParams::new(vec!["x.example".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let err = CertAuthority::from_pem(
            &cert.pem(),
            &key.serialize_pem(),
            NonZeroUsize::MIN,
            provider(),
        )
        .err()
        .unwrap();
        assert!(matches!(err, CaError::NotCa), "{err}");
    }

    #[test]
    fn non_p256_keys_and_garbage_are_refused_with_a_reason() {
        let (cert, _) = generate_ca("one").unwrap();
        let p384 = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let err =
            CertAuthority::from_pem(&cert, &p384.serialize_pem(), NonZeroUsize::MIN, provider())
                .err()
                .unwrap();
        assert!(matches!(err, CaError::KeyAlgorithm(_)), "{err}");
        let err = CertAuthority::from_pem("nope", "nope", NonZeroUsize::MIN, provider())
            .err()
            .unwrap();
        assert!(matches!(err, CaError::CertPem(_)), "{err}");
    }

    #[test]
    fn a_sec1_key_is_accepted() {
        // openssl's `ecparam -genkey` output shape: ECPrivateKey with the curve parameters and
        // the public key, under an "EC PRIVATE KEY" label. Take it out of a PKCS#8 key.
        let (cert, key_pem) = generate_ca("sec1").unwrap();
        let pkcs8 = PrivatePkcs8KeyDer::from_pem_slice(key_pem.as_bytes()).unwrap();
        let der = pkcs8.secret_pkcs8_der();
        // PrivateKeyInfo = 30 len { 02 01 00, 30 13 <alg>, 04 len <ECPrivateKey> }
        let header = |at: usize| -> (usize, usize) {
            match der[at + 1] {
                n if n < 0x80 => (at + 2, n as usize),
                0x81 => (at + 3, der[at + 2] as usize),
                _ => (
                    at + 4,
                    u16::from_be_bytes([der[at + 2], der[at + 3]]) as usize,
                ),
            }
        };
        let (body, _) = header(0);
        let octets_at = body + 3 + 21;
        assert_eq!(der[octets_at], 0x04);
        let (start, len) = header(octets_at);
        let sec1 = &der[start..start + len];
        let sec1_pem = format!(
            "-----BEGIN EC PRIVATE KEY-----\n{}\n-----END EC PRIVATE KEY-----\n",
            base64::engine::general_purpose::STANDARD.encode(sec1)
        );
        assert!(
            sec1_to_pkcs8(sec1) == der,
            "the wrapping is the inverse of the unwrapping"
        );
        CertAuthority::from_pem(&cert, &sec1_pem, NonZeroUsize::MIN, provider()).unwrap();
    }

    /// Written by `openssl ecparam -name prime256v1 -genkey -noout` and `openssl req -x509`
    /// (test data only: this CA signs nothing outside this test).
    const OPENSSL_CA_CERT: &str = "-----BEGIN CERTIFICATE-----\nMIIBcDCCARWgAwIBAgIURxYUk+HBwX1tgr5W8pGBax0TmwcwCgYIKoZIzj0EAwIw\nDTELMAkGA1UEAwwCY2EwHhcNMjYxMjAxMjAwNTE2WhcNMjYxMjAzMjAwNTE2WjAN\nMQswCQYDVQQDDAJjYTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABLP2Za79lNr3\nSJWuZGPdd231s4Bq7eIdBDemYsJEP+1ItcGqf51h7xfJJprb6ijTxhq/hy8c7Rbn\n4RbljSxk042jUzBRMB0GA1UdDgQWBBQZ27Z7WpMQSJOein7r7gh7BQeE6TAfBgNV\nHSMEGDAWgBQZ27Z7WpMQSJOein7r7gh7BQeE6TAPBgNVHRMBAf8EBTADAQH/MAoG\nCCqGSM49BAMCA0kAMEYCIQDJk65XcWalHf7ISJx3SxhgZL4b0lzlnWkyh049Vni9\n7QIhAN6s4v6PVExmG1FdLGO5/jL7owHg5rlr4HgVDApZwWJK\n-----END CERTIFICATE-----\n";
    const OPENSSL_SEC1_KEY: &str = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIEal8svpvAcSJUxCg9lm1cjW5vKP/or5k95jSRT5cCejoAoGCCqGSM49\nAwEHoUQDQgAEs/Zlrv2U2vdIla5kY913bfWzgGrt4h0EN6ZiwkQ/7Ui1wap/nWHv\nF8kmmtvqKNPGGr+HLxztFufhFuWNLGTTjQ==\n-----END EC PRIVATE KEY-----\n";

    #[test]
    fn an_openssl_sec1_key_is_accepted() {
        let ca = CertAuthority::from_pem(
            OPENSSL_CA_CERT,
            OPENSSL_SEC1_KEY,
            NonZeroUsize::MIN,
            provider(),
        )
        .unwrap();
        ca.server_config("kubernetes.default.svc").unwrap();
    }
}
