//! Access tracking on real KVM guests: sampled reads and logged writes
//! build histories while the guest runs on; an outgoing migration pauses
//! tracking (and gets the histories), a failed one resumes it.

mod common;
use common::kvm_usable;

use std::time::{Duration, Instant};

use ferry_migration::{Endpoint, MigratableVm, MigrateOptions};
use ferry_vmm::access::{AccessConfig, TrackingState, WriteSource};
use ferry_vmm::migration::{migrate, WaitingDestination};
use ferry_vmm::{Vm, VmConfig};

const MIB: u64 = 1 << 20;
const WORKLOAD: &str = "compute+dirty:rate=32,wss=16";

fn config(access: Option<AccessConfig>) -> VmConfig {
    let mut c = VmConfig::new(128 * MIB, 1, WORKLOAD.parse().unwrap());
    c.access = access;
    c
}

fn running(access: Option<AccessConfig>) -> Vm {
    let vm = Vm::create(config(access)).unwrap();
    vm.start().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !vm.metrics().unwrap().valid() {
        assert!(
            Instant::now() < deadline,
            "the guest never published metrics"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    vm
}

fn progress(vm: &Vm) -> Vec<u64> {
    let m = vm.metrics().unwrap();
    (0..2).map(|i| m.progress(i)).collect()
}

/// Skips loudly where tracking cannot start here (no userfaultfd).
fn tracking_or_skip(vm: &Vm) -> bool {
    let s = vm.access().status().expect("tracking was asked for");
    if s.state == TrackingState::Failed && s.stats.periods == 0 {
        eprintln!("SKIP: access tracking unavailable here: {:?}", s.error);
        return false;
    }
    assert_eq!(s.state, TrackingState::Tracking, "{s:?}");
    true
}

#[test]
fn tracking_builds_histories_and_steps_aside_for_migrations() {
    common::secure();
    tracking_case(WriteSource::Log, 1);
}

#[test]
fn sampled_tracking_needs_no_dirty_log_and_steps_aside_for_migrations() {
    common::secure();
    tracking_case(WriteSource::Sample, ferry_memory::DEFAULT_GRAIN_PAGES);
}

fn tracking_case(writes: WriteSource, grain: u64) {
    if !kvm_usable() {
        return;
    }
    let access = AccessConfig {
        period: Duration::from_millis(100),
        share: 4,
        grain,
        writes,
    };
    let src = running(Some(access));
    if !tracking_or_skip(&src) {
        return;
    }
    let before = progress(&src);
    std::thread::sleep(Duration::from_millis(1200));
    let after = progress(&src);
    assert!(
        after.iter().zip(&before).all(|(a, b)| a > b),
        "both workloads advance under tracking: {before:?} -> {after:?}"
    );
    let s = src.access().status().unwrap();
    assert!(s.stats.periods >= 8, "{s:?}");
    assert!(s.stats.arms >= 8 && s.stats.minor_faults_total > 0, "{s:?}");
    let h = src.access_history().expect("histories while tracking");
    let accessed: u64 = h.clock.iter().flatten().map(|&c| u64::from(c)).sum();
    let aged = h.aging.iter().flatten().filter(|&&a| a != 0).count();
    assert!(accessed > 0 && aged > 0, "{accessed} accessed, {aged} aged");
    assert_eq!(h.clock.len(), src.memory().regions().len());
    eprintln!("tracking: {}", serde_json::to_string(&s).unwrap());

    // A migration nobody answers fails: tracking pauses for it and
    // resumes, histories kept.
    let nobody: Endpoint = format!(
        "unix:{}",
        std::env::temp_dir()
            .join(format!("ferry-access-nobody-{}.sock", std::process::id()))
            .display()
    )
    .parse()
    .unwrap();
    assert!(migrate(&src, &nobody, &MigrateOptions::default(), &mut |_| {}).is_err());
    let s = src.access().status().unwrap();
    assert_eq!(s.state, TrackingState::Tracking, "{s:?}");
    assert_eq!(
        src.dirty_log()
            .is_started(ferry_vmm::vstate::dirty::Consumer::Access),
        writes == WriteSource::Log,
        "the dirty log serves tracking only when it logs writes"
    );
    assert!(!src
        .dirty_log()
        .is_started(ferry_vmm::vstate::dirty::Consumer::Migration));

    // A real one: every page verifies (the dirty log served the migration
    // while tracking had it too), tracking stays paused afterwards.
    let dst = Vm::create(config(None)).unwrap();
    let incoming =
        WaitingDestination::listen(&"tcp:127.0.0.1:0".parse::<Endpoint>().unwrap()).unwrap();
    let addr = incoming.endpoint();
    let opts = MigrateOptions {
        verify: true,
        ..Default::default()
    };
    let periods = s.stats.periods;
    let stats = std::thread::scope(|sc| {
        let d = sc.spawn(|| incoming.receive(&dst, Duration::from_secs(30)));
        let st = migrate(&src, &addr, &opts, &mut |_| {})
            .expect("migration")
            .done()
            .expect("done, not paused");
        d.join().unwrap().expect("incoming");
        st
    });
    assert_eq!(stats.verified_pages, 128 * MIB / 4096);
    let s = src.access().status().unwrap();
    assert_eq!(s.state, TrackingState::Paused, "{s:?}");
    assert!(src.access_history().unwrap().periods >= periods);
    assert!(dst.access().status().is_none(), "off on the destination");
    src.stop();
    assert_eq!(src.access().status().unwrap().state, TrackingState::Stopped);
    let moved = progress(&dst);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        progress(&dst)[0] > moved[0],
        "the guest runs on at the destination"
    );
}

#[test]
fn without_tracking_there_is_no_history() {
    common::secure();
    if !kvm_usable() {
        return;
    }
    let vm = running(None);
    assert!(vm.access().status().is_none());
    assert!(vm.access_history().is_none());
    vm.stop();
}
