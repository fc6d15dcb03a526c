//! `ferry upgrade HOST`: hands every VM on a host over to a fresh VMM
//! process (a new ferry binary, or the same one to rejuvenate an aged
//! VMM) with the zero-copy handover: no guest memory is copied and the VM
//! stays on its host. One VM at a time (or N); after each, the VM must be running
//! under its new process and its guest doing work (its progress counters
//! growing, if they grew before) before the next starts: the health check.
//! A handover that fails leaves the VM with its old process (the
//! handover's commit point), and the upgrade stops there.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::fleet::Fleet;
use crate::FleetError;

/// One VM's handover.
#[derive(Clone, Debug, serde::Serialize)]
pub struct UpgradeReport {
    /// The VM.
    pub vm: String,
    /// Its VMM's process before and after.
    pub old_pid: u32,
    /// After (0 if it failed).
    pub new_pid: u32,
    /// How long the guest was paused (ms).
    pub downtime_ms: Option<f64>,
    /// Guest memory copied (bytes): 0 for a handover.
    pub copied_bytes: u64,
    /// Seconds the handover took.
    pub secs: f64,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The handover's own account (its parts: pause, save, restore...), as
    /// the agent gave it; absent if it failed before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handover: Option<ferry_vmm::handover::HandoverStats>,
}

/// Hands each VM on `host` to a new VMM running `binary` (the agent's own
/// ferry if None), `parallel` at a time; `update` sees each VM's report as
/// it ends. A batch with a failure is the last.
pub fn run(
    fleet: &Fleet,
    host: &str,
    binary: Option<PathBuf>,
    parallel: usize,
    update: &mut dyn FnMut(&UpgradeReport),
) -> Result<Vec<UpgradeReport>, FleetError> {
    let agent = fleet.agent(host)?;
    let before = agent.info()?;
    let names: Vec<String> = before
        .vms
        .iter()
        .filter(|v| v.runs_here())
        .map(|v| v.spec.name.clone())
        .collect();
    let mut out = Vec::new();
    for batch in names.chunks(parallel.max(1)) {
        let reports: Vec<UpgradeReport> = std::thread::scope(|sc| {
            let running: Vec<_> = batch
                .iter()
                .map(|name| sc.spawn(|| one(fleet, &agent, host, name, binary.clone())))
                .collect();
            running
                .into_iter()
                .filter_map(|h| h.join().ok().flatten())
                .collect()
        });
        let failed = reports.iter().any(|r| r.error.is_some());
        for r in reports {
            update(&r);
            out.push(r);
        }
        if failed {
            // A new binary that fails one VM would fail the next: stop.
            break;
        }
    }
    Ok(out)
}

/// Hands VM `name` over and checks it; None if it is gone meanwhile.
fn one(
    fleet: &Fleet,
    agent: &crate::AgentClient,
    host: &str,
    name: &str,
    binary: Option<PathBuf>,
) -> Option<UpgradeReport> {
    // As it is now: its counters just before its handover, read twice to
    // see whether its guest is counting at all (a workload that finished
    // stands still, healthy).
    let find = || -> Option<crate::api::VmInfo> {
        agent
            .info()
            .ok()?
            .vms
            .into_iter()
            .find(|v| v.spec.name == name)
    };
    let first = find()?;
    std::thread::sleep(Duration::from_millis(300));
    let mut vm = find()?;
    if vm.progress <= first.progress {
        vm.progress = None; // not counting: only its process is checked
    }
    let t = Instant::now();
    let mut r = UpgradeReport {
        vm: name.into(),
        old_pid: vm.pid,
        new_pid: 0,
        downtime_ms: None,
        copied_bytes: 0,
        secs: 0.0,
        error: None,
        handover: None,
    };
    match agent.upgrade(name, binary) {
        Ok(reply) => {
            r.downtime_ms = Some(reply.stats.downtime_ms);
            r.copied_bytes = reply.stats.memory_bytes_copied;
            r.handover = Some(reply.stats);
            match healthy(fleet, host, &vm) {
                Ok(pid) => r.new_pid = pid,
                Err(e) => r.error = Some(e),
            }
        }
        Err(e) => r.error = Some(e.to_string()),
    }
    r.secs = t.elapsed().as_secs_f64();
    Some(r)
}

/// The health check: within 10 s the VM runs under a process that is not
/// its old one and, if its guest's counters grew before (`before`'s), they
/// grow past where they were. Its new pid.
fn healthy(fleet: &Fleet, host: &str, before: &crate::api::VmInfo) -> Result<u32, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let counted = before.progress.unwrap_or(0);
    loop {
        let last = match fleet.host(host) {
            Ok(h) => match h.vms.iter().find(|v| v.spec.name == before.spec.name) {
                Some(v)
                    if v.state == "running"
                        && v.pid != before.pid
                        && v.pid != 0
                        && (counted == 0 || v.progress.unwrap_or(0) > counted) =>
                {
                    return Ok(v.pid)
                }
                Some(v) => format!("{} under pid {}", v.state, v.pid),
                None => "gone from its host".to_string(),
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(format!("after the handover the VM is {last}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
