//! The pinned Debian packages of the images (`images/debian-pins.sh`, images/README.md,
//! "Pinned Debian packages"). Each test gives the script a mirror of its own (a `file://`
//! directory) and a cache in a scratch directory, so nothing leaves the machine: a pin the
//! archive no longer serves, a file with another sha256, a malformed lock line and a lock that
//! does not match what was installed each stop with a message that says what to do; the
//! refresh pins each package by its `Packages` index entry; the checked-in locks pin every
//! listed package once.

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use cli_mcp_e2e::workspace::workspace_root;

fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

fn scratch(what: &str) -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("cli-mcp-pins-{what}-"))
        .tempdir()
        .context("creating a scratch directory")
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

/// `images/debian-pins.sh ARGS` against a mirror directory of the test's own.
fn pins(dir: &Path, args: &[&str]) -> Result<Output> {
    let script = workspace_root().join("images/debian-pins.sh");
    let mirror = format!("file://{}", dir.join("mirror").display());
    Command::new(&script)
        .args(args)
        .env("ARCH", "amd64")
        .env("DEBIAN_MIRROR", &mirror)
        .env("DEBIAN_SECURITY_MIRROR", format!("{mirror}-security"))
        .env("CLI_MCP_CACHE", dir.join("cache"))
        .output()
        .with_context(|| format!("running {}", script.display()))
}

fn fails_saying(out: &Output, wanted: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {stderr}");
    for w in wanted {
        assert!(stderr.contains(w), "missing {w:?} in: {stderr}");
    }
}

#[test]
fn a_pin_the_archive_no_longer_serves_or_serves_otherwise_stops_the_build() -> Result<()> {
    let dir = scratch("pins")?;
    let d = dir.path();
    let path = "pool/main/h/hello/hello_9.9-9_amd64.deb";
    let served = b"not the pinned file";
    let lock = d.join("test.lock");
    let line = |sha: &str| format!("# a comment\nhello=9.9-9 amd64 {sha} debian {path}\n");
    std::fs::write(&lock, line(&"0".repeat(64)))?;
    let (lock_s, repo_s) = (lock.to_str().context("utf-8")?, d.join("repo"));
    let repo_s = repo_s.to_str().context("utf-8")?;

    // Not served: the archive has dropped the version.
    let out = pins(d, &["fetch", lock_s, repo_s])?;
    fails_saying(
        &out,
        &[
            "hello=9.9-9 (amd64)",
            "is not served by the archive any more",
            "images/debian-pins.sh refresh",
        ],
    );

    // Served, but not the file that was pinned.
    let file = d.join("mirror").join(path);
    std::fs::create_dir_all(file.parent().context("parent")?)?;
    std::fs::write(&file, served)?;
    let out = pins(d, &["fetch", lock_s, repo_s])?;
    fails_saying(
        &out,
        &[
            &format!("has sha256 {}", sha256_hex(served)),
            &format!("pins hello=9.9-9 (amd64) to {}", "0".repeat(64)),
        ],
    );

    // A malformed line is named with its number.
    std::fs::write(&lock, "hello 9.9-9 amd64\n")?;
    let out = pins(d, &["fetch", lock_s, repo_s])?;
    fails_saying(&out, &["line 1 is not", "hello 9.9-9 amd64"]);

    // The lock must be exactly what the root filesystem holds.
    std::fs::write(&lock, line(&sha256_hex(served)))?;
    let list = d.join("installed");
    std::fs::write(&list, "hello 9.9-9 amd64\nextra 1.0 amd64\n")?;
    let out = pins(d, &["check", lock_s, list.to_str().context("utf-8")?])?;
    fails_saying(
        &out,
        &[
            "does not hold exactly the packages",
            "> extra 1.0 amd64",
            "images/debian-pins.sh refresh",
        ],
    );
    std::fs::write(&list, "hello 9.9-9 amd64\n")?;
    let out = pins(d, &["check", lock_s, list.to_str().context("utf-8")?])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn refresh_pins_each_package_by_its_packages_index_entry() -> Result<()> {
    let dir = scratch("lock")?;
    let d = dir.path();
    let lists = d.join("lists");
    std::fs::create_dir_all(&lists)?;
    let stanza = |p: &str, v: &str, a: &str, file: &str, sha: char| {
        let sha = sha.to_string().repeat(64);
        format!("Package: {p}\nVersion: {v}\nArchitecture: {a}\nFilename: {file}\nSHA256: {sha}\n")
    };
    // Two versions of `a` in the main archive (the older one is not wanted); `b`'s stanza
    // ends its file without a blank line; `c` comes from the security archive.
    let main = format!(
        "{}\n{}\n{}",
        stanza("a", "1", "amd64", "pool/main/a/a/a_1_amd64.deb", 'a'),
        stanza("a", "0", "amd64", "pool/main/a/a/a_0_amd64.deb", '0'),
        stanza("b", "1:2", "all", "pool/main/b/b/b_2_all.deb", 'b'),
    );
    std::fs::write(
        lists.join("deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages"),
        main,
    )?;
    let security = stanza(
        "c",
        "3+deb12u1",
        "amd64",
        "pool/updates/main/c/c/c_3_amd64.deb",
        'c',
    );
    std::fs::write(
        lists.join(
            "deb.debian.org_debian-security_dists_bookworm-security_main_binary-amd64_Packages",
        ),
        security + "\n",
    )?;
    let list = d.join("installed");
    std::fs::write(&list, "c 3+deb12u1 amd64\nb 1:2 all\na 1 amd64\n")?;
    let (list_s, lists_s) = (
        list.to_str().context("utf-8")?,
        lists.to_str().context("utf-8")?,
    );
    let out = pins(d, &["lock", list_s, lists_s])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = [
        format!(
            "a=1 amd64 {} debian pool/main/a/a/a_1_amd64.deb",
            "a".repeat(64)
        ),
        format!(
            "b=1:2 all {} debian pool/main/b/b/b_2_all.deb",
            "b".repeat(64)
        ),
        format!(
            "c=3+deb12u1 amd64 {} debian-security pool/updates/main/c/c/c_3_amd64.deb",
            "c".repeat(64)
        ),
    ];
    assert_eq!(String::from_utf8_lossy(&out.stdout), want.join("\n") + "\n");

    // A package the indices do not have cannot be pinned.
    std::fs::write(&list, "a 1 amd64\nd 4 amd64\n")?;
    let out = pins(d, &["lock", list_s, lists_s])?;
    fails_saying(&out, &["no Packages entry for d 4 amd64"]);
    Ok(())
}

#[test]
fn the_checked_in_locks_pin_every_listed_package_once() -> Result<()> {
    let images = workspace_root().join("images");
    let arch = String::from_utf8(run(Command::new("dpkg").arg("--print-architecture"))?.stdout)?;
    for rfs in ["sandbox", "base"] {
        let lock_path = images.join(format!("{rfs}/debian-packages.{}.lock", arch.trim()));
        let lock = std::fs::read_to_string(&lock_path)
            .with_context(|| format!("reading {}", lock_path.display()))?;
        let names: Vec<&str> = lock
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| l.split('=').next().unwrap_or_default())
            .collect();
        let unique: std::collections::BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(
            unique.len(),
            names.len(),
            "{}: each package once",
            lock_path.display()
        );
        let listed = std::fs::read_to_string(images.join(format!("{rfs}/debian-packages")))?;
        for pkg in listed
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            assert!(
                names.contains(&pkg),
                "{pkg} is listed in images/{rfs}/debian-packages but not pinned in {}: run \
                 `images/debian-pins.sh refresh` (as root) and commit the locks",
                lock_path.display()
            );
        }
    }
    Ok(())
}
