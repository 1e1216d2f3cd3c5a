//! The real node's identities: client certificates signed by the cluster CA (the kubelet's
//! and kube-proxy's), written into kubeconfigs only their owner can read.

use std::fs::OpenOptions;
use std::path::Path;

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::error::{Error, Result};

/// A client certificate `CN=cn, O=orgs...` signed by the cluster CA: `(cert, key)` PEMs.
pub fn client_cert(
    ca_cert_pem: &str,
    ca_key_pem: &str,
    cn: &str,
    orgs: &[&str],
) -> Result<(String, String)> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(ca_cert_pem, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2099, 12, 31);
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    for o in orgs {
        dn.push(DnType::OrganizationName, *o);
    }
    params.distinguished_name = dn;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Write `contents` to `path`, readable by its owner only (it holds a private key).
pub fn write_private(path: &Path, contents: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io("creating", path, e))?;
    f.write_all(contents.as_bytes())
        .map_err(|e| Error::io("writing", path, e))
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    #[test]
    fn client_cert_is_signed_by_the_cluster_ca() {
        let dir = std::env::temp_dir().join(format!("cli-mcp-node-pki-{}", std::process::id()));
        let pki = crate::pki::Pki::generate(&dir, &[]).expect("pki");
        let ca_key = fs::read_to_string(&pki.ca_key).expect("ca key");
        let (cert, key) = client_cert(
            &pki.ca_cert_pem,
            &ca_key,
            "system:node:n1",
            &["system:nodes"],
        )
        .expect("cert");
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(key.contains("PRIVATE KEY"));
        // The issuer of the new certificate is the CA's subject.
        let der = pem_der(&cert);
        let ca_der = pem_der(&pki.ca_cert_pem);
        let (_, c) = x509_parser::parse_x509_certificate(&der).expect("parse");
        let (_, ca) = x509_parser::parse_x509_certificate(&ca_der).expect("parse ca");
        assert_eq!(c.issuer(), ca.subject());
        assert!(c.verify_signature(Some(ca.public_key())).is_ok());
        let _ = fs::remove_dir_all(&dir);
    }

    fn pem_der(pem: &str) -> Vec<u8> {
        use base64::Engine;
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .expect("base64")
    }
}
