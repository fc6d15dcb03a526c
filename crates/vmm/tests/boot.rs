//! Boots real guests on /dev/kvm and checks what they do, through the guest's
//! own counters. Skips loudly where KVM is not usable.

mod common;
use common::kvm_usable;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_vmm::control::{ControlClient, ControlServer, Request, VmControl};
use ferry_vmm::guest_abi::{task_state, ARENA_BASE, BOOT_INFO_GPA};
use ferry_vmm::metrics::MetricsSnapshot;
use ferry_vmm::{Vm, VmConfig, VmExit};

const MIB: u64 = 1 << 20;

fn boot(mem: u64, vcpus: u32, workload: &str) -> Vm {
    let config = VmConfig::new(mem, vcpus, workload.parse().unwrap());
    boot_with(config)
}

fn boot_with(config: VmConfig) -> Vm {
    let vm = Vm::create(config).expect("create VM");
    vm.start().expect("start VM");
    wait_for(&vm, Duration::from_secs(5), "guest metrics page", |m| {
        m.valid()
    });
    vm
}

/// Polls the guest's metrics until `cond` holds; fails with the console on timeout or exit.
fn wait_for(
    vm: &Vm,
    timeout: Duration,
    what: &str,
    cond: impl Fn(&MetricsSnapshot) -> bool,
) -> MetricsSnapshot {
    let deadline = Instant::now() + timeout;
    loop {
        let m = vm.metrics().unwrap();
        if cond(&m) {
            return m;
        }
        if let Some(exit) = vm.wait_exit(Duration::from_millis(10)) {
            panic!(
                "VM stopped while waiting for {what}: {exit}\nconsole:\n{}",
                vm.console_lines().join("\n")
            );
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}\nconsole:\n{}",
            vm.console_lines().join("\n")
        );
    }
}

fn settle(vm: &Vm, d: Duration) {
    if let Some(exit) = vm.wait_exit(d) {
        panic!(
            "VM stopped: {exit}\nconsole:\n{}",
            vm.console_lines().join("\n")
        );
    }
}

#[test]
fn idle_guest_boots_ticks_and_halts() {
    if !kvm_usable() {
        return;
    }
    let vm = boot(64 * MIB, 1, "idle");
    let a = vm.metrics().unwrap();
    settle(&vm, Duration::from_millis(500));
    let b = vm.metrics().unwrap();
    let ticks = b.cpu_totals().ticks - a.cpu_totals().ticks;
    // 100 Hz for 0.5 s; allow for a slow, shared machine.
    assert!((20..=80).contains(&ticks), "ticks in 0.5 s: {ticks}");
    let idle = b.cpu_totals().idle_ms - a.cpu_totals().idle_ms;
    assert!(
        idle > 300.0,
        "an idle guest should be halted most of the time, idle {idle:.0} ms of 500"
    );
    assert!(vm
        .console_lines()
        .iter()
        .any(|l| l.contains("ferry guest: 1 vCPUs")));
    assert_eq!(vm.stop(), VmExit::Stopped);
}

/// Per region, its data ranges and their bytes.
fn contents(vm: &Vm) -> Vec<Vec<(u64, u64, Vec<u8>)>> {
    let m = vm.memory();
    m.regions()
        .iter()
        .map(|r| {
            r.data_ranges()
                .into_iter()
                .map(|(off, len)| {
                    let mut bytes = vec![0u8; len as usize];
                    m.read_bytes(r.gpa() + off, &mut bytes).unwrap();
                    (off, len, bytes)
                })
                .collect()
        })
        .collect()
}

#[test]
fn build_then_install_boot_image_boots_like_create() {
    if !kvm_usable() {
        return;
    }
    let config = VmConfig::new(64 * MIB, 2, "compute".parse().unwrap());
    let vm = Vm::build(config.clone(), config.new_memory().unwrap()).unwrap();
    assert!(
        vm.memory()
            .regions()
            .iter()
            .all(|r| r.data_ranges().is_empty()),
        "build writes nothing into guest memory"
    );
    assert!(
        matches!(vm.start(), Err(ferry_vmm::VmError::WrongState(_))),
        "nothing to run yet"
    );
    vm.install_boot_image().unwrap();

    let created = Vm::create(config).unwrap();
    let (mut mine, mut theirs) = (contents(&vm), contents(&created));
    assert!(!mine[0].is_empty());
    // The boot info page holds the TSC rate, which may be measured.
    for c in [&mut mine, &mut theirs] {
        for (off, len, bytes) in c[0].iter_mut() {
            if let Some(at) = BOOT_INFO_GPA.checked_sub(*off).filter(|at| at < len) {
                let end = (at as usize + 4096).min(bytes.len());
                bytes[at as usize..end].fill(0);
            }
        }
    }
    assert!(mine == theirs, "the same boot image as create writes");
    drop(created);

    vm.start().unwrap();
    wait_for(&vm, Duration::from_secs(5), "guest metrics page", |m| {
        m.valid()
    });
    let a = vm.metrics().unwrap();
    settle(&vm, Duration::from_millis(300));
    let b = vm.metrics().unwrap();
    assert!(b.progress(0) > a.progress(0) + 10_000_000, "compute runs");
    for cpu in 0..2 {
        assert!(
            b.raw.cpu[cpu].ticks > a.raw.cpu[cpu].ticks,
            "vCPU {cpu} ticks"
        );
    }
    assert!(matches!(
        vm.install_boot_image(),
        Err(ferry_vmm::VmError::WrongState(_))
    ));
}

#[test]
fn compute_runs_at_native_speed_order() {
    if !kvm_usable() {
        return;
    }
    let vm = boot(64 * MIB, 1, "compute");
    let a = vm.metrics().unwrap();
    settle(&vm, Duration::from_secs(1));
    let b = vm.metrics().unwrap();
    let ops = ferry_vmm::metrics::rate(&a, &b, a.progress(0), b.progress(0));
    // A native CPL3 loop does ~1e9 adds/s; emulated code would manage ~1e6.
    assert!(ops > 1e8, "compute ops/s {ops:.3e}");
}

#[test]
fn dirty_rate_follows_the_request() {
    if !kvm_usable() {
        return;
    }
    for (rate_mib, pattern) in [(32u64, "seq"), (128, "random")] {
        let vm = boot(
            128 * MIB,
            1,
            &format!("dirty:rate={rate_mib},wss=32,pattern={pattern}"),
        );
        settle(&vm, Duration::from_millis(300));
        let a = vm.metrics().unwrap();
        settle(&vm, Duration::from_secs(2));
        let b = vm.metrics().unwrap();
        let got = ferry_vmm::metrics::rate(&a, &b, a.progress(0), b.progress(0)) / MIB as f64;
        let want = rate_mib as f64;
        assert!(
            (got - want).abs() < want * 0.2,
            "dirty rate {got:.1} MiB/s for a request of {want} MiB/s ({pattern})"
        );
    }
}

/// The dirty-rate probe (what a drain asks before it picks a mode) sees
/// what a migration's dirty rounds would: at least what the guest writes
/// (KVM may log more than was written, never less), no more distinct pages
/// than the working set, more for a faster writer, next to nothing for an
/// idle guest; and a probe leaves the log as it found it.
#[test]
fn the_dirty_rate_probe_measures_what_the_guest_writes() {
    if !kvm_usable() {
        return;
    }
    let probe = |vm: &Vm| {
        let (pages, secs) = vm.dirty_rate(Duration::from_millis(500)).unwrap();
        pages as f64 * 4096.0 / secs / MIB as f64
    };
    let mut rates = Vec::new();
    for rate in [16u64, 128] {
        let vm = boot(
            512 * MIB,
            1,
            &format!("dirty:rate={rate},wss=64,pattern=seq"),
        );
        settle(&vm, Duration::from_millis(300));
        let (a, b) = (probe(&vm), probe(&vm));
        for got in [a, b] {
            // At least 80% of the writes; at most the 64 MiB working set
            // in the half second.
            assert!(
                got >= rate as f64 * 0.8 && got <= 64.0 / 0.45,
                "{got:.1} MiB/s for a {rate} MiB/s writer over 64 MiB"
            );
        }
        rates.push(a);
    }
    assert!(
        rates[1] > rates[0],
        "a faster writer dirties more: {rates:?}"
    );
    let idle = boot(256 * MIB, 1, "idle");
    settle(&idle, Duration::from_millis(300));
    let rate = probe(&idle);
    assert!(rate < 1.0, "an idle guest dirties {rate:.2} MiB/s");
}

#[test]
fn memtouch_tasks_finish_with_plausible_times() {
    if !kvm_usable() {
        return;
    }
    let vm = boot(128 * MIB, 1, "memtouch:tasks=4,mib=8");
    let m = wait_for(&vm, Duration::from_secs(20), "memtouch tasks", |m| {
        m.tasks_done(0) == 4
    });
    assert_eq!(m.tasks().len(), 4);
    for t in m.tasks() {
        assert_eq!(t.state, task_state::DONE);
        assert_eq!(
            t.progress,
            8 * MIB,
            "each task touches every page of its 8 MiB"
        );
        let ms = m.task_ms(t).unwrap();
        assert!(ms > 0.0 && ms < 10_000.0, "task time {ms} ms");
    }
    // The guest really wrote one byte per page: check a page in host memory.
    let mut b = [0u8; 1];
    vm.memory()
        .read_bytes(ARENA_BASE + 5 * 4096, &mut b)
        .unwrap();
    assert_eq!(b[0], 5 | 1);
}

#[test]
fn sort_is_checked_by_the_guest() {
    if !kvm_usable() {
        return;
    }
    let vm = boot(128 * MIB, 1, "sort:mib=16");
    let m = wait_for(&vm, Duration::from_secs(30), "sort", |m| {
        m.tasks_done(0) == 1
    });
    assert_eq!(
        m.result(0),
        1,
        "guest reports the keys sorted and checksums equal"
    );
    assert_eq!(
        m.progress(0),
        8 * (16 * MIB / 8),
        "8 radix passes over every key"
    );
    assert!(vm
        .console_lines()
        .iter()
        .any(|l| l.contains("sorted, checksums match")));
}

#[test]
fn fill_writes_known_content() {
    if !kvm_usable() {
        return;
    }
    let vm = boot(64 * MIB, 1, "fill:content=best,mib=8");
    wait_for(&vm, Duration::from_secs(10), "fill", |m| {
        m.tasks_done(0) == 1
    });
    let mut page = vec![0u8; 4096];
    vm.memory()
        .read_bytes(ARENA_BASE + 3 * 4096, &mut page)
        .unwrap();
    assert!(
        page.iter().all(|&b| b == 3),
        "best-case page 3 is one repeated byte"
    );
}

#[test]
fn two_and_four_vcpus_all_run_tasks() {
    if !kvm_usable() {
        return;
    }
    for vcpus in [2u32, 4] {
        let vm = boot(64 * MIB, vcpus, &format!("compute:tasks={}", vcpus * 2));
        settle(&vm, Duration::from_millis(800));
        let m = vm.metrics().unwrap();
        let mut cpus: Vec<u64> = m.tasks().iter().map(|t| t.cpu).collect();
        cpus.sort();
        cpus.dedup();
        assert_eq!(
            cpus.len(),
            vcpus as usize,
            "tasks are spread over every vCPU"
        );
        for t in m.tasks() {
            assert!(t.progress > 0, "task on vCPU {} made no progress", t.cpu);
        }
        for (i, c) in m.raw.cpu[..vcpus as usize].iter().enumerate() {
            assert!(
                c.ticks > 10 && c.context_switches > 0,
                "vCPU {i} ticks {}",
                c.ticks
            );
        }
    }
}

#[test]
fn pause_stops_counters_and_resume_restarts_them() {
    if !kvm_usable() {
        return;
    }
    let vm = Arc::new(boot(64 * MIB, 2, "compute"));
    let dir = std::env::temp_dir().join(format!("ferry-pause-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("vm.sock");
    let _server = ControlServer::start(&sock, Arc::new(VmControl::new(vm.clone()))).unwrap();
    let mut ctl = ControlClient::connect(&sock).unwrap();
    settle(&vm, Duration::from_millis(200));

    ctl.call(&Request::Pause).unwrap();
    assert_eq!(ctl.call(&Request::Status).unwrap()["state"], "paused");
    let p1 = vm.metrics().unwrap().progress(0);
    std::thread::sleep(Duration::from_millis(300));
    let p2 = vm.metrics().unwrap().progress(0);
    assert_eq!(p1, p2, "counters must not move while paused");

    ctl.call(&Request::Resume).unwrap();
    settle(&vm, Duration::from_millis(300));
    let p3 = vm.metrics().unwrap().progress(0);
    assert!(
        p3 > p2 + 10_000_000,
        "counters advance after resume: {p2} -> {p3}"
    );

    ctl.call(&Request::Quit).unwrap();
    assert_eq!(vm.wait_exit(Duration::from_secs(5)), Some(VmExit::Stopped));
    drop(ctl);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The scheduling policy of thread `tid`.
fn policy(tid: u32) -> i32 {
    // SAFETY: the call only reads the named thread's policy.
    unsafe { libc::sched_getscheduler(tid as libc::pid_t) & !libc::SCHED_RESET_ON_FORK }
}

#[test]
fn a_pause_raises_the_vcpus_only_until_they_park() {
    if !kvm_usable() {
        return;
    }
    let vm = boot(64 * MIB, 2, "compute");
    settle(&vm, Duration::from_millis(200));
    let tids = vm.vcpu_tids();
    assert!(tids.iter().all(|&t| t != 0));
    // A migration's pause (its thread at real time since session 46) and
    // any other (control `pause`, at normal priority): the kicked vCPU
    // threads run at real time until each has parked, then never again.
    for real_time_caller in [true, false] {
        let raised = std::thread::scope(|s| {
            s.spawn(|| {
                let urgent = real_time_caller
                    .then(|| ferry_migration::priority::Urgent::enter("FERRY_TEST_PRIORITY"));
                vm.pause().expect("a pause");
                urgent.is_some_and(|u| u.raised())
            })
            .join()
            .unwrap()
        });
        if real_time_caller && !raised {
            eprintln!("NOTE: no CAP_SYS_NICE here: the pause ran at normal priority");
        }
        // Each parked thread lowers itself just after it counts as parked.
        let deadline = Instant::now() + Duration::from_secs(5);
        while tids.iter().any(|&t| policy(t) != libc::SCHED_OTHER) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        for &t in &tids {
            assert_eq!(
                policy(t),
                libc::SCHED_OTHER,
                "vCPU thread {t} parked raised"
            );
        }
        let p1 = vm.metrics().unwrap().progress(0);
        vm.resume().unwrap();
        settle(&vm, Duration::from_millis(300));
        assert!(
            vm.metrics().unwrap().progress(0) > p1,
            "the guest runs again"
        );
        for &t in &tids {
            assert_eq!(
                policy(t),
                libc::SCHED_OTHER,
                "vCPU thread {t} runs the guest raised"
            );
        }
    }
    vm.stop();
}

#[test]
fn bad_configs_are_refused_clearly() {
    let cfg = |mem, vcpus| VmConfig::new(mem, vcpus, "idle".parse().unwrap());
    let err = |c| {
        Vm::create(c)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(err(cfg(16 * MIB, 1)).contains("too small"));
    assert!(err(cfg(64 * MIB + 1, 1)).contains("multiple of the 4 KiB page"));
    assert!(err(cfg(64 * MIB, 0)).contains("out of range"));
    assert!(err(cfg(64 * MIB, 9)).contains("out of range"));
    let mut c = cfg(64 * MIB, 1);
    c.kvm_path = "/nonexistent/kvm".into();
    let e = err(c);
    assert!(
        e.contains("cannot open /nonexistent/kvm") && e.contains("KVM is not available"),
        "{e}"
    );
    let mut c = cfg(64 * MIB, 1);
    c.workloads = "memtouch:tasks=8,mib=64".parse().unwrap();
    assert!(err(c).contains("raise --mem"));
    let mut c = cfg(64 * MIB, 1);
    c.kernel = Some("/nonexistent/guest.elf".into());
    assert!(err(c).contains("cannot read guest kernel /nonexistent/guest.elf"));
}

#[test]
fn throttle_takes_vcpu_time_away_and_gives_it_back() {
    if !kvm_usable() {
        return;
    }
    let vm = boot(64 * MIB, 1, "compute");
    let rate = |vm: &Vm| {
        let a = vm.metrics().unwrap();
        settle(vm, Duration::from_millis(500));
        let b = vm.metrics().unwrap();
        ferry_vmm::metrics::rate(&a, &b, a.progress(0), b.progress(0))
    };
    let free = rate(&vm);
    vm.set_throttle(75);
    settle(&vm, Duration::from_millis(50));
    let throttled = rate(&vm);
    vm.set_throttle(0);
    settle(&vm, Duration::from_millis(50));
    // Another test's guest on the two cores can take a third of this
    // one's time in any window (and can only lower a window's rate: the
    // best of three is taken); a throttle left on would hold it near the
    // throttled rate.
    let came_back = |r: f64| r > free * 0.5 && r > throttled * 1.5;
    let mut after = rate(&vm);
    for _ in 0..2 {
        if came_back(after) {
            break;
        }
        after = after.max(rate(&vm));
    }
    assert!(
        throttled < free * 0.5,
        "75% throttle: {throttled:.3e} vs {free:.3e} ops/s"
    );
    assert!(
        came_back(after),
        "unthrottled again: {after:.3e} vs {free:.3e} free, {throttled:.3e} throttled ops/s"
    );
}
