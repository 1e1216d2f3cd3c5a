//! Files in the state dir, which the shell user can write to: nothing there is trusted.
//! Links are never followed, a FIFO never blocks a read or a write, and nothing but a
//! regular file of its own is read or written through.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Mode of the agent's directories: the session's files are nobody else's business.
pub const DIR_MODE: u32 = 0o700;

/// Whether `path` itself is a directory (a link to one is not). Checked before the agent
/// writes or removes anything in one of its directories, since a command may have replaced
/// the directory with a link to somewhere else.
pub fn is_real_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// Makes `path` a directory of ours, as the agent needs it: creates it (and missing
/// parents) with [`DIR_MODE`]; replaces a link, file or FIFO a command put there (a link is
/// removed, never followed); and gives a directory the agent owns its mode back when a
/// command changed it (`chmod 000`). A directory owned by someone else is left as it is.
pub fn own_dir(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            let ours = m.uid() == nix::unistd::geteuid().as_raw();
            if ours && m.mode() & 0o7777 != DIR_MODE {
                fs::set_permissions(path, fs::Permissions::from_mode(DIR_MODE))?;
            }
            return Ok(());
        }
        Ok(_) => fs::remove_file(path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
}

/// Creates `path` (which must not exist, and is never followed if it is a link) with
/// `bytes`.
pub fn write_new_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)
}

/// Writes `bytes` at the start of `path` and cuts the file to their length. Never follows a
/// link, never blocks on a FIFO, and refuses anything but a regular file with one name.
pub fn write_in_place(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .mode(0o600)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() || meta.nlink() != 1 {
        return Err(io::Error::other("not a regular file of its own"));
    }
    file.write_all_at(bytes, 0)?;
    file.set_len(bytes.len() as u64)
}

/// Reads a whole file of at most `cap` bytes. `Ok(None)`: no file. `Err`: the file is not
/// one we could have written (a link, a FIFO, too large); the reason is for the log.
pub fn read_capped(path: &Path, cap: u64) -> Result<Option<Vec<u8>>, String> {
    let mut file = match fs::File::options()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err("it is a symbolic link".into())
        }
        Err(e) => return Err(format!("cannot open it: {e}")),
    };
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat it: {e}"))?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let what = if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return Err(format!("it is {what}"));
    }
    if meta.len() > cap {
        return Err(format!(
            "it is {} bytes, over the {cap}-byte cap",
            meta.len()
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // The file may grow after the stat: never read past the cap.
    (&mut file)
        .take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read it: {e}"))?;
    if bytes.len() as u64 > cap {
        return Err(format!("it grew over the {cap}-byte cap"));
    }
    Ok(Some(bytes))
}
