//! The operator's command line: flags, their env vars, and the configuration they make.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::context::{OperatorConfig, Scope};
use crate::leader::LeaderConfig;

#[derive(Parser, Debug)]
#[command(
    name = "cli-mcp-operator",
    version,
    about = "Kubernetes operator for CliMcpInstance"
)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Address of /metrics, /livez and /readyz.
    #[arg(long, env = "CLI_MCP_HEALTH_LISTEN", default_value = "0.0.0.0:8081")]
    pub health_listen: SocketAddr,

    /// Namespaces to watch (comma list); empty = the whole cluster.
    #[arg(long, env = "WATCH_NAMESPACE", default_value = "")]
    pub watch_namespace: String,

    /// Image of the MCP server.
    #[arg(long, env = "RELATED_IMAGE_SERVER")]
    pub server_image: Option<String>,

    /// Default sandbox image (spec.sandbox.image overrides it).
    #[arg(long, env = "RELATED_IMAGE_SANDBOX")]
    pub sandbox_image: Option<String>,

    /// Image of the credential proxy (every instance runs one).
    #[arg(long, env = "RELATED_IMAGE_PROXY")]
    pub proxy_image: Option<String>,

    /// The tools on the default sandbox image's PATH and their versions, as the image build
    /// recorded them: the JSON of `sandbox-tools.json` beside the archives (also
    /// `/etc/cli-mcp/tools.json` and the label `io.cli-mcp.tools` of the image). Named in the
    /// sandbox briefing of instances that run the default sandbox image.
    #[arg(long, env = "CLI_MCP_SANDBOX_TOOLS")]
    pub sandbox_tools: Option<String>,

    /// Seconds between two reviews of what each instance's kubeconfig identity may do, for
    /// its sandbox briefing (a changed kubeconfig is reviewed at once). At least 1.
    #[arg(
        long,
        env = "CLI_MCP_BRIEFING_REFRESH",
        default_value_t = crate::context::DEFAULT_BRIEFING_REFRESH.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..=24 * 3600)
    )]
    pub briefing_refresh: u64,

    /// Create config/admission's ValidatingAdmissionPolicies at start where they are missing,
    /// naming this process's ServiceAccount as the operator (`crate::policies`). For OLM,
    /// whose bundles cannot carry them (the bundle's CSV sets it); kustomize and Helm apply
    /// them themselves.
    #[arg(long, env = "CLI_MCP_CREATE_ADMISSION_POLICIES", default_value_t = false, action = clap::ArgAction::Set)]
    pub create_admission_policies: bool,

    /// Run leader election on a Lease (disable only for a single replica).
    #[arg(long, env = "CLI_MCP_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,

    /// Namespace of the Lease (default: the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_election_namespace: Option<String>,

    /// The operator's own ServiceAccount (the downward API's `spec.serviceAccountName`): an
    /// instance in the operator's namespace (`POD_NAMESPACE`) whose ServiceAccounts would be
    /// this one is refused, also where the admission policies are not installed.
    #[arg(long, env = "POD_SERVICE_ACCOUNT")]
    pub pod_service_account: Option<String>,

    #[arg(long, env = "CLI_MCP_LEASE_NAME", default_value = "cli-mcp-operator")]
    pub lease_name: String,

    /// Lease duration in seconds: how long a dead leader blocks a standby.
    #[arg(long, env = "CLI_MCP_LEASE_DURATION", default_value_t = 15)]
    pub lease_duration: u64,

    /// Seconds before expiry at which the leader renews.
    #[arg(long, env = "CLI_MCP_LEASE_GRACE", default_value_t = 5)]
    pub lease_grace: u64,

    /// Identity in the Lease and in Events (default: hostname-pid).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// Log JSON lines.
    #[arg(long, env = "CLI_MCP_LOG_JSON", default_value_t = false)]
    pub log_json: bool,

    /// Seconds a teardown waits for pods before releasing the CR anyway.
    #[arg(long, env = "CLI_MCP_TEARDOWN_TIMEOUT", default_value_t = 600)]
    pub teardown_timeout: u64,

    /// Seconds a generated serving certificate is valid (renewed when a third is left). At
    /// least a minute, so renewals cannot become a busy loop; at most five years, half the
    /// CA's lifetime.
    #[arg(
        long,
        env = "CLI_MCP_TLS_LIFETIME",
        default_value_t = crate::children::secrets::DEFAULT_TLS_LIFETIME.as_secs(),
        value_parser = clap::value_parser!(u64).range(60..=5 * 365 * 24 * 3600)
    )]
    pub tls_lifetime: u64,

    /// Seconds between periodic re-checks of every instance.
    #[arg(long, env = "CLI_MCP_RESYNC", default_value_t = 600)]
    pub resync: u64,

    /// `auto` detects OpenShift by its `route.openshift.io` API group; on OpenShift sandbox
    /// pods fix no UID (its SCC assigns one).
    #[arg(long, env = "CLI_MCP_PLATFORM", value_enum, default_value_t = crate::platform::PlatformChoice::Auto)]
    pub platform: crate::platform::PlatformChoice,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print the CustomResourceDefinition YAML.
    Crdgen,
    /// Write the OLM bundle (`bundle/`) from kustomize's renderings of `config/default` and
    /// `config/samples` (`hack/olm-bundle.sh` runs kustomize and this).
    OlmBundle {
        /// `kustomize build config/default` output.
        #[arg(long)]
        rendered: std::path::PathBuf,
        /// `kustomize build config/samples` output.
        #[arg(long)]
        samples: std::path::PathBuf,
        /// The workspace root: `config/manifests/` is read from it, `bundle/` written in it.
        #[arg(long, default_value = ".")]
        root: std::path::PathBuf,
        /// Write nothing; exit non-zero naming every file that differs.
        #[arg(long)]
        check: bool,
    },
}

impl Command {
    /// Runs a one-shot command (no cluster, no runtime).
    pub fn run(&self) -> anyhow::Result<()> {
        match self {
            Command::Crdgen => {
                print!("{}", crate::crdgen::crd_yaml()?);
                Ok(())
            }
            Command::OlmBundle {
                rendered,
                samples,
                root,
                check,
            } => crate::olm::generate(rendered, samples, root, *check),
        }
    }
}

/// Why the flags make no configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("no server image: set RELATED_IMAGE_SERVER (or --server-image)")]
    NoServerImage,
    #[error("{0}")]
    SandboxTools(String),
}

impl Args {
    /// The process configuration. The server image has no default: a Deployment rendered
    /// without one could never start.
    pub fn operator_config(&self) -> Result<OperatorConfig, ConfigError> {
        let server_image = self
            .server_image
            .clone()
            .filter(|s| !s.is_empty())
            .ok_or(ConfigError::NoServerImage)?;
        let mut config = OperatorConfig::new(
            server_image,
            self.sandbox_image.clone().filter(|s| !s.is_empty()),
        );
        config.proxy_image = self.proxy_image.clone().filter(|s| !s.is_empty());
        config.scope = Scope::parse(Some(&self.watch_namespace));
        config.teardown_timeout = Duration::from_secs(self.teardown_timeout);
        config.tls_lifetime = Duration::from_secs(self.tls_lifetime);
        // A resync below 10 s would be a busy loop over every instance.
        config.resync = Duration::from_secs(self.resync.max(10));
        config.identity = self.identity();
        config.sandbox_tools = match self.sandbox_tools.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(json) => {
                Some(crate::briefing::parse_tools(json).map_err(ConfigError::SandboxTools)?)
            }
        };
        config.briefing_refresh = Duration::from_secs(self.briefing_refresh);
        config.own_account = self
            .leader_election_namespace
            .clone()
            .zip(self.pod_service_account.clone())
            .filter(|(ns, sa)| !ns.is_empty() && !sa.is_empty());
        Ok(config)
    }

    /// The Lease to elect a leader on; `default_namespace` is the client's (in a cluster,
    /// the operator's own).
    pub fn lease_config(&self, default_namespace: &str) -> LeaderConfig {
        LeaderConfig {
            namespace: self
                .leader_election_namespace
                .clone()
                .unwrap_or_else(|| default_namespace.to_owned()),
            lease_name: self.lease_name.clone(),
            identity: self.identity(),
            duration: self.lease_duration,
            grace: self.lease_grace,
        }
    }

    fn identity(&self) -> String {
        self.identity.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|_| "operator".into());
            format!("{host}-{}", std::process::id())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_make_the_config() {
        let args = Args::try_parse_from([
            "cli-mcp-operator",
            "--server-image",
            "srv:1",
            "--watch-namespace",
            "b, a",
            "--resync",
            "1",
            "--identity",
            "op-1",
            "--leader-election-namespace",
            "ops",
        ])
        .expect("flags parse");
        let c = args.operator_config().expect("config");
        assert_eq!(c.server_image, "srv:1");
        assert_eq!(c.scope, Scope::Namespaces(vec!["a".into(), "b".into()]));
        assert_eq!(c.resync, Duration::from_secs(10));
        assert_eq!(c.identity, "op-1");
        let lease = args.lease_config("default");
        assert_eq!(
            (lease.namespace.as_str(), lease.identity.as_str()),
            ("ops", "op-1")
        );

        assert_eq!(c.tls_lifetime, Duration::from_secs(2 * 365 * 24 * 3600));

        let empty =
            Args::try_parse_from(["cli-mcp-operator", "--server-image", ""]).expect("flags parse");
        assert!(empty.operator_config().is_err());

        let short = ["cli-mcp-operator", "--server-image", "s", "--tls-lifetime"];
        let ok = Args::try_parse_from(short.iter().copied().chain(["60"])).expect("a minute");
        assert_eq!(
            ok.operator_config().expect("config").tls_lifetime,
            Duration::from_secs(60)
        );
        let err = Args::try_parse_from(short.iter().copied().chain(["59"]))
            .expect_err("under a minute is refused");
        assert!(err.to_string().contains("59"), "{err}");
    }

    #[test]
    fn the_briefings_tools_and_refresh_are_read_and_checked() {
        let base = ["cli-mcp-operator", "--server-image", "s"];
        let c = Args::try_parse_from(base)
            .expect("flags parse")
            .operator_config()
            .expect("config");
        assert_eq!(c.sandbox_tools, None);
        assert_eq!(c.briefing_refresh, Duration::from_secs(180));
        let args = Args::try_parse_from(base.iter().copied().chain([
            "--sandbox-tools",
            r#"[{"name":"jq","version":"1.6"}]"#,
            "--briefing-refresh",
            "2",
        ]))
        .expect("flags parse");
        let c = args.operator_config().expect("config");
        assert_eq!(
            c.sandbox_tools.as_deref().map(|t| t[0].version.as_str()),
            Some("1.6")
        );
        assert_eq!(c.briefing_refresh, Duration::from_secs(2));
        let bad = Args::try_parse_from(base.iter().copied().chain(["--sandbox-tools", "jq 1.6"]))
            .expect("flags parse");
        let e = bad.operator_config().expect_err("not a record");
        assert!(e.to_string().contains("sandbox-tools.json"), "{e}");
        assert!(
            Args::try_parse_from(base.iter().copied().chain(["--briefing-refresh", "0"])).is_err()
        );
    }
}
