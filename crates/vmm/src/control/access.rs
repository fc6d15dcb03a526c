//! Who may reach a control socket: only the VMM's own user and root. The
//! socket file is created owner-only (0600) whatever the umask, without a
//! moment where it is reachable more widely, and every connecting peer's
//! uid is checked with SO_PEERCRED (the kernel's record of who connected,
//! not a claim of the peer's), since a socket file's mode can be changed
//! after the fact or inherited from elsewhere.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// Binds a listening unix socket at `path` that only this user (and root)
/// can connect to, whatever the umask (the migration transport's, shared
/// by every unix socket ferry listens on).
pub use ferry_migration::transport::bind_owner_only;

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
