//! The resolution of [`Flags`] into [`Settings`]: one step per group of settings, each
//! returning its typed part, run in the order their rules are checked (so that, of several
//! wrong flags, the same one is named first).

use std::net::SocketAddr;
use std::time::Duration;

use cli_mcp_api::names::InstanceName;
use cli_mcp_api::sandbox::SandboxConfig;
use cli_mcp_api::wire::{FILE_READ_MAX, MAX_TIMEOUT_MS};
use cli_mcp_api::SessionId;

use super::{
    err, AuthMode, BackendKind, FlagError, Flags, Limits, Settings, TlsFiles, Transport,
    IN_CLUSTER_ENV, MAX_COMMAND_BYTES, POD_NAMESPACE_ENV,
};
use crate::auth::resource::ProtectedResource;
use crate::auth::AuthOptions;
use crate::limits::MAX_INSTRUCTIONS_BYTES;
use crate::origin::AllowedOrigin;

/// What serves whom: the auth mode, the backend and the MCP listen address, whose defaults
/// depend on whether the server runs in a cluster.
struct Modes {
    auth: AuthMode,
    backend: BackendKind,
    listen: SocketAddr,
}

/// The instance the server serves, from `--sandbox-config`, `--instance` and `--namespace`.
struct Instance {
    sandbox: Option<SandboxConfig>,
    instance: Option<InstanceName>,
    namespace: Option<String>,
}

impl Flags {
    /// Applies the defaults and rules. `env` reads an environment variable (injected so tests
    /// do not depend on the process environment).
    pub fn resolve(self, env: impl Fn(&str) -> Option<String>) -> Result<Settings, FlagError> {
        let Modes {
            auth,
            backend,
            listen,
        } = self.modes(&env);
        let tls = self.tls(auth)?;
        let Instance {
            sandbox,
            instance,
            namespace,
        } = self.instance(&env, auth, backend)?;
        let stdio_session = self.stdio_session(auth)?;
        let limits = self.limits(backend)?;
        let shutdown_delay = self.shutdown_delay()?;
        self.check_token_review()?;
        let allowed_origins = self.allowed_origins()?;
        let instructions = bounded_text("--instructions", self.instructions.as_deref())?;
        let briefing = bounded_text("--briefing", self.briefing.as_deref())?;
        let protected_resource = protected_resource(
            &self.authorization_servers,
            self.resource_url.as_deref(),
            &self.scopes,
            &self.token_audiences,
            auth,
            tls.is_some(),
        )?;
        let auth_options = self.auth_options(protected_resource.as_ref());

        Ok(Settings {
            auth_options,
            transport: self.transport,
            stdio_session,
            listen,
            // A local server is for one user's machine: its metrics are nobody else's business.
            health_listen: self.health_listen.unwrap_or(match backend {
                BackendKind::Local => SocketAddr::from(([127, 0, 0, 1], 8081)),
                BackendKind::Kubernetes => SocketAddr::from(([0, 0, 0, 0], 8081)),
            }),
            backend,
            auth,
            tls,
            instance,
            namespace,
            hmac_key_file: self.hmac_key_file,
            sandbox,
            limits,
            agent_binary: self.agent_binary,
            log_json: self.log_json,
            shutdown_delay,
            allowed_origins,
            instructions,
            briefing,
            protected_resource,
        })
    }

    /// `--auth`, `--backend` and `--listen`, with their in-cluster defaults.
    fn modes(&self, env: &impl Fn(&str) -> Option<String>) -> Modes {
        let in_cluster = env(IN_CLUSTER_ENV).is_some_and(|v| !v.is_empty());
        let auth = self.auth.unwrap_or(if in_cluster {
            AuthMode::Kubernetes
        } else {
            AuthMode::None
        });
        let backend = self.backend.unwrap_or(if in_cluster {
            BackendKind::Kubernetes
        } else {
            BackendKind::Local
        });
        let listen = self.listen.unwrap_or_else(|| {
            let default = match auth {
                AuthMode::Kubernetes => "0.0.0.0:8443",
                AuthMode::None => "127.0.0.1:8080",
            };
            default
                .parse()
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 8080)))
        });
        Modes {
            auth,
            backend,
            listen,
        }
    }

    /// `--tls-cert` and `--tls-key`: both or neither, and both when bearer tokens come over
    /// HTTP.
    fn tls(&self, auth: AuthMode) -> Result<Option<TlsFiles>, FlagError> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
            }),
            (None, None) => None,
            (Some(_), None) => {
                return Err(err(
                    "--tls-cert is set but --tls-key is not; pass both (or neither)",
                ))
            }
            (None, Some(_)) => {
                return Err(err(
                    "--tls-key is set but --tls-cert is not; pass both (or neither)",
                ))
            }
        };
        if auth == AuthMode::Kubernetes && tls.is_none() && self.transport == Transport::Http {
            return Err(err(
                "--auth kubernetes needs TLS, because bearer tokens must not travel in clear: \
                 pass --tls-cert and --tls-key (or --auth none for local use)",
            ));
        }
        Ok(tls)
    }

    /// `--sandbox-config`, `--instance` and `--namespace`, which must name one instance, and
    /// what the backend and the auth mode need of them.
    fn instance(
        &self,
        env: &impl Fn(&str) -> Option<String>,
        auth: AuthMode,
        backend: BackendKind,
    ) -> Result<Instance, FlagError> {
        let sandbox = match &self.sandbox_config {
            None => None,
            Some(json) => Some(serde_json::from_str::<SandboxConfig>(json).map_err(|e| {
                err(format!(
                    "--sandbox-config is not a valid SandboxConfig JSON document: {e}"
                ))
            })?),
        };
        let instance = match &self.instance {
            Some(s) => Some(InstanceName::parse(s).map_err(|e| err(format!("--instance: {e}")))?),
            None => sandbox.as_ref().map(|s| s.instance.clone()),
        };
        let namespace = self
            .namespace
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| env(POD_NAMESPACE_ENV).filter(|s| !s.is_empty()))
            .or_else(|| sandbox.as_ref().map(|s| s.namespace.clone()));
        if let Some(s) = &sandbox {
            if instance.as_ref() != Some(&s.instance) {
                return Err(err(format!(
                    "--instance {} differs from the instance {} in --sandbox-config; they must name the same CliMcpInstance",
                    instance.as_ref().map(|i| i.as_str()).unwrap_or(""),
                    s.instance
                )));
            }
            if namespace.as_deref() != Some(s.namespace.as_str()) {
                return Err(err(format!(
                    "--namespace {} differs from the namespace {} in --sandbox-config; sandboxes live in the instance namespace",
                    namespace.as_deref().unwrap_or(""),
                    s.namespace
                )));
            }
        }
        if backend == BackendKind::Kubernetes && sandbox.is_none() {
            return Err(err(
                "--backend kubernetes needs --sandbox-config (the operator renders it from the \
                 CliMcpInstance); for a local try-out use --backend local",
            ));
        }
        if auth == AuthMode::Kubernetes && (instance.is_none() || namespace.is_none()) {
            return Err(err(
                "--auth kubernetes authorises callers on climcpinstances/mcp of one instance: \
                 pass --instance and --namespace (or --sandbox-config)",
            ));
        }
        Ok(Instance {
            sandbox,
            instance,
            namespace,
        })
    }

    /// `--session-id`, which the stdio transport needs and only it may go without a token.
    fn stdio_session(&self, auth: AuthMode) -> Result<Option<SessionId>, FlagError> {
        match (self.transport, &self.session_id) {
            (Transport::Stdio, None) => Err(err(
                "--transport stdio needs --session-id (a DNS-1123 label such as `dev-1`)",
            )),
            (Transport::Stdio, Some(_)) if auth == AuthMode::Kubernetes => Err(err(
                "--transport stdio has no caller token to check: use --auth none with it",
            )),
            (_, Some(s)) => Ok(Some(
                SessionId::parse(s).map_err(|e| err(format!("--session-id {s:?}: {e}")))?,
            )),
            (Transport::Http, None) => Ok(None),
        }
    }

    /// The limits of every call, each within its range.
    fn limits(&self, backend: BackendKind) -> Result<Limits, FlagError> {
        if self.max_sessions == 0 {
            return Err(err("--max-sessions must be at least 1"));
        }
        self.check_activity_stamp_gap()?;
        self.check_per_client_limits(backend)?;
        self.check_timeouts()?;
        self.check_sizes()?;
        if self.start_timeout == 0 {
            return Err(err("--start-timeout must be at least 1 second"));
        }
        Ok(Limits {
            max_sessions: self.max_sessions,
            max_sessions_per_client: self.max_sessions_per_client,
            new_sessions_per_minute_per_client: self.new_sessions_per_minute_per_client,
            default_timeout: Duration::from_secs(self.default_timeout),
            max_timeout: Duration::from_secs(self.max_timeout),
            output_budget: self.output_budget,
            max_body_bytes: self.max_body_bytes,
            max_command_bytes: MAX_COMMAND_BYTES.min(self.max_body_bytes),
            start_timeout: Duration::from_secs(self.start_timeout),
            max_resource_read: self.max_resource_read_bytes,
            activity_stamp_gap: Duration::from_secs(self.activity_stamp_gap),
        })
    }

    fn check_activity_stamp_gap(&self) -> Result<(), FlagError> {
        let gaps = cli_mcp_api::activity::STAMP_GAP_MIN.as_secs()
            ..=cli_mcp_api::activity::STAMP_GAP_MAX.as_secs();
        if !gaps.contains(&self.activity_stamp_gap) {
            return Err(err(format!(
                "--activity-stamp-gap {} is out of range: it must be {}..={} seconds",
                self.activity_stamp_gap,
                gaps.start(),
                gaps.end()
            )));
        }
        Ok(())
    }

    /// The per-client limits: at least 1, and only where there are several clients.
    fn check_per_client_limits(&self, backend: BackendKind) -> Result<(), FlagError> {
        for (flag, set, ok) in [
            (
                "--max-sessions-per-client",
                self.max_sessions_per_client.is_some(),
                self.max_sessions_per_client.is_none_or(|n| n >= 1),
            ),
            (
                "--new-sessions-per-minute-per-client",
                self.new_sessions_per_minute_per_client.is_some(),
                self.new_sessions_per_minute_per_client
                    .is_none_or(|n| n >= 1),
            ),
        ] {
            if !ok {
                return Err(err(format!(
                    "{flag} must be at least 1 (leave it out for no limit)"
                )));
            }
            if set && backend == BackendKind::Local {
                return Err(err(format!(
                    "{flag} needs --backend kubernetes (the local backend serves one user)"
                )));
            }
        }
        Ok(())
    }

    /// `--max-timeout` within the agent's limit, `--default-timeout` within it.
    fn check_timeouts(&self) -> Result<(), FlagError> {
        let agent_max_s = MAX_TIMEOUT_MS / 1000;
        if self.max_timeout == 0 || self.max_timeout > agent_max_s {
            return Err(err(format!(
                "--max-timeout {} is out of range: it must be 1..={agent_max_s} seconds (the sandbox agent's limit)",
                self.max_timeout
            )));
        }
        if self.default_timeout == 0 || self.default_timeout > self.max_timeout {
            return Err(err(format!(
                "--default-timeout {} must be between 1 and --max-timeout ({})",
                self.default_timeout, self.max_timeout
            )));
        }
        Ok(())
    }

    /// The byte limits: output budget, resource reads and request bodies.
    fn check_sizes(&self) -> Result<(), FlagError> {
        if self.output_budget < 1024 {
            return Err(err(format!(
                "--output-budget {} is too small; use at least 1024 bytes",
                self.output_budget
            )));
        }
        if !(1024..=FILE_READ_MAX).contains(&self.max_resource_read_bytes) {
            return Err(err(format!(
                "--max-resource-read-bytes {} must be between 1024 and {FILE_READ_MAX} (the \
                 agent's largest read)",
                self.max_resource_read_bytes
            )));
        }
        if self.max_body_bytes < 4096 {
            return Err(err(format!(
                "--max-body-bytes {} is too small; use at least 4096 bytes",
                self.max_body_bytes
            )));
        }
        Ok(())
    }

    fn shutdown_delay(&self) -> Result<Duration, FlagError> {
        if self.shutdown_delay > 5 {
            return Err(err(format!(
                "--shutdown-delay {} is too long; use 0 to 5 seconds (the 20 s drain that \
                 follows must fit, with a margin, in the pod's 30 s termination grace period)",
                self.shutdown_delay
            )));
        }
        Ok(Duration::from_secs(self.shutdown_delay))
    }

    /// `--token-audience` and `--auth-cache-seconds`.
    fn check_token_review(&self) -> Result<(), FlagError> {
        if self.token_audiences.iter().any(|a| a.trim().is_empty()) {
            return Err(err(
                "--token-audience is empty; give the audience the callers' tokens are bound to \
                 (`kubectl create token <sa> --audience <aud>`)",
            ));
        }
        if !(1..=3600).contains(&self.auth_cache_seconds) {
            return Err(err(format!(
                "--auth-cache-seconds {} is out of range; use 1 to 3600",
                self.auth_cache_seconds
            )));
        }
        Ok(())
    }

    fn allowed_origins(&self) -> Result<Vec<AllowedOrigin>, FlagError> {
        self.allowed_origins
            .iter()
            .map(|o| AllowedOrigin::parse(o).map_err(|e| err(format!("--allowed-origin {e}"))))
            .collect()
    }

    /// How tokens are reviewed: ServiceAccount tokens against `--token-audience`, tokens of
    /// the authorization servers against those and the resource URL too.
    fn auth_options(&self, protected_resource: Option<&ProtectedResource>) -> AuthOptions {
        let mut oidc_audiences = self.token_audiences.clone();
        if let Some(url) = protected_resource.and_then(|r| r.resource_url.as_ref()) {
            oidc_audiences.push(url.as_str().to_owned());
        }
        AuthOptions {
            audiences: self.token_audiences.clone(),
            oidc_issuers: protected_resource
                .map(|r| r.authorization_servers.clone())
                .unwrap_or_default(),
            oidc_audiences,
            allowed_ttl: Duration::from_secs(self.auth_cache_seconds),
            ..Default::default()
        }
    }
}

/// `--instructions` or `--briefing` (`flag`): blank is none, and the text is sent on every
/// connection, so it is bounded.
fn bounded_text(flag: &str, text: Option<&str>) -> Result<Option<String>, FlagError> {
    let Some(text) = text.filter(|t| !t.trim().is_empty()) else {
        return Ok(None);
    };
    let max = MAX_INSTRUCTIONS_BYTES;
    if text.len() > max {
        return Err(err(format!(
            "{flag} is {} bytes; the limit is {max}: keep it to what the model needs on every \
             connection",
            text.len()
        )));
    }
    Ok(Some(text.to_owned()))
}

/// The rules of `--authorization-server`, `--resource-url` and `--scope`.
fn protected_resource(
    authorization_servers: &[String],
    resource_url: Option<&str>,
    scopes: &[String],
    token_audiences: &[String],
    auth: AuthMode,
    tls: bool,
) -> Result<Option<crate::auth::resource::ProtectedResource>, FlagError> {
    use crate::auth::resource::{parse_authorization_server, parse_resource_url};
    if auth == AuthMode::None {
        let set = [
            (!authorization_servers.is_empty(), "--authorization-server"),
            (resource_url.is_some(), "--resource-url"),
            (!scopes.is_empty(), "--scope"),
        ];
        if let Some((_, flag)) = set.iter().find(|(on, _)| *on) {
            return Err(err(format!(
                "{flag} describes how clients get tokens, but --auth none checks none: use \
                 it with --auth kubernetes"
            )));
        }
        return Ok(None);
    }
    let authorization_servers = authorization_servers
        .iter()
        .map(|a| {
            parse_authorization_server(a.trim())
                .map_err(|e| err(format!("--authorization-server {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let resource_url = match resource_url.map(str::trim) {
        None | Some("") => None,
        Some(u) => Some(parse_resource_url(u).map_err(|e| err(format!("--resource-url {e}")))?),
    };
    if !authorization_servers.is_empty() && token_audiences.is_empty() && resource_url.is_none() {
        return Err(err(
            "--authorization-server needs --resource-url (or --token-audience): an \
             authorization server's token is accepted only when its `aud` names this \
             server, and a URL derived from the request's Host cannot decide that",
        ));
    }
    if let Some(bad) = scopes.iter().find(|s| {
        s.is_empty()
            || !s
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
    }) {
        return Err(err(format!(
            "--scope {bad:?} is not an OAuth scope (visible ASCII without spaces, quotes or \
             backslashes)"
        )));
    }
    Ok(Some(crate::auth::resource::ProtectedResource {
        authorization_servers,
        resource_url,
        scopes: scopes.to_vec(),
        tls,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;
    use std::collections::HashMap;

    fn parse(args: &[&str]) -> Flags {
        let mut full = vec!["cli-mcp-server"];
        full.extend_from_slice(args);
        Flags::try_parse_from(full).expect("flags parse")
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn sandbox_json() -> String {
        let cfg = SandboxConfig::new(
            InstanceName::parse("demo").expect("valid"),
            "ns1",
            "cli-mcp-agent:dev",
        );
        serde_json::to_string(&cfg).expect("serializes")
    }

    #[test]
    fn local_defaults_without_a_cluster() {
        let s = parse(&[]).resolve(no_env).expect("resolves");
        assert_eq!(s.backend, BackendKind::Local);
        assert_eq!(s.auth, AuthMode::None);
        assert_eq!(s.listen, "127.0.0.1:8080".parse().expect("addr"));
        assert_eq!(s.health_listen, "127.0.0.1:8081".parse().expect("addr"));
        assert_eq!(s.limits.max_sessions, 100);
        assert_eq!(s.limits.default_timeout, Duration::from_secs(60));
        assert_eq!(s.limits.max_timeout, Duration::from_secs(300));
        assert_eq!(s.limits.output_budget, 65536);
    }

    #[test]
    fn in_cluster_defaults_to_kubernetes_and_requires_tls() {
        let env = HashMap::from([
            (IN_CLUSTER_ENV.to_string(), "10.96.0.1".to_string()),
            (POD_NAMESPACE_ENV.to_string(), "ns1".to_string()),
        ]);
        let get = |k: &str| env.get(k).cloned();
        let json = sandbox_json();
        let e = parse(&["--sandbox-config", &json])
            .resolve(get)
            .expect_err("TLS missing");
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        let s = parse(&[
            "--sandbox-config",
            &json,
            "--tls-cert",
            "/c",
            "--tls-key",
            "/k",
        ])
        .resolve(get)
        .expect("resolves");
        assert_eq!(s.auth, AuthMode::Kubernetes);
        assert_eq!(s.backend, BackendKind::Kubernetes);
        assert_eq!(s.listen, "0.0.0.0:8443".parse().expect("addr"));
        assert_eq!(s.health_listen, "0.0.0.0:8081".parse().expect("addr"));
        assert_eq!(s.namespace.as_deref(), Some("ns1"));
        assert_eq!(s.instance.map(|i| i.to_string()).as_deref(), Some("demo"));
    }

    #[test]
    fn kubernetes_backend_needs_sandbox_config() {
        let e = parse(&["--backend", "kubernetes"])
            .resolve(no_env)
            .expect_err("no config");
        assert!(e.to_string().contains("--sandbox-config"), "{e}");
        let e = parse(&["--sandbox-config", "{not json"])
            .resolve(no_env)
            .expect_err("bad json");
        assert!(e.to_string().contains("not a valid SandboxConfig"), "{e}");
    }

    #[test]
    fn the_sandbox_placement_reaches_the_pods_the_server_builds() {
        let mut cfg: serde_json::Value = serde_json::from_str(&sandbox_json()).expect("json");
        cfg["placement"] = serde_json::json!({
            "runtimeClassName": "gvisor",
            "nodeSelector": {"pool": "sandboxes"},
            "tolerations": [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "sandbox-low",
            "imagePullSecrets": [{"name": "regcred"}]
        });
        let json = cfg.to_string();
        let s = parse(&["--backend", "kubernetes", "--sandbox-config", &json])
            .resolve(no_env)
            .expect("resolves");
        let sandbox = s.sandbox.expect("sandbox config");
        let pod = cli_mcp_api::sandbox::build_sandbox_pod(
            &sandbox,
            &cli_mcp_api::sandbox::SandboxRole::session(
                &cli_mcp_api::token::HmacKey::from_bytes([1; 32]),
                cli_mcp_api::SessionId::parse("s1").expect("sid"),
                cli_mcp_api::token::SandboxNonce::from_bytes([2; cli_mcp_api::token::NONCE_LEN]),
                None,
            ),
            "2026-12-01T00:00:00Z",
        );
        let spec = pod.spec.expect("spec");
        assert_eq!(spec.runtime_class_name.as_deref(), Some("gvisor"));
        assert_eq!(
            spec.node_selector
                .and_then(|m| m.get("pool").cloned())
                .as_deref(),
            Some("sandboxes")
        );
        assert_eq!(spec.tolerations.map(|t| t.len()), Some(1));
        assert_eq!(spec.priority_class_name.as_deref(), Some("sandbox-low"));
        assert_eq!(
            spec.image_pull_secrets
                .map(|p| p[0].name.clone())
                .as_deref(),
            Some("regcred")
        );

        // A malformed placement is refused at start, not turned into pods without it.
        cfg["placement"] = serde_json::json!({"tolerations": "all"});
        let e = parse(&[
            "--backend",
            "kubernetes",
            "--sandbox-config",
            &cfg.to_string(),
        ])
        .resolve(no_env)
        .expect_err("bad placement");
        assert!(e.to_string().contains("not a valid SandboxConfig"), "{e}");
    }

    #[test]
    fn instance_and_namespace_must_match_the_sandbox_config() {
        let json = sandbox_json();
        let e = parse(&["--sandbox-config", &json, "--instance", "other"])
            .resolve(no_env)
            .expect_err("mismatch");
        assert!(e.to_string().contains("differs"), "{e}");
        let e = parse(&["--sandbox-config", &json, "--namespace", "ns2"])
            .resolve(no_env)
            .expect_err("mismatch");
        assert!(e.to_string().contains("namespace"), "{e}");
    }

    #[test]
    fn stdio_rules() {
        let e = parse(&["--transport", "stdio"])
            .resolve(no_env)
            .expect_err("no sid");
        assert!(e.to_string().contains("--session-id"), "{e}");
        let e = parse(&["--transport", "stdio", "--session-id", "Bad_Id"])
            .resolve(no_env)
            .expect_err("bad sid");
        assert!(e.to_string().contains("only lowercase"), "{e}");
        let s = parse(&["--transport", "stdio", "--session-id", "dev-1"])
            .resolve(no_env)
            .expect("ok");
        assert_eq!(
            s.stdio_session.map(|s| s.to_string()).as_deref(),
            Some("dev-1")
        );
    }

    #[test]
    fn limits_are_checked() {
        let huge = "x".repeat(MAX_INSTRUCTIONS_BYTES + 1);
        for (args, needle) in [
            (vec!["--max-timeout", "301"], "--max-timeout"),
            (
                vec!["--default-timeout", "100", "--max-timeout", "50"],
                "--default-timeout",
            ),
            (vec!["--max-sessions", "0"], "--max-sessions"),
            (vec!["--output-budget", "10"], "--output-budget"),
            (vec!["--tls-cert", "/c"], "--tls-key"),
            (vec!["--shutdown-delay", "6"], "--shutdown-delay"),
            (
                vec!["--activity-stamp-gap", "1"],
                "--activity-stamp-gap 1 is out of range: it must be 2..=60 seconds",
            ),
            (
                vec!["--activity-stamp-gap", "61"],
                "--activity-stamp-gap 61",
            ),
            (
                vec!["--instructions", &huge],
                "--instructions is 16385 bytes",
            ),
            (vec!["--briefing", &huge], "--briefing is 16385 bytes"),
            (
                vec!["--allowed-origin", "app.example.com"],
                "--allowed-origin \"app.example.com\" is not an origin",
            ),
        ] {
            let e = parse(&args).resolve(no_env).expect_err("invalid");
            assert!(e.to_string().contains(needle), "{args:?}: {e}");
        }
    }

    #[test]
    fn authorization_servers_are_validated_and_need_an_audience() {
        let k = |extra: &[&str]| {
            let mut args = vec![
                "--auth",
                "kubernetes",
                "--tls-cert",
                "/c",
                "--tls-key",
                "/k",
                "--instance",
                "demo",
                "--namespace",
                "ns1",
            ];
            args.extend_from_slice(extra);
            parse(&args).resolve(no_env)
        };
        for (args, needle) in [
            (
                vec![
                    "--authorization-server",
                    "http://idp.example",
                    "--token-audience",
                    "a",
                ],
                "--authorization-server \"http://idp.example\" is not an https URL",
            ),
            (
                vec![
                    "--authorization-server",
                    "https://idp.example#f",
                    "--token-audience",
                    "a",
                ],
                "fragment",
            ),
            (
                vec!["--authorization-server", "https://idp.example"],
                "needs --resource-url",
            ),
            (
                vec!["--resource-url", "http://mcp.example/mcp"],
                "--resource-url",
            ),
            (vec!["--scope", "a b"], "--scope \"a b\""),
        ] {
            let e = k(&args).expect_err("invalid");
            assert!(e.to_string().contains(needle), "{args:?}: {e}");
        }
        let s = k(&[
            "--authorization-server",
            "https://idp.example/realms/a",
            "--resource-url",
            "https://mcp.example/mcp",
            "--token-audience",
            "cli-mcp",
            "--scope",
            "openid,mcp",
        ])
        .expect("resolves");
        let r = s.protected_resource.expect("metadata");
        assert_eq!(r.authorization_servers, ["https://idp.example/realms/a"]);
        assert_eq!(r.scopes, ["openid", "mcp"]);
        assert!(r.tls);
        assert_eq!(
            s.auth_options.oidc_issuers,
            ["https://idp.example/realms/a"]
        );
        assert_eq!(
            s.auth_options.oidc_audiences,
            ["cli-mcp", "https://mcp.example/mcp"]
        );
        assert_eq!(
            s.auth_options.audiences,
            ["cli-mcp"],
            "ServiceAccount tokens: unchanged"
        );
        // Kubernetes tokens only: the metadata lists no authorization server.
        let s = k(&[]).expect("resolves");
        assert_eq!(
            s.protected_resource.map(|r| r.authorization_servers.len()),
            Some(0)
        );
        let e = parse(&["--authorization-server", "https://idp.example"])
            .resolve(no_env)
            .expect_err("auth none");
        assert!(e.to_string().contains("--auth kubernetes"), "{e}");
    }

    #[test]
    fn allowed_origins_repeat_or_come_comma_separated() {
        let s = parse(&[
            "--allowed-origin",
            "https://a.example",
            "--allowed-origin",
            "http://b.example:*",
        ])
        .resolve(no_env)
        .expect("resolves");
        let shown: Vec<String> = s.allowed_origins.iter().map(|o| o.to_string()).collect();
        assert_eq!(shown, ["https://a.example:443", "http://b.example:*"]);
        assert!(parse(&[])
            .resolve(no_env)
            .expect("resolves")
            .allowed_origins
            .is_empty());
    }
}
