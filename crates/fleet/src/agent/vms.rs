//! The VMs an agent keeps: a record per VM in its state directory (what
//! was asked, its control socket, its VMM's pid), the VMM processes it
//! starts, and what their control sockets say. A VMM is started in a
//! session of its own, writing to a log file: it outlives the agent, and a
//! restarted agent adopts it from its record.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferry_vmm::control::{ControlClient, Request as Control};
use serde_json::Value;

use crate::api::{VmInfo, VmSpec};
use crate::FleetError;

/// How long a new VMM may take to answer on its control socket.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// One VM this agent keeps.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Record {
    spec: VmSpec,
    socket: PathBuf,
    pid: u32,
    /// `started`, `arriving [by MODE]` (a destination waiting for it),
    /// `migrated [by MODE]`, `forwarding`.
    came_by: String,
    /// What of its memory this host holds, if less than all (a split VM's
    /// main host).
    #[serde(default)]
    budget: Option<u64>,
}

impl Record {
    /// The memory it takes here.
    fn held(&self) -> u64 {
        self.budget.unwrap_or(self.spec.mem_bytes)
    }
}

/// The VMs of one host.
pub struct Vms {
    dir: PathBuf,
    ferry: PathBuf,
    host_ip: IpAddr,
    records: Mutex<BTreeMap<String, Record>>,
    /// VMMs this agent started (reaped here); adopted ones are not its
    /// children.
    children: Mutex<Vec<Child>>,
    /// VMs being sent away now (listed as `sending`).
    sending: Mutex<std::collections::BTreeSet<String>>,
    /// New VMMs run with `--share-pages`.
    share_pages: bool,
    /// Its VMs are fenced through this registry (docs/safety.md), and
    /// their holder named after this host.
    fence: Option<Fencing>,
}

/// Where an agent's VMs are fenced, and the host name they hold them as.
#[derive(Clone, Debug)]
struct Fencing {
    registry: String,
    host: String,
}

/// A VMM whose status says the registry gives its VM to another process,
/// and that is no paused postcopy's source (which may still serve pages).
fn lost_its_claim(status: &Value) -> bool {
    status["owner"]["state"] == "handed" && status["postcopy_paused"].is_null()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Vms {
    /// The VMs recorded in `dir` whose VMMs still answer (adopted); records
    /// of VMMs that are gone are removed. New VMMs run `ferry` and listen
    /// for incoming VMs on `host_ip`.
    pub fn adopt(dir: &Path, ferry: PathBuf, host_ip: IpAddr) -> Result<Self, FleetError> {
        create_private_dir(dir)?;
        let mut records = BTreeMap::new();
        let entries =
            std::fs::read_dir(dir).map_err(FleetError::io(format!("{}", dir.display())))?;
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let Ok(rec) = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(|e| e.to_string()))
            else {
                tracing::warn!("agent: {} is not a VM record; left alone", path.display());
                continue;
            };
            match status(&rec.socket) {
                Ok(s) if lost_its_claim(&s) => {
                    // A copy the registry says another process holds (it
                    // stopped itself): not this host's VM any more.
                    tracing::warn!(
                        "agent: VM {} (pid {}) no longer holds its claim ({}); its VMM is stopped",
                        rec.spec.name,
                        rec.pid,
                        s["owner"]
                    );
                    let _ = ControlClient::connect(&rec.socket)
                        .and_then(|mut c| c.call(&Control::Quit));
                    let _ = std::fs::remove_file(&path);
                }
                Ok(s) => {
                    let mut rec = rec;
                    rec.pid = s["pid"].as_u64().unwrap_or(0) as u32;
                    tracing::info!("agent: adopted VM {} (pid {})", rec.spec.name, rec.pid);
                    records.insert(rec.spec.name.clone(), rec);
                }
                // Its VMM lives but does not answer: kept (listed
                // unresponsive) rather than lost to the fleet.
                Err(e) if process_alive(rec.pid) => {
                    tracing::warn!(
                        "agent: VM {} (pid {}) does not answer ({e}); kept",
                        rec.spec.name,
                        rec.pid
                    );
                    records.insert(rec.spec.name.clone(), rec);
                }
                Err(e) => {
                    tracing::info!("agent: VM {} is gone ({e}); its record goes", rec.spec.name);
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(Vms {
            dir: dir.into(),
            ferry,
            host_ip,
            records: Mutex::new(records),
            children: Mutex::new(Vec::new()),
            sending: Mutex::new(Default::default()),
            share_pages: false,
            fence: None,
        })
    }

    /// Whether the VMMs it starts from now on run with `--share-pages`.
    pub fn sharing(mut self, on: bool) -> Self {
        self.share_pages = on;
        self
    }

    /// Fences the VMs it starts from now on through `registry` (as
    /// `ferry run --registry` takes it), holding them as `host`: a fresh
    /// VM under its name, an arriving one from its source's claim.
    pub fn fenced(mut self, registry: String, host: &str) -> Self {
        self.fence = Some(Fencing {
            registry,
            host: host.into(),
        });
        self
    }

    /// Memory and vCPUs the VMs take (waiting destinations included).
    pub fn taken(&self) -> (u64, u32, u32) {
        let r = lock(&self.records);
        let mem = r.values().map(Record::held).sum();
        let vcpus = r.values().map(|v| v.spec.vcpus).sum();
        (mem, vcpus, r.len() as u32)
    }

    /// True if a VM of this name is kept here.
    pub fn has(&self, name: &str) -> bool {
        lock(&self.records).contains_key(name)
    }

    /// Starts `spec` with `extra` flags for `ferry run` (the VMM runs until
    /// stopped), holding `budget` of its memory here if given (a split VM's
    /// main host); fails if the name is taken. `fits` says whether there is
    /// room beside the memory and vCPUs taken already, under the same lock.
    pub fn start(
        &self,
        spec: &VmSpec,
        budget: Option<u64>,
        extra: &[String],
        came_by: &str,
        fits: impl FnOnce(u64, u32, u64, u32) -> Result<(), FleetError>,
    ) -> Result<VmInfo, FleetError> {
        spec.check()?;
        let socket = self.dir.join(format!("{}.sock", spec.name));
        {
            // The name is taken from here on: a second start of it fails.
            let mut r = lock(&self.records);
            if r.contains_key(&spec.name) {
                return Err(FleetError::Refused(format!(
                    "a VM named {} runs here already",
                    spec.name
                )));
            }
            let mem = r.values().map(Record::held).sum();
            let vcpus = r.values().map(|v| v.spec.vcpus).sum();
            fits(budget.unwrap_or(spec.mem_bytes), spec.vcpus, mem, vcpus)?;
            r.insert(
                spec.name.clone(),
                Record {
                    spec: spec.clone(),
                    socket: socket.clone(),
                    pid: 0,
                    came_by: came_by.into(),
                    budget,
                },
            );
        }
        match self.spawn(spec, &socket, extra) {
            Ok(pid) => {
                let rec = {
                    let mut r = lock(&self.records);
                    // Only this call removes a record still starting.
                    let Some(rec) = r.get_mut(&spec.name) else {
                        return Err(FleetError::Vm {
                            vm: spec.name.clone(),
                            reason: "its record went while its VMM started".into(),
                        });
                    };
                    rec.pid = pid;
                    rec.clone()
                };
                self.persist(&rec)?;
                self.info_of(&rec)
            }
            Err(e) => {
                lock(&self.records).remove(&spec.name);
                Err(e)
            }
        }
    }

    /// The incoming address for a new waiting destination on this host.
    pub fn incoming_addr(&self) -> Result<String, FleetError> {
        // A port the kernel says is free now; the VMM binds it at once.
        let l = std::net::TcpListener::bind((self.host_ip, 0))
            .map_err(FleetError::io("cannot find a free port"))?;
        let port = l
            .local_addr()
            .map_err(FleetError::io("a free port"))?
            .port();
        Ok(format!("tcp:{}:{port}", self.host_ip))
    }

    fn spawn(&self, spec: &VmSpec, socket: &Path, extra: &[String]) -> Result<u32, FleetError> {
        let log = self.dir.join(format!("{}.log", spec.name));
        let _ = std::fs::remove_file(socket);
        let mut args: Vec<String> = vec![
            "run".into(),
            "--mem".into(),
            spec.mem_bytes.to_string(),
            "--vcpus".into(),
            spec.vcpus.to_string(),
            "--workload".into(),
            spec.workload.clone(),
            "--control".into(),
            socket.display().to_string(),
            "--quiet".into(),
        ];
        // A VM arriving brings its address and service port with its state
        // (and its clients with them): a waiting VMM must not take them
        // beforehand, or the address would stand on two hosts at once.
        let arriving = extra.iter().any(|a| a == "--incoming");
        if let (Some(a), false) = (&spec.vm_address, arriving) {
            args.extend(["--vm-address".into(), a.clone()]);
        }
        if let (Some(s), false) = (&spec.serve, arriving) {
            args.extend(["--serve".into(), s.clone()]);
        }
        if self.share_pages {
            args.push("--share-pages".into());
        }
        let mut env = Vec::new();
        if let Some(f) = &self.fence {
            if arriving {
                args.push("--fenced".into());
            } else {
                args.extend(["--vm-name".into(), spec.name.clone()]);
            }
            args.extend(["--registry".into(), f.registry.clone()]);
            env.push(("FERRY_HOST", f.host.as_str()));
        }
        args.extend(extra.iter().cloned());
        let mut child = super::process::spawn_detached(&self.ferry, &args, &env, &log)?;
        let pid = child.id();
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Ok(Some(code)) = child.try_wait() {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                let why = tail
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                return Err(FleetError::Vm {
                    vm: spec.name.clone(),
                    reason: format!("its VMM ended at start ({code}): {why}"),
                });
            }
            if status(socket).is_ok() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(FleetError::Vm {
                    vm: spec.name.clone(),
                    reason: format!("its VMM did not answer within {READY_WITHIN:?}"),
                });
            }
            // A VMM answers within tens of ms: looked for often, as a
            // drain's move waits on it.
            std::thread::sleep(Duration::from_millis(10));
        }
        lock(&self.children).push(child);
        Ok(pid)
    }

    /// Reaps the VMMs this agent started that have ended.
    pub fn reap(&self) {
        lock(&self.children).retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
    }

    /// Every VM as its VMM says now; VMs whose VMM is gone are forgotten
    /// (not those still starting: their start call owns them), and one
    /// whose VMM lives but does not answer is listed "unresponsive".
    pub fn list(&self) -> Vec<VmInfo> {
        // A VMM of ours that ended is a zombie until reaped: reap first,
        // so that it does not look alive.
        self.reap();
        let recs: Vec<Record> = lock(&self.records).values().cloned().collect();
        let mut out = Vec::new();
        for rec in recs {
            if rec.pid == 0 {
                out.push(unanswered(&rec, "starting"));
                continue;
            }
            match self.info_of(&rec) {
                Ok(i) => out.push(i),
                // A VMM that is alive but does not answer (busy, stuck) is
                // still there: forgetting it would leave its VM out of
                // every drain and listing.
                Err(e) if process_alive(rec.pid) => {
                    tracing::warn!("agent: VM {} does not answer ({e})", rec.spec.name);
                    out.push(unanswered(&rec, "unresponsive"));
                }
                Err(e) => {
                    tracing::info!("agent: VM {} is gone ({e})", rec.spec.name);
                    self.forget(&rec.spec.name);
                }
            }
        }
        out
    }

    fn info_of(&self, rec: &Record) -> Result<VmInfo, FleetError> {
        let s = status(&rec.socket)?;
        let waiting = waits(&s);
        let came_by = if let (Some(how), false) = (rec.came_by.strip_prefix("arriving"), waiting) {
            // It came ("arriving by postcopy" becomes "migrated by
            // postcopy"): say so from now on.
            let arrived = format!("migrated{how}");
            let mut r = lock(&self.records);
            if let Some(x) = r.get_mut(&rec.spec.name) {
                x.came_by = arrived.clone();
                let x = x.clone();
                drop(r);
                let _ = self.persist(&x);
            }
            arrived
        } else {
            rec.came_by.clone()
        };
        let sending = lock(&self.sending).contains(&rec.spec.name);
        Ok(VmInfo {
            spec: rec.spec.clone(),
            state: if waiting {
                "waiting".into()
            } else if rec.came_by == "forwarding" {
                "forwarding".into()
            } else if sending {
                "sending".into()
            } else {
                s["state"].as_str().unwrap_or("unknown").to_string()
            },
            pid: s["pid"].as_u64().unwrap_or(0) as u32,
            socket: rec.socket.clone(),
            uptime_s: s["uptime_s"].as_f64().unwrap_or(0.0),
            came_by,
            progress: if waiting { None } else { progress(&rec.socket) },
            dirty_bytes_per_s: None,
        })
    }

    /// The control socket of VM `name`.
    pub fn socket(&self, name: &str) -> Result<PathBuf, FleetError> {
        lock(&self.records)
            .get(name)
            .map(|r| r.socket.clone())
            .ok_or_else(|| FleetError::Refused(format!("no VM named {name} runs here")))
    }

    /// Marks VM `name` as being sent away until the guard drops; fails if
    /// it is being sent already.
    pub fn sending(&self, name: &str) -> Result<Sending<'_>, FleetError> {
        if !lock(&self.sending).insert(name.to_string()) {
            return Err(FleetError::Refused(format!(
                "VM {name} is being moved already"
            )));
        }
        Ok(Sending {
            vms: self,
            name: name.into(),
        })
    }

    /// VM `name`'s VMM process (0 if unknown).
    pub fn pid(&self, name: &str) -> u32 {
        lock(&self.records).get(name).map_or(0, |r| r.pid)
    }

    /// Stops VM `name` (its VMM quits) and forgets it.
    pub fn stop(&self, name: &str) -> Result<(), FleetError> {
        let socket = self.socket(name)?;
        let pid = self.pid(name);
        if pid == 0 {
            return Err(FleetError::Refused(format!(
                "VM {name} is still starting here; stop it once it runs"
            )));
        }
        match ControlClient::connect(&socket).and_then(|mut c| c.call(&Control::Quit)) {
            Ok(_) => self.wait_gone(pid, Duration::from_secs(10)),
            Err(e) => {
                // Not answering: end the process itself.
                tracing::warn!("agent: VM {name} does not answer ({e}); ending its VMM");
                if pid > 0 {
                    // SAFETY: kill has no memory effects; pid is this VM's VMM.
                    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
                    self.wait_gone(pid, Duration::from_secs(5));
                }
            }
        }
        self.forget(name);
        Ok(())
    }

    /// Keeps VM `name`'s VMM as a forwarder: the VM runs elsewhere, but
    /// its clients could not move with it, and this VMM forwards them there
    /// for as long as it runs (stopping it with the VM's name ends that).
    pub fn forwarding(&self, name: &str) {
        let rec = {
            let mut r = lock(&self.records);
            let Some(rec) = r.get_mut(name) else { return };
            rec.came_by = "forwarding".into();
            rec.clone()
        };
        let _ = self.persist(&rec);
    }

    /// Forgets VM `name` (it moved away or is gone).
    pub fn forget(&self, name: &str) {
        lock(&self.records).remove(name);
        let _ = std::fs::remove_file(self.dir.join(format!("{name}.json")));
        self.reap();
    }

    /// Waits until process `pid` is gone (reaped, if it is a child of this
    /// agent's), at most `max`.
    pub fn wait_gone(&self, pid: u32, max: Duration) {
        let deadline = Instant::now() + max;
        loop {
            self.reap();
            if !process_alive(pid) || Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Notes VM `name`'s VMM process after a handover.
    pub fn repid(&self, name: &str) -> Result<(), FleetError> {
        let socket = self.socket(name)?;
        let pid = status(&socket)?["pid"].as_u64().unwrap_or(0) as u32;
        let rec = {
            let mut r = lock(&self.records);
            let Some(rec) = r.get_mut(name) else {
                return Ok(());
            };
            rec.pid = pid;
            rec.clone()
        };
        self.persist(&rec)
    }

    fn persist(&self, rec: &Record) -> Result<(), FleetError> {
        let path = self.dir.join(format!("{}.json", rec.spec.name));
        let tmp = path.with_extension("json.new");
        let bytes = serde_json::to_vec_pretty(rec).map_err(|e| FleetError::Io {
            what: format!("{}", path.display()),
            error: e.into(),
        })?;
        std::fs::write(&tmp, bytes)
            .and_then(|_| std::fs::rename(&tmp, &path))
            .map_err(FleetError::io(format!("{}", path.display())))
    }
}

/// A VM being sent away ([`Vms::sending`]).
pub struct Sending<'a> {
    vms: &'a Vms,
    name: String,
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        lock(&self.vms.sending).remove(&self.name);
    }
}

/// What VM's control socket says of it.
pub fn status(socket: &Path) -> Result<Value, FleetError> {
    ControlClient::connect(socket)
        .and_then(|mut c| c.call(&Control::Status))
        .map_err(|e| FleetError::Vm {
            vm: socket.display().to_string(),
            reason: e.to_string(),
        })
}

/// How fast the VM at `socket` dirties memory (bytes/s), over half a
/// second of its dirty log, if its VMM answers.
pub fn dirty_rate(socket: &Path) -> Option<f64> {
    let r = ControlClient::connect(socket)
        .and_then(|mut c| c.call(&Control::DirtyRate { ms: Some(500) }))
        .ok()?;
    r["dirty_bytes_per_s"].as_f64()
}

/// The VM's workloads' progress counters added up, if its VMM answers.
fn progress(socket: &Path) -> Option<u64> {
    let m = ControlClient::connect(socket)
        .and_then(|mut c| c.call(&Control::Metrics))
        .ok()?;
    m["metrics"]["workloads"]
        .as_array()
        .map(|ws| ws.iter().filter_map(|w| w["progress"].as_u64()).sum())
}

/// Makes `dir` (0700: it holds control sockets) if missing.
fn create_private_dir(dir: &Path) -> Result<(), FleetError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(FleetError::io(format!("cannot make {}", dir.display())))
}

/// Whether a VMM's `status` says it waits for its VM: until its vCPUs
/// start. A postcopy destination runs the VM while its incoming migration
/// goes on (the pages still come), and a drain that took it for waiting
/// would stop it. A VMM that says "waiting" itself waits; one from before
/// that state existed does while incoming with an uptime of 0 (no vCPU
/// started).
fn waits(status: &Value) -> bool {
    status["state"] == "waiting"
        || (!status["incoming"].is_null() && status["uptime_s"].as_f64().unwrap_or(0.0) == 0.0)
}

/// What the record alone says of a VM whose VMM gave no status (still
/// starting, or not answering), in `state`.
fn unanswered(rec: &Record, state: &str) -> VmInfo {
    VmInfo {
        spec: rec.spec.clone(),
        state: state.into(),
        pid: rec.pid,
        socket: rec.socket.clone(),
        uptime_s: 0.0,
        came_by: rec.came_by.clone(),
        progress: None,
        dirty_bytes_per_s: None,
    }
}

/// True if process `pid` exists (a zombie counts until it is reaped).
pub(super) fn process_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks that the
    // process exists.
    pid > 0 && unsafe { libc::kill(pid as i32, 0) } == 0
}

#[cfg(test)]
mod tests;
