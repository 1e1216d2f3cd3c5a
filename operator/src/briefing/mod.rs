//! The sandbox briefing: what a model is told about its sandbox before its first call, in
//! the MCP server's instructions (the server's `--briefing`, rendered into the server
//! Deployment's env). It is short, and every line of it is true when it is made:
//!
//! - the sandbox image's tools and versions, as the image build recorded them (the
//!   operator's `--sandbox-tools`, which describes its default sandbox image; another image
//!   gets "not recorded");
//! - each context of the kubernetes target with the identity it acts as and what that
//!   identity may do ([`review`], summed up by [`rbac`]), or that each session acts as its
//!   MCP caller (`identity: impersonateCaller`);
//! - the allow-listed domains;
//! - the limits a command runs into, and where a cut output is kept.
//!
//! The reviews are remembered per instance ([`BriefingCache`]) and made again when the
//! kubeconfig changes or the refresh interval has passed; the text is rendered from the spec
//! and the remembered reviews on every reconcile, and a new text rolls the server.

pub mod rbac;
pub mod review;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Most tools a record may list.
const MAX_TOOLS: usize = 32;

/// One tool on the sandbox image's PATH and its version, as `hack/build-images.sh` records
/// them (`/etc/cli-mcp/tools.json` in the image, `sandbox-tools.json` beside the archives).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    pub name: String,
    pub version: String,
}

/// Reads a tools record (`--sandbox-tools`): a JSON array of `{"name", "version"}`, at most
/// [`MAX_TOOLS`], names and versions short and printable. The error says what is wrong.
pub fn parse_tools(json: &str) -> Result<Vec<Tool>, String> {
    let tools: Vec<Tool> = serde_json::from_str(json).map_err(|e| {
        format!(
            "--sandbox-tools (CLI_MCP_SANDBOX_TOOLS) is not a JSON list of {{\"name\", \"version\"}}: {e}; \
             use the sandbox-tools.json that hack/build-images.sh writes beside the image archives"
        )
    })?;
    if tools.len() > MAX_TOOLS {
        return Err(format!(
            "--sandbox-tools lists {} tools; at most {MAX_TOOLS}: name the ones that matter",
            tools.len()
        ));
    }
    let fine = |s: &str| {
        !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_graphic() || c == ' ')
    };
    if let Some(bad) = tools.iter().find(|t| !fine(&t.name) || !fine(&t.version)) {
        return Err(format!(
            "--sandbox-tools: entry {:?} {:?} must have a name and a version of 1..64 printable \
             ASCII characters",
            bad.name, bad.version
        ));
    }
    Ok(tools)
}

/// What one context's identity may do, as far as the operator could find out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// Reviewed with the context's own credentials. `identity`: the username the API server
    /// gave (`None` when it would not say).
    Reviewed {
        identity: Option<String>,
        rights: rbac::Rights,
    },
    /// `identity: impersonateCaller`: each session acts as its MCP caller.
    AsCaller,
    /// The review failed (unreachable, refused, too slow).
    Unknown,
}

/// One context of the kubernetes target's kubeconfig.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextFacts {
    pub name: String,
    pub cluster: String,
    /// The kubeconfig's current context (what kubectl uses without `--context`).
    pub current: bool,
    pub access: Access,
}

/// What the briefing says about Kubernetes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kube {
    /// No kubernetes target: no cluster is reachable.
    NoTarget,
    /// The target's kubeconfig is not usable (yet): nothing is known.
    Pending,
    /// Its contexts, the current one first (at most [`review::MAX_CONTEXTS`]), and how many
    /// more the kubeconfig has.
    Contexts {
        described: Vec<ContextFacts>,
        more: usize,
    },
}

/// Everything the briefing is rendered from.
#[derive(Debug, Clone)]
pub struct Facts<'a> {
    /// The instance's sandbox image, and its tools when they are recorded.
    pub image: &'a str,
    pub tools: Option<&'a [Tool]>,
    pub kube: &'a Kube,
    /// Allow-listed upstreams, `host:port`.
    pub domains: Vec<String>,
    /// `spec.networkPolicy.extraEgress` opens more than the proxy.
    pub extra_egress: bool,
    pub default_timeout_secs: u64,
    pub max_timeout_secs: u64,
    pub output_budget: i64,
    pub idle_timeout: Duration,
}

/// `64 KiB`, `1.5 MiB`, `900 bytes`.
fn bytes(n: i64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    }
}

/// `30m`, `2h`, `90s`.
fn span(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        s if s >= 3600 && s % 3600 == 0 => format!("{}h", s / 3600),
        s if s >= 60 && s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

fn tools_line(f: &Facts) -> String {
    match f.tools {
        Some(tools) if !tools.is_empty() => {
            let list: Vec<String> = tools
                .iter()
                .map(|t| format!("{} {}", t.name, t.version))
                .collect();
            format!("- Tools: {}.", list.join(", "))
        }
        _ => format!(
            "- Tools: not recorded for the sandbox image {}; check with `command -v NAME`.",
            f.image
        ),
    }
}

/// One context's line; `earlier`: the contexts before it, whose identity it may share.
fn context_line(c: &ContextFacts, earlier: &[ContextFacts]) -> String {
    let current = if c.current { "current, " } else { "" };
    let head = format!("context `{}` ({current}cluster `{}`)", c.name, c.cluster);
    // Contexts of one cluster and user (another default namespace) are reviewed alike:
    // saying it again would double the briefing for nothing.
    let same = earlier
        .iter()
        .find(|e| e.access == c.access && matches!(c.access, Access::Reviewed { .. }));
    if let Some(e) = same {
        return format!("  - {head}: the same identity and rights as `{}`.", e.name);
    }
    match &c.access {
        Access::AsCaller => format!(
            "  - {head}: each session acts as its MCP caller, so the cluster's RBAC for your \
             caller decides; `kubectl auth can-i --list` shows it."
        ),
        Access::Unknown => format!(
            "  - {head}: what its identity may do is unknown (the operator's review failed)."
        ),
        Access::Reviewed { identity, rights } => {
            let who = identity
                .as_deref()
                .map(|i| format!(", as {i}"))
                .unwrap_or_default();
            format!("  - {head}{who}: {}", rbac::render(rights))
        }
    }
}

fn kube_lines(kube: &Kube) -> Vec<String> {
    match kube {
        Kube::NoTarget => vec!["- Kubernetes: no cluster is reachable from this sandbox.".into()],
        Kube::Pending => {
            vec!["- Kubernetes: unknown (the proxy's kubeconfig is not usable yet).".into()]
        }
        Kube::Contexts { described, more } => {
            let mut lines = vec![
                "- Kubernetes, with kubectl (the credential proxy adds the credentials):".into(),
            ];
            for (i, c) in described.iter().enumerate() {
                lines.push(context_line(c, &described[..i]));
            }
            if *more > 0 {
                lines.push(format!(
                    "  - {more} more contexts, not described here (`kubectl config get-contexts`)."
                ));
            }
            lines
        }
    }
}

fn network_line(f: &Facts) -> String {
    let domains: Vec<String> = f
        .domains
        .iter()
        .map(|d| d.strip_suffix(":443").unwrap_or(d).to_owned())
        .collect();
    let hosts = if domains.is_empty() {
        "- Network: no other HTTPS host is reachable".to_owned()
    } else {
        format!(
            "- Network: other HTTPS hosts reachable through the proxy: {}",
            domains.join(", ")
        )
    };
    let rest = if f.extra_egress {
        "; the network policy also lets some other destinations through."
    } else {
        "."
    };
    format!("{hosts}{rest}")
}

fn limits_line(f: &Facts) -> String {
    format!(
        "- Limits: a command is stopped after {}s unless its `timeout` argument asks for more \
         (at most {}s); the shell survives. stdout and stderr keep {} each (head and tail); \
         a cut stream is kept whole as the MCP resource the result names \
         (sandbox://<session>/spill/…, read with resources/read, like files under /workspace: \
         sandbox://<session>/workspace/<path>). A sandbox idle for {} is deleted with its files.",
        f.default_timeout_secs,
        f.max_timeout_secs,
        bytes(f.output_budget),
        span(f.idle_timeout)
    )
}

/// The briefing's text.
pub fn render(f: &Facts) -> String {
    let mut lines = vec!["About this sandbox (generated by the operator):".to_owned()];
    lines.push(tools_line(f));
    lines.extend(kube_lines(f.kube));
    lines.push(network_line(f));
    lines.push(limits_line(f));
    lines.join("\n")
}

/// The last review of one instance.
struct Known {
    /// What the review depends on besides time: the kubeconfig's version and the identity
    /// mode. Another key is another review, at once.
    key: String,
    at: Instant,
    kube: Kube,
}

/// The last reviews of every instance, by uid.
#[derive(Default)]
pub struct BriefingCache {
    last: Mutex<HashMap<String, Known>>,
}

impl BriefingCache {
    /// The remembered review of instance `uid`, while it was made for `key` less than `every`
    /// ago, with the time left until it is due again.
    pub fn fresh(&self, uid: &str, key: &str, every: Duration) -> Option<(Kube, Duration)> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let k = last.get(uid).filter(|k| k.key == key)?;
        let due = every.checked_sub(k.at.elapsed()).filter(|d| !d.is_zero())?;
        Some((k.kube.clone(), due))
    }

    pub fn store(&self, uid: &str, key: String, kube: Kube) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let at = Instant::now();
        last.insert(uid.to_owned(), Known { key, at, kube });
    }

    /// The instance is gone, or its briefing is off.
    pub fn forget(&self, uid: &str) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::authorization::v1::ResourceRule;
    use k8s_openapi::api::rbac::v1::ClusterRole;

    use super::rbac::{Checked, Rights};
    use super::*;
    use crate::children::test_support::cr;
    use crate::children::Spec;

    /// What a typical instance must stay under, in characters.
    const TYPICAL_BOUND: usize = 1500;

    fn workspace_file(path: &str) -> String {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// The tools the operator is given in config/manager (what `make run` installs).
    fn manager_tools() -> Vec<Tool> {
        let yaml = workspace_file("config/manager/manager.yaml");
        for doc in serde_yaml::Deserializer::from_str(&yaml) {
            let v: serde_json::Value = serde::Deserialize::deserialize(doc).expect("YAML");
            let Some(env) = v.pointer("/spec/template/spec/containers/0/env") else {
                continue;
            };
            let value = env
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["name"] == "CLI_MCP_SANDBOX_TOOLS")
                .and_then(|e| e["value"].as_str())
                .expect("CLI_MCP_SANDBOX_TOOLS in config/manager/manager.yaml");
            return parse_tools(value).expect("a valid tools record");
        }
        panic!("no Deployment in config/manager/manager.yaml")
    }

    /// The rules of the sample's investigator ClusterRole, as a rules review returns them,
    /// with what every authenticated identity may do besides.
    fn investigator_rules() -> Vec<ResourceRule> {
        let yaml = workspace_file("config/samples/investigation-kubeconfig.yaml");
        let role: ClusterRole = serde_yaml::Deserializer::from_str(&yaml)
            .filter_map(|d| serde_yaml::Value::deserialize(d).ok())
            .find(|v| v["kind"] == "ClusterRole")
            .and_then(|v| serde_yaml::from_value(v).ok())
            .expect("the sample ClusterRole");
        let mut rules: Vec<ResourceRule> = role
            .rules
            .unwrap_or_default()
            .into_iter()
            .map(|r| ResourceRule {
                api_groups: r.api_groups,
                resources: r.resources,
                resource_names: r.resource_names,
                verbs: r.verbs,
            })
            .collect();
        rules.push(ResourceRule {
            api_groups: Some(vec!["authorization.k8s.io".into()]),
            resources: Some(vec!["selfsubjectrulesreviews".into()]),
            resource_names: None,
            verbs: vec!["create".into()],
        });
        rules
    }

    fn sample_spec() -> Spec {
        let yaml = workspace_file("config/samples/cli-mcp_v1alpha1_climcpinstance.yaml");
        let v: serde_json::Value = serde_yaml::from_str(&yaml).expect("sample CR");
        Spec::read(&cr(v["spec"].clone()), "server:1", Some("sandbox:1"), None).expect("spec")
    }

    fn facts<'a>(spec: &'a Spec, tools: Option<&'a [Tool]>, kube: &'a Kube) -> Facts<'a> {
        Facts {
            image: &spec.sandbox.image,
            tools,
            kube,
            domains: spec.proxy.allowlist.iter().map(|d| d.to_string()).collect(),
            extra_egress: !spec.extra_egress.is_empty(),
            default_timeout_secs: spec.default_timeout_secs,
            max_timeout_secs: spec.max_timeout_secs,
            output_budget: spec.output_budget,
            idle_timeout: spec.idle_timeout,
        }
    }

    /// `make run`'s sample with the investigator kubeconfig, in a cluster with more
    /// namespaces than are reviewed: every part is there, and the whole stays short.
    #[test]
    fn the_samples_briefing_names_everything_and_stays_short() {
        let spec = sample_spec();
        let tools = manager_tools();
        let grants = rbac::grants(&investigator_rules());
        let per_namespace: BTreeMap<String, rbac::Grants> = (0..review::MAX_NAMESPACES)
            .map(|i| (format!("namespace-{i:02}"), grants.clone()))
            .collect();
        let rights = rbac::collapse(
            Checked::Listed {
                reviewed: review::MAX_NAMESPACES,
                total: 57,
            },
            per_namespace,
            false,
        );
        let kube = Kube::Contexts {
            described: vec![ContextFacts {
                name: "investigator".into(),
                cluster: "cluster".into(),
                current: true,
                access: Access::Reviewed {
                    identity: Some(
                        "system:serviceaccount:cli-mcp-demo:cli-mcp-investigator".into(),
                    ),
                    rights,
                },
            }],
            more: 0,
        };
        let text = render(&facts(&spec, Some(&tools), &kube));
        eprintln!("{} characters:\n{text}", text.chars().count());
        assert!(
            text.chars().count() <= TYPICAL_BOUND,
            "{} characters, over {TYPICAL_BOUND}:\n{text}",
            text.chars().count()
        );
        for t in &tools {
            assert!(
                text.contains(&format!("{} {}", t.name, t.version)),
                "{t:?}: {text}"
            );
        }
        for needle in [
            "context `investigator` (current, cluster `cluster`), as \
             system:serviceaccount:cli-mcp-demo:cli-mcp-investigator",
            "In the 32 namespaces checked (of 57): read-only core (configmaps,",
            "apps (daemonsets, deployments, replicasets, statefulsets)",
            "May write nothing.",
            "- Network: no other HTTPS host is reachable.",
            "stopped after 60s",
            "(at most 300s)",
            "keep 64 KiB each",
            "sandbox://<session>/spill/",
            "idle for 30m",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
        assert!(!text.contains("selfsubject"), "{text}");
    }

    #[test]
    fn each_kind_of_access_and_target_is_said_plainly() {
        let spec = Spec::read(
            &cr(serde_json::json!({
                "sandbox": {"image": "example.com/mine:1"},
                "proxy": {"targets": [
                    {"type": "kubernetes", "identity": "impersonateCaller"},
                    {"type": "allowlist", "domains": ["api.github.com", "example.com:8443"]}
                ]},
                "networkPolicy": {"extraEgress": [{"ports": [{"port": 53}]}]}
            })),
            "server:1",
            Some("sandbox:1"),
            None,
        )
        .expect("spec");
        let reviewed = Access::Reviewed {
            identity: Some("alice".into()),
            rights: rbac::collapse(Checked::Only("team".into()), BTreeMap::new(), false),
        };
        let kube = Kube::Contexts {
            described: vec![
                ContextFacts {
                    name: "prod".into(),
                    cluster: "prod".into(),
                    current: true,
                    access: Access::AsCaller,
                },
                ContextFacts {
                    name: "dev".into(),
                    cluster: "dev".into(),
                    current: false,
                    access: Access::Unknown,
                },
                ContextFacts {
                    name: "team".into(),
                    cluster: "dev".into(),
                    current: false,
                    access: reviewed.clone(),
                },
                ContextFacts {
                    name: "team-2".into(),
                    cluster: "dev".into(),
                    current: false,
                    access: reviewed,
                },
            ],
            more: 3,
        };
        let tools = [Tool {
            name: "jq".into(),
            version: "1.6".into(),
        }];
        let text = render(&facts(&spec, None, &kube));
        for needle in [
            "- Tools: not recorded for the sandbox image example.com/mine:1",
            "context `prod` (current, cluster `prod`): each session acts as its MCP caller",
            "context `dev` (cluster `dev`): what its identity may do is unknown",
            "context `team` (cluster `dev`), as alice: In namespace team",
            "context `team-2` (cluster `dev`): the same identity and rights as `team`.",
            "  - 3 more contexts, not described here",
            "- Network: other HTTPS hosts reachable through the proxy: api.github.com, \
             example.com:8443; the network policy also lets some other destinations through.",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
        let with_tools = render(&facts(&spec, Some(&tools), &Kube::NoTarget));
        assert!(with_tools.contains("- Tools: jq 1.6."), "{with_tools}");
        assert!(
            with_tools.contains("- Kubernetes: no cluster is reachable from this sandbox."),
            "{with_tools}"
        );
        let pending = render(&facts(&spec, None, &Kube::Pending));
        assert!(pending.contains("- Kubernetes: unknown"), "{pending}");
    }

    #[test]
    fn a_tools_record_is_checked() {
        let ok = parse_tools(r#"[{"name":"bash","version":"5.2.15"}]"#).expect("valid");
        assert_eq!(ok[0].name, "bash");
        for (bad, needle) in [
            ("bash 5.2", "not a JSON list"),
            (r#"[{"name":"bash"}]"#, "not a JSON list"),
            (
                r#"[{"name":"bash","version":"5","path":"/bin"}]"#,
                "not a JSON list",
            ),
            (r#"[{"name":"","version":"5"}]"#, "1..64 printable"),
            (r#"[{"name":"bash","version":"5\n"}]"#, "1..64 printable"),
        ] {
            let e = parse_tools(bad).expect_err(bad);
            assert!(e.contains(needle), "{bad}: {e}");
        }
        let many: Vec<String> = (0..33)
            .map(|i| format!(r#"{{"name":"t{i}","version":"1"}}"#))
            .collect();
        let e = parse_tools(&format!("[{}]", many.join(","))).expect_err("too many");
        assert!(e.contains("at most 32"), "{e}");
    }

    #[test]
    fn a_review_is_reused_until_due_or_until_the_kubeconfig_changes() {
        let cache = BriefingCache::default();
        let every = Duration::from_secs(60);
        assert!(cache.fresh("u", "k1", every).is_none());
        cache.store("u", "k1".into(), Kube::Pending);
        let (kube, due) = cache.fresh("u", "k1", every).expect("fresh");
        assert_eq!(kube, Kube::Pending);
        assert!(due <= every && due > Duration::from_secs(50), "{due:?}");
        assert!(
            cache.fresh("u", "k2", every).is_none(),
            "another kubeconfig"
        );
        assert!(cache.fresh("u", "k1", Duration::ZERO).is_none(), "due");
        assert!(cache.fresh("other", "k1", every).is_none());
        cache.forget("u");
        assert!(cache.fresh("u", "k1", every).is_none());
        let _ = Rights {
            checked: Checked::Only("x".into()),
            everywhere: Default::default(),
            more: Vec::new(),
            incomplete: false,
        };
    }
}
