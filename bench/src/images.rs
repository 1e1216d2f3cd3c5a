//! `cli-mcp-bench images`: sizes of the OCI image archives `hack/build-images.sh` builds
//! (images/README.md), as a table: the archive (gzip-compressed layers, what a registry
//! stores and a node pulls) and the layers uncompressed (what the node unpacks).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use cli_mcp_e2e::workspace::workspace_root;

#[derive(clap::Args)]
pub struct ImagesArgs {
    /// A directory `hack/build-images.sh` printed (default: run the script; it is cached).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub fn images_bench(args: ImagesArgs) -> anyhow::Result<()> {
    let (dir, took) = match args.dir {
        Some(dir) => (dir, None),
        None => {
            let script = workspace_root().join("hack/build-images.sh");
            let start = Instant::now();
            let out = Command::new(&script)
                .stderr(Stdio::inherit())
                .output()
                .with_context(|| format!("running {}", script.display()))?;
            if !out.status.success() {
                bail!("{} failed ({})", script.display(), out.status);
            }
            let stdout = String::from_utf8_lossy(&out.stdout);
            let dir = stdout
                .lines()
                .last()
                .context("the script printed nothing")?;
            (PathBuf::from(dir), Some(start.elapsed()))
        }
    };
    let tsv = dir.join("images.tsv");
    let tsv =
        std::fs::read_to_string(&tsv).with_context(|| format!("reading {}", tsv.display()))?;
    println!("\n## images ({})\n", dir.display());
    println!("| image | layers | archive (compressed) | layers uncompressed |");
    println!("|---|---|---|---|");
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0));
    for line in tsv.lines().skip(1) {
        let f: Vec<&str> = line.split('\t').collect();
        let [image, _manifest, archive, uncompressed, layers] = f[..] else {
            bail!("unexpected images.tsv line {line:?}");
        };
        let archive: u64 = archive.parse().context("archive bytes")?;
        let uncompressed: u64 = uncompressed.parse().context("uncompressed bytes")?;
        println!(
            "| {image} | {layers} | {} | {} |",
            mib(archive),
            mib(uncompressed)
        );
    }
    if let Some(took) = took {
        println!(
            "\nhack/build-images.sh took {:.1} s (cached when its inputs did not change)",
            took.as_secs_f64()
        );
    }
    Ok(())
}
