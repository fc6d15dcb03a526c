//! Live precopy migration of real KVM guests between two VMs over loopback TCP,
//! with end-to-end page verification.

mod common;
use common::kvm_usable;

use std::time::{Duration, Instant};

use ferry_migration::{Endpoint, MigrateOptions};
use ferry_vmm::migration::{migrate, WaitingDestination};
use ferry_vmm::{Vm, VmConfig};

const MIB: u64 = 1 << 20;

fn running(workload: &str, vcpus: u32) -> Vm {
    let vm = Vm::create(VmConfig::new(128 * MIB, vcpus, workload.parse().unwrap())).unwrap();
    vm.start().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !vm.metrics().unwrap().valid() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    vm
}

fn migrate_and_check(workload: &str, vcpus: u32) {
    let src = running(workload, vcpus);
    std::thread::sleep(Duration::from_millis(300));
    let dst = Vm::create(VmConfig::new(128 * MIB, vcpus, workload.parse().unwrap())).unwrap();
    let incoming =
        WaitingDestination::listen(&"tcp:127.0.0.1:0".parse::<Endpoint>().unwrap()).unwrap();
    let addr = incoming.endpoint();
    let opts = MigrateOptions {
        streams: 2,
        verify: true,
        ..Default::default()
    };
    let (stats, istats) = std::thread::scope(|s| {
        let d = s.spawn(|| incoming.receive(&dst, Duration::from_secs(30)));
        let st = migrate(&src, &addr, &opts, &mut |_| {})
            .expect("migration")
            .done()
            .expect("done, not paused");
        (st, d.join().unwrap().expect("incoming"))
    });
    let at_switch = src.metrics().unwrap();
    src.stop();
    assert_eq!(
        stats.verified_pages,
        128 * MIB / 4096,
        "every page verified"
    );
    if let Some(exit) = dst.wait_exit(Duration::from_millis(500)) {
        panic!(
            "migrated VM stopped: {exit}\n{}",
            dst.console_lines().join("\n")
        );
    }
    let after = dst.metrics().unwrap();
    for w in 0..src.config().workloads.0.len() {
        assert!(
            after.progress(w) > at_switch.progress(w),
            "workload {w} advances after the switchover"
        );
    }
    // Idle memory is mostly zero: far fewer bytes than RAM went on the wire.
    eprintln!("destination restore+start {:.2} ms", istats.restore_ms);
    eprintln!(
        "{workload}: total {:.3} s, downtime {:.2} ms {:?}, {} rounds, {} pages, {} zero pages, {} bytes ({})",
        stats.total_secs,
        stats.downtime_ms,
        stats.downtime_parts,
        stats.rounds.len(),
        stats.pages,
        stats.zero_pages,
        stats.bytes,
        stats.converged
    );
}

#[test]
fn idle_guest_migrates_with_few_bytes() {
    common::secure();
    if !kvm_usable() {
        return;
    }
    let src = running("idle", 1);
    let dst = Vm::create(VmConfig::new(128 * MIB, 1, "idle".parse().unwrap())).unwrap();
    let incoming =
        WaitingDestination::listen(&"tcp:127.0.0.1:0".parse::<Endpoint>().unwrap()).unwrap();
    let addr = incoming.endpoint();
    let opts = MigrateOptions {
        verify: true,
        ..Default::default()
    };
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| incoming.receive(&dst, Duration::from_secs(30)));
        let st = migrate(&src, &addr, &opts, &mut |_| {})
            .unwrap()
            .done()
            .expect("done, not paused");
        d.join().unwrap().unwrap();
        st
    });
    src.stop();
    let nonzero_mib = stats.pages as f64 * 4096.0 / MIB as f64;
    assert!(
        nonzero_mib < 16.0,
        "an idle 128 MiB guest has little non-zero memory: {nonzero_mib:.1} MiB sent"
    );
    assert!(stats.bytes < 24 * MIB, "{} bytes on the wire", stats.bytes);
    let ticks = dst.metrics().unwrap().cpu_totals().ticks;
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        dst.metrics().unwrap().cpu_totals().ticks > ticks + 10,
        "the guest ticks at the destination"
    );
}

#[test]
fn compute_and_dirty_guests_migrate_and_keep_running() {
    common::secure();
    if !kvm_usable() {
        return;
    }
    migrate_and_check("compute+dirty:rate=64,wss=32", 1);
    migrate_and_check("compute:tasks=2+dirty:rate=128,wss=32,pattern=random", 2);
}
