//! Who may reach a control socket: only the VMM's own user and root. The
//! socket file is created owner-only (0600) whatever the umask, without a
//! moment where it is reachable more widely, and every connecting peer's
//! uid is checked with SO_PEERCRED (the kernel's record of who connected,
//! not a claim of the peer's), since a socket file's mode can be changed
//! after the fact or inherited from elsewhere.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

/// Longest socket path bound directly (sun_path holds 108 bytes with its
/// terminating NUL); longer temporary paths are reached through /proc.
const SUN_PATH_MAX: usize = 107;

/// Removes the temporary directory (and anything left in it) when dropped.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Binds a listening unix socket at `path` that only this user (and root)
/// can connect to. The umask is process-wide, so changing it around bind
/// would race with every other thread creating files; instead the socket
/// is bound inside a new directory that only this user can enter (mkdir
/// makes it with at most 0700, and chmod, which ignores the umask, makes
/// it exactly 0700), made 0600 by chmod while nobody else can reach it,
/// and then renamed to `path` (a rename keeps the file's mode, and is
/// atomic: `path` never shows a socket with wider permissions).
pub fn bind_owner_only(path: &Path) -> io::Result<UnixListener> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    if path.file_name().is_none() {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let dir = parent.join(format!(".ferry-ctl-{:x}-{nanos:x}", std::process::id()));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let guard = TempDir(dir.clone());
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
    std::fs::rename(&tmp, path)?;
    drop(guard);
    Ok(listener)
}

/// The uid of the process that connected `s`, as the kernel recorded it.
pub fn peer_uid(s: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are ours and sized for SO_PEERCRED's answer;
    // the descriptor is a live socket for the call; the result is checked.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Why a peer may not use the control socket, or None if it may: it must
/// be this process's user, or root.
pub fn refusal(s: &UnixStream) -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    match peer_uid(s) {
        Ok(uid) if uid == me || uid == 0 => None,
        Ok(uid) => Some(format!(
            "refused: this VMM's control socket serves its own user (uid {me}) and root, not uid {uid}"
        )),
        Err(e) => Some(format!("refused: cannot tell who connected ({e})")),
    }
}
