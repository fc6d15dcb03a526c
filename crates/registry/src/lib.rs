//! Which hosts offer memory to VMs, and where a split VM should go.
//!
//! Every host that can take part in a split migration advertises itself
//! here: a waiting destination VMM (a candidate main host, with the memory
//! it may give the VM) or a memory server (a sub-host, with its free
//! capacity); and every host of a fleet through its agent (`ferry agent`:
//! the memory and vCPUs it offers VMs, and its link). An advertisement lives only as long as its owner keeps it
//! alive, so a dead host disappears by itself.
//!
//! - [`embedded`]: one machine (the default): a directory of JSON files,
//!   each with an expiry the owner keeps pushing forward.
//! - [`etcd`]: a real etcd cluster through its v3 JSON gateway, each entry
//!   under a lease that a keep-alive thread renews; over mutual TLS with
//!   the host's fleet certificate (`etcds://`) or plaintext (`etcd://`).
//! - [`placement`]: from the hosts to a main host and sub-hosts.
//! - [`ownership`]: which one process may run each VM (an epoch changed
//!   only by compare-and-swap), the fence against two running copies.

pub mod embedded;
pub mod etcd;
mod http;
mod link;
pub mod ownership;
pub mod placement;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub use placement::{place, Placement, PlacementError, SubShare};

/// What a host offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostKind {
    /// A destination VMM waiting for a VM: a candidate main host.
    Vmm,
    /// A memory server: a candidate sub-host.
    Memserver,
    /// A host's agent (`ferry agent`): where fleet operations start, stop
    /// and move its VMs.
    Agent,
}

impl std::fmt::Display for HostKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostKind::Vmm => "vmm",
            HostKind::Memserver => "memserver",
            HostKind::Agent => "agent",
        })
    }
}

/// One advertisement.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HostEntry {
    /// Unique name (host name plus what runs there).
    pub name: String,
    /// What it offers.
    pub kind: HostKind,
    /// Where to reach it (`tcp:HOST:PORT` for a VMM, `HOST:PORT` for a
    /// memory server).
    pub addr: String,
    /// Bytes of guest memory it may hold in all.
    pub capacity: u64,
    /// Bytes of that still free.
    pub free: u64,
    /// What an agent offers besides memory (agents only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentOffer>,
}

/// What a host's agent offers VMs, besides memory.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentOffer {
    /// vCPUs it may run in all.
    pub vcpus: u32,
    /// vCPUs still free.
    pub free_vcpus: u32,
    /// Its link's speed (bits/s; 0: unknown).
    pub link_bps: u64,
    /// VMs it runs.
    pub vms: u32,
}

/// Why the registry could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The embedded registry's directory.
    #[error("registry directory {path}: {source}")]
    Dir {
        /// The directory.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// etcd did not answer, or answered with an error.
    #[error("etcd at {endpoint}: {reason}")]
    Etcd {
        /// Where.
        endpoint: String,
        /// What went wrong.
        reason: String,
    },
    /// A registry address that is not one.
    #[error(
        "bad registry address {0:?}: give etcds://HOST:PORT (TLS with this host's certificate) \
         or etcd://HOST:PORT (plaintext), or dir:PATH for the embedded one"
    )]
    BadAddress(String),
    /// An `etcds://` address, and no credentials to speak TLS with.
    #[error(
        "registry {0} speaks TLS and needs this host's credentials (ca.pem, cert.pem, key.pem), \
         and none were given"
    )]
    NoCredentials(String),
    /// A record key that is not one ([`check_key`]), or a value too large.
    #[error("bad registry record key {0:?} (1 to 200 of A-Z a-z 0-9 . _ / -, no empty, . or .. segment), or its value is over 1 MiB")]
    BadKey(String),
    /// An entry that does not decode (another program's key, or damage).
    #[error("registry entry {key} is not a ferry host: {reason}")]
    BadEntry {
        /// Its key or file.
        key: String,
        /// Why.
        reason: String,
    },
}

/// A registry of hosts.
pub trait Registry: Send + Sync {
    /// Publishes `entry` so that it expires `ttl` after the last
    /// [`Registry::advertise`] or [`Registry::refresh`] (a later call with
    /// the same name replaces it).
    fn advertise(&self, entry: &HostEntry, ttl: Duration) -> Result<(), RegistryError>;
    /// Keeps `name`'s entry alive another `ttl`.
    fn refresh(&self, name: &str, ttl: Duration) -> Result<(), RegistryError>;
    /// Removes `name`'s entry now.
    fn withdraw(&self, name: &str) -> Result<(), RegistryError>;
    /// Every live entry.
    fn hosts(&self) -> Result<Vec<HostEntry>, RegistryError>;
    /// Where this registry is, for messages.
    fn describe(&self) -> String;
    /// Stores `value` under `key` among the fleet's records: state that must
    /// outlive the process that wrote it (a drain's), so it has no lease
    /// and stays until deleted. Keys are [`check_key`]'s.
    fn put_record(&self, key: &str, value: &[u8]) -> Result<(), RegistryError>;
    /// The record under `key`, if any.
    fn get_record(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError>;
    /// Removes the record under `key` (none there is not an error).
    fn delete_record(&self, key: &str) -> Result<(), RegistryError>;
    /// Every record whose key starts with `prefix`, by key.
    fn records(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RegistryError>;
    /// The record under `key` with its version: a number that changes with
    /// every write of it and is never 0.
    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, u64)>, RegistryError>;
    /// Compare-and-swap: writes `value` under `key` only if the record's
    /// version is still `version` (0: only if there is no record). False
    /// if it changed meanwhile: nothing was written.
    fn put_if_version(&self, key: &str, value: &[u8], version: u64) -> Result<bool, RegistryError>;
}

/// The largest record a registry stores or reads back.
pub const MAX_RECORD: usize = 1 << 20;

/// Refuses a record key that is not 1 to 200 of `[A-Za-z0-9._/-]` in
/// `/`-separated segments, none empty, `.` or `..`.
pub fn check_key(key: &str) -> Result<(), RegistryError> {
    let ok = !key.is_empty()
        && key.len() <= 200
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b))
        && key
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != "..");
    if ok {
        Ok(())
    } else {
        Err(RegistryError::BadKey(key.into()))
    }
}

/// Opens a registry: `etcds://HOST:PORT` (mutual TLS with `tls`, which it
/// needs), `etcd://HOST:PORT` (plaintext), `dir:PATH`, or `None` for the
/// embedded one in its default directory. Only `etcds://` uses `tls`.
pub fn open(
    addr: Option<&str>,
    tls: Option<Arc<ferry_tls::Credentials>>,
) -> Result<Arc<dyn Registry>, RegistryError> {
    match addr {
        None => Ok(Arc::new(embedded::Embedded::open(embedded::default_dir())?)),
        Some(a) if a.starts_with("etcd://") || a.starts_with("etcds://") => {
            Ok(Arc::new(etcd::Etcd::new(a, tls)?))
        }
        Some(a) if a.starts_with("dir:") => Ok(Arc::new(embedded::Embedded::open(
            std::path::PathBuf::from(&a[4..]),
        )?)),
        Some(a) => Err(RegistryError::BadAddress(a.into())),
    }
}

/// An advertisement kept alive by a thread until dropped (then withdrawn).
pub struct Advertisement {
    registry: Arc<dyn Registry>,
    name: String,
    /// What is advertised; held across every registry call, so an update
    /// and a renewal never interleave (the embedded registry's renewal
    /// rewrites the file it read).
    entry: Arc<std::sync::Mutex<HostEntry>>,
    ttl: Duration,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// How long an advertisement outlives its owner's last sign of life.
pub const DEFAULT_TTL: Duration = Duration::from_secs(5);

impl Advertisement {
    /// Publishes `entry` and renews it every `ttl / 3`.
    pub fn start(
        registry: Arc<dyn Registry>,
        entry: HostEntry,
        ttl: Duration,
    ) -> Result<Self, RegistryError> {
        registry.advertise(&entry, ttl)?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(std::sync::Mutex::new(entry.clone()));
        let thread = {
            let (registry, stop, shared) = (registry.clone(), stop.clone(), shared.clone());
            std::thread::Builder::new()
                .name("registry".into())
                .spawn(move || keep_alive(&*registry, &shared, &stop, ttl))
                .ok()
        };
        Ok(Advertisement {
            registry,
            name: entry.name,
            entry: shared,
            ttl,
            stop,
            thread,
        })
    }

    /// Changes what is advertised (free memory went down or up).
    pub fn update(&self, free: u64) -> Result<(), RegistryError> {
        self.update_with(|e| e.free = free)
    }

    /// Changes what is advertised as `change` says, and publishes it.
    pub fn update_with(&self, change: impl FnOnce(&mut HostEntry)) -> Result<(), RegistryError> {
        let mut e = self.entry.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut e);
        self.registry.advertise(&e, self.ttl)
    }
}

/// Renews an advertisement until told to stop; a registry that stops
/// answering is retried (the entry expires meanwhile, and comes back).
fn keep_alive(
    registry: &dyn Registry,
    entry: &std::sync::Mutex<HostEntry>,
    stop: &AtomicBool,
    ttl: Duration,
) {
    let step = Duration::from_millis(50);
    let every = ttl / 3;
    let mut waited = Duration::ZERO;
    let mut lost = false;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(step);
        waited += step;
        if waited < every {
            continue;
        }
        waited = Duration::ZERO;
        let e = entry.lock().unwrap_or_else(|p| p.into_inner());
        // After a failure the lease may be gone: publish again.
        let r = if lost {
            registry.advertise(&e, ttl)
        } else {
            registry.refresh(&e.name, ttl)
        };
        match r {
            Ok(()) => {
                if lost {
                    tracing::info!("registry {} reachable again", registry.describe());
                }
                lost = false;
            }
            Err(err) => {
                if !lost {
                    tracing::warn!("cannot renew {} in the registry: {err}", e.name);
                }
                lost = true;
            }
        }
    }
}

impl Drop for Advertisement {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Err(e) = self.registry.withdraw(&self.name) {
            tracing::warn!("cannot withdraw {} from the registry: {e}", self.name);
        }
    }
}
