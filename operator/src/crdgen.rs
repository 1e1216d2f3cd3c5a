//! The CRD as YAML, generated from the Rust types (`cli-mcp-operator crdgen`,
//! `hack/crdgen.sh`). The checked-in copies are compared with this by a test.

use kube::CustomResourceExt;

use cli_mcp_api::crd::CliMcpInstance;

/// Paths of the checked-in copies, relative to the workspace root.
pub const CHECKED_IN: &[&str] = &[
    "config/crd/bases/cli-mcp.redhat.com_climcpinstances.yaml",
    "charts/cli-mcp-operator/crds/cli-mcp.redhat.com_climcpinstances.yaml",
];

pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    let body = serde_yaml::to_string(&CliMcpInstance::crd())?;
    Ok(format!(
        "# Generated from api/src/crd.rs by hack/crdgen.sh (cli-mcp-operator crdgen). Do not edit.\n{body}"
    ))
}
