//! Unix sockets only this process's user (and root) can connect to: a
//! migration endpoint (`--incoming unix:PATH`, a handover's socket) and
//! the VMM's control socket. The file is created owner-only (0600)
//! whatever the umask, without a moment where it is reachable more
//! widely, and never in place of a file that is already there.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

/// Longest socket path bound directly (sun_path holds 108 bytes with its
/// terminating NUL); longer temporary paths are reached through /proc.
const SUN_PATH_MAX: usize = 107;

/// Removes the temporary directory (and anything left in it) when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Binds a listening unix socket at `path` that only this user (and root)
/// can connect to; fails if `path` exists. The umask is process-wide, so
/// changing it around bind would race with every other thread creating
/// files; instead the socket is bound inside a new directory that only
/// this user can enter (mkdir makes it with at most 0700, and chmod, which
/// ignores the umask, makes it exactly 0700), made 0600 by chmod while
/// nobody else can reach it, and then linked at `path` (a link is the same
/// file, mode and all, and link(2) refuses a name that exists: `path`
/// never shows a socket with wider permissions, nor replaces anything).
pub fn bind_owner_only(path: &Path) -> io::Result<UnixListener> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if path.file_name().is_none() {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = parent.join(format!(".ferry-sock-{:x}-{nanos:x}", std::process::id()));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let _guard = TempDir(dir.clone());
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    let tmp = dir.join("s");
    let listener = if tmp.as_os_str().len() <= SUN_PATH_MAX {
        UnixListener::bind(&tmp)?
    } else {
        // The directory through its descriptor: a short path to the same
        // place.
        let d = std::fs::File::open(&dir)?;
        UnixListener::bind(format!("/proc/self/fd/{}/s", d.as_raw_fd()))?
    };
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    std::fs::hard_link(&tmp, path)?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn scratch(what: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferry-owner-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_socket_is_owner_only_and_never_replaces_a_file() {
        let dir = scratch("bind");
        let path = dir.join("s.sock");
        let l = bind_owner_only(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600);
        let _c = UnixStream::connect(&path).unwrap();
        l.accept().unwrap();
        // Nothing is left beside it.
        let beside: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(beside, [std::ffi::OsString::from("s.sock")]);
        // A file already there stays.
        let kept = dir.join("data");
        std::fs::write(&kept, b"keep me").unwrap();
        let e = bind_owner_only(&kept).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(std::fs::read(&kept).unwrap(), b"keep me");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
