//! The images are reproducible (images/README.md, "Reproducible"): `hack/build-images.sh`
//! run twice from clean image caches, with the same inputs, writes byte-identical archives;
//! the Debian packages come only from the pins (`images/debian-pins.sh`).
//!
//! `two_clean_builds_give_the_same_digests` builds the four images twice, each into an empty
//! `CLI_MCP_IMAGES_CACHE` (so every Debian root filesystem, layer, config and archive is made
//! anew), the second under another umask, time zone, locale and temporary directory, and
//! compares the manifest digests (`images.tsv`) and the archives' sha256 (`SHA256SUMS`). On a
//! difference it names the image and the first config key or layer file that differs.
//!
//! What the two builds share, and why that does not weaken the comparison: the inputs. Our
//! binaries are copied once and given to both (another build of the workspace may replace
//! them meanwhile); kubectl and yq come from their caches, keyed by their versions. The .debs
//! come from `$CLI_MCP_CACHE/debian-debs`, but a cached .deb is used only when its content
//! has the sha256 the lock pins, which is the file the archive served; downloading them twice
//! would compare the archive with itself, not the build (and download ~40 MB more each run).
//! Each build takes 35–95 s here (2 CPUs, mostly mmdebstrap installing the 103 packages),
//! the test 70–185 s, depending on the load.
//!
//! The pins themselves are tested in `debian_pins.rs`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{bail, ensure, Context, Result};
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

fn scratch(what: &str) -> Result<tempfile::TempDir> {
    // /var/tmp: the builds need a few hundred MB, more than a tmpfs /tmp may hold.
    tempfile::Builder::new()
        .prefix(&format!("cli-mcp-repro-{what}-"))
        .tempdir_in("/var/tmp")
        .context("creating a scratch directory")
}

/// Our four binaries, copied (release build if there is one, else the debug build).
fn snapshot_binaries(into: &Path) -> Result<PathBuf> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    let bins = cli_mcp_e2e::project_images::BINARIES;
    let from = ["release", "debug"]
        .iter()
        .map(|p| target.join(p))
        .find(|d| bins.iter().all(|b| d.join(b).is_file()))
        .with_context(|| format!("no build of {bins:?} under {}", target.display()))?;
    let dir = into.join("bin");
    std::fs::create_dir_all(&dir)?;
    for b in bins {
        std::fs::copy(from.join(b), dir.join(b)).with_context(|| format!("copying {b}"))?;
    }
    Ok(dir)
}

/// One build into an empty images cache; `odd` runs it under another umask, time zone,
/// locale and TMPDIR, with unreachable Debian mirrors. Returns the directory of the archives.
fn build(bin_dir: &Path, cache: &Path, odd: bool) -> Result<PathBuf> {
    let script = workspace_root().join("hack/build-images.sh");
    let mut cmd = Command::new("bash");
    let umask = if odd { "077" } else { "022" };
    cmd.arg("-c")
        .arg(format!("umask {umask} && exec \"$0\""))
        .arg(&script)
        .env("CLI_MCP_BIN_DIR", bin_dir)
        .env("CLI_MCP_IMAGES_CACHE", cache)
        .stderr(Stdio::inherit());
    if odd {
        let tmp = cache.with_extension("tmp");
        std::fs::create_dir_all(&tmp)?;
        // Mirrors that do not resolve: with every pinned .deb in the shared cache (build A
        // fetched them), the build must not need the archive at all, so what the archive
        // serves today cannot change the images.
        cmd.env("TZ", "Pacific/Chatham")
            .env("LC_ALL", "C.UTF-8")
            .env("TMPDIR", tmp)
            .env("DEBIAN_MIRROR", "http://deb.invalid/debian")
            .env(
                "DEBIAN_SECURITY_MIRROR",
                "http://deb.invalid/debian-security",
            );
    }
    let out = run(&mut cmd)?;
    let stdout = String::from_utf8(out.stdout).context("script output is not UTF-8")?;
    Ok(PathBuf::from(
        stdout
            .lines()
            .last()
            .context("the script printed nothing")?,
    ))
}

/// `images.tsv`'s manifest digest and `SHA256SUMS`' archive hash of cli-mcp-NAME.
fn digests(dir: &Path, name: &str) -> Result<(String, String)> {
    let tsv = std::fs::read_to_string(dir.join("images.tsv")).context("reading images.tsv")?;
    let manifest = tsv
        .lines()
        .find(|l| l.contains(&format!("/cli-mcp-{name}:")))
        .and_then(|l| l.split('\t').nth(1))
        .with_context(|| format!("cli-mcp-{name} not in images.tsv"))?;
    let sums = std::fs::read_to_string(dir.join("SHA256SUMS")).context("reading SHA256SUMS")?;
    let archive = sums
        .lines()
        .find(|l| l.ends_with(&format!(" cli-mcp-{name}.tar")))
        .and_then(|l| l.split_whitespace().next())
        .with_context(|| format!("cli-mcp-{name}.tar not in SHA256SUMS"))?;
    Ok((manifest.to_owned(), archive.to_owned()))
}

fn json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

fn blob(layout: &Path, digest: &str) -> PathBuf {
    layout
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"))
}

/// The first JSON path at which two documents differ (`.config.Labels.x: "a" ≠ "b"`).
fn first_json_difference(a: &Value, b: &Value, at: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let (va, vb) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                first_json_difference(va, vb, &format!("{at}.{k}"))
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (va, vb))| first_json_difference(va, vb, &format!("{at}[{i}]"))),
        _ if a == b => None,
        _ => Some(format!("{at}: {a} ≠ {b}")),
    }
}

/// The first entry at which two tars (gzipped: `z`) differ: in the verbose listing (name,
/// mode, owner, size, mtime, link), else in a file's content, else only in the compression.
fn first_tar_difference(a: &Path, b: &Path, z: bool, work: &Path) -> Result<String> {
    let flags = if z { "-tvzf" } else { "-tvf" };
    let list = |p: &Path| -> Result<Vec<String>> {
        let out = run(Command::new("tar")
            .args(["--numeric-owner", "--full-time", flags])
            .arg(p))?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect())
    };
    let (la, lb) = (list(a)?, list(b)?);
    if let Some((x, y)) = la.iter().zip(&lb).find(|(x, y)| x != y) {
        return Ok(format!("first differing entry: {x:?} ≠ {y:?}"));
    }
    if la.len() != lb.len() {
        return Ok(format!("{} entries ≠ {} entries", la.len(), lb.len()));
    }
    let (da, db) = (work.join("a"), work.join("b"));
    for (d, p) in [(&da, a), (&db, b)] {
        std::fs::create_dir_all(d)?;
        run(Command::new("tar")
            .arg(if z { "-xzf" } else { "-xf" })
            .arg(p)
            .arg("-C")
            .arg(d))?;
    }
    for line in &la {
        let name = line.split_whitespace().nth(5).unwrap_or_default();
        let (fa, fb) = (da.join(name), db.join(name));
        if fa.is_file() && !fa.is_symlink() && std::fs::read(&fa)? != std::fs::read(&fb)? {
            return Ok(format!("first differing file: {name} (content)"));
        }
    }
    Ok("same entries and contents; only the compressed bytes differ (gzip)".to_owned())
}

/// Why two archives of image NAME differ: the config's first differing key, or the first
/// differing layer and the first file in it. Both archives are unpacked under WORK.
fn explain(name: &str, a: &Path, b: &Path, work: &Path) -> Result<String> {
    let (ua, ub) = (
        work.join(format!("{name}-a")),
        work.join(format!("{name}-b")),
    );
    for (d, p) in [(&ua, a), (&ub, b)] {
        std::fs::create_dir_all(d)?;
        run(Command::new("tar").arg("-xf").arg(p).arg("-C").arg(d))?;
    }
    let manifest = |d: &Path| -> Result<Value> {
        let index = json(&d.join("index.json"))?;
        let digest = index["manifests"][0]["digest"]
            .as_str()
            .context("index digest")?;
        json(&blob(d, digest))
    };
    let (ma, mb) = (manifest(&ua)?, manifest(&ub)?);
    let mut why = Vec::new();
    if ma["config"]["digest"] != mb["config"]["digest"] {
        let cfg =
            |d: &Path, m: &Value| json(&blob(d, m["config"]["digest"].as_str().unwrap_or("")));
        let diff = first_json_difference(&cfg(&ua, &ma)?, &cfg(&ub, &mb)?, "");
        why.push(format!(
            "config differs at {}",
            diff.unwrap_or_else(|| "(formatting only)".into())
        ));
    }
    let layers = |m: &Value| -> Vec<String> {
        m["layers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["digest"].as_str().map(str::to_owned))
            .collect()
    };
    let (la, lb) = (layers(&ma), layers(&mb));
    if la.len() != lb.len() {
        why.push(format!("{} layers ≠ {} layers", la.len(), lb.len()));
    }
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        if x != y {
            let work = work.join(format!("{name}-layer{i}"));
            let first = first_tar_difference(&blob(&ua, x), &blob(&ub, y), true, &work)?;
            why.push(format!("layer {i} ({x} ≠ {y}): {first}"));
            break;
        }
    }
    if why.is_empty() {
        // The image is the same; the archive around it is not (crane pushes it as it is).
        let first = first_tar_difference(a, b, false, &work.join(format!("{name}-archive")))?;
        why.push(format!("same manifest, different archive: {first}"));
    }
    Ok(format!("cli-mcp-{name}: {}", why.join("; ")))
}

/// Every image of build B against build A: Ok when all are byte-identical, else an error
/// naming each differing image and its first difference.
fn compare_builds(a: &Path, b: &Path, names: &[&str], work: &Path) -> Result<()> {
    let mut differences = Vec::new();
    for name in names {
        if digests(a, name)? != digests(b, name)? {
            let archive = format!("cli-mcp-{name}.tar");
            differences.push(explain(name, &a.join(&archive), &b.join(&archive), work)?);
        }
    }
    if !differences.is_empty() {
        bail!(
            "two builds from the same inputs differ ({} and {}):\n{}",
            a.display(),
            b.display(),
            differences.join("\n")
        );
    }
    Ok(())
}

#[test]
fn two_clean_builds_give_the_same_digests() -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: hack/build-images.sh runs as root (mmdebstrap, layer owners)");
        return Ok(());
    }
    let dir = scratch("builds")?;
    let bins = snapshot_binaries(dir.path())?;
    let a = build(&bins, &dir.path().join("a"), false)?;
    let b = build(&bins, &dir.path().join("b"), true)?;
    compare_builds(&a, &b, &IMAGES, &dir.path().join("explain"))?;
    let (manifest, _) = digests(&a, "sandbox")?;
    eprintln!("both builds: cli-mcp-sandbox {manifest}");
    Ok(())
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

/// A build directory of one fake image `cli-mcp-NAME` as hack/build-images.sh lays it out
/// (OCI archive, images.tsv, SHA256SUMS): one gzipped layer holding FILES, a config with
/// LABEL; the archive's own entries have mtime MTIME.
fn fake_build(
    dir: &Path,
    name: &str,
    files: &[(&str, &str)],
    label: &str,
    mtime: u32,
) -> Result<()> {
    let (root, layout) = (dir.join("layer"), dir.join("layout"));
    for (path, content) in files {
        let p = root.join(path);
        std::fs::create_dir_all(p.parent().context("parent")?)?;
        std::fs::write(&p, content)?;
    }
    std::fs::create_dir_all(layout.join("blobs/sha256"))?;
    let put = |bytes: &[u8]| -> Result<String> {
        let hex = sha256_hex(bytes);
        std::fs::write(layout.join("blobs/sha256").join(&hex), bytes)?;
        Ok(format!("sha256:{hex}"))
    };
    let tgz = dir.join("layer.tar.gz");
    run(Command::new("tar")
        .args([
            "--sort=name",
            "--mtime=@0",
            "--owner=0",
            "--group=0",
            "-czf",
        ])
        .arg(&tgz)
        .arg("-C")
        .arg(&root)
        .arg("."))?;
    let layer = put(&std::fs::read(&tgz)?)?;
    let config = serde_json::json!({"architecture": "amd64", "os": "linux",
        "config": {"Labels": {"io.cli-mcp.test": label}}});
    let config = put(&serde_json::to_vec(&config)?)?;
    let manifest = serde_json::json!({"schemaVersion": 2,
        "config": {"digest": config}, "layers": [{"digest": layer}]});
    let manifest = put(&serde_json::to_vec(&manifest)?)?;
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{"digest": manifest}]});
    std::fs::write(layout.join("index.json"), serde_json::to_vec(&index)?)?;
    let archive = dir.join(format!("cli-mcp-{name}.tar"));
    run(Command::new("tar")
        .args(["--sort=name", &format!("--mtime=@{mtime}"), "-cf"])
        .arg(&archive)
        .arg("-C")
        .arg(&layout)
        .arg("."))?;
    let sum = sha256_hex(&std::fs::read(&archive)?);
    std::fs::write(
        dir.join("SHA256SUMS"),
        format!("{sum}  cli-mcp-{name}.tar\n"),
    )?;
    std::fs::write(
        dir.join("images.tsv"),
        format!("ref\tmanifest\nlocalhost/cli-mcp-{name}:0.1.0\t{manifest}\n"),
    )?;
    Ok(())
}

#[test]
fn a_differing_layer_or_config_is_named_with_its_first_file_or_key() -> Result<()> {
    let dir = scratch("compare")?;
    let d = |n: &str| dir.path().join(n);
    let files = [("etc/motd", "hello\n"), ("usr/bin/tool", "v1\n")];
    fake_build(&d("a"), "fake", &files, "one", 0)?;
    fake_build(&d("same"), "fake", &files, "one", 0)?;
    compare_builds(&d("a"), &d("same"), &["fake"], &d("w0"))
        .context("identical inputs must compare equal")?;

    fake_build(
        &d("file"),
        "fake",
        &[("etc/motd", "hello\n"), ("usr/bin/tool", "v2\n")],
        "one",
        0,
    )?;
    let err = compare_builds(&d("a"), &d("file"), &["fake"], &d("w1"))
        .expect_err("a changed file must fail the comparison")
        .to_string();
    assert!(err.contains("cli-mcp-fake: layer 0"), "{err}");
    assert!(
        err.contains("first differing file: ./usr/bin/tool"),
        "{err}"
    );
    assert!(!err.contains("config differs"), "{err}");

    fake_build(&d("label"), "fake", &files, "two", 0)?;
    let err = compare_builds(&d("a"), &d("label"), &["fake"], &d("w2"))
        .expect_err("a changed config must fail the comparison")
        .to_string();
    assert!(
        err.contains(
            r#"cli-mcp-fake: config differs at .config.Labels.io.cli-mcp.test: "one" ≠ "two""#
        ),
        "{err}"
    );

    fake_build(
        &d("extra"),
        "fake",
        &[
            ("etc/motd", "hello\n"),
            ("etc/new", "x\n"),
            ("usr/bin/tool", "v1\n"),
        ],
        "one",
        0,
    )?;
    let err = compare_builds(&d("a"), &d("extra"), &["fake"], &d("w3"))
        .expect_err("an added file must fail the comparison")
        .to_string();
    assert!(
        err.contains("first differing entry") && err.contains("./etc/new"),
        "{err}"
    );

    // The same image in an archive whose own entries differ (what a umask or clock would do).
    fake_build(&d("archive"), "fake", &files, "one", 86400)?;
    let err = compare_builds(&d("a"), &d("archive"), &["fake"], &d("w4"))
        .expect_err("a changed archive must fail the comparison")
        .to_string();
    assert!(
        err.contains("cli-mcp-fake: same manifest, different archive: first differing entry"),
        "{err}"
    );
    Ok(())
}
