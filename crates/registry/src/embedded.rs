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
        let mut s = String::new();
        for b in name.bytes() {
            if b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-' {
                s.push(b as char);
            } else {
                s.push_str(&format!("%{b:02X}"));
            }
        }
        self.dir.join(format!("{s}.json"))
    }

    fn write(&self, rec: &Record) -> Result<(), RegistryError> {
        let path = self.file(&rec.entry.name);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let body = serde_json::to_vec(rec).map_err(|e| self.err(e.into()))?;
        std::fs::write(&tmp, body).map_err(|e| self.err(e))?;
        std::fs::rename(&tmp, &path).map_err(|e| self.err(e))
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
}
