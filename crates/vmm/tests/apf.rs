//! KVM asynchronous page faults in the guest: the workload arena is put under
//! a userfaultfd whose handler delays every page by ~2 ms (like a postcopy
//! fetch). With APF, the guest parks only the faulting task and keeps running
//! another; without it, the whole vCPU waits in the host. The guest's own
//! counters show the difference.

mod common;
use common::kvm_usable;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_memory::{Features, RegisterMode, UffdError, Userfaultfd};
use ferry_vmm::guest_abi::ARENA_BASE;
use ferry_vmm::{Vm, VmConfig};

const MIB: u64 = 1 << 20;
const FAULT_DELAY: Duration = Duration::from_millis(2);

struct Outcome {
    /// Compute ops/s while the memtouch tasks were faulting.
    compute_rate: f64,
    /// Time for all memtouch tasks to finish, ms.
    memtouch_ms: f64,
    apf_not_present: u64,
    /// Not-present events the vCPU waited out in KVM (no other task could run).
    apf_inline: u64,
    apf_ready: u64,
    context_switches: u64,
    faults_served: u64,
}

fn run(apf: bool) -> Option<Outcome> {
    run_with(apf, "memtouch:tasks=4,mib=1+compute:tasks=1", 4)
}

/// Runs `workloads` (memtouch first) on one vCPU until its `memtouch_tasks`
/// are done.
fn run_with(apf: bool, workloads: &str, memtouch_tasks: u64) -> Option<Outcome> {
    let workloads = workloads.parse().unwrap();
    let mut config = VmConfig::new(64 * MIB, 1, workloads);
    config.apf = apf;
    let vm = Vm::create(config).expect("create VM");
    let uffd = match Userfaultfd::new(Features {
        missing_shmem: true,
        ..Default::default()
    }) {
        Ok(u) => Arc::new(u),
        Err(e) => {
            eprintln!("SKIP: userfaultfd unavailable: {e}");
            return None;
        }
    };
    // Only the arena: the guest kernel never touches it, so only CPL3 tasks fault.
    let region = &vm.memory().regions()[0];
    let start = region.host_addr() as u64 + ARENA_BASE;
    let len = region.size() - ARENA_BASE;
    uffd.register(
        start,
        len,
        RegisterMode {
            missing: true,
            ..Default::default()
        },
    )
    .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let handler = {
        let (uffd, stop, served) = (uffd.clone(), stop.clone(), served.clone());
        std::thread::spawn(move || {
            let page = vec![0u8; 4096];
            let mut events = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if !uffd.poll(Duration::from_millis(20)).unwrap() {
                    continue;
                }
                events.clear();
                uffd.read_events(&mut events).unwrap();
                for ev in &events {
                    if let ferry_memory::Event::PageFault { addr, .. } = *ev {
                        std::thread::sleep(FAULT_DELAY);
                        match uffd.copy(addr & !4095, &page, true) {
                            Ok(_) | Err(UffdError::AlreadyMapped { .. }) => {}
                            Err(e) => panic!("resolving a fault: {e}"),
                        }
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        })
    };

    vm.start().unwrap();
    let t0 = Instant::now();
    let mut first = None;
    let last = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "memtouch did not finish"
        );
        if let Some(exit) = vm.wait_exit(Duration::from_millis(10)) {
            panic!("VM stopped: {exit}\n{}", vm.console_lines().join("\n"));
        }
        let m = vm.metrics().unwrap();
        if !m.valid() {
            continue;
        }
        if first.is_none() {
            first = Some(m.clone());
        }
        if m.tasks_done(0) == memtouch_tasks {
            break m;
        }
    };
    let first = first.unwrap();
    vm.stop();
    stop.store(true, Ordering::Relaxed);
    handler.join().unwrap();
    let memtouch_ms = last
        .tasks()
        .iter()
        .filter(|t| t.workload == 0)
        .filter_map(|t| last.task_ms(t))
        .fold(0.0, f64::max);
    let c = last.cpu_totals();
    Some(Outcome {
        compute_rate: ferry_vmm::metrics::rate(&first, &last, first.progress(1), last.progress(1)),
        memtouch_ms,
        apf_not_present: c.apf_not_present,
        apf_inline: c.apf_inline,
        apf_ready: c.apf_ready,
        context_switches: c.context_switches,
        faults_served: served.load(Ordering::Relaxed),
    })
}

#[test]
fn apf_lets_other_tasks_run_while_a_task_waits_for_a_page() {
    if !kvm_usable() {
        return;
    }
    let Some(on) = run(true) else { return };
    let Some(off) = run(false) else { return };
    eprintln!(
        "APF on:  compute {:.3e} ops/s, memtouch {:.0} ms, not-present {}, ready {}, faults {}",
        on.compute_rate, on.memtouch_ms, on.apf_not_present, on.apf_ready, on.faults_served
    );
    eprintln!(
        "APF off: compute {:.3e} ops/s, memtouch {:.0} ms, not-present {}, ready {}, faults {}",
        off.compute_rate, off.memtouch_ms, off.apf_not_present, off.apf_ready, off.faults_served
    );
    // 4 tasks x 1 MiB = 1024 pages, each delayed by the handler.
    assert!(on.faults_served >= 1024 && off.faults_served >= 1024);
    // With APF the guest saw most faults as 'page not present' and got them back.
    assert!(
        on.apf_not_present > 512,
        "APF not-present events: {}",
        on.apf_not_present
    );
    assert!(on.apf_ready >= on.apf_not_present / 2);
    assert_eq!(
        off.apf_not_present, 0,
        "without APF the guest never hears of host faults"
    );
    // The compute task kept the vCPU busy while memtouch tasks waited; without
    // APF the vCPU itself waited on each fault.
    assert!(
        on.compute_rate > 2.0 * off.compute_rate,
        "compute ops/s with APF {:.3e} should far exceed without {:.3e}",
        on.compute_rate,
        off.compute_rate
    );
}

#[test]
fn a_vcpu_with_nothing_else_to_run_waits_for_its_page_in_kvm() {
    if !kvm_usable() {
        return;
    }
    // One task on the vCPU: nothing could run while a page arrives, so the
    // guest never turns APF on (each fault would cost it two traps).
    let Some(one) = run_with(true, "memtouch:tasks=1,mib=1", 1) else {
        return;
    };
    eprintln!(
        "1 task:  not-present {}, inline {}, faults {}",
        one.apf_not_present, one.apf_inline, one.faults_served
    );
    assert!(one.faults_served >= 256);
    assert_eq!(one.apf_not_present, 0, "APF stays off with one task");
    // Two tasks alone: the first to fault is parked and the other runs.
    // When that one faults too, nothing is left to run: it retries and
    // waits in KVM (inline) until the first's 'page ready', which parks it
    // on its own token and runs the first. From then on every fault finds
    // the other task parked: inline, and a switch at each 'page ready'.
    let Some(two) = run_with(true, "memtouch:tasks=2,mib=1", 2) else {
        return;
    };
    eprintln!(
        "2 tasks: not-present {}, inline {}, ready {}, switches {}, faults {}",
        two.apf_not_present, two.apf_inline, two.apf_ready, two.context_switches, two.faults_served
    );
    assert!(two.faults_served >= 512);
    assert!(two.apf_not_present > 256, "{}", two.apf_not_present);
    assert!(
        two.apf_inline >= two.apf_not_present / 2 && two.apf_inline < two.apf_not_present,
        "{} inline of {}",
        two.apf_inline,
        two.apf_not_present
    );
    assert!(
        two.apf_ready >= two.apf_not_present,
        "each fault's page ready"
    );
    assert!(
        two.context_switches >= two.apf_inline / 2,
        "a woken task takes the vCPU: {} switches",
        two.context_switches
    );
}
