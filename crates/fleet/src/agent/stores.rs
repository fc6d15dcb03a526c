//! The memory servers an agent runs for split VMs (one per VM on a host):
//! `ferry memserver` processes that hold the pages the VM's main host does
//! not, recorded in the state directory (`stores/VM.json`) and adopted by a
//! restarted agent while their process lives. A store ends with its VM.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::api::StoreInfo;
use crate::FleetError;

/// How long a new memory server may take to listen.
const READY_WITHIN: Duration = Duration::from_secs(20);

/// The memory servers of one host.
pub struct Stores {
    dir: PathBuf,
    ferry: PathBuf,
    host_ip: IpAddr,
    stores: Mutex<BTreeMap<String, StoreInfo>>,
    children: Mutex<Vec<std::process::Child>>,
    /// Pids of every store this agent started (its children's, reaped or
    /// not).
    spawned: Mutex<Vec<u32>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only asks whether the process exists.
    pid > 0 && unsafe { libc::kill(pid as i32, 0) } == 0
}

impl Stores {
    /// The stores recorded under `dir/stores` whose process lives.
    pub fn adopt(dir: &Path, ferry: PathBuf, host_ip: IpAddr) -> Result<Self, FleetError> {
        let dir = dir.join("stores");
        std::fs::create_dir_all(&dir).map_err(FleetError::io(format!("{}", dir.display())))?;
        let mut stores = BTreeMap::new();
        for e in std::fs::read_dir(&dir)
            .map_err(FleetError::io(format!("{}", dir.display())))?
            .flatten()
        {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            match std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<StoreInfo>(&b).ok())
            {
                Some(s) if alive(s.pid) => {
                    stores.insert(s.vm.clone(), s);
                }
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(Stores {
            dir,
            ferry,
            host_ip,
            stores: Mutex::new(stores),
            children: Mutex::new(Vec::new()),
            spawned: Mutex::new(Vec::new()),
        })
    }

    /// Memory the stores take.
    pub fn taken(&self) -> u64 {
        lock(&self.stores).values().map(|s| s.bytes).sum()
    }

    /// The stores, as they are now (ended ones forgotten).
    pub fn list(&self) -> Vec<StoreInfo> {
        lock(&self.children).retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
        let mut s = lock(&self.stores);
        let gone: Vec<String> = s
            .values()
            .filter(|x| !alive(x.pid))
            .map(|x| x.vm.clone())
            .collect();
        for vm in gone {
            s.remove(&vm);
            let _ = std::fs::remove_file(self.dir.join(format!("{vm}.json")));
        }
        s.values().cloned().collect()
    }

    /// Starts a memory server of `bytes` for VM `vm`, or with `standby` a
    /// postcopy standby for its move (fails if one runs for it here);
    /// `fits` says whether there is room beside what the stores take
    /// already (given), under the lock.
    pub fn start(
        &self,
        vm: &str,
        bytes: u64,
        standby: bool,
        fits: impl FnOnce(u64) -> Result<(), FleetError>,
    ) -> Result<StoreInfo, FleetError> {
        crate::api::check_name(vm)?;
        let mut s = lock(&self.stores);
        if s.contains_key(vm) {
            return Err(FleetError::Refused(format!(
                "a memory server for VM {vm} runs here already"
            )));
        }
        fits(s.values().map(|x| x.bytes).sum())?;
        // A port the kernel says is free now; the server binds it at once.
        let port = std::net::TcpListener::bind((self.host_ip, 0))
            .and_then(|l| l.local_addr())
            .map_err(FleetError::io("cannot find a free port"))?
            .port();
        let at = SocketAddr::new(self.host_ip, port);
        let log = self.dir.join(format!("{vm}.log"));
        let args: Vec<String> = if standby {
            vec![
                "standby".into(),
                "--listen".into(),
                format!("tcp:{at}"),
                "--capacity".into(),
                bytes.to_string(),
                "--once".into(),
            ]
        } else {
            vec![
                "memserver".into(),
                "--listen".into(),
                format!("tcp:{at}"),
                "--capacity".into(),
                bytes.to_string(),
                "--no-registry".into(),
                "--name".into(),
                format!("store-{vm}"),
            ]
        };
        let what = if standby { "standby" } else { "memory server" };
        let mut child = super::process::spawn_detached(&self.ferry, &args, &[], &log)?;
        let deadline = Instant::now() + READY_WITHIN;
        while TcpStream::connect_timeout(&at, Duration::from_millis(200)).is_err() {
            if let Ok(Some(code)) = child.try_wait() {
                return Err(FleetError::Refused(format!(
                    "the {what} for VM {vm} ended at start ({code}): {}",
                    super::process::last_words(&log)
                )));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(FleetError::Refused(format!(
                    "the {what} for VM {vm} did not listen within {READY_WITHIN:?}"
                )));
            }
            // It listens within about 10 ms: looked for often, as a
            // drain's move waits on it.
            std::thread::sleep(Duration::from_millis(10));
        }
        let info = StoreInfo {
            vm: vm.into(),
            addr: format!("tcp:{at}"),
            bytes,
            pid: child.id(),
            standby,
        };
        lock(&self.spawned).push(child.id());
        lock(&self.children).push(child);
        let path = self.dir.join(format!("{vm}.json"));
        std::fs::write(&path, serde_json::to_vec_pretty(&info).unwrap_or_default())
            .map_err(FleetError::io(format!("{}", path.display())))?;
        s.insert(vm.into(), info.clone());
        Ok(info)
    }

    /// Ends VM `vm`'s memory server here; false if there is none.
    pub fn stop(&self, vm: &str) -> bool {
        let Some(info) = lock(&self.stores).remove(vm) else {
            return false;
        };
        // A standby (`--once`) often ends with its move before it is
        // stopped: a child of this agent is signalled only while it runs
        // (once reaped, its pid may be another process's). A store adopted
        // after a restart is no child of ours: alive() is all there is.
        let running = {
            let mut children = lock(&self.children);
            match children.iter_mut().find(|c| c.id() == info.pid) {
                Some(c) => matches!(c.try_wait(), Ok(None)),
                None => !lock(&self.spawned).contains(&info.pid) && alive(info.pid),
            }
        };
        if running {
            // SAFETY: kill sends a signal to the store's own process, which
            // has not been reaped (our child) or still exists (adopted).
            unsafe { libc::kill(info.pid as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while alive(info.pid) && Instant::now() < deadline {
            lock(&self.children).retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_file(self.dir.join(format!("{vm}.json")));
        true
    }
}
