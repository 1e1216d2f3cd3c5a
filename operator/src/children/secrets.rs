//! The generate-once Secrets: the HMAC key (`cli-mcp-<n>-hmac`, key `key`) and, when the
//! admin gives none, a CA (`cli-mcp-<n>-tls-ca`, operator-only) plus a serving certificate
//! issued from it (`cli-mcp-<n>-tls`) whose CA is published in ConfigMap `cli-mcp-<n>-ca`.
//! These are created, never applied: an existing Secret is never overwritten, except the
//! serving certificate when it is renewed.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use sha2::{Digest, Sha256};

use cli_mcp_api::names::InstanceName;

/// Key of the HMAC Secret.
pub const HMAC_KEY: &str = "key";
pub const TLS_CRT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
pub const CA_CRT: &str = "ca.crt";
/// Key of the serving CA's private key, only in the operator-only CA Secret.
pub const CA_KEY: &str = "ca.key";

/// Name of the ConfigMap publishing the generated CA.
pub fn ca_config_map_name(n: &InstanceName) -> String {
    format!("{}-ca", n.server())
}

/// OpenShift's Service annotation asking its service CA for a serving certificate, in the
/// Secret it names (keys tls.crt, tls.key; renewed by the service CA).
pub const SERVING_CERT_ANNOTATION: &str = "service.beta.openshift.io/serving-cert-secret-name";
/// What the service CA writes on the Service when it cannot issue the certificate.
pub const SERVING_CERT_ERROR_ANNOTATION: &str =
    "service.beta.openshift.io/serving-cert-generation-error";
/// OpenShift's ConfigMap annotation asking for the service CA bundle. The injector then
/// owns the ConfigMap's data: it replaces it with [`SERVICE_CA_KEY`] alone.
pub const INJECT_CABUNDLE_ANNOTATION: &str = "service.beta.openshift.io/inject-cabundle";
/// The key the service CA bundle is injected under.
pub const SERVICE_CA_KEY: &str = "service-ca.crt";

/// The Secret OpenShift's service CA issues the serving certificate into.
pub fn service_tls_secret_name(n: &InstanceName) -> String {
    format!("{}-service-tls", n.server())
}

/// The ConfigMap OpenShift injects its service CA bundle into. Not the CA ConfigMap
/// itself: the injector would remove its `ca.crt`, the key clients read everywhere.
pub fn service_ca_config_map_name(n: &InstanceName) -> String {
    format!("{}-service-ca", n.server())
}

/// The ConfigMap the service CA bundle is injected into: only the annotation, no data, so
/// the operator's apply and the injector never contend for a field.
pub fn service_ca_config_map(meta: ObjectMeta) -> ConfigMap {
    let mut meta = meta;
    meta.annotations = Some(BTreeMap::from([(
        INJECT_CABUNDLE_ANNOTATION.to_owned(),
        "true".to_owned(),
    )]));
    ConfigMap {
        metadata: meta,
        ..Default::default()
    }
}

/// 32 random bytes as 64 lowercase hex characters, the form `HmacKey::from_hex` reads.
pub fn generate_hmac_key() -> String {
    let bytes: [u8; 32] = rand::random();
    hex::encode(bytes)
}

/// A short, stable fingerprint of secret material, safe to publish in an annotation.
pub fn version_of(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    hex::encode(h.finalize())[..16].to_owned()
}

pub fn hmac_secret(meta: ObjectMeta, key_hex: &str) -> Secret {
    Secret {
        metadata: meta,
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            HMAC_KEY.to_owned(),
            ByteString(key_hex.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

/// PEM material of a generated CA and serving certificate.
#[derive(Clone)]
pub struct TlsMaterial {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsMaterial(<redacted>)")
    }
}

/// DNS names the serving certificate covers: the Service in all its spellings.
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// How long a generated serving certificate is valid unless the operator is told otherwise
/// (`CLI_MCP_TLS_LIFETIME`).
pub const DEFAULT_TLS_LIFETIME: Duration = Duration::from_secs(2 * YEAR);
/// The generated serving CA's lifetime.
const CA_LIFETIME: Duration = Duration::from_secs(10 * YEAR);
const YEAR: u64 = 365 * 24 * 3600;

/// The CA the serving certificates of an instance are issued from: its certificate is
/// published (ConfigMap `cli-mcp-<n>-ca`), its key stays in an operator-only Secret
/// ([`tls_ca_secret_name`]) that no pod mounts, so renewing the leaf never changes what
/// clients trust.
#[derive(Clone)]
pub struct CaMaterial {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for CaMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CaMaterial(<redacted>)")
    }
}

/// The operator-only Secret holding the serving CA's certificate and key.
pub fn tls_ca_secret_name(n: &InstanceName) -> String {
    format!("{}-ca", n.tls_secret())
}

/// Backdating covers clocks a little behind the operator's, without making a short test
/// lifetime mostly past.
fn backdate(lifetime: Duration) -> Duration {
    (lifetime / 10).min(Duration::from_secs(3600))
}

/// Generates the serving CA (ECDSA P-256, valid 10 years, may sign leaf certificates only).
pub fn generate_tls_ca(service: &str, namespace: &str) -> Result<CaMaterial, rcgen::Error> {
    let now = SystemTime::now();
    let key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        format!("cli-mcp {namespace}/{service} CA"),
    );
    ca.distinguished_name = dn;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = (now - backdate(CA_LIFETIME)).into();
    ca.not_after = (now + CA_LIFETIME).into();
    let cert = ca.self_signed(&key)?;
    Ok(CaMaterial {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Issues a serving certificate from `ca` for the Service's DNS names plus `extra_hosts`
/// (the exposed public host, for an edge that passes TLS through), valid `lifetime` but
/// never past the CA.
pub fn issue_serving_cert(
    ca: &CaMaterial,
    service: &str,
    namespace: &str,
    extra_hosts: &[String],
    lifetime: Duration,
) -> Result<TlsMaterial, rcgen::Error> {
    let now = SystemTime::now();
    let ca_key = KeyPair::from_pem(&ca.key_pem)?;
    let ca_until = validity(&ca.cert_pem).map(|(_, until)| until);
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key)?;
    let key = KeyPair::generate()?;
    let mut srv = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("{service}.{namespace}.svc"));
    srv.distinguished_name = dn;
    srv.subject_alt_names = service_dns_names(service, namespace)
        .into_iter()
        .chain(extra_hosts.iter().cloned())
        .map(|n| n.try_into().map(SanType::DnsName))
        .collect::<Result<_, _>>()?;
    srv.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    srv.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    srv.use_authority_key_identifier_extension = true;
    srv.not_before = (now - backdate(lifetime)).into();
    let until = now + lifetime;
    srv.not_after = ca_until.map_or(until, |ca| ca.min(until)).into();
    let cert = srv.signed_by(&key, &issuer)?;
    Ok(TlsMaterial {
        ca_pem: ca.cert_pem.clone(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Generates a CA (ECDSA P-256, valid 10 years) and a serving certificate (2 years) for the
/// Service's DNS names plus `extra_hosts`.
pub fn generate_tls(
    service: &str,
    namespace: &str,
    extra_hosts: &[String],
) -> Result<TlsMaterial, rcgen::Error> {
    let ca = generate_tls_ca(service, namespace)?;
    issue_serving_cert(&ca, service, namespace, extra_hosts, DEFAULT_TLS_LIFETIME)
}

/// `(notBefore, notAfter)` of the first certificate in `pem`; `None` if it does not parse.
pub fn validity(pem: &str) -> Option<(SystemTime, SystemTime)> {
    let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).ok()?;
    let cert = p.parse_x509().ok()?;
    let at = |t: x509_parser::time::ASN1Time| {
        let secs = u64::try_from(t.timestamp()).ok()?;
        SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs))
    };
    Some((
        at(cert.validity().not_before)?,
        at(cert.validity().not_after)?,
    ))
}

/// When a serving certificate is renewed: once less than a third of its validity is left
/// (at the default lifetime, eight months before it expires), so a renewal that fails
/// keeps being retried long before clients see an expired certificate. `None` when the
/// certificate does not parse: it is re-issued at once.
pub fn renew_at(cert_pem: &str) -> Option<SystemTime> {
    let (from, until) = validity(cert_pem)?;
    let life = until.duration_since(from).unwrap_or_default();
    Some(until - life / 3)
}

/// PEM of the credential proxy's CA: the certificate sandboxes trust and the key the proxy
/// signs its per-host leaf certificates with.
#[derive(Clone)]
pub struct ProxyCa {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for ProxyCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProxyCa(<redacted>)")
    }
}

/// Generates the proxy CA: ECDSA P-256 (the default of `KeyPair::generate`), valid 10
/// years, allowed to sign leaf certificates only (path length 0). Rotate by deleting the
/// Secret: a new CA is generated, the proxy rolls and warm sandboxes are replaced.
pub fn generate_proxy_ca(instance: &str, namespace: &str) -> Result<ProxyCa, rcgen::Error> {
    let now = std::time::SystemTime::now();
    let year = std::time::Duration::from_secs(365 * 24 * 3600);
    let key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        format!("cli-mcp {namespace}/{instance} credential proxy CA"),
    );
    dn.push(DnType::OrganizationName, "cli-mcp");
    ca.distinguished_name = dn;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = (now - std::time::Duration::from_secs(3600)).into();
    ca.not_after = (now + 10 * year).into();
    let cert = ca.self_signed(&key)?;
    Ok(ProxyCa {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

pub fn proxy_ca_secret(meta: ObjectMeta, ca: &ProxyCa) -> Secret {
    let b = |s: &str| ByteString(s.as_bytes().to_vec());
    Secret {
        metadata: meta,
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([
            (cli_mcp_api::proxy::CA_CERT_KEY.to_owned(), b(&ca.cert_pem)),
            (cli_mcp_api::proxy::CA_KEY_KEY.to_owned(), b(&ca.key_pem)),
        ])),
        ..Default::default()
    }
}

pub fn tls_ca_secret(meta: ObjectMeta, ca: &CaMaterial) -> Secret {
    let b = |s: &str| ByteString(s.as_bytes().to_vec());
    Secret {
        metadata: meta,
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([
            (CA_CRT.to_owned(), b(&ca.cert_pem)),
            (CA_KEY.to_owned(), b(&ca.key_pem)),
        ])),
        ..Default::default()
    }
}

pub fn tls_secret(meta: ObjectMeta, m: &TlsMaterial) -> Secret {
    let b = |s: &str| ByteString(s.as_bytes().to_vec());
    Secret {
        metadata: meta,
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            (TLS_CRT.to_owned(), b(&m.cert_pem)),
            (TLS_KEY.to_owned(), b(&m.key_pem)),
            (CA_CRT.to_owned(), b(&m.ca_pem)),
        ])),
        ..Default::default()
    }
}

pub fn ca_config_map(meta: ObjectMeta, ca_pem: &str) -> ConfigMap {
    ConfigMap {
        metadata: meta,
        data: Some(BTreeMap::from([(CA_CRT.to_owned(), ca_pem.to_owned())])),
        ..Default::default()
    }
}

/// The value of `key` in a Secret, if present and not blank.
pub fn secret_value<'a>(s: &'a Secret, key: &str) -> Option<&'a [u8]> {
    s.data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| b.0.as_slice())
        .filter(|b| !b.iter().all(u8::is_ascii_whitespace))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_key_is_64_lower_hex_and_random() {
        let a = generate_hmac_key();
        assert_eq!(a.len(), 64);
        assert!(cli_mcp_api::token::HmacKey::from_hex(&a).is_ok());
        assert_ne!(a, generate_hmac_key());
    }

    #[test]
    fn tls_material_covers_the_service_names() {
        let m = generate_tls("cli-mcp-demo", "ns1", &[]).expect("generate");
        assert!(m.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(m.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(m.key_pem.contains("PRIVATE KEY"));
        assert_ne!(m.ca_pem, m.cert_pem);
        let s = tls_secret(ObjectMeta::default(), &m);
        assert_eq!(s.type_.as_deref(), Some("kubernetes.io/tls"));
        assert!(secret_value(&s, TLS_CRT).is_some());
        assert_eq!(
            service_dns_names("svc", "ns")[3],
            "svc.ns.svc.cluster.local"
        );
    }

    #[test]
    fn an_exposed_host_is_a_name_of_the_serving_certificate() {
        use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
        let m =
            generate_tls("cli-mcp-demo", "ns1", &["mcp.example.com".to_owned()]).expect("generate");
        let der = rustls_pemfile_der(&m.cert_pem);
        let (_, cert) = X509Certificate::from_der(&der).expect("certificate parses");
        let san = cert
            .subject_alternative_name()
            .expect("extension")
            .expect("SANs");
        let names: Vec<&str> = san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::DNSName(d) => Some(*d),
                _ => None,
            })
            .collect();
        assert!(names.contains(&"mcp.example.com"), "{names:?}");
        assert!(names.contains(&"cli-mcp-demo.ns1.svc"), "{names:?}");
    }

    fn rustls_pemfile_der(pem: &str) -> Vec<u8> {
        let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).expect("PEM");
        p.contents
    }

    #[test]
    fn a_renewed_leaf_comes_from_the_same_ca_and_renews_at_two_thirds() {
        let ca = generate_tls_ca("cli-mcp-demo", "ns1").expect("CA");
        let life = Duration::from_secs(3000);
        let a = issue_serving_cert(&ca, "cli-mcp-demo", "ns1", &[], life).expect("leaf");
        let b = issue_serving_cert(&ca, "cli-mcp-demo", "ns1", &[], life).expect("leaf");
        assert_ne!(a.key_pem, b.key_pem);
        assert_eq!(a.ca_pem, b.ca_pem);
        // Both chain to the one CA: the leaf's issuer is the CA's subject.
        let subject = |pem: &str| {
            let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).expect("PEM");
            let c = p.parse_x509().expect("X.509");
            (c.subject().to_string(), c.issuer().to_string())
        };
        assert_eq!(subject(&a.cert_pem).1, subject(&ca.cert_pem).0);
        let (from, until) = validity(&a.cert_pem).expect("validity");
        let now = SystemTime::now();
        // Backdated by a tenth of the lifetime, valid the lifetime from now.
        let backdated = now.duration_since(from).expect("from in the past");
        assert!((299..=301).contains(&backdated.as_secs()), "{backdated:?}");
        let ahead = until.duration_since(now).expect("until ahead");
        assert!((2998..=3000).contains(&ahead.as_secs()), "{ahead:?}");
        // A third of 3300 s before the end.
        let renew = renew_at(&a.cert_pem).expect("renew_at");
        assert_eq!(until.duration_since(renew).expect("before").as_secs(), 1100);
        assert!(renew_at("not a certificate").is_none());
        // A leaf never outlives its CA.
        let long =
            issue_serving_cert(&ca, "s", "n", &[], Duration::from_secs(20 * YEAR)).expect("leaf");
        assert_eq!(
            validity(&long.cert_pem).expect("leaf").1,
            validity(&ca.cert_pem).expect("CA").1
        );
        let s = tls_ca_secret(ObjectMeta::default(), &ca);
        assert!(secret_value(&s, CA_KEY).is_some());
        assert!(!format!("{ca:?}").contains("PRIVATE"));
    }

    #[test]
    fn the_proxy_ca_is_a_p256_ca_in_two_keys() {
        let ca = generate_proxy_ca("demo", "ns1").expect("generate");
        let s = proxy_ca_secret(ObjectMeta::default(), &ca);
        let crt = secret_value(&s, "ca.crt").expect("ca.crt");
        let key = secret_value(&s, "ca.key").expect("ca.key");
        assert!(String::from_utf8_lossy(crt).starts_with("-----BEGIN CERTIFICATE-----"));
        let key_pem = String::from_utf8_lossy(key).into_owned();
        let kp = KeyPair::from_pem(&key_pem).expect("key parses");
        assert_eq!(kp.algorithm(), &rcgen::PKCS_ECDSA_P256_SHA256);
        assert!(!format!("{ca:?}").contains("PRIVATE"));
        assert_ne!(
            generate_proxy_ca("demo", "ns1").expect("generate").key_pem,
            ca.key_pem
        );
    }

    #[test]
    fn blank_values_do_not_count() {
        let s = hmac_secret(ObjectMeta::default(), "  \n");
        assert!(secret_value(&s, HMAC_KEY).is_none());
        assert_ne!(version_of(&[b"a", b"bc"]), version_of(&[b"ab", b"c"]));
    }
}
