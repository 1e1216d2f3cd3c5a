//! The OCI image archives `hack/build-images.sh` builds (images/README.md): their config
//! (user, entry point, HOME, architecture), the files of their layers (the sandbox's CLIs,
//! the group-0 writable /workspace), and, where containerd can be started, that they import
//! and run.
//!
//! The first test needs no container engine: it reads the archives with `tar`. The second
//! starts a throwaway containerd of its own (root, state and socket in a temporary
//! directory, CRI plugin off), imports the four archives with `ctr images import` and runs
//! commands in the sandbox under an arbitrary UID in group 0, as OpenShift's restricted SCC
//! would. It is skipped, saying so, when `containerd`, `ctr` or `runc` is not on PATH
//! (Debian: `apt-get install containerd`) or the test does not run as root.
//!
//! The images are cached by `hack/build-images.sh`; a cold build (Debian root filesystems,
//! yq) takes minutes, a cached one seconds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use cli_mcp_e2e::workspace::workspace_root;
use serde_json::Value;

const IMAGES: [&str; 4] = ["operator", "server", "proxy", "sandbox"];

fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

/// The directory `hack/build-images.sh` prints last (building the images when not cached).
/// The binaries are the release build when there is one, else the debug build `make test`
/// has just made (so a cold `make test` does not compile everything again in release mode;
/// the images are then bigger but hold the same files); with neither the script builds
/// the release binaries.
fn images_dir() -> Result<PathBuf> {
    let script = workspace_root().join("hack/build-images.sh");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    let built = |profile: &str| {
        let dir = target.join(profile);
        cli_mcp_e2e::project_images::BINARIES
            .iter()
            .all(|b| dir.join(b).is_file())
            .then_some(dir)
    };
    let mut cmd = Command::new(&script);
    if let Some(bin_dir) = built("release").or_else(|| built("debug")) {
        cmd.env("CLI_MCP_BIN_DIR", bin_dir);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    ensure!(
        out.status.success(),
        "{} failed ({})",
        script.display(),
        out.status
    );
    let stdout = String::from_utf8(out.stdout).context("script output is not UTF-8")?;
    let dir = stdout
        .lines()
        .last()
        .context("the script printed nothing")?;
    Ok(PathBuf::from(dir))
}

/// The image references of `images.tsv` by short name (operator, server, sandbox).
fn refs(dir: &Path) -> Result<BTreeMap<String, String>> {
    let tsv = std::fs::read_to_string(dir.join("images.tsv")).context("reading images.tsv")?;
    let mut refs = BTreeMap::new();
    for line in tsv.lines().skip(1) {
        let r = line.split('\t').next().context("empty images.tsv line")?;
        let short = r
            .rsplit_once('/')
            .and_then(|(_, n)| n.split_once(':'))
            .and_then(|(n, _)| n.strip_prefix("cli-mcp-"))
            .with_context(|| format!("unexpected image reference {r}"))?;
        refs.insert(short.to_owned(), r.to_owned());
    }
    Ok(refs)
}

/// One entry of a layer: mode string (`drwxrwx---`), uid, gid, and a link target.
#[derive(Debug, Clone)]
struct Entry {
    mode: String,
    uid: u32,
    gid: u32,
    link: Option<String>,
}

/// An extracted OCI archive: its index, manifest, config and the layer file lists.
struct Image {
    config: Value,
    index: Value,
    /// Path → entry, later layers overriding earlier ones.
    files: BTreeMap<String, Entry>,
    layers: usize,
}

fn json(path: &Path) -> Result<Value> {
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("parsing {}", path.display()))
}

fn blob(root: &Path, digest: &str) -> Result<PathBuf> {
    let hex = digest
        .strip_prefix("sha256:")
        .with_context(|| format!("digest {digest} is not sha256"))?;
    Ok(root.join("blobs/sha256").join(hex))
}

fn list_layer(path: &Path, files: &mut BTreeMap<String, Entry>) -> Result<()> {
    let out = run(Command::new("tar")
        .args(["--numeric-owner", "-tvzf"])
        .arg(path))?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // drwxrwx--- 1001/0  0 2026-12-01 13:40 ./workspace/   (and "name -> target" links)
        let t: Vec<&str> = line.split_whitespace().collect();
        ensure!(t.len() >= 6, "unexpected tar listing line {line:?}");
        let (mode, owner, rest) = (t[0], t[1], t[5..].join(" "));
        let (name, link) = match rest.split_once(" -> ") {
            Some((n, l)) => (n.to_owned(), Some(l.to_owned())),
            None => (rest.clone(), None),
        };
        let (uid, gid) = owner
            .split_once('/')
            .and_then(|(u, g)| Some((u.parse().ok()?, g.parse().ok()?)))
            .with_context(|| format!("unexpected owner in {line:?}"))?;
        let name = name
            .trim_start_matches("./")
            .trim_end_matches('/')
            .to_owned();
        files.insert(
            name,
            Entry {
                mode: mode.to_owned(),
                uid,
                gid,
                link,
            },
        );
    }
    Ok(())
}

fn read_image(archive: &Path, scratch: &Path) -> Result<Image> {
    std::fs::create_dir_all(scratch)?;
    run(Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(scratch))?;
    let layout = json(&scratch.join("oci-layout"))?;
    ensure!(
        layout["imageLayoutVersion"] == "1.0.0",
        "oci-layout: {layout}"
    );
    let index = json(&scratch.join("index.json"))?;
    let desc = &index["manifests"][0];
    let manifest = json(&blob(
        scratch,
        desc["digest"].as_str().context("manifest digest")?,
    )?)?;
    let config = json(&blob(
        scratch,
        manifest["config"]["digest"]
            .as_str()
            .context("config digest")?,
    )?)?;
    let mut files = BTreeMap::new();
    let layers = manifest["layers"].as_array().context("layers")?;
    for l in layers {
        ensure!(
            l["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip",
            "layer media type: {l}"
        );
        list_layer(
            &blob(scratch, l["digest"].as_str().context("layer digest")?)?,
            &mut files,
        )?;
    }
    Ok(Image {
        config,
        index,
        files,
        layers: layers.len(),
    })
}

/// Follow top-level symlinks such as `bin -> usr/bin` (merged /usr).
fn resolve<'a>(img: &'a Image, path: &str) -> Option<(String, &'a Entry)> {
    let mut path = path.to_owned();
    for _ in 0..8 {
        if let Some(e) = img.files.get(&path) {
            match &e.link {
                Some(target) if e.mode.starts_with('l') => {
                    let dir = Path::new(&path)
                        .parent()
                        .map(Path::to_path_buf)
                        .unwrap_or_default();
                    path = if let Some(abs) = target.strip_prefix('/') {
                        abs.to_owned()
                    } else {
                        dir.join(target).to_string_lossy().into_owned()
                    };
                    continue;
                }
                _ => return Some((path, e)),
            }
        }
        // A symlinked parent directory: bin/bash with bin -> usr/bin.
        let (first, rest) = path.split_once('/')?;
        let e = img.files.get(first)?;
        let target = e.link.as_deref().filter(|_| e.mode.starts_with('l'))?;
        path = format!("{}/{rest}", target.trim_start_matches('/'));
    }
    None
}

fn assert_executable(img: &Image, path: &str) {
    let (real, e) = resolve(img, path).unwrap_or_else(|| panic!("{path} missing from the image"));
    assert!(
        e.mode.starts_with('-') && e.mode.as_bytes().get(3) == Some(&b'x'),
        "{path} ({real}) is not an executable file: {e:?}"
    );
}

fn env_of(config: &Value) -> Vec<String> {
    config["config"]["Env"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn go_arch() -> Result<String> {
    let out = run(Command::new("dpkg").arg("--print-architecture"))?;
    let deb = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Ok(match deb.as_str() {
        "armhf" => "arm".into(),
        "i386" => "386".into(),
        "ppc64el" => "ppc64le".into(),
        other => other.into(),
    })
}

#[test]
fn archives_hold_the_users_entry_points_and_tools() -> Result<()> {
    let dir = images_dir()?;
    let refs = refs(&dir)?;
    let scratch = tempdir("read")?;
    let arch = go_arch()?;
    let tag = env!("CARGO_PKG_VERSION");
    let mut images = BTreeMap::new();
    for name in IMAGES {
        let archive = dir.join(format!("cli-mcp-{name}.tar"));
        let img = read_image(&archive, &scratch.0.join(name))?;
        let want_ref = format!("localhost/cli-mcp-{name}:{tag}");
        assert_eq!(refs.get(name), Some(&want_ref), "images.tsv");
        let ann = &img.index["manifests"][0]["annotations"];
        assert_eq!(
            ann["io.containerd.image.name"],
            want_ref.as_str(),
            "{name}: index annotations"
        );
        assert_eq!(
            ann["org.opencontainers.image.ref.name"], tag,
            "{name}: index annotations"
        );
        assert_eq!(
            img.config["architecture"],
            arch.as_str(),
            "{name}: architecture"
        );
        assert_eq!(img.config["os"], "linux", "{name}: os");
        let binary = match name {
            "sandbox" => "cli-mcp-agent".to_owned(),
            other => format!("cli-mcp-{other}"),
        };
        let entrypoint = format!("/usr/local/bin/{binary}");
        assert_eq!(
            img.config["config"]["Entrypoint"],
            serde_json::json!([entrypoint]),
            "{name}: entry point"
        );
        assert_executable(&img, entrypoint.trim_start_matches('/'));
        // Our binaries are linked against glibc: the loader and libc must be there.
        assert!(
            img.files.keys().any(|p| p.ends_with("/libc.so.6")),
            "{name}: no libc.so.6"
        );
        assert!(
            img.files.contains_key("etc/ssl/certs/ca-certificates.crt"),
            "{name}: no CA bundle"
        );
        assert!(
            img.files
                .contains_key("usr/share/cli-mcp/debian-packages.txt"),
            "{name}: no Debian package manifest"
        );
        images.insert(name, img);
    }

    let op = &images["operator"];
    assert_eq!(op.config["config"]["User"], "65532:65532");
    assert!(
        !op.files
            .keys()
            .any(|p| p.ends_with("bin/sh") || p.ends_with("bin/bash")),
        "the operator image has no shell"
    );
    let server = &images["server"];
    assert_eq!(server.config["config"]["User"], "1001:0");
    let proxy = &images["proxy"];
    assert_eq!(proxy.config["config"]["User"], "1001:0");
    assert!(
        !proxy
            .files
            .keys()
            .any(|p| p.ends_with("bin/sh") || p.ends_with("bin/bash")),
        "the proxy image has no shell"
    );

    let sbx = &images["sandbox"];
    assert_eq!(sbx.config["config"]["User"], "1001:0");
    assert_eq!(sbx.config["config"]["WorkingDir"], "/workspace");
    assert!(
        env_of(&sbx.config).contains(&"HOME=/workspace".to_owned()),
        "sandbox env: {:?}",
        env_of(&sbx.config)
    );
    assert_eq!(sbx.layers, 3, "Debian, kubectl + yq, agent");
    for tool in [
        "bin/bash",
        "usr/local/bin/kubectl",
        "usr/local/bin/yq",
        "usr/local/bin/cli-mcp-agent",
        "usr/bin/jq",
        "usr/bin/curl",
    ] {
        assert_executable(sbx, tool);
    }
    let ws = &sbx
        .files
        .get("workspace")
        .expect("/workspace in the sandbox");
    assert!(
        ws.mode.starts_with('d'),
        "/workspace is a directory: {ws:?}"
    );
    assert_eq!(ws.gid, 0, "/workspace group");
    assert_eq!(ws.uid, 1001, "/workspace owner");
    assert_eq!(
        &ws.mode[4..7],
        &ws.mode[1..4],
        "/workspace: group = user (g=u)"
    );
    assert_eq!(&ws.mode[5..6], "w", "/workspace group-writable");
    Ok(())
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir(what: &str) -> Result<TempDir> {
    let base = std::env::temp_dir().join(format!("cli-mcp-images-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    Ok(TempDir(base))
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
}

/// A containerd of this test only; killed (by its PID) and its directory removed on drop.
struct Containerd {
    child: Child,
    socket: PathBuf,
    dir: TempDir,
}

impl Containerd {
    fn start() -> Result<Self> {
        let dir = tempdir("containerd")?;
        let d = &dir.0;
        let socket = d.join("containerd.sock");
        let config = d.join("config.toml");
        std::fs::write(
            &config,
            format!(
                r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
"#,
                root = d.join("root").display(),
                state = d.join("state").display(),
                sock = socket.display(),
                opt = d.join("opt").display(),
            ),
        )?;
        let log = std::fs::File::create(d.join("containerd.log"))?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting containerd")?;
        let c = Containerd { child, socket, dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if c.ctr()
                .arg("version")
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
            {
                return Ok(c);
            }
            ensure!(
                Instant::now() < deadline,
                "containerd did not answer on {} within 60 s (log: {})",
                c.socket.display(),
                c.dir.0.join("containerd.log").display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn ctr(&self) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address").arg(&self.socket).args(["-n", "k8s.io"]);
        c
    }
}

/// `ctr images unmount --rm` of a mounted image rootfs, on drop.
struct Unmount(Command, PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = self
            .0
            .args(["images", "unmount", "--rm"])
            .arg(&self.1)
            .output();
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn sandbox_runs_under_an_arbitrary_uid_in_group_0() -> Result<()> {
    let missing: Vec<&str> = ["containerd", "ctr", "runc", "containerd-shim-runc-v2"]
        .into_iter()
        .filter(|t| !on_path(t))
        .collect();
    if !missing.is_empty() || !nix::unistd::geteuid().is_root() {
        eprintln!(
            "skipped: needs root and {} on PATH (apt-get install containerd)",
            if missing.is_empty() {
                "containerd".to_owned()
            } else {
                missing.join(", ")
            }
        );
        return Ok(());
    }
    let dir = images_dir()?;
    let refs = refs(&dir)?;
    let containerd = Containerd::start()?;
    for name in IMAGES {
        run(containerd
            .ctr()
            .args(["images", "import"])
            .arg(dir.join(format!("cli-mcp-{name}.tar"))))?;
    }
    let listed = run(containerd.ctr().args(["images", "ls", "-q"]))?;
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    for r in refs.values() {
        assert!(
            listed.lines().any(|l| l == r),
            "{r} not in `ctr images ls`: {listed}"
        );
    }

    let id = |what: &str| format!("cli-mcp-images-{what}-{}", std::process::id());
    // Operator, server and proxy: the binaries start (glibc, libgcc) in their minimal base.
    for name in ["operator", "server", "proxy"] {
        let out = run(containerd
            .ctr()
            .args(["run", "--rm"])
            .arg(&refs[name])
            .arg(id(name))
            .arg(format!("/usr/local/bin/cli-mcp-{name}"))
            .arg("--help"))?;
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage"),
            "{name} --help: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // The image's own user (the operator renders no runAsUser): 1001, group 0.
    let out = run(containerd
        .ctr()
        .args(["run", "--rm"])
        .arg(&refs["sandbox"])
        .arg(id("sandbox-default"))
        .args(["bash", "-c", "echo $(id -u):$(id -g)"]))?;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1001:0");

    // An arbitrary UID in group 0 with no capabilities, as OpenShift's restricted SCC runs
    // it. `ctr run` (1.6) has no --user: run an OCI spec on the image's mounted rootfs.
    let config = read_image(
        &dir.join("cli-mcp-sandbox.tar"),
        &containerd.dir.0.join("sandbox-image"),
    )?
    .config;
    let rootfs = containerd.dir.0.join("sandbox-rootfs");
    std::fs::create_dir_all(&rootfs)?;
    run(containerd
        .ctr()
        .args(["images", "mount", "--rw"])
        .arg(&refs["sandbox"])
        .arg(&rootfs))?;
    let _unmount = Unmount(containerd.ctr(), rootfs.clone());
    let script = r#"set -e
echo "uid=$(id -u) gid=$(id -g) home=$HOME pwd=$(pwd)"
jq --version
yq --version
kubectl version --client
echo written >"$HOME/probe" && cat "$HOME/probe"
cli-mcp-agent --help >/dev/null && echo agent-ok"#;
    let spec = run(containerd.ctr().args(["oci", "spec"]))?;
    let mut spec: Value = serde_json::from_slice(&spec.stdout).context("ctr oci spec")?;
    spec["root"] = serde_json::json!({ "path": rootfs, "readonly": false });
    let p = &mut spec["process"];
    p["user"] = serde_json::json!({ "uid": 1234567, "gid": 0 });
    p["env"] = serde_json::json!(env_of(&config));
    p["cwd"] = config["config"]["WorkingDir"].clone();
    p["args"] = serde_json::json!(["bash", "-c", script]);
    p["capabilities"] = serde_json::json!({ "bounding": [], "effective": [], "permitted": [] });
    let spec_file = containerd.dir.0.join("sandbox-spec.json");
    std::fs::write(&spec_file, serde_json::to_vec(&spec)?)?;
    let out = run(containerd
        .ctr()
        .args(["run", "--rm", "--config"])
        .arg(&spec_file)
        .arg(id("sandbox")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    for want in [
        "uid=1234567 gid=0 home=/workspace pwd=/workspace",
        "jq-1.",
        "yq (https://github.com/mikefarah/yq/) version v4",
        "Client Version: v1.",
        "written",
        "agent-ok",
    ] {
        assert!(stdout.contains(want), "missing {want:?} in:\n{stdout}");
    }
    Ok(())
}
