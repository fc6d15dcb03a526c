//! The registry for one machine: a directory with one JSON file per host,
//! each carrying the time it expires. Processes on the machine (network
//! namespaces included: they share the file system) advertise by writing
//! their file atomically (a temporary file renamed over it) and keep it
//! alive by pushing the expiry forward; readers skip expired files.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{HostEntry, Registry, RegistryError};

/// The embedded registry's directory: `$FERRY_REGISTRY_DIR`, else
/// `/run/ferry/registry` for root, else under `$XDG_RUNTIME_DIR` or /tmp.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRY_REGISTRY_DIR") {
        return PathBuf::from(d);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return PathBuf::from("/run/ferry/registry");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => Path::new(&d).join("ferry/registry"),
        None => PathBuf::from(format!("/tmp/ferry-registry-{uid}")),
    }
}

/// A file's content (public for the fuzz targets only: fuzz/,
/// docs/fuzzing.md).
#[doc(hidden)]
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Record {
    /// The advertisement.
    pub entry: HostEntry,
    /// Seconds since the epoch after which the entry is dead.
    pub expires: f64,
}

/// The directory registry.
pub struct Embedded {
    dir: PathBuf,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Embedded {
    /// Opens (creating) the directory.
    pub fn open(dir: PathBuf) -> Result<Self, RegistryError> {
        std::fs::create_dir_all(&dir).map_err(|source| RegistryError::Dir {
            path: dir.display().to_string(),
            source,
        })?;
        Ok(Embedded { dir })
    }

    fn err(&self, source: std::io::Error) -> RegistryError {
        RegistryError::Dir {
            path: self.dir.display().to_string(),
            source,
        }
    }

    /// A host's file: its name with anything but [A-Za-z0-9._-] spelled
    /// as %XX, so no name can reach outside the directory.
    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{}.json", escape(name)))
    }

    /// The records' directory (the hosts' listing skips it: no `.json`).
    fn records_dir(&self) -> PathBuf {
        self.dir.join("records")
    }

    /// Writes `body` to `path` whole, then renames it into place (the
    /// temporary file's name starts with '.', which no entry's or record's
    /// does, and does not end in `.json`: listings never see it).
    fn write_file(&self, path: &std::path::Path, body: &[u8]) -> Result<(), RegistryError> {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("x");
        let tmp = path.with_file_name(format!(".{name}.tmp{}", std::process::id()));
        std::fs::write(&tmp, body).map_err(|e| self.err(e))?;
        std::fs::rename(&tmp, path).map_err(|e| self.err(e))
    }

    fn write(&self, rec: &Record) -> Result<(), RegistryError> {
        let body = serde_json::to_vec(rec).map_err(|e| self.err(e.into()))?;
        self.write_file(&self.file(&rec.entry.name), &body)
    }
}

impl Registry for Embedded {
    fn advertise(&self, entry: &HostEntry, ttl: Duration) -> Result<(), RegistryError> {
        self.write(&Record {
            entry: entry.clone(),
            expires: now() + ttl.as_secs_f64(),
        })
    }

    fn refresh(&self, name: &str, ttl: Duration) -> Result<(), RegistryError> {
        let path = self.file(name);
        let text = std::fs::read(&path).map_err(|e| self.err(e))?;
        let mut rec: Record =
            serde_json::from_slice(&text).map_err(|e| RegistryError::BadEntry {
                key: path.display().to_string(),
                reason: e.to_string(),
            })?;
        rec.expires = now() + ttl.as_secs_f64();
        self.write(&rec)
    }

    fn withdraw(&self, name: &str) -> Result<(), RegistryError> {
        match std::fs::remove_file(self.file(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(self.err(e)),
            _ => Ok(()),
        }
    }

    fn hosts(&self) -> Result<Vec<HostEntry>, RegistryError> {
        let t = now();
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(|e| self.err(e))? {
            let path = e.map_err(|e| self.err(e))?.path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            // A file removed or half-replaced meanwhile is simply not there.
            let Ok(text) = std::fs::read(&path) else {
                continue;
            };
            match serde_json::from_slice::<Record>(&text) {
                Ok(r) if r.expires > t => out.push(r.entry),
                Ok(_) => {}
                Err(e) => tracing::warn!("skipping {}: {e}", path.display()),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn describe(&self) -> String {
        format!("dir:{}", self.dir.display())
    }

    fn put_record(&self, key: &str, value: &[u8]) -> Result<(), RegistryError> {
        crate::check_key(key)?;
        if value.len() > crate::MAX_RECORD {
            return Err(RegistryError::BadKey(key.into()));
        }
        std::fs::create_dir_all(self.records_dir()).map_err(|e| self.err(e))?;
        self.write_file(&self.records_dir().join(escape(key)), value)
    }

    fn get_record(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        crate::check_key(key)?;
        match std::fs::read(self.records_dir().join(escape(key))) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.err(e)),
        }
    }

    fn delete_record(&self, key: &str) -> Result<(), RegistryError> {
        crate::check_key(key)?;
        match std::fs::remove_file(self.records_dir().join(escape(key))) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(self.err(e)),
            _ => Ok(()),
        }
    }

    fn records(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RegistryError> {
        let dir = match std::fs::read_dir(self.records_dir()) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(self.err(e)),
        };
        let mut out = Vec::new();
        for e in dir {
            let path = e.map_err(|e| self.err(e))?.path();
            let Some(key) = path
                .file_name()
                .and_then(|n| n.to_str())
                .filter(|n| !n.starts_with('.'))
                .and_then(unescape)
            else {
                continue;
            };
            if !key.starts_with(prefix) {
                continue;
            }
            // A record removed meanwhile is simply not there.
            if let Ok(v) = std::fs::read(&path) {
                out.push((key, v));
            }
        }
        out.sort();
        Ok(out)
    }

    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, u64)>, RegistryError> {
        Ok(self.get_record(key)?.map(|v| {
            let version = version_of(&v);
            (v, version)
        }))
    }

    fn put_if_version(&self, key: &str, value: &[u8], version: u64) -> Result<bool, RegistryError> {
        crate::check_key(key)?;
        if value.len() > crate::MAX_RECORD {
            return Err(RegistryError::BadKey(key.into()));
        }
        std::fs::create_dir_all(self.records_dir()).map_err(|e| self.err(e))?;
        // Every compare-and-swap on this machine takes the one lock; a plain
        // put does not need it (its rename is atomic).
        let _lock = self.cas_lock()?;
        let now = self.get_versioned(key)?.map_or(0, |(_, v)| v);
        if now != version {
            return Ok(false);
        }
        self.write_file(&self.records_dir().join(escape(key)), value)?;
        Ok(true)
    }
}

/// A record's version in the embedded registry: a 64-bit hash of its bytes
/// (FNV-1a), never 0. Two different values with the same hash would make a
/// swap succeed that should not; ownership records carry a random holder
/// id and a time, so that takes a 2^-64 chance.
fn version_of(value: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in value {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

/// An exclusive `flock` on the records' lock file, released when dropped.
struct CasLock(std::fs::File);

impl Drop for CasLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: the fd is the open file's own; unlocking cannot fail in a
        // way that matters (closing the file releases the lock anyway).
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Embedded {
    fn cas_lock(&self) -> Result<CasLock, RegistryError> {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.records_dir().join(".cas.lock"))
            .map_err(|e| self.err(e))?;
        // SAFETY: flock on an fd this function owns; it blocks until no other
        // process holds the lock, and has no memory effects.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(self.err(std::io::Error::last_os_error()));
        }
        Ok(CasLock(f))
    }
}

/// `name` with anything but [A-Za-z0-9._-] (and a leading '.') spelled as
/// %XX: a file name of its own that cannot reach outside its directory.
fn escape(name: &str) -> String {
    let mut s = String::new();
    for (i, b) in name.bytes().enumerate() {
        if b.is_ascii_alphanumeric() || (b == b'.' && i > 0) || b == b'_' || b == b'-' {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// The name [`escape`] made `file` from (None for a file it did not make).
fn unescape(file: &str) -> Option<String> {
    let b = file.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostKind;

    fn entry(name: &str, free: u64) -> HostEntry {
        HostEntry {
            name: name.into(),
            kind: HostKind::Memserver,
            addr: "10.0.0.1:7000".into(),
            capacity: 1 << 30,
            free,
            agent: None,
        }
    }

    #[test]
    fn entries_live_until_they_expire_or_are_withdrawn() {
        let dir = std::env::temp_dir().join(format!("ferry-reg-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let r = Embedded::open(dir.clone()).unwrap();
        r.advertise(&entry("a/../b", 5), Duration::from_secs(30))
            .unwrap();
        r.advertise(&entry("c", 7), Duration::from_millis(150))
            .unwrap();
        // The odd name stays inside the directory.
        assert!(dir.join("a%2F..%2Fb.json").exists());
        let names: Vec<String> = r.hosts().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["a/../b", "c"]);
        r.refresh("c", Duration::from_millis(150)).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let names: Vec<String> = r.hosts().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["a/../b"], "c expired");
        // Advertising again replaces.
        r.advertise(&entry("a/../b", 9), Duration::from_secs(30))
            .unwrap();
        assert_eq!(r.hosts().unwrap()[0].free, 9);
        r.withdraw("a/../b").unwrap();
        r.withdraw("never-there").unwrap();
        assert!(r.hosts().unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn records_stay_until_deleted_and_keys_cannot_leave_the_directory() {
        let dir = std::env::temp_dir().join(format!("ferry-reg-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let r = Embedded::open(dir.clone()).unwrap();
        r.put_record("drains/h1", b"one").unwrap();
        r.put_record("drains/h2", b"two").unwrap();
        r.put_record("other", b"x").unwrap();
        assert_eq!(
            r.get_record("drains/h1").unwrap().as_deref(),
            Some(&b"one"[..])
        );
        assert_eq!(r.get_record("drains/h9").unwrap(), None);
        let drains = r.records("drains/").unwrap();
        assert_eq!(
            drains,
            vec![
                ("drains/h1".to_string(), b"one".to_vec()),
                ("drains/h2".into(), b"two".to_vec())
            ]
        );
        r.put_record("drains/h1", b"again").unwrap();
        assert_eq!(
            r.get_record("drains/h1").unwrap().as_deref(),
            Some(&b"again"[..])
        );
        r.delete_record("drains/h1").unwrap();
        r.delete_record("drains/h1").unwrap();
        assert_eq!(r.records("drains/").unwrap().len(), 1);
        // Records are not hosts, and hosts are not records.
        assert!(r.hosts().unwrap().is_empty());
        for bad in ["", "../x", "a b", "x\0", "a//b", "a/./b", "/a"] {
            assert!(r.put_record(bad, b"v").is_err(), "{bad:?}");
        }
        r.put_record(".hidden/../../x", b"v").unwrap_err();
        // Compare-and-swap: only against the version read.
        assert!(r.put_if_version("cas/a", b"1", 0).unwrap());
        assert!(!r.put_if_version("cas/a", b"x", 0).unwrap(), "it exists");
        let (v, ver) = r.get_versioned("cas/a").unwrap().unwrap();
        assert_eq!(v, b"1");
        assert_ne!(ver, 0);
        assert!(r.put_if_version("cas/a", b"2", ver).unwrap());
        assert!(!r.put_if_version("cas/a", b"3", ver).unwrap(), "stale");
        assert_eq!(r.get_record("cas/a").unwrap().as_deref(), Some(&b"2"[..]));
        assert!(r.put_if_version("../x", b"v", 0).is_err());
        assert!(r
            .put_record("big", &vec![0u8; crate::MAX_RECORD + 1])
            .is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
