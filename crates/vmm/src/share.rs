//! Cross-VM page sharing on one host (`ferry run --share-pages`): each VMM
//! that shares publishes where its guest RAM is (its pid and the memfds'
//! descriptor numbers) in the host's share directory, and a destination
//! that shares maps the other VMs' RAM read-only from there, so a source
//! can send pages those VMs already hold as references
//! (`ferry_migration::shared`).
//!
//! - The directory is per network namespace by default
//!   (`/run/ferry/share/net-INODE` for root): on a real host that is the
//!   host; the lab's hosts are namespaces of one machine and must not see
//!   each other's VMs.
//! - An entry is trusted only as far as the kernel allows: it must belong
//!   to this user, name a live process started when the entry says, and a
//!   descriptor of that process that is a memfd; the memory is opened
//!   through /proc (the same permission a debugger needs) and read with
//!   pread, never mapped (`ferry_memory::PeerRegion`). Every page taken from
//!   it is checked by its hash.
//! - The directory must be this user's alone (0700), or nothing is
//!   published or read there.
//! - An entry disappears when its VMM exits; one left by a VMM that was
//!   killed is ignored (its process is gone or another one has its pid).

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ferry_memory::{GuestMemory, PeerRegion};

/// An entry larger than this is not read.
const MAX_ENTRY_BYTES: u64 = 64 << 10;
/// Regions an entry may list.
const MAX_REGIONS: usize = 64;

/// What a sharing VMM publishes.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Entry {
    pid: u32,
    /// Its start time (/proc/PID/stat, clock ticks after boot): a pid
    /// reused by another process does not match.
    start: u64,
    regions: Vec<EntryRegion>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct EntryRegion {
    gpa: u64,
    size: u64,
    fd: i32,
}

/// The share directory of this host: `FERRY_SHARE_DIR` if set, else one
/// per network namespace under /run/ferry/share (root), the user's
/// runtime directory, or /tmp.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRY_SHARE_DIR") {
        return PathBuf::from(d);
    }
    let net = fs::metadata("/proc/self/ns/net").map_or(0, |m| m.ino());
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let base = if uid == 0 {
        PathBuf::from("/run/ferry/share")
    } else {
        match std::env::var_os("XDG_RUNTIME_DIR") {
            Some(d) => Path::new(&d).join("ferry/share"),
            None => PathBuf::from(format!("/tmp/ferry-share-{uid}")),
        }
    };
    base.join(format!("net-{net}"))
}

/// This VMM's entry; removed when dropped.
#[derive(Debug)]
pub struct Published {
    dir: PathBuf,
    path: PathBuf,
}

impl Published {
    /// The directory it was published in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Checks that `dir` is a directory (not a link to one) of this user's
/// that no one else may write or read: another user's directory could
/// hold entries planted for this VMM to follow.
fn check_private(dir: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(dir)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a directory of uid {me} alone (mode 0700)",
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// Publishes `memory` in `dir` (created owner-only if missing; an
/// existing one must be this user's alone).
pub fn publish(dir: &Path, memory: &GuestMemory) -> io::Result<Published> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    check_private(dir)?;
    let pid = std::process::id();
    let start =
        start_time(pid).ok_or_else(|| io::Error::other("cannot read this process's start time"))?;
    let entry = Entry {
        pid,
        start,
        regions: memory
            .regions()
            .iter()
            .map(|r| EntryRegion {
                gpa: r.gpa(),
                size: r.size(),
                fd: r.fd().as_raw_fd(),
            })
            .collect(),
    };
    let path = dir.join(format!("{pid}.json"));
    let tmp = dir.join(format!(".{pid}.json.tmp"));
    {
        // A fresh file, never one (or a link) someone left in its place.
        let _ = fs::remove_file(&tmp);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        // The mode above is filtered by the umask; owner-only either way.
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        serde_json::to_writer(&mut f, &entry).map_err(io::Error::other)?;
    }
    fs::rename(&tmp, &path)?;
    Ok(Published {
        dir: dir.to_path_buf(),
        path,
    })
}

/// The RAM of every other VMM that shares in `dir`, opened read-only.
/// Entries that cannot be trusted or opened are skipped (and logged).
pub fn siblings(dir: &Path) -> Vec<PeerRegion> {
    if let Err(why) = check_private(dir) {
        tracing::warn!(%why, "no pages shared");
        return Vec::new();
    }
    let Ok(list) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let me = std::process::id();
    let mut out = Vec::new();
    for e in list.flatten() {
        let path = e.path();
        if path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        match open_entry(&path, me) {
            Ok(Some(regions)) => out.extend(regions),
            Ok(None) => {}
            Err(why) => tracing::debug!(entry = %path.display(), %why, "share entry skipped"),
        }
    }
    out
}

/// The regions `path` publishes, None if it is this process's own.
fn open_entry(path: &Path, me: u32) -> Result<Option<Vec<PeerRegion>>, String> {
    let meta = fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if !meta.is_file() || meta.uid() != unsafe { libc::geteuid() } {
        return Err("not a file of this user".into());
    }
    if meta.len() > MAX_ENTRY_BYTES {
        return Err("too large".into());
    }
    let text = fs::read(path).map_err(|e| e.to_string())?;
    let entry: Entry = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
    if entry.pid == me {
        return Ok(None);
    }
    if entry.regions.len() > MAX_REGIONS {
        return Err("too many regions".into());
    }
    if start_time(entry.pid) != Some(entry.start) {
        return Err("its VMM is gone".into());
    }
    let mut regions = Vec::new();
    for r in &entry.regions {
        let fd_path = format!("/proc/{}/fd/{}", entry.pid, r.fd);
        let target = fs::read_link(&fd_path).map_err(|e| e.to_string())?;
        if !target.to_string_lossy().starts_with("/memfd:") {
            return Err(format!("{fd_path} is not a memfd"));
        }
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&fd_path)
            .map_err(|e| e.to_string())?;
        // What was opened, not what was looked at before: the process may
        // have ended and its pid or fd number been reused in between.
        let opened = fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map_err(|e| e.to_string())?;
        if !opened.to_string_lossy().starts_with("/memfd:")
            || start_time(entry.pid) != Some(entry.start)
        {
            return Err(format!("{fd_path} changed while it was opened"));
        }
        let name = format!("pid {} at {:#x}", entry.pid, r.gpa);
        regions.push(PeerRegion::open(&name, r.size, file.into()).map_err(|e| e.to_string())?);
    }
    Ok(Some(regions))
}

/// A process's start time in clock ticks after boot (field 22 of
/// /proc/PID/stat), if it lives.
fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_vm_is_found_by_others_and_not_by_itself() {
        let dir = std::env::temp_dir().join(format!("ferry-share-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let memory = GuestMemory::new(&[(0, 16 * 4096)]).unwrap();
        memory.write_bytes(4096, &[9u8; 4096]).unwrap();
        let published = publish(&dir, &memory).unwrap();
        let mode = fs::metadata(dir.join(format!("{}.json", std::process::id())))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // This process's own entry is not a sibling.
        assert!(siblings(&dir).is_empty());
        // As another process would see it: open the entry by path.
        let path = dir.join(format!("{}.json", std::process::id()));
        let regions = open_entry(&path, 0).unwrap().unwrap();
        assert_eq!(regions.len(), 1);
        let mut page = [0u8; 4096];
        assert!(regions[0].copy_page(4096, &mut page));
        assert_eq!(page, [9u8; 4096]);
        // A stale entry (a pid that started at another time) is skipped.
        let stale = Entry {
            pid: std::process::id(),
            start: 1,
            regions: vec![],
        };
        fs::write(dir.join("stale.json"), serde_json::to_vec(&stale).unwrap()).unwrap();
        assert!(open_entry(&dir.join("stale.json"), 0).is_err());
        drop(published);
        assert!(!path.exists(), "the entry goes with its VMM");
        // A directory others may write is neither published in nor read.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(publish(&dir, &memory).is_err());
        assert!(siblings(&dir).is_empty());
        let _ = fs::remove_dir_all(&dir);
    }
}
