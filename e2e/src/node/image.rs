//! Local images on the real node: one-layer docker-archives packed from a directory (the
//! pause image, the DNS pod's), imported into the node's containerd with `ctr`.

use std::fs::{self, File};
use std::io::Read;
use std::path::Path;
use std::process::Command;

use serde_json::json;
use sha2::{Digest, Sha256};

use super::run;
use crate::error::{Error, Result};

/// The sandbox ("pause") image, built from Debian's static catatonit and imported at start.
pub const PAUSE_IMAGE: &str = "localhost/cli-mcp-pause:1";
/// Where Debian's `catatonit` package puts the static binary.
pub const CATATONIT: &str = "/usr/bin/catatonit";
/// containerd namespace of the CRI plugin.
pub const CRI_NAMESPACE: &str = "k8s.io";

/// The image config of a one-layer image (docker-archive `<sha>.json`).
pub fn image_config_json(entrypoint: &[&str], diff_id: &str) -> String {
    json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": entrypoint,
            "Env": ["PATH=/bin:/usr/bin"],
            "WorkingDir": "/"
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]}
    })
    .to_string()
}

/// The docker-archive `manifest.json` of a one-layer image.
pub fn image_manifest_json(config_file: &str, tag: &str, layer_file: &str) -> String {
    json!([{"Config": config_file, "RepoTags": [tag], "Layers": [layer_file]}]).to_string()
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(|e| Error::io("opening", path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::io("reading", path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

fn tar_cmd() -> Command {
    let mut c = Command::new("tar");
    c.args([
        "--sort=name",
        "--mtime=@0",
        "--owner=0",
        "--group=0",
        "--numeric-owner",
    ]);
    c
}

/// Pack the directory `rootfs` as a one-layer image `tag` with `entrypoint` into the
/// docker-archive `out` (what `ctr images import` reads). `work` is a scratch directory.
pub fn build_image_archive(
    rootfs: &Path,
    tag: &str,
    entrypoint: &[&str],
    work: &Path,
    out: &Path,
) -> Result<()> {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work).map_err(|e| Error::io("creating", work, e))?;
    let layer = work.join("layer.tar");
    run(tar_cmd()
        .arg("-C")
        .arg(rootfs)
        .arg("-cf")
        .arg(&layer)
        .arg("."))?;
    let diff_id = sha256_file(&layer)?;
    let layer_dir = work.join(&diff_id);
    fs::create_dir_all(&layer_dir).map_err(|e| Error::io("creating", &layer_dir, e))?;
    let layer_file = format!("{diff_id}/layer.tar");
    fs::rename(&layer, work.join(&layer_file)).map_err(|e| Error::io("moving", &layer, e))?;
    let config = image_config_json(entrypoint, &diff_id);
    let config_file = format!("{}.json", hex::encode(Sha256::digest(config.as_bytes())));
    let config_path = work.join(&config_file);
    fs::write(&config_path, &config).map_err(|e| Error::io("writing", &config_path, e))?;
    let manifest = work.join("manifest.json");
    fs::write(
        &manifest,
        image_manifest_json(&config_file, tag, &layer_file),
    )
    .map_err(|e| Error::io("writing", &manifest, e))?;
    run(tar_cmd().arg("-C").arg(work).arg("-cf").arg(out).args([
        "manifest.json",
        &config_file,
        &diff_id,
    ]))?;
    let _ = fs::remove_dir_all(work);
    Ok(())
}

/// `ctr` against the node's containerd, in the CRI namespace.
pub(super) fn ctr(socket: &Path) -> Command {
    let mut c = Command::new("ctr");
    c.arg("--address")
        .arg(socket)
        .arg("--namespace")
        .arg(CRI_NAMESPACE);
    c
}

/// Import a docker-archive into the node's containerd (pods use it with
/// `imagePullPolicy: Never` or `IfNotPresent`).
pub fn import_image(socket: &Path, archive: &Path) -> Result<()> {
    run(ctr(socket).args(["images", "import"]).arg(archive)).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_json_names_the_layer_and_the_tag() {
        let c: serde_json::Value =
            serde_json::from_str(&image_config_json(&["/catatonit", "-P"], "ab12")).expect("c");
        assert_eq!(c["rootfs"]["diff_ids"][0], "sha256:ab12");
        assert_eq!(c["config"]["Entrypoint"][1], "-P");
        let m: serde_json::Value = serde_json::from_str(&image_manifest_json(
            "cc.json",
            "localhost/x:1",
            "ab12/layer.tar",
        ))
        .expect("m");
        assert_eq!(m[0]["RepoTags"][0], "localhost/x:1");
        assert_eq!(m[0]["Layers"][0], "ab12/layer.tar");
        assert_eq!(m[0]["Config"], "cc.json");
    }
}
