//! PKI for one local cluster, generated fresh for every `up` with rcgen (ECDSA P-256).
//!
//! - `ca.crt`/`ca.key`: the cluster CA. It signs the apiserver serving certificate and the
//!   client certificates, and is the apiserver's `--client-ca-file`.
//! - `apiserver.crt`/`apiserver.key`: serving certificate with the SANs clients use: the
//!   pod-reachable host address, loopback, the `kubernetes` Service IP and names.
//! - `sa.key`/`sa.pub`: service-account token signing key pair.
//! - `admin.crt`/`admin.key`: client certificate `CN=cli-mcp-admin, O=system:masters`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::error::{Error, Result};

/// Common name of the admin client certificate.
pub const ADMIN_USER: &str = "cli-mcp-admin";
/// Group of the admin client certificate (bound to cluster-admin by default RBAC).
pub const ADMIN_GROUP: &str = "system:masters";

/// DNS names the apiserver serving certificate carries besides its IP addresses.
pub const APISERVER_DNS_NAMES: &[&str] = &[
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];

/// Paths and PEM contents of the generated PKI.
#[derive(Debug, Clone)]
pub struct Pki {
    pub dir: PathBuf,
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub apiserver_cert: PathBuf,
    pub apiserver_key: PathBuf,
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
    pub admin_cert: PathBuf,
    pub admin_key: PathBuf,
    pub ca_cert_pem: String,
    pub admin_cert_pem: String,
    pub admin_key_pem: String,
}

fn validity(params: &mut CertificateParams) {
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2099, 12, 31);
}

fn write(path: &Path, contents: &str, mode: u32) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(|e| Error::io("creating", path, e))?;
    f.write_all(contents.as_bytes())
        .map_err(|e| Error::io("writing", path, e))
}

impl Pki {
    /// Generate a fresh PKI into `dir` (created if missing). `ips` are the IP SANs of the
    /// apiserver serving certificate (127.0.0.1 and 10.96.0.1 are always added).
    pub fn generate(dir: &Path, ips: &[IpAddr]) -> Result<Pki> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;

        // CA
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::default();
        validity(&mut ca_params);
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "cli-mcp-e2e-ca");
        ca_params.distinguished_name = dn;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let ca_cert_pem = ca_cert.pem();
        let issuer = Issuer::new(ca_params, &ca_key);

        // apiserver serving certificate
        let server_key = KeyPair::generate()?;
        let mut server_params = CertificateParams::default();
        validity(&mut server_params);
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "kube-apiserver");
        server_params.distinguished_name = dn;
        let mut sans: Vec<SanType> = Vec::new();
        for name in APISERVER_DNS_NAMES {
            sans.push(SanType::DnsName((*name).try_into()?));
        }
        let mut all_ips: Vec<IpAddr> =
            vec![IpAddr::from([127, 0, 0, 1]), IpAddr::from([10, 96, 0, 1])];
        for ip in ips {
            if !all_ips.contains(ip) {
                all_ips.push(*ip);
            }
        }
        sans.extend(all_ips.into_iter().map(SanType::IpAddress));
        server_params.subject_alt_names = sans;
        server_params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        server_params.use_authority_key_identifier_extension = true;
        let server_cert = server_params.signed_by(&server_key, &issuer)?;

        // admin client certificate
        let admin_key = KeyPair::generate()?;
        let mut admin_params = CertificateParams::default();
        validity(&mut admin_params);
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, ADMIN_USER);
        dn.push(DnType::OrganizationName, ADMIN_GROUP);
        admin_params.distinguished_name = dn;
        admin_params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        admin_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        admin_params.use_authority_key_identifier_extension = true;
        let admin_cert = admin_params.signed_by(&admin_key, &issuer)?;

        // service-account signing key pair
        let sa_key = KeyPair::generate()?;

        let pki = Pki {
            dir: dir.to_path_buf(),
            ca_cert: dir.join("ca.crt"),
            ca_key: dir.join("ca.key"),
            apiserver_cert: dir.join("apiserver.crt"),
            apiserver_key: dir.join("apiserver.key"),
            sa_key: dir.join("sa.key"),
            sa_pub: dir.join("sa.pub"),
            admin_cert: dir.join("admin.crt"),
            admin_key: dir.join("admin.key"),
            ca_cert_pem,
            admin_cert_pem: admin_cert.pem(),
            admin_key_pem: admin_key.serialize_pem(),
        };
        write(&pki.ca_cert, &pki.ca_cert_pem, 0o644)?;
        write(&pki.ca_key, &ca_key.serialize_pem(), 0o600)?;
        write(&pki.apiserver_cert, &server_cert.pem(), 0o644)?;
        write(&pki.apiserver_key, &server_key.serialize_pem(), 0o600)?;
        write(&pki.sa_key, &sa_key.serialize_pem(), 0o600)?;
        write(&pki.sa_pub, &sa_key.public_key_pem(), 0o644)?;
        write(&pki.admin_cert, &pki.admin_cert_pem, 0o644)?;
        write(&pki.admin_key, &pki.admin_key_pem, 0o600)?;
        Ok(pki)
    }
}

/// A kubeconfig for `user` (client certificate and key) with everything embedded, so it
/// keeps working when copied elsewhere, as long as the cluster runs.
pub fn kubeconfig(server: &str, ca_pem: &str, cert_pem: &str, key_pem: &str, user: &str) -> String {
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: cli-mcp
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: {user}
  user:
    client-certificate-data: {cert}
    client-key-data: {key}
contexts:
- name: cli-mcp
  context:
    cluster: cli-mcp
    user: {user}
    namespace: default
current-context: cli-mcp
",
        ca = b64(ca_pem),
        cert = b64(cert_pem),
        key = b64(key_pem),
    )
}

/// Write the admin identity's kubeconfig (see [`kubeconfig`]).
pub fn write_kubeconfig(path: &Path, server: &str, pki: &Pki) -> Result<()> {
    let text = kubeconfig(
        server,
        &pki.ca_cert_pem,
        &pki.admin_cert_pem,
        &pki.admin_key_pem,
        ADMIN_USER,
    );
    write(path, &text, 0o600)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_all_files_and_a_readable_kubeconfig() {
        let dir = std::env::temp_dir().join(format!("cli-mcp-pki-test-{}", std::process::id()));
        let pki = Pki::generate(&dir, &["10.244.0.1".parse().expect("ip")]).expect("pki");
        for p in [
            &pki.ca_cert,
            &pki.ca_key,
            &pki.apiserver_cert,
            &pki.apiserver_key,
            &pki.sa_key,
            &pki.sa_pub,
            &pki.admin_cert,
            &pki.admin_key,
        ] {
            let text = std::fs::read_to_string(p).expect("read pem");
            assert!(
                text.starts_with("-----BEGIN "),
                "{} is not PEM",
                p.display()
            );
        }
        assert!(std::fs::read_to_string(&pki.sa_pub)
            .expect("sa.pub")
            .contains("PUBLIC KEY"));
        let kc = dir.join("kubeconfig");
        write_kubeconfig(&kc, "https://10.244.0.1:6443", &pki).expect("kubeconfig");
        let parsed = kube::config::Kubeconfig::read_from(&kc).expect("parse kubeconfig");
        assert_eq!(parsed.current_context.as_deref(), Some("cli-mcp"));
        assert_eq!(parsed.clusters.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
