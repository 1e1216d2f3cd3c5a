//! The project's own images (operator, server, sandbox, credential proxy) on the real node: [`build`] runs
//! `hack/build-images.sh` with the given binaries (cached by its inputs under
//! `$CLI_MCP_CACHE/images`, outside the repo: a second call with the same binaries takes
//! seconds), [`push_into`] pushes the archives to the node's image registry
//! ([`crate::registry`]) under `<registry>/cli-mcp/cli-mcp-<name>:<version>` and under every
//! short name the manifests and the tests put in pods, from which the kubelet pulls them.
//!
//! The names: `config/manager` runs `cli-mcp-operator:<version>` (the workspace version) and
//! gives the operator `RELATED_IMAGE_SERVER=cli-mcp-server:<version>`,
//! `RELATED_IMAGE_SANDBOX=cli-mcp-sandbox:<version>` and `RELATED_IMAGE_PROXY=
//! cli-mcp-proxy:<version>`; the journeys' overlay ([`crate::journey::operator_overlay`])
//! uses `cli-mcp-operator:e2e`, [`SERVER_IMAGE`] and
//! [`SANDBOX_IMAGE`]. containerd's CRI normalises a short name the way
//! Docker does (`cli-mcp-server:dev` is `docker.io/library/cli-mcp-server:dev`, [`normalize`]),
//! and the node's registry stands in for `docker.io`, so the images are also pushed there as
//! `library/cli-mcp-server:dev` and so on.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{Error, Result};
use crate::registry::{RegistryInfo, PROJECT_PATH};
use crate::workspace::workspace_root;

/// Environment variable naming a directory of already built archives (the last line of
/// `hack/build-images.sh`), to skip the build.
pub const IMAGES_DIR_ENV: &str = "CLI_MCP_IMAGES_DIR";

/// The server image the tests' operators put in instances (`RELATED_IMAGE_SERVER`); the
/// local cluster maps `cli-mcp-server:*` to the built binary.
pub const SERVER_IMAGE: &str = "cli-mcp-server:dev";
/// The sandbox image (`RELATED_IMAGE_SANDBOX`); `cli-mcp-agent:*` maps to the built agent.
pub const SANDBOX_IMAGE: &str = "cli-mcp-agent:dev";
/// The credential proxy image (`RELATED_IMAGE_PROXY`); `cli-mcp-proxy:*` maps to the built
/// proxy. Every instance runs a proxy.
pub const PROXY_IMAGE: &str = "cli-mcp-proxy:dev";

/// Which image each name the kubelet may be asked for is: (image, names). The packaged
/// manifests pin the workspace version, which is this crate's.
pub const ALIASES: &[(&str, &[&str])] = &[
    (
        "operator",
        &[
            concat!("cli-mcp-operator:", env!("CARGO_PKG_VERSION")),
            "cli-mcp-operator:e2e",
        ],
    ),
    (
        "server",
        &[
            concat!("cli-mcp-server:", env!("CARGO_PKG_VERSION")),
            SERVER_IMAGE,
        ],
    ),
    (
        "sandbox",
        &[
            concat!("cli-mcp-sandbox:", env!("CARGO_PKG_VERSION")),
            SANDBOX_IMAGE,
        ],
    ),
    (
        "proxy",
        &[
            concat!("cli-mcp-proxy:", env!("CARGO_PKG_VERSION")),
            PROXY_IMAGE,
        ],
    ),
];

/// Images of [`ALIASES`] a build may still lack (`hack/build-images.sh` from before the
/// credential proxy): [`ProjectImages::load`] leaves them out with a warning instead of
/// failing, so only pods that use one cannot start.
pub const OPTIONAL: &[&str] = &["proxy"];

/// The binaries the images carry.
pub const BINARIES: [&str; 4] = [
    "cli-mcp-operator",
    "cli-mcp-server",
    "cli-mcp-proxy",
    "cli-mcp-agent",
];

/// One built image archive.
#[derive(Debug, Clone)]
pub struct ProjectImage {
    /// `operator`, `server` or `sandbox`.
    pub name: String,
    /// The OCI archive (`cli-mcp-<name>.tar`).
    pub archive: PathBuf,
    /// The name the archive itself carries (`localhost/cli-mcp-<name>:<version>`).
    pub reference: String,
    /// Its manifest's digest (`sha256:…`, `images.tsv`), which the registry keeps.
    pub digest: String,
    /// The normalised names it is pushed under besides its own ([`ALIASES`]).
    pub aliases: Vec<String>,
}

/// The three archives of one build.
#[derive(Debug, Clone)]
pub struct ProjectImages {
    /// The build's directory (`$CLI_MCP_CACHE/images/<hash>`).
    pub dir: PathBuf,
    pub images: Vec<ProjectImage>,
}

impl ProjectImages {
    /// Reads a build directory: `images.tsv` and the archives it names.
    pub fn load(dir: &Path) -> Result<ProjectImages> {
        let tsv_path = dir.join("images.tsv");
        let tsv =
            std::fs::read_to_string(&tsv_path).map_err(|e| Error::io("reading", &tsv_path, e))?;
        let mut images = Vec::new();
        let mut skipped = Vec::new();
        for line in tsv.lines().skip(1).filter(|l| !l.trim().is_empty()) {
            let mut cols = line.split('\t');
            let reference = cols.next().unwrap_or_default().to_owned();
            let digest = cols.next().unwrap_or_default().to_owned();
            let name = reference
                .rsplit_once('/')
                .map_or(reference.as_str(), |(_, n)| n)
                .split_once(':')
                .and_then(|(n, _)| n.strip_prefix("cli-mcp-"))
                .ok_or_else(|| Error::Parse {
                    path: tsv_path.clone(),
                    detail: format!("unexpected image reference {reference:?}"),
                })?
                .to_owned();
            let archive = dir.join(format!("cli-mcp-{name}.tar"));
            if !archive.is_file() && OPTIONAL.contains(&name.as_str()) {
                tracing::warn!(
                    "{} names {reference} but {} is missing: not importing the {name} image",
                    tsv_path.display(),
                    archive.display()
                );
                skipped.push(name);
                continue;
            }
            if !archive.is_file() {
                return Err(Error::Parse {
                    path: tsv_path.clone(),
                    detail: format!("names {reference} but {} is missing", archive.display()),
                });
            }
            let aliases = ALIASES
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, a)| a.iter().map(|a| normalize(a)).collect())
                .unwrap_or_default();
            images.push(ProjectImage {
                name,
                archive,
                reference,
                digest,
                aliases,
            });
        }
        for (name, _) in ALIASES {
            if images.iter().any(|i| i.name == *name) || skipped.iter().any(|s| s == name) {
                continue;
            }
            if OPTIONAL.contains(name) {
                tracing::warn!(
                    "{} lists no cli-mcp-{name} image (hack/build-images.sh does not build it \
                     yet?): not importing it; pods that use it cannot start",
                    tsv_path.display()
                );
            } else {
                return Err(Error::Parse {
                    path: tsv_path.clone(),
                    detail: format!("no cli-mcp-{name} image listed"),
                });
            }
        }
        Ok(ProjectImages {
            dir: dir.to_path_buf(),
            images,
        })
    }

    /// Every short name [`push_into`] makes pullable, normalised (`docker.io/library/…`).
    pub fn names(&self) -> Vec<String> {
        self.images.iter().flat_map(|i| i.aliases.clone()).collect()
    }
}

/// Builds (or finds in the cache) the images of the binaries in `bin_dir` (a cargo profile
/// dir; the debug build is fine for tests, only bigger) with `hack/build-images.sh`.
/// `$CLI_MCP_IMAGES_DIR` names a finished build instead. Needs root, Go, a Debian host and
/// the control plane's kubectl (built by `hack/build-control-plane.sh`, cached); a cold
/// build takes minutes (the Debian root filesystems), a warm one seconds.
pub fn build(bin_dir: &Path) -> Result<ProjectImages> {
    if let Some(dir) = std::env::var_os(IMAGES_DIR_ENV) {
        return ProjectImages::load(Path::new(&dir));
    }
    let (script, mut cmd) = build_command(bin_dir)?;
    let out = cmd.output().map_err(|e| Error::Command {
        command: script.display().to_string(),
        detail: e.to_string(),
    })?;
    let dir = crate::build_scripts::bin_dir_from(&script, out, IMAGES_DIR_ENV)?;
    ProjectImages::load(&dir)
}

/// [`build`] for a caller that may give up on it (`cli-mcp-cluster up` on SIGTERM): the
/// script runs in a process group of its own, which dropping the future terminates (the
/// script's EXIT trap removes its unfinished build directory).
pub async fn build_async(bin_dir: &Path) -> Result<ProjectImages> {
    if let Some(dir) = std::env::var_os(IMAGES_DIR_ENV) {
        return ProjectImages::load(Path::new(&dir));
    }
    let (script, cmd) = build_command(bin_dir)?;
    let cmd = tokio::process::Command::from(cmd);
    let dir = crate::build_scripts::bin_dir_from_cancellable(&script, cmd, IMAGES_DIR_ENV).await?;
    ProjectImages::load(&dir)
}

fn build_command(bin_dir: &Path) -> Result<(PathBuf, Command)> {
    for b in BINARIES {
        if !bin_dir.join(b).is_file() {
            return Err(Error::Prerequisite(format!(
                "{} is missing; build it first (`cargo build -p cli-mcp-operator -p \
                 cli-mcp-server -p cli-mcp-proxy -p cli-mcp-agent`)",
                bin_dir.join(b).display()
            )));
        }
    }
    let script = workspace_root().join("hack/build-images.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .env("CLI_MCP_BIN_DIR", bin_dir)
        .stdin(Stdio::null())
        // The script's progress goes to our stderr: a cold build is slow and says why.
        .stderr(Stdio::inherit());
    // The control plane found elsewhere (`$CLI_MCP_CONTROL_PLANE_BIN`) has the kubectl to use.
    if let Some(cp) = std::env::var_os(crate::build_scripts::CONTROL_PLANE_BIN_ENV) {
        let kubectl = Path::new(&cp).join("kubectl");
        if kubectl.is_file() && std::env::var_os("KUBECTL").is_none() {
            cmd.env("KUBECTL", kubectl);
        }
    }
    Ok((script, cmd))
}

/// Pushes the archives to the node's registry as `<host>/cli-mcp/cli-mcp-<name>:<tag>`
/// (checking that the registry keeps each manifest's digest), then copies each to the
/// `library/` names of its [`ALIASES`], which the node's containerd pulls for `docker.io`.
/// Idempotent. Returns the references by digest it pushed, then the short names.
pub fn push_into(
    registry: &RegistryInfo,
    images: &ProjectImages,
    work: &Path,
) -> Result<Vec<String>> {
    let push = |image: &ProjectImage| -> Result<String> {
        let tag = image
            .reference
            .rsplit_once(':')
            .map_or("latest", |(_, t)| t);
        let repo = format!("{}/{PROJECT_PATH}/cli-mcp-{}", registry.host, image.name);
        let digest = registry.push(&image.archive, &format!("{repo}:{tag}"), work)?;
        if !image.digest.is_empty() && digest != image.digest {
            return Err(Error::Other(format!(
                "{repo}: the registry holds {digest}, images.tsv says {}",
                image.digest
            )));
        }
        let by_digest = format!("{repo}@{digest}");
        for alias in &image.aliases {
            let path = alias.strip_prefix("docker.io/").unwrap_or(alias);
            registry.copy(&by_digest, &format!("{}/{path}", registry.host))?;
        }
        Ok(by_digest)
    };
    // One push at a time reads and sends layer after layer; all at once take about as long
    // as the biggest (the sandbox).
    let pushed = std::thread::scope(|scope| {
        let running: Vec<_> = images
            .images
            .iter()
            .map(|image| scope.spawn(move || push(image)))
            .collect();
        running
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(Error::Other("an image push thread panicked".into())))
            })
            .collect::<Result<Vec<String>>>()
    })?;
    Ok(pushed.into_iter().chain(images.names()).collect())
}

/// A Docker-style image reference in the form containerd's CRI stores it: a name without a
/// registry is on `docker.io`, a one-component name there is under `library/`, and no tag
/// or digest means `:latest`.
pub fn normalize(reference: &str) -> String {
    let (first, rest) = match reference.split_once('/') {
        Some((first, rest))
            if first.contains('.') || first.contains(':') || first == "localhost" =>
        {
            (first.to_owned(), rest.to_owned())
        }
        Some(_) => ("docker.io".to_owned(), reference.to_owned()),
        None => ("docker.io".to_owned(), format!("library/{reference}")),
    };
    let last = rest.rsplit('/').next().unwrap_or_default();
    let tagged = last.contains(':') || rest.contains('@');
    format!("{first}/{rest}{}", if tagged { "" } else { ":latest" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_normalise_like_containerd() {
        assert_eq!(
            normalize("cli-mcp-server:dev"),
            "docker.io/library/cli-mcp-server:dev"
        );
        assert_eq!(
            normalize("cli-mcp-operator"),
            "docker.io/library/cli-mcp-operator:latest"
        );
        assert_eq!(normalize("org/img:1"), "docker.io/org/img:1");
        assert_eq!(
            normalize("localhost/cli-mcp-sandbox:0.1.0"),
            "localhost/cli-mcp-sandbox:0.1.0"
        );
        assert_eq!(
            normalize("registry.example.com:5000/a/b"),
            "registry.example.com:5000/a/b:latest"
        );
        assert_eq!(
            normalize("quay.io/x/y@sha256:abc"),
            "quay.io/x/y@sha256:abc"
        );
    }

    /// Every image config/manager names is a project image of the workspace version under
    /// a registry, and its short name is pushed for the tests: if config/manager changes an
    /// image, this fails until [`ALIASES`] follows.
    #[test]
    fn aliases_cover_the_images_of_config_manager() {
        let root = workspace_root();
        let manager = std::fs::read_to_string(root.join("config/manager/manager.yaml"))
            .expect("config/manager/manager.yaml");
        let all: Vec<&str> = ALIASES
            .iter()
            .flat_map(|(_, a)| a.iter().copied())
            .collect();
        let mut seen = 0;
        for line in manager.lines().map(str::trim) {
            let value = line
                .strip_prefix("image:")
                .or_else(|| line.strip_prefix("value:"))
                .map(str::trim);
            let Some((registry, short)) = value.and_then(|v| v.rsplit_once('/')) else {
                continue;
            };
            if short.starts_with("cli-mcp-") {
                assert!(
                    registry.contains('.'),
                    "{registry}/{short}: a registry host"
                );
                assert!(
                    all.contains(&short),
                    "{short} of manager.yaml not in {all:?}"
                );
                seen += 1;
            }
        }
        assert_eq!(
            seen, 4,
            "operator, server, sandbox and proxy images in manager.yaml"
        );
    }

    #[test]
    fn load_rejects_a_build_without_the_sandbox() {
        let dir = std::env::temp_dir().join(format!("cli-mcp-pi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(
            dir.join("images.tsv"),
            "ref\tmanifest\n\
             localhost/cli-mcp-operator:0.1.0\tsha256:a\n\
             localhost/cli-mcp-server:0.1.0\tsha256:b\n",
        )
        .expect("tsv");
        for n in ["operator", "server"] {
            std::fs::write(dir.join(format!("cli-mcp-{n}.tar")), b"x").expect("tar");
        }
        let err = ProjectImages::load(&dir).expect_err("no sandbox");
        assert!(err.to_string().contains("cli-mcp-sandbox"), "{err}");
        std::fs::write(
            dir.join("images.tsv"),
            "ref\tmanifest\n\
             localhost/cli-mcp-operator:0.1.0\tsha256:a\n\
             localhost/cli-mcp-server:0.1.0\tsha256:b\n\
             localhost/cli-mcp-sandbox:0.1.0\tsha256:c\n",
        )
        .expect("tsv");
        let err = ProjectImages::load(&dir).expect_err("no sandbox archive");
        assert!(err.to_string().contains("cli-mcp-sandbox.tar"), "{err}");
        std::fs::write(dir.join("cli-mcp-sandbox.tar"), b"x").expect("tar");
        let images = ProjectImages::load(&dir).expect("complete");
        let names = images.names();
        let sandbox = concat!(
            "docker.io/library/cli-mcp-sandbox:",
            env!("CARGO_PKG_VERSION")
        );
        assert!(names.contains(&sandbox.to_owned()), "{names:?}");
        assert!(names.contains(&"docker.io/library/cli-mcp-agent:dev".to_owned()));
        assert!(
            !names.iter().any(|n| n.starts_with("localhost/")),
            "the archives' own names are never pulled: {names:?}"
        );
        // A build without the credential proxy still loads, without its names.
        assert!(!images.images.iter().any(|i| i.name == "proxy"));
        assert!(
            !names.iter().any(|n| n.contains("cli-mcp-proxy")),
            "{names:?}"
        );
        // One with it imports it under the name config/manager gives the operator.
        let mut tsv = std::fs::read_to_string(dir.join("images.tsv")).expect("tsv");
        tsv.push_str("localhost/cli-mcp-proxy:0.1.0\tsha256:d\n");
        std::fs::write(dir.join("images.tsv"), &tsv).expect("tsv");
        let names = ProjectImages::load(&dir).expect("proxy listed").names();
        assert!(
            !names.iter().any(|n| n.contains("cli-mcp-proxy")),
            "no archive: {names:?}"
        );
        std::fs::write(dir.join("cli-mcp-proxy.tar"), b"x").expect("tar");
        let names = ProjectImages::load(&dir).expect("with proxy").names();
        let proxy = concat!(
            "docker.io/library/cli-mcp-proxy:",
            env!("CARGO_PKG_VERSION")
        );
        assert!(names.contains(&proxy.to_owned()), "{names:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
