//! `ferry upgrade HOST`: hands every VM on a host over to a fresh VMM
//! process (a new ferry binary, or the same one to rejuvenate an aged
//! VMM) with the zero-copy handover: no guest memory is copied and the VM
//! stays on its host. One VM at a time (or N); after each, the VM must be running
//! under its new process and its guest doing work (its progress counters
//! growing, if they grew before) before the next starts: the health check.
//! A handover that fails leaves the VM with its old process (the
//! handover's commit point), and the upgrade stops there.
//!
//! A host that is down is no host with nothing to upgrade: one the
//! registry lists dead, or whose agent does not answer, fails the upgrade
//! ([`FleetError::HostDown`]), as `ferry drain` of it does; an agent that
//! stops answering partway fails the VM it was to hand over next (and the
//! upgrade stops there), never leaving it out of the report.

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
    let before = agent
        .info()
        .map_err(|e| down(host, e, "no VM was upgraded"))?;
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

/// A failed call to `host`'s agent: one whose link failed (the agent
/// does not answer) says the host is down, `then` telling what it left
/// undone; any other error (the agent answered with one) stays as it is.
fn down(host: &str, e: FleetError, then: &str) -> FleetError {
    match e {
        FleetError::Link { agent, reason } => FleetError::HostDown {
            host: host.into(),
            reason: format!("its agent at {agent} does not answer ({reason}); {then}"),
        },
        e => e,
    }
}

/// VM `name` in what `host`'s agent answered: None if it no longer lists
/// it (stopped or moved meanwhile). An agent that did not answer is no
/// VM gone: the VM may well run on, not upgraded (the error says so).
fn listed(
    answer: Result<crate::api::HostInfo, FleetError>,
    host: &str,
    name: &str,
) -> Result<Option<crate::api::VmInfo>, FleetError> {
    let h = answer.map_err(|e| down(host, e, "the VM was not handed over"))?;
    Ok(h.vms.into_iter().find(|v| v.spec.name == name))
}

/// Hands VM `name` over and checks it; None if it is gone meanwhile.
fn one(
    fleet: &Fleet,
    agent: &crate::AgentClient,
    host: &str,
    name: &str,
    binary: Option<PathBuf>,
) -> Option<UpgradeReport> {
    let t = Instant::now();
    let mut r = UpgradeReport {
        vm: name.into(),
        old_pid: 0,
        new_pid: 0,
        downtime_ms: None,
        copied_bytes: 0,
        secs: 0.0,
        error: None,
        handover: None,
    };
    // As it is now: its counters just before its handover, read twice to
    // see whether its guest is counting at all (a workload that finished
    // stands still, healthy).
    let find = || listed(agent.info(), host, name);
    let seen = find().and_then(|first| {
        let Some(first) = first else {
            return Ok(None);
        };
        r.old_pid = first.pid;
        std::thread::sleep(Duration::from_millis(300));
        Ok(find()?.map(|now| (first, now)))
    });
    let vm = match seen {
        Ok(Some((first, now))) if now.progress > first.progress => now,
        // Not counting: only its process is checked.
        Ok(Some((_, now))) => crate::api::VmInfo {
            progress: None,
            ..now
        },
        Ok(None) => return None,
        Err(e) => {
            r.error = Some(e.to_string());
            r.secs = t.elapsed().as_secs_f64();
            return Some(r);
        }
    };
    r.old_pid = vm.pid;
    let t = Instant::now();
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
        Err(e) => {
            let then = "whether the VM was handed over is unknown until its agent answers again";
            r.error = Some(down(host, e, then).to_string());
        }
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

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::sync::Arc;

    use ferry_registry::{HostEntry, HostKind, Registry};

    use super::*;
    use crate::testing;

    fn fleet(tag: &str) -> (Fleet, Arc<dyn Registry>) {
        let dir = std::env::temp_dir().join(format!("ferry-upgrade-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let reg = ferry_registry::open(Some(&format!("dir:{}", dir.display())), None).unwrap();
        (Fleet::new(reg.clone(), None), reg)
    }

    /// `host`'s agent registered at `addr`, its lease alive.
    fn live(reg: &Arc<dyn Registry>, host: &str, addr: &str) {
        let e = HostEntry {
            name: host.into(),
            kind: HostKind::Agent,
            addr: addr.into(),
            capacity: 4 << 30,
            free: 4 << 30,
            agent: None,
        };
        reg.advertise(&e, Duration::from_secs(60)).unwrap();
        let known = serde_json::json!({ "addr": addr }).to_string();
        reg.put_record(&crate::fleet::known_key(host), known.as_bytes())
            .unwrap();
    }

    /// An agent (plaintext) that answers `answers` info requests with a
    /// host running VM `vm`, then is gone (its port refuses).
    fn agent_dying_after(answers: usize, host: &str, vm: &str) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let info = testing::host(host, 1024, 4, vec![testing::vm(vm, 256, 1)]);
        std::thread::spawn(move || {
            for _ in 0..answers {
                let (c, _) = l.accept().unwrap();
                let mut line = String::new();
                BufReader::new(&c).read_line(&mut line).unwrap();
                assert!(line.contains("info"), "{line}");
                let reply = serde_json::json!({ "ok": true, "host": info });
                writeln!(&c, "{reply}").unwrap();
            }
            // Dropped: the agent is dead.
        });
        addr
    }

    fn upgrade(fleet: &Fleet, host: &str) -> Result<Vec<UpgradeReport>, FleetError> {
        run(fleet, host, None, 1, &mut |_| {})
    }

    #[test]
    fn a_host_the_registry_lists_dead_is_not_upgraded_it_fails_naming_it() {
        let (fleet, reg) = fleet("dead");
        // Registered once (its record stays), no lease now.
        let known = serde_json::json!({ "addr": "127.0.0.1:9" }).to_string();
        reg.put_record(&crate::fleet::known_key("ferry-h1"), known.as_bytes())
            .unwrap();
        match upgrade(&fleet, "ferry-h1") {
            Err(FleetError::HostDown { host, reason }) => {
                assert_eq!(host, "ferry-h1");
                assert!(reason.contains("lists it dead"), "{reason}");
                assert!(reason.contains("127.0.0.1:9"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_host_whose_agent_does_not_answer_is_not_upgraded_it_fails_naming_it() {
        let (fleet, reg) = fleet("silent");
        // Its lease has not lapsed yet; its agent is gone.
        live(&reg, "ferry-h1", &agent_dying_after(0, "ferry-h1", "vm1"));
        std::thread::sleep(Duration::from_millis(50));
        let e = upgrade(&fleet, "ferry-h1").unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(&e, FleetError::HostDown { host, .. } if host == "ferry-h1"),
            "{e:?}"
        );
        assert!(text.contains("does not answer"), "{text}");
        assert!(text.contains("no VM was upgraded"), "{text}");
    }

    #[test]
    fn an_agent_that_dies_mid_upgrade_fails_the_vm_it_was_to_hand_over() {
        let (fleet, reg) = fleet("dying");
        // It lists vm1 twice (the upgrade's look at the host, the VM's
        // first reading), then dies before the second reading: the VM is
        // not left out of the report as if it had gone (the upgrade
        // printed {"vms":[]} and exited 0), it failed.
        live(&reg, "ferry-h1", &agent_dying_after(2, "ferry-h1", "vm1"));
        let reports = upgrade(&fleet, "ferry-h1").unwrap();
        assert_eq!(reports.len(), 1, "{reports:?}");
        let r = &reports[0];
        assert_eq!(r.vm, "vm1");
        assert_eq!((r.old_pid, r.new_pid), (1, 0), "never handed over");
        assert!(r.downtime_ms.is_none() && r.handover.is_none(), "{r:?}");
        let e = r.error.as_deref().expect("the VM failed");
        assert!(e.contains("host ferry-h1"), "{e}");
        assert!(e.contains("does not answer"), "{e}");
        assert!(e.contains("not handed over"), "{e}");
    }
}
