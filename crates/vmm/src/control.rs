//! The control socket: one unix socket per VM speaking JSON lines, like QMP.
//!
//! ```text
//! client                                   VMM
//!   {"cmd":"status"}\n          ──────▶
//!                               ◀──────   {"ok":true,"state":"running",...}\n
//!   {"cmd":"pause"}\n           ──────▶
//!                               ◀──────   {"ok":true}\n
//!   {"cmd":"bogus"}\n           ──────▶
//!                               ◀──────   {"ok":false,"error":"..."}\n
//! ```
//! Commands: `status`, `metrics`, `pause`, `resume`, `quit`. A line longer
//! than [`MAX_LINE`] bytes is refused and the connection closed.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};

use crate::vmm::Vm;

/// Longest request line accepted.
pub const MAX_LINE: usize = 64 * 1024;

/// A control request.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    /// State, size, workloads, uptime.
    Status,
    /// The guest's counters.
    Metrics,
    /// Stop the vCPUs.
    Pause,
    /// Run them again.
    Resume,
    /// Stop the VM and end its VMM process.
    Quit,
    /// Live-migrate the VM; progress lines precede the final reply.
    Migrate(MigrateRequest),
    /// Continue a postcopy migration that paused on a broken link (to the
    /// same destination, or where it is reachable now).
    #[serde(rename = "migrate-resume")]
    MigrateResume {
        /// The destination's address now, if it changed.
        #[serde(default)]
        to: Option<ferry_migration::Endpoint>,
        /// How long to keep reconnecting if the link breaks again (ms);
        /// the paused migration's own setting when absent.
        #[serde(default)]
        reconnect_timeout_ms: Option<u64>,
        /// Write the resumed migration's timeline here.
        #[serde(default)]
        timeline: Option<PathBuf>,
    },
    /// Move the VM to a new VMM process on this host without copying its
    /// memory; the control socket's path moves with it.
    Handover {
        /// The ferry binary the new process runs (default: this one's).
        #[serde(default)]
        binary: Option<String>,
        /// Compare per-page hashes of guest memory in both processes.
        #[serde(default)]
        verify: bool,
    },
    /// Write the guest's non-zero pages, in guest address order, to a file.
    Dump {
        /// Where (a path on the VMM's host).
        path: String,
    },
}

/// Parameters of a migration request: where to, and how (the engine's
/// own options, parsed once by the client; omitted fields take their
/// defaults).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MigrateRequest {
    /// Destination, `tcp:HOST:PORT` or `unix:PATH`.
    pub to: ferry_migration::Endpoint,
    /// How to migrate.
    #[serde(flatten)]
    pub options: ferry_migration::MigrateOptions,
    /// Write the migration's timeline (JSON lines, both sides, then the
    /// summary) here, whether it succeeds or not; none when absent.
    #[serde(default)]
    pub timeline: Option<PathBuf>,
}

/// Why a control call failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Could not create the socket.
    #[error("cannot listen on control socket {path}: {source}")]
    Listen {
        /// Socket path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Another live VMM owns the socket.
    #[error("control socket {0} is in use by another running VM")]
    InUse(PathBuf),
    /// Could not reach the VMM.
    #[error("no VM answers on {path}: {source}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The connection failed midway.
    #[error("control connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// The VMM answered something that is not a control reply.
    #[error("bad reply from the VMM: {0}")]
    BadReply(String),
    /// The VMM refused the request.
    #[error("the VMM refused: {0}")]
    Refused(String),
}

/// Serves requests; implemented by whatever owns the VM.
pub trait ControlHandler: Send + Sync {
    /// Handles one request: Ok(fields to add to the reply) or Err(message).
    fn handle(&self, req: Request, progress: &mut dyn FnMut(Value)) -> Result<Value, String>;

    /// Runs once the reply to a request has been written: effects that may
    /// end the VMM process (a finished migration) wait for it, so the client
    /// always gets its whole answer.
    fn after_reply(&self) {}
}

/// A control socket's listener, shared by its accept thread and a handover
/// (which lends it to the next VMM process, so clients keep the path).
pub struct ControlSocket {
    path: PathBuf,
    listener: UnixListener,
    /// False while a handover holds new clients in the listen queue.
    accepting: AtomicBool,
    stop: AtomicBool,
    /// Another process serves the path now: do not remove it.
    retired: AtomicBool,
}

impl ControlSocket {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The listening socket, to duplicate for the next process.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// New clients wait in the listen queue until [`accept_again`](Self::accept_again)
    /// (or the next process accepts them).
    pub fn hold_clients(&self) {
        self.accepting.store(false, Ordering::Release);
    }

    /// Accept clients again (a handover failed).
    pub fn accept_again(&self) {
        self.accepting.store(true, Ordering::Release);
    }

    /// Another process serves this path now: stop accepting for good, and
    /// leave the path in place when this server is dropped.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        self.stop.store(true, Ordering::Release);
    }
}

/// A listening control socket; removed when dropped (unless retired).
pub struct ControlServer {
    socket: Arc<ControlSocket>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Listens on `path` and serves each connection on its own thread.
    pub fn start(path: &Path, handler: Arc<dyn ControlHandler>) -> Result<Self, ControlError> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(ControlError::InUse(path.into()));
            }
            let _ = std::fs::remove_file(path); // stale socket of a VMM that died
        }
        let listener = UnixListener::bind(path).map_err(|source| ControlError::Listen {
            path: path.into(),
            source,
        })?;
        Self::adopt(listener, path, handler)
    }

    /// Serves a listening socket bound at `path` by another VMM process
    /// (a handover): the path stays, clients queued on it are served here.
    pub fn adopt(
        listener: UnixListener,
        path: &Path,
        handler: Arc<dyn ControlHandler>,
    ) -> Result<Self, ControlError> {
        let listen_err = |source| ControlError::Listen {
            path: path.into(),
            source,
        };
        listener.set_nonblocking(true).map_err(listen_err)?;
        let socket = Arc::new(ControlSocket {
            path: path.into(),
            listener,
            accepting: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        });
        let s = socket.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(&s, handler))
            .map_err(listen_err)?;
        Ok(ControlServer {
            socket,
            thread: Some(thread),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.socket.path
    }

    /// The shared listener (for a handover).
    pub fn socket(&self) -> Arc<ControlSocket> {
        self.socket.clone()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.socket.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if !self.socket.retired.load(Ordering::Acquire) {
            let _ = std::fs::remove_file(&self.socket.path);
        }
    }
}

fn accept_loop(socket: &ControlSocket, handler: Arc<dyn ControlHandler>) {
    while !socket.stop.load(Ordering::Acquire) {
        if !socket.accepting.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        match socket.listener.accept() {
            Ok((stream, _)) => {
                let h = handler.clone();
                let _ = std::thread::Builder::new()
                    .name("control-conn".into())
                    .spawn(move || serve(stream, h));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn serve(stream: UnixStream, handler: Arc<dyn ControlHandler>) {
    let _ = stream.set_nonblocking(false);
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = Vec::new();
        match (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.len() > MAX_LINE {
            let reply =
                json!({"ok": false, "error": format!("request longer than {MAX_LINE} bytes")});
            let _ = writeln!(writer, "{reply}");
            return;
        }
        let reply = match serde_json::from_slice::<Request>(&line) {
            Err(e) => json!({"ok": false, "error": format!(
                "bad request ({e}); send one JSON object per line, e.g. {{\"cmd\":\"status\"}} \
                 (commands: status, metrics, pause, resume, quit)")}),
            Ok(req) => match handler.handle(req, &mut |p| {
                let _ = writeln!(writer, "{}", json!({ "progress": p }));
            }) {
                Ok(Value::Object(mut fields)) => {
                    fields.insert("ok".into(), Value::Bool(true));
                    Value::Object(fields)
                }
                Ok(other) => json!({"ok": true, "value": other}),
                Err(msg) => json!({"ok": false, "error": msg}),
            },
        };
        let written = writeln!(writer, "{reply}").and_then(|_| writer.flush());
        handler.after_reply();
        if written.is_err() {
            return;
        }
    }
}

/// A connection to a VMM's control socket.
pub struct ControlClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl ControlClient {
    /// Connects to `path`.
    pub fn connect(path: &Path) -> Result<Self, ControlError> {
        let stream = UnixStream::connect(path).map_err(|source| ControlError::Connect {
            path: path.into(),
            source,
        })?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let writer = stream.try_clone()?;
        Ok(ControlClient {
            reader: BufReader::new(stream),
            writer,
        })
    }

    /// Sends a request and returns the reply's fields (without "ok").
    pub fn call(&mut self, req: &Request) -> Result<Value, ControlError> {
        self.call_with_progress(req, &mut |_| {})
    }

    /// Like [`call`](Self::call), handing progress lines to `on_progress`.
    pub fn call_with_progress(
        &mut self,
        req: &Request,
        on_progress: &mut dyn FnMut(&Value),
    ) -> Result<Value, ControlError> {
        let line = serde_json::to_string(req).map_err(|e| ControlError::BadReply(e.to_string()))?;
        // A migration may go quiet for longer than a reply may take (a
        // round on a slow link, a postcopy reconnecting); the VMM bounds
        // each of its steps itself.
        let long = matches!(
            req,
            Request::Migrate(_) | Request::MigrateResume { .. } | Request::Handover { .. }
        );
        self.reader
            .get_ref()
            .set_read_timeout((!long).then_some(Duration::from_secs(10)))?;
        writeln!(self.writer, "{line}")?;
        let (reply, mut v) = loop {
            let mut reply = String::new();
            if (&mut self.reader).take(16 << 20).read_line(&mut reply)? == 0 {
                return Err(ControlError::BadReply("connection closed".into()));
            }
            let v: Value =
                serde_json::from_str(&reply).map_err(|e| ControlError::BadReply(e.to_string()))?;
            match v.get("progress") {
                Some(p) => on_progress(p),
                None => break (reply, v),
            }
        };
        let obj = v
            .as_object_mut()
            .ok_or_else(|| ControlError::BadReply(reply.clone()))?;
        match obj.remove("ok") {
            Some(Value::Bool(true)) => Ok(v),
            Some(Value::Bool(false)) => Err(ControlError::Refused(
                obj.get("error")
                    .and_then(Value::as_str)
                    .unwrap_or("no reason given")
                    .into(),
            )),
            _ => Err(ControlError::BadReply(reply)),
        }
    }
}

/// What a VMM does once a reply is out.
enum After {
    /// Stop the VM (quit).
    Stop,
    /// Release it: it runs at this destination now.
    Migrated(String),
    /// Release it: this process runs it now.
    HandedOver(u32),
}

/// What a handover needs from the VMM's front end.
pub struct HandoverSetup {
    /// The binary a handover runs when the request names none.
    pub default_binary: PathBuf,
    /// The control socket whose path moves with the VM.
    pub control: Option<Arc<ControlSocket>>,
    /// The front end's settings for the new process (JSON text), taken at
    /// the time of the handover.
    pub run: Box<dyn Fn() -> String + Send + Sync>,
}

/// Serves the control requests of one [`Vm`].
pub struct VmControl {
    vm: Arc<Vm>,
    /// What to do once the reply is out.
    after: std::sync::Mutex<Option<After>>,
    /// How to hand the VM over (None: handover refused).
    handover: std::sync::Mutex<Option<HandoverSetup>>,
    /// Held while a migration or handover moves the VM: one at a time.
    moving: std::sync::Mutex<()>,
    /// A postcopy whose link broke: the VM runs at the destination and
    /// needs pages only this VM holds, so it must never run here again.
    paused: std::sync::Mutex<Option<ferry_migration::PausedPostcopy>>,
}

impl VmControl {
    /// A handler for `vm`.
    pub fn new(vm: Arc<Vm>) -> Self {
        VmControl {
            vm,
            after: std::sync::Mutex::new(None),
            handover: std::sync::Mutex::new(None),
            moving: std::sync::Mutex::new(()),
            paused: std::sync::Mutex::new(None),
        }
    }

    /// Lets `handover` requests run, with what they need from the front end.
    pub fn set_handover(&self, setup: HandoverSetup) {
        *self.handover.lock().unwrap_or_else(|e| e.into_inner()) = Some(setup);
    }
}

/// The guest's metrics as the control socket and `--json` outputs show them.
pub fn metrics_json(vm: &Vm) -> Result<Value, String> {
    let m = vm.metrics().map_err(|e| e.to_string())?;
    let workloads: Vec<Value> = vm
        .config()
        .workloads
        .0
        .iter()
        .enumerate()
        .map(|(i, w)| {
            json!({
                "spec": w.to_string(),
                "unit": w.unit(),
                "progress": m.progress(i),
                "tasks": m.tasks_of(i),
                "tasks_ready": m.tasks_ready(i),
                "tasks_done": m.tasks_done(i),
                "result": m.result(i),
            })
        })
        .collect();
    let tasks: Vec<Value> = m
        .tasks()
        .iter()
        .map(|t| {
            json!({
                "workload": t.workload,
                "cpu": t.cpu,
                "state": t.state,
                "progress": t.progress,
                "ms": m.task_ms(t),
                "done": t.end_tsc != 0,
            })
        })
        .collect();
    Ok(json!({
        "valid": m.valid(),
        "guest_ms": m.guest_ms(),
        "cpu": m.cpu_totals(),
        "workloads": workloads,
        "tasks": tasks,
    }))
}

impl ControlHandler for VmControl {
    fn after_reply(&self) {
        match self.after.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(After::Migrated(to)) => self.vm.finish_migrated(to),
            Some(After::HandedOver(pid)) => self.vm.finish_handed_over(pid),
            Some(After::Stop) => self.vm.request_stop(),
            None => {}
        }
    }

    fn handle(&self, req: Request, progress: &mut dyn FnMut(Value)) -> Result<Value, String> {
        let vm = &self.vm;
        let _moving = match req {
            Request::Migrate(_) | Request::MigrateResume { .. } | Request::Handover { .. } => {
                Some(self.moving.try_lock().map_err(|_| {
                    "another migration or handover of this VM is in progress".to_string()
                })?)
            }
            // The run state must not change under a migration or handover
            // (a resume would run the guest beside its new process).
            Request::Pause | Request::Resume | Request::Quit => {
                Some(self.moving.try_lock().map_err(|_| {
                    "a migration or handover of this VM is in progress; try again once it ends"
                        .to_string()
                })?)
            }
            _ => None,
        };
        match req {
            Request::Status => Ok(json!({
                "pid": std::process::id(),
                "state": vm.run_state(),
                "postcopy_paused": self.paused.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|p| p.reason.clone()),
                "vcpus": vm.config().vcpus,
                "mem_bytes": vm.config().mem_bytes,
                "workloads": vm.config().workloads.to_string(),
                "apf": vm.config().apf,
                "migrations": vm.migrations(),
                "uptime_s": vm.uptime().as_secs_f64(),
                "tsc_khz": vm.tsc_khz(),
                "service": vm.service().map(|s| s.local_addr().to_string()),
                "vm_address": vm.service().and_then(|s| s.vm_address()).map(|a| a.to_string()),
                "split": vm.pager_stats(),
                "access": vm.access().status(),
            })),
            Request::Metrics => metrics_json(vm).map(|m| json!({ "metrics": m })),
            Request::Dump { path } => dump_pages(vm, &path),
            Request::Pause => vm.pause().map(|_| json!({})).map_err(|e| e.to_string()),
            Request::Resume if self.postcopy_paused() => Err(
                "a postcopy migration of this VM is paused: the VM runs at the destination and must not run here too; continue the migration with `ferry migrate --resume`".into(),
            ),
            // The service too: after a migration that ended in doubt its
            // clients may be held, or checkpointed for a move.
            Request::Resume => {
                // The service first: checkpointed clients leave repair
                // mode before the guest can answer them.
                if let Some(s) = vm.service() {
                    s.release();
                }
                vm.resume().map(|_| json!({})).map_err(|e| e.to_string())
            }
            Request::Migrate(_) if self.postcopy_paused() => Err(
                "a postcopy migration of this VM is paused; continue it with `ferry migrate --resume`".into(),
            ),
            Request::MigrateResume {
                to,
                reconnect_timeout_ms,
                timeline,
            } => {
                let mut paused = self
                    .paused
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .ok_or("no postcopy migration of this VM is paused")?;
                if let Some(ms) = reconnect_timeout_ms {
                    paused.opts.reconnect_timeout_ms = ms;
                }
                let dest = to.clone().unwrap_or_else(|| paused.to.clone());
                let head = header(vm, "resume", &dest.to_string(), paused.opts.mode.name());
                let rec = crate::timeline::Recorder::new("source");
                let result = vm.watch().record(vm, &rec, || {
                    crate::migration::resume(vm, paused, to, &mut |p| {
                        if let Ok(v) = serde_json::to_value(p) {
                            progress(v);
                        }
                    })
                });
                let summary = summary_line(&result);
                let reply = self.migrated(dest.to_string(), result);
                with_timeline(reply, &rec, timeline.as_deref(), head, summary)
            }
            Request::Quit => {
                *self.after.lock().unwrap_or_else(|e| e.into_inner()) = Some(After::Stop);
                Ok(json!({}))
            }
            Request::Handover { .. } if self.postcopy_paused() => Err(
                "a postcopy migration of this VM is paused; continue it with `ferry migrate --resume`".into(),
            ),
            Request::Handover { binary, verify } => self.hand_over(binary, verify, progress),
            Request::Migrate(m) => {
                let head = header(vm, "migrate", &m.to.to_string(), m.options.mode.name());
                let rec = crate::timeline::Recorder::new("source");
                let result = vm.watch().record(vm, &rec, || {
                    crate::migration::migrate(vm, &m.to, &m.options, &mut |p| {
                        if let Ok(v) = serde_json::to_value(p) {
                            progress(v);
                        }
                    })
                });
                let summary = summary_line(&result);
                let reply = self.migrated(m.to.to_string(), result);
                with_timeline(reply, &rec, m.timeline.as_deref(), head, summary)
            }
        }
    }
}

impl VmControl {
    /// Runs a handover; the VM is released here once the reply is out.
    fn hand_over(
        &self,
        binary: Option<String>,
        verify: bool,
        progress: &mut dyn FnMut(Value),
    ) -> Result<Value, String> {
        use crate::handover::{hand_over, HandoverError, HandoverPlan};
        let setup = self.handover.lock().unwrap_or_else(|e| e.into_inner());
        let setup = setup
            .as_ref()
            .ok_or("this VMM cannot hand its VM over yet (an incoming migration is still bringing its memory here)")?;
        let plan = HandoverPlan {
            binary: binary.map_or_else(|| setup.default_binary.clone(), PathBuf::from),
            control: setup.control.clone(),
            run: (setup.run)(),
            verify,
        };
        // The new process maps the memory afresh; this one's tracking
        // steps aside (and comes back only if the VM stays here).
        let tracking = self.vm.access().pause();
        match hand_over(&self.vm, &plan, &mut |step| {
            progress(json!({ "step": step }))
        }) {
            Ok(stats) => {
                *self.after.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(After::HandedOver(stats.new_pid));
                Ok(json!({ "stats": stats }))
            }
            Err(HandoverError::InDoubt { pid, reason }) => {
                // Never run here again: the new process may run it.
                *self.after.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(After::HandedOver(pid));
                Err(format!("handover outcome unknown: the new VMM (pid {pid}) took the VM and then did not confirm it runs it ({reason}); this VMM lets the VM go"))
            }
            Err(e) => {
                if tracking {
                    self.vm.access().resume();
                }
                Err(format!("handover failed, the VM keeps running here: {e}"))
            }
        }
    }

    fn postcopy_paused(&self) -> bool {
        self.paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The reply to a migration (or its resume): on success the VM is
    /// released once the reply is out; a paused postcopy is kept for
    /// `migrate-resume`.
    fn migrated(
        &self,
        to: String,
        result: Result<ferry_migration::MigrationStats, ferry_migration::MigrationError>,
    ) -> Result<Value, String> {
        use ferry_migration::MigrationError as E;
        match result {
            Ok(stats) => {
                *self.after.lock().unwrap_or_else(|e| e.into_inner()) = Some(After::Migrated(to));
                Ok(json!({ "stats": stats }))
            }
            Err(e @ E::PostcopyPaused(_)) => {
                let msg = e.to_string();
                if let E::PostcopyPaused(p) = e {
                    *self.paused.lock().unwrap_or_else(|e| e.into_inner()) = Some(*p);
                }
                Err(msg)
            }
            Err(e @ E::InDoubt(_)) => Err(format!("migration outcome unknown: {e}")),
            Err(e @ E::PostcopyBroken { .. }) => Err(e.to_string()),
            Err(e) => Err(format!("migration failed, the VM keeps running here: {e}")),
        }
    }
}

/// The first line of a timeline: what migrated where, and how.
fn header(vm: &Vm, what: &str, to: &str, mode: &str) -> Value {
    let c = vm.config();
    json!({
        "type": "header", "format": 1, "what": what, "mode": mode, "to": to,
        "t": ferry_migration::telemetry::unix_now(),
        "vm": {
            "mem_bytes": c.mem_bytes, "vcpus": c.vcpus,
            "workloads": c.workloads.0.iter().map(|w| w.to_string()).collect::<Vec<_>>(),
            "tick_hz": c.tick_hz,
        },
        "ferry": env!("CARGO_PKG_VERSION"),
    })
}

/// The last line of a timeline: the migration's result.
fn summary_line(
    result: &Result<ferry_migration::MigrationStats, ferry_migration::MigrationError>,
) -> Value {
    match result {
        Ok(stats) => json!({ "type": "summary", "ok": true, "stats": stats }),
        Err(e) => json!({ "type": "summary", "ok": false, "error": e.to_string() }),
    }
}

/// Writes the timeline (when asked for) and says where in the reply: a
/// field of a success, a sentence after an error.
fn with_timeline(
    reply: Result<Value, String>,
    rec: &crate::timeline::Recorder,
    path: Option<&std::path::Path>,
    head: Value,
    summary: Value,
) -> Result<Value, String> {
    let Some(path) = path else { return reply };
    let written = rec
        .write(path, head, summary)
        .map_err(|e| format!("cannot write the timeline {}: {e}", path.display()));
    match (reply, written) {
        (Ok(mut v), Ok(())) => {
            v["timeline"] = json!(path);
            Ok(v)
        }
        (Ok(mut v), Err(w)) => {
            v["timeline_error"] = json!(w);
            Ok(v)
        }
        (Err(e), Ok(())) => Err(format!("{e} (timeline: {})", path.display())),
        (Err(e), Err(w)) => Err(format!("{e} ({w})")),
    }
}

/// Writes every non-zero page of guest RAM to `path`; replies with counts.
fn dump_pages(vm: &Vm, path: &str) -> Result<Value, String> {
    use std::io::Write;
    if path.is_empty() {
        return Err("dump needs a file path".into());
    }
    let file = std::fs::File::create(path).map_err(|e| format!("cannot create {path}: {e}"))?;
    let mut w = std::io::BufWriter::new(file);
    let (mut pages, mut zero) = (0u64, 0u64);
    for r in vm.memory().regions() {
        for (off, len) in r.data_ranges() {
            for p in (off..off + len).step_by(4096) {
                let mut page = [0u8; 4096];
                vm.memory()
                    .read_bytes(r.gpa() + p, &mut page)
                    .map_err(|e| e.to_string())?;
                if page.iter().all(|&b| b == 0) {
                    zero += 1;
                    continue;
                }
                w.write_all(&page)
                    .map_err(|e| format!("cannot write {path}: {e}"))?;
                pages += 1;
            }
        }
    }
    w.flush().map_err(|e| format!("cannot write {path}: {e}"))?;
    Ok(json!({ "path": path, "pages": pages, "zero_pages_skipped": zero }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Echo(Mutex<Vec<Request>>);
    impl ControlHandler for Echo {
        fn handle(&self, req: Request, _: &mut dyn FnMut(Value)) -> Result<Value, String> {
            self.0.lock().unwrap().push(req.clone());
            match req {
                Request::Quit => Err("no".into()),
                _ => Ok(json!({"seen": true})),
            }
        }
    }

    #[test]
    fn requests_replies_and_errors() {
        let dir = std::env::temp_dir().join(format!("ferry-ctl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vm.sock");
        let handler = Arc::new(Echo(Mutex::new(Vec::new())));
        let server = ControlServer::start(&path, handler.clone()).unwrap();
        assert!(matches!(
            ControlServer::start(&path, handler.clone()),
            Err(ControlError::InUse(_))
        ));
        let mut c = ControlClient::connect(&path).unwrap();
        assert_eq!(c.call(&Request::Status).unwrap()["seen"], true);
        assert!(matches!(c.call(&Request::Quit), Err(ControlError::Refused(m)) if m == "no"));

        // Garbage and oversized lines get an error reply, not a crash.
        let mut raw = UnixStream::connect(&path).unwrap();
        writeln!(raw, "{{\"cmd\":\"explode\"}}").unwrap();
        let mut r = BufReader::new(raw.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(
            line.contains("\"ok\":false") && line.contains("commands: status"),
            "{line}"
        );
        raw.write_all(&vec![b'x'; MAX_LINE + 10]).unwrap();
        line.clear();
        r.read_line(&mut line).unwrap();
        assert!(line.contains("longer than"), "{line}");

        drop(server);
        assert!(!path.exists());
        assert!(matches!(
            ControlClient::connect(&path),
            Err(ControlError::Connect { .. })
        ));
        assert_eq!(handler.0.lock().unwrap().len(), 2);
    }
}
