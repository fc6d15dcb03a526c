//! What each control command does to the VM: [`VmControl`] is the
//! [`ControlHandler`] of one [`Vm`] (status, metrics, pause and resume,
//! quit, migrate and its resume after a broken postcopy link, handover,
//! dump), with the timeline a migration writes and what happens once its
//! reply is out.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value};

use super::{ControlHandler, ControlSocket, Request};
use crate::vm::Vm;

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
    /// What to do once the reply is out, and the connection thread whose
    /// reply it waits for (another connection's reply must not trigger it:
    /// the process could end while this reply is still being written).
    after: AfterReply<After>,
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
            after: AfterReply::default(),
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

/// The disk workload's own check (None without one, or before it set
/// up): what it wrote and read, what it checked, what was bad, and its
/// requests per second since it started.
pub fn disk_check_json(vm: &Vm) -> Option<Value> {
    let index = vm
        .config()
        .workloads
        .0
        .iter()
        .position(|w| matches!(w, crate::workload::Workload::Disk(_)))?;
    let d = crate::workload::disk::read_metrics(vm.memory())?;
    let m = vm.metrics().ok()?;
    let ms = m
        .tasks()
        .iter()
        .find(|t| t.workload == index as u64)
        .and_then(|t| m.task_ms(t))
        .unwrap_or(0.0);
    let tsc_khz = vm.tsc_khz().max(1) as f64;
    let phase = match d.phase {
        crate::guest_abi::disk_phase::FILL => "fill",
        crate::guest_abi::disk_phase::RUN => "run",
        crate::guest_abi::disk_phase::VERIFY => "verify",
        crate::guest_abi::disk_phase::DONE => "done",
        _ => "setup",
    };
    let mut v = serde_json::to_value(d).ok()?;
    v["phase"] = json!(phase);
    v["iops"] = json!(if ms > 0.0 {
        d.ops as f64 / (ms / 1000.0)
    } else {
        0.0
    });
    v["latency_us_mean"] = json!(if d.ops > 0 {
        d.lat_tsc_sum as f64 / d.ops as f64 / tsc_khz * 1000.0
    } else {
        0.0
    });
    v["latency_us_max"] = json!(d.lat_tsc_max as f64 / tsc_khz * 1000.0);
    v["ms"] = json!(ms);
    Some(v)
}

/// An effect that waits for one connection's reply: set by the thread
/// that handles the request, taken only by that thread once its reply is
/// written. (Each connection is served on a thread of its own.)
struct AfterReply<T>(std::sync::Mutex<Option<(std::thread::ThreadId, T)>>);

impl<T> Default for AfterReply<T> {
    fn default() -> Self {
        AfterReply(std::sync::Mutex::new(None))
    }
}

impl<T> AfterReply<T> {
    /// Keeps `what` for the calling thread's reply.
    fn set(&self, what: T) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((std::thread::current().id(), what));
    }

    /// What the calling thread set, if anything (another thread's effect
    /// stays for that thread).
    fn take_mine(&self) -> Option<T> {
        let mut a = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match a.as_ref() {
            Some((t, _)) if *t == std::thread::current().id() => a.take().map(|(_, x)| x),
            _ => None,
        }
    }
}

impl VmControl {
    /// Does `what` once this connection's reply is written.
    fn after_this_reply(&self, what: After) {
        self.after.set(what);
    }
}

impl ControlHandler for VmControl {
    fn after_reply(&self) {
        let mine = self.after.take_mine();
        match mine {
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
                "state": vm.reported_state(),
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
                "incoming": vm.waiting(),
                "preallocated": vm.preallocated().map(|(bytes, running)| json!({
                    "bytes": bytes, "running": running,
                })),
                "token": vm.waiting().and_then(|w| w.token),
                // What this VMM's migration links speak (the flag that chose it).
                "links": ferry_migration::transport::describe(),
                // Who may run the VM, by the registry (fenced VMs only).
                "owner": vm.owner().and_then(|o| o.status()),
                "disks": vm.disks().iter().map(|d| d.info()).collect::<Vec<_>>(),
                "disk_check": disk_check_json(vm),
            })),
            Request::Metrics => metrics_json(vm).map(|m| json!({ "metrics": m })),
            Request::Dump { path } => dump_pages(vm, &path),
            Request::DirtyRate { ms } => {
                let window = std::time::Duration::from_millis(ms.unwrap_or(500).clamp(10, 5000));
                vm.dirty_rate(window)
                    .map(|(pages, secs)| {
                        json!({
                            "dirty_pages": pages,
                            "window_s": secs,
                            "dirty_bytes_per_s": pages as f64 * 4096.0 / secs.max(1e-9),
                        })
                    })
                    .map_err(|e| e.to_string())
            }
            Request::Pause => vm.pause().map(|_| json!({})).map_err(|e| e.to_string()),
            Request::Resume if self.postcopy_paused() => Err(
                "a postcopy migration of this VM is paused: the VM runs at the destination and must not run here too; continue the migration with `ferry migrate --resume`".into(),
            ),
            // The service too: after a migration that ended in doubt its
            // clients may be held, or checkpointed for a move.
            // A VMM waiting for its incoming migration: nothing here may
            // run, and its service stays held while pages land.
            Request::Resume if vm.fence_forbids().is_some() => Err(format!(
                "the owner fence forbids running the VM here: {}",
                vm.fence_forbids().unwrap_or_default()
            )),
            Request::MigrateResume { .. } if destination_lost(vm).is_some() => {
                Err(destination_lost(vm).unwrap_or_default())
            }
            Request::Resume if !vm.has_started() => Err(
                "the VM has not started here: it waits for its incoming migration".into(),
            ),
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
                let result = vm.watch().record(&**vm, &rec, || {
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
                self.after_this_reply(After::Stop);
                Ok(json!({}))
            }
            Request::Handover { .. } if self.postcopy_paused() => Err(
                "a postcopy migration of this VM is paused; continue it with `ferry migrate --resume`".into(),
            ),
            Request::Handover { binary, verify } => self.hand_over(binary, verify, progress),
            Request::Migrate(m) => {
                let head = header(vm, "migrate", &m.to.to_string(), m.options.mode.name());
                let rec = crate::timeline::Recorder::new("source");
                let result = vm.watch().record(&**vm, &rec, || {
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
            control: setup
                .control
                .clone()
                .map(|c| c as Arc<dyn crate::handover::MovingListener>),
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
                self.after_this_reply(After::HandedOver(stats.new_pid));
                Ok(json!({ "stats": stats }))
            }
            Err(HandoverError::InDoubt { pid, reason }) => {
                // Never run here again: the new process may run it.
                self.after_this_reply(After::HandedOver(pid));
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
        result: Result<ferry_migration::Outcome, ferry_migration::MigrationError>,
    ) -> Result<Value, String> {
        use ferry_migration::{MigrationError as E, Outcome};
        match result {
            Ok(Outcome::Done(stats)) => {
                self.after_this_reply(After::Migrated(to));
                Ok(json!({ "stats": stats }))
            }
            Ok(Outcome::Paused(p)) => {
                let msg = p.to_string();
                *self.paused.lock().unwrap_or_else(|e| e.into_inner()) = Some(*p);
                Err(msg)
            }
            Err(e @ E::InDoubt(_)) => Err(format!("migration outcome unknown: {e}")),
            Err(e @ (E::PostcopyBroken { .. } | E::VerifyAfterSwitch { .. })) => Err(e.to_string()),
            Err(e) => Err(format!("migration failed, the VM keeps running here: {e}")),
        }
    }
}

/// The first line of a timeline: what migrated where, and how.
fn header(vm: &Vm, what: &str, to: &str, mode: &str) -> Value {
    let c = vm.config();
    json!({
        "type": "header", "format": 1, "what": what, "mode": mode, "to": to,
        "t": ferry_migration::unix_now(),
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
    result: &Result<ferry_migration::Outcome, ferry_migration::MigrationError>,
) -> Value {
    use ferry_migration::Outcome;
    match result {
        Ok(Outcome::Done(stats)) => json!({ "type": "summary", "ok": true, "stats": stats }),
        Ok(Outcome::Paused(p)) => json!({ "type": "summary", "ok": false, "error": p.to_string() }),
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

/// A paused postcopy's destination that holds the VM and stopped renewing
/// its claim: it seems dead, and the VM's newest state with it (what a
/// resume cannot bring back, said plainly).
fn destination_lost(vm: &Vm) -> Option<String> {
    let st = vm.owner()?.status()?;
    (st.state == "handed" && st.holder_lapsed).then(|| {
        format!(
            "the destination that took VM {} (epoch {}, {}) stopped renewing its claim: it seems \
             dead, and the VM's newest state (what it ran since the switch) died with it. This \
             host keeps the state from the switch, paused; docs/safety.md says why ferry does not \
             run it again by itself",
            st.vm,
            st.epoch.unwrap_or(0),
            st.holder.as_deref().unwrap_or("unknown")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::AfterReply;

    #[test]
    fn an_effect_waits_for_the_reply_of_the_connection_that_asked() {
        let after = std::sync::Arc::new(AfterReply::default());
        // A migrate's connection keeps "end the VMM" for its own reply.
        after.set("migrated");
        // Another connection's reply (a status) goes out first: it must
        // not end the process under the migrate's reply.
        let other = after.clone();
        let taken = std::thread::spawn(move || other.take_mine())
            .join()
            .unwrap();
        assert_eq!(taken, None);
        assert_eq!(after.take_mine(), Some("migrated"));
        assert_eq!(after.take_mine(), None, "taken once");
    }
}
