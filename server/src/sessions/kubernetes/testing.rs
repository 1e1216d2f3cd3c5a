//! What the unit tests of the backend's parts share: the instance's key and config, and
//! sandbox pods as the API server returns them, sealed or planted.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use cli_mcp_api::names::{annotation, InstanceName};
use cli_mcp_api::sandbox::SandboxConfig;
use cli_mcp_api::seal::seal_for;
use cli_mcp_api::token::HmacKey;

pub fn key() -> HmacKey {
    HmacKey::from_bytes([8; 32])
}

pub fn cfg() -> SandboxConfig {
    SandboxConfig::new(InstanceName::parse("demo").expect("name"), "ns1", "img:1")
}

/// A client that points nowhere: what is tested with it makes no API call.
pub fn nowhere() -> kube::Client {
    let url = "http://127.0.0.1:9".parse().expect("url");
    kube::Client::try_from(kube::Config::new(url)).expect("client")
}

/// `p` as the API server returns it once Ready, sealed by its writer.
pub fn stored_and_sealed(mut p: Pod, uid: &str) -> Pod {
    p.metadata.uid = Some(uid.into());
    p.metadata.resource_version = Some("7".into());
    p.status = Some(
        serde_json::from_value(serde_json::json!({
            "phase": "Running", "podIP": "10.1.0.7",
            "conditions": [{"type": "Ready", "status": "True"}]
        }))
        .expect("status"),
    );
    let seal = seal_for(&p, &key()).expect("namespace, name and uid");
    p.annotations_mut().insert(annotation::SEAL.into(), seal);
    p
}

/// The attack: the original deleted and recreated under its name with all its labels,
/// annotations (the seal too) and env. Only the uid differs: the API server chose it.
pub fn planted_namesake(original: &Pod) -> Pod {
    let mut p = original.clone();
    p.metadata.uid = Some("uid-the-api-server-gave-the-plant".into());
    p
}
