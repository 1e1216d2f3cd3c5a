//! Which node a cluster runs its pods on: the process kubelet or the real node.

use crate::error::{Error, Result};

/// Environment variable selecting the node: `process` (default) or `real`.
pub const NODE_ENV: &str = "CLI_MCP_NODE";

/// Which node a cluster runs its pods on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeKind {
    /// `cli-mcp-kubelet`: pods as local processes in their own netns (the default).
    #[default]
    Process,
    /// kubelet + kube-proxy on containerd/runc: pods as real containers from local images.
    Real,
}

impl std::str::FromStr for NodeKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "" | "process" => Ok(NodeKind::Process),
            "real" => Ok(NodeKind::Real),
            other => Err(Error::Prerequisite(format!(
                "unknown node kind {other:?}: use `process` (cli-mcp-kubelet) or `real` \
                 (kubelet + kube-proxy on containerd)"
            ))),
        }
    }
}

impl NodeKind {
    /// `$CLI_MCP_NODE`, or the process kubelet when it is unset.
    pub fn from_env() -> Result<Self> {
        std::env::var(NODE_ENV).unwrap_or_default().parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_kind_parses() {
        assert_eq!("".parse::<NodeKind>().expect("empty"), NodeKind::Process);
        assert_eq!("process".parse::<NodeKind>().expect("p"), NodeKind::Process);
        assert_eq!("real".parse::<NodeKind>().expect("r"), NodeKind::Real);
        assert!("docker".parse::<NodeKind>().is_err());
    }
}
