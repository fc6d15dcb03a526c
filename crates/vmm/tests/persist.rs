//! VM state save/restore on real KVM: a running guest is paused, its state
//! saved, encoded and decoded, and a second VM built from that state and a
//! copy of the memory carries on where the first stopped.

mod common;
use common::kvm_usable;

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_memory::GuestMemory;
use ferry_vmm::devices::service::wire::{self, Op, Request, Response, Status};
use ferry_vmm::guest_abi::SVC_SLOTS;
use ferry_vmm::vstate::persist::{self, PersistError};
use ferry_vmm::{Vm, VmConfig, VmError, VmState};

const MIB: u64 = 1 << 20;

fn config() -> VmConfig {
    VmConfig::new(
        64 * MIB,
        2,
        "compute:tasks=2+dirty:rate=32,wss=8".parse().unwrap(),
    )
}

fn wait_valid(vm: &Vm) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !vm.metrics().unwrap().valid() {
        assert!(Instant::now() < deadline, "guest never published metrics");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_restored_vm_carries_on_where_the_saved_one_stopped() {
    if !kvm_usable() {
        return;
    }
    let a = Vm::create(config()).unwrap();
    a.start().unwrap();
    wait_valid(&a);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        matches!(a.save_state(), Err(ferry_vmm::VmError::WrongState(_))),
        "running VMs refuse"
    );
    a.pause().unwrap();
    let saved = a.save_state().unwrap();
    let at_pause = a.metrics().unwrap();
    assert!(at_pause.progress(0) > 0 && at_pause.progress(1) > 0);

    // Encode and decode: the same state comes back.
    let bytes = persist::encode(&saved).unwrap();
    let state: VmState = persist::decode(&bytes).unwrap();
    assert_eq!(state.vcpus.len(), 2);
    for (x, y) in saved.vcpus.iter().zip(&state.vcpus) {
        assert_eq!(x.regs.rip, y.regs.rip);
        assert_eq!(x.sregs.cr3, y.sregs.cr3);
        assert_eq!(x.xsave, y.xsave);
        assert_eq!(x.lapic.regs, y.lapic.regs);
        assert_eq!(x.msrs.len(), y.msrs.len());
        assert!(
            x.msrs
                .iter()
                .any(|m| m.index == 0x4b56_4d02 && m.data & 1 == 1),
            "async PF enabled"
        );
    }

    // A second VM gets A's memory and state, then runs instead of A.
    let b = Vm::create(config()).unwrap();
    copy_between(a.memory(), b.memory());
    b.restore_state(&state).unwrap();
    a.stop();
    // Read before the start: once running, B's guest may count on before a
    // read here (a race, not a restore fault).
    let start = b.metrics().unwrap();
    b.start().unwrap();
    assert_eq!(
        start.progress(0),
        at_pause.progress(0),
        "B starts exactly where A paused"
    );
    if let Some(exit) = b.wait_exit(Duration::from_millis(700)) {
        panic!(
            "restored VM stopped: {exit}\n{}",
            b.console_lines().join("\n")
        );
    }
    let later = b.metrics().unwrap();
    assert!(
        later.progress(0) > at_pause.progress(0) + 100_000_000,
        "compute carries on"
    );
    assert!(later.progress(1) > at_pause.progress(1), "dirty carries on");
    for cpu in 0..2 {
        assert!(
            later.raw.cpu[cpu].ticks > at_pause.raw.cpu[cpu].ticks + 20,
            "vCPU {cpu} ticks"
        );
    }
    assert!(matches!(
        b.restore_state(&state),
        Err(ferry_vmm::VmError::WrongState(_))
    ));
}

/// A destination makes its vCPU threads before the state comes
/// (`prepare_incoming`, so the switch does not wait for them): parked, the
/// VM still waits and refuses a resume, takes the state through the parked
/// threads, and carries on once started.
#[test]
fn an_incoming_vm_with_threads_made_ahead_restores_through_them_and_carries_on() {
    if !kvm_usable() {
        return;
    }
    let a = Vm::create(config()).unwrap();
    a.start().unwrap();
    wait_valid(&a);
    std::thread::sleep(Duration::from_millis(300));
    a.pause().unwrap();
    let state = a.save_state().unwrap();
    let at_pause = a.metrics().unwrap();

    let b = Vm::create(config()).unwrap();
    b.prepare_incoming().unwrap();
    b.prepare_incoming().unwrap(); // a second time: nothing more
    assert_eq!(b.reported_state(), ferry_vmm::ReportedState::Waiting);
    assert!(!b.has_started());
    assert!(
        matches!(b.resume(), Err(VmError::WrongState(w)) if w.contains("incoming")),
        "a resume must not run vCPUs that have no state"
    );
    copy_between(a.memory(), b.memory());
    a.stop();
    // A second State replaces the first whole (a source sends State again
    // after an early one): both go through the parked threads.
    b.restore_state(&state).unwrap();
    b.restore_state(&state).unwrap();
    assert_eq!(b.reported_state(), ferry_vmm::ReportedState::Waiting);
    b.start().unwrap();
    assert_eq!(b.reported_state(), ferry_vmm::ReportedState::Running);
    if let Some(exit) = b.wait_exit(Duration::from_millis(700)) {
        panic!(
            "restored VM stopped: {exit}\n{}",
            b.console_lines().join("\n")
        );
    }
    let later = b.metrics().unwrap();
    assert!(
        later.progress(0) > at_pause.progress(0) + 100_000_000,
        "compute carries on"
    );
    // Paused again, its state is read through the threads' lent fds.
    b.pause().unwrap();
    let again = b.save_state().unwrap();
    assert_eq!(again.vcpus.len(), 2);
    assert!(matches!(
        b.restore_state(&state),
        Err(VmError::WrongState(_))
    ));
    b.stop();
}

#[test]
fn a_vm_that_stops_while_its_threads_wait_for_its_state_stops_cleanly() {
    if !kvm_usable() {
        return;
    }
    // An incoming migration that failed: the parked threads end with the VM.
    let b = Vm::create(config()).unwrap();
    b.prepare_incoming().unwrap();
    let t = Instant::now();
    let exit = b.stop();
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "stopped in {:?}",
        t.elapsed()
    );
    assert_eq!(exit.to_string(), ferry_vmm::VmExit::Stopped.to_string());
}

#[test]
fn hostile_state_bytes_are_refused() {
    assert!(matches!(
        persist::decode::<VmState>(b"garbage"),
        Err(PersistError::Envelope { .. })
    ));
    let mut bytes = persist::encode(&vec![1u32, 2, 3]).unwrap();
    bytes[8] = 9;
    assert!(matches!(
        persist::decode::<Vec<u32>>(&bytes),
        Err(PersistError::Envelope { found: 9 })
    ));
    bytes[8] = persist::STATE_VERSION as u8;
    assert!(
        persist::decode::<Vec<u32>>(&bytes[..bytes.len() - 1]).is_err(),
        "truncated"
    );
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        persist::decode::<Vec<u32>>(&long),
        Err(PersistError::Decode(_))
    ));
    assert_eq!(persist::decode::<Vec<u32>>(&bytes).unwrap(), vec![1, 2, 3]);
}

const VALUE: usize = 64;

fn kv_config() -> VmConfig {
    let mut c = VmConfig::new(
        64 * MIB,
        2,
        format!("kv:workers=2,keys=1024,value={VALUE}")
            .parse()
            .unwrap(),
    );
    c.serve = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    c
}

/// A client connection to a VM's service device.
struct Client {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Client {
    fn connect(vm: &Vm) -> Client {
        let s = TcpStream::connect(vm.service().unwrap().local_addr()).unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Client {
            w: s.try_clone().unwrap(),
            r: BufReader::new(s),
        }
    }

    fn send(&mut self, req: &Request) {
        self.w.write_all(&req.encode()).unwrap();
    }

    fn call(&mut self, req: &Request) -> Response {
        self.send(req);
        let body = wire::read_frame(&mut self.r, wire::MAX_BODY)
            .unwrap()
            .expect("an answer");
        Response::decode(&body).unwrap()
    }

    fn set(&mut self, key: u64, seed: u64) -> Request {
        Request {
            op: Op::Set,
            id: key,
            key,
            seed,
            value: wire::value(VALUE, key, seed),
        }
    }

    /// GETs `key` and checks it holds the value SET with `seed`.
    fn expect(&mut self, key: u64, seed: u64) {
        let resp = self.call(&Request::new(Op::Get, key, key, 0));
        assert_eq!(resp.status, Status::Ok, "{}", resp.message());
        assert_eq!(resp.seed, seed, "key {key} holds the value last SET");
        assert_eq!(resp.value, wire::value(VALUE, key, seed));
    }
}

fn wait_until(what: &str, vm: &Vm, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        if let Some(exit) = vm.wait_exit(Duration::from_millis(5)) {
            panic!(
                "VM stopped waiting for {what}: {exit}\n{}",
                vm.console_lines().join("\n")
            );
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
    }
}

/// Every region's bytes in fresh memory of the same layout.
fn copy_memory(config: &VmConfig, from: &GuestMemory) -> Arc<GuestMemory> {
    let to = config.new_memory().unwrap();
    copy_between(from, &to);
    to
}

/// Copies every region of `from` into `to` (same layout).
fn copy_between(from: &GuestMemory, to: &GuestMemory) {
    let mut buf = vec![0u8; 4 * MIB as usize];
    for r in from.regions() {
        for off in (0..r.size()).step_by(buf.len()) {
            let n = buf.len().min((r.size() - off) as usize);
            from.read_bytes(r.gpa() + off, &mut buf[..n]).unwrap();
            to.write_bytes(r.gpa() + off, &buf[..n]).unwrap();
        }
    }
}

#[test]
fn a_vm_built_around_saved_memory_restores_its_service_and_finishes_requests_in_the_ring() {
    if !kvm_usable() {
        return;
    }
    let a = Vm::create(kv_config()).unwrap();
    a.start().unwrap();
    wait_valid(&a);
    let svc_a = a.service().unwrap().clone();
    wait_until("the kv service", &a, || svc_a.guest_ready());
    let mut c1 = Client::connect(&a);
    let req = c1.set(7, 1);
    assert_eq!(c1.call(&req).status, Status::Ok);
    c1.expect(7, 1);

    // Paused, the guest answers nothing: a second client's SET stays in the ring.
    a.pause().unwrap();
    let mut c2 = Client::connect(&a);
    let req = c2.set(9, 2);
    c2.send(&req);
    wait_until("the SET posted into the ring", &a, || {
        svc_a.stats.posted.load(Ordering::Relaxed) == 3
    });
    let saved = a.save_state().unwrap();
    let svc_saved = saved.service.clone().expect("service state saved");
    assert_eq!(svc_saved.next_conn, 3, "two connections so far");
    assert_eq!(
        svc_saved.free_slots.len(),
        SVC_SLOTS - 1,
        "one slot in flight"
    );
    let state: VmState = persist::decode(&persist::encode(&saved).unwrap()).unwrap();
    assert_eq!(state.service.as_ref(), Some(&svc_saved));
    let at_pause = a.metrics().unwrap();

    // B: built around a copy of A's memory, nothing written; A's state restored.
    let memory = copy_memory(&kv_config(), a.memory());
    a.stop();
    let b = Vm::build(kv_config(), memory).unwrap();
    let svc_b = b.service().unwrap().clone();
    assert_ne!(
        svc_b.local_addr(),
        svc_a.local_addr(),
        "B listens on its own port"
    );
    b.restore_state(&state).unwrap();
    let restored = svc_b.state();
    assert_eq!(restored.next_conn, svc_saved.next_conn);
    assert_eq!(restored.free_slots, svc_saved.free_slots);
    assert_eq!(
        restored.port,
        svc_b.local_addr().port(),
        "B keeps its own port"
    );
    // Read before B runs: once started it may at once answer the request
    // left in the ring and count it.
    assert_eq!(
        b.metrics().unwrap().progress(0),
        at_pause.progress(0),
        "B starts exactly where A paused"
    );
    b.start().unwrap();

    // B finishes the SET left in the ring (its client stayed with A: the
    // answer goes nowhere) and gets the slot back.
    wait_until("the SET in the ring answered", &b, || {
        svc_b.stats.responses.load(Ordering::Relaxed) == 1
            && svc_b.state().free_slots.len() == SVC_SLOTS
    });
    assert_eq!(svc_b.stats.guest_errors.load(Ordering::Relaxed), 0);

    // A new client at B sees both SETs; its connection id comes after A's.
    let mut c3 = Client::connect(&b);
    c3.expect(7, 1);
    c3.expect(9, 2);
    assert_eq!(svc_b.state().next_conn, svc_saved.next_conn + 1);
    if let Some(exit) = b.wait_exit(Duration::from_millis(300)) {
        panic!(
            "restored VM stopped: {exit}\n{}",
            b.console_lines().join("\n")
        );
    }
    let later = b.metrics().unwrap();
    assert!(
        later.progress(0) >= at_pause.progress(0) + 3,
        "kv carries on: {} -> {}",
        at_pause.progress(0),
        later.progress(0)
    );
    for cpu in 0..2 {
        assert!(
            later.raw.cpu[cpu].ticks > at_pause.raw.cpu[cpu].ticks + 10,
            "vCPU {cpu} ticks"
        );
    }
}

#[test]
fn a_service_state_and_the_vm_must_agree() {
    if !kvm_usable() {
        return;
    }
    let with = Vm::create(kv_config()).unwrap();
    let saved_with = with.save_state().unwrap();
    let without = Vm::create(config()).unwrap();
    let saved_without = without.save_state().unwrap();
    assert!(matches!(
        without.restore_state(&saved_with),
        Err(VmError::ServiceMissing)
    ));
    assert!(matches!(
        with.restore_state(&saved_without),
        Err(VmError::ServiceUnexpected)
    ));
    let mut bad = saved_with.clone();
    bad.service.as_mut().unwrap().free_slots = vec![1, 1];
    assert!(matches!(with.restore_state(&bad), Err(VmError::Service(_))));
    bad.service.as_mut().unwrap().free_slots = vec![SVC_SLOTS as u16];
    assert!(matches!(with.restore_state(&bad), Err(VmError::Service(_))));
    with.restore_state(&saved_with).unwrap();
}

#[test]
fn build_refuses_memory_of_another_layout() {
    // Checked before KVM is opened: runs without KVM too.
    let wrong = |ranges: &[(u64, u64)]| {
        let memory = Arc::new(GuestMemory::new(ranges).unwrap());
        match Vm::build(config(), memory) {
            Err(e @ VmError::MemoryMismatch { .. }) => e.to_string(),
            Err(e) => panic!("{ranges:x?}: wrong error {e}"),
            Ok(_) => panic!("{ranges:x?}: accepted"),
        }
    };
    let e = wrong(&[(0, 32 * MIB)]);
    assert!(e.contains("do not match"), "{e}");
    wrong(&[(0, 128 * MIB)]);
    wrong(&[(0, 32 * MIB), (32 * MIB, 32 * MIB)]);
    wrong(&[(2 * MIB, 64 * MIB)]);
}

/// memtouch after=migrate on a VM moved by hand (pause, save, copy memory,
/// restore, count the migration, start): its tasks fill and wait on the
/// source, and run only where the migration was counted, timed from there.
#[test]
fn memtouch_after_migrate_waits_for_the_move_and_times_from_it() {
    if !kvm_usable() {
        return;
    }
    let config = VmConfig::new(
        128 * MIB,
        2,
        "memtouch:tasks=4,mib=8,after=migrate".parse().unwrap(),
    );
    let a = Vm::create(config.clone()).unwrap();
    assert_eq!(a.migrations(), 0, "a booted VM starts at zero");
    a.start().unwrap();
    wait_valid(&a);
    wait_until("memtouch tasks ready", &a, || {
        a.metrics().unwrap().tasks_ready(0) == 4
    });
    // Filled and waiting: nothing touched, nothing timed, nobody done.
    std::thread::sleep(Duration::from_millis(100));
    let m = a.metrics().unwrap();
    assert_eq!((m.progress(0), m.tasks_done(0)), (0, 0));
    assert!(m.tasks().iter().all(|t| t.start_tsc == 0));
    assert_eq!(m.raw.workloads[0].signal_tsc, 0);
    let filled = a.memory().read_obj::<u64>(0x100_0000 + 8).unwrap();
    assert_ne!(filled, 0, "the region holds random data");

    a.pause().unwrap();
    let saved = a.save_state().unwrap();
    assert_eq!(saved.migrations, 0);
    let state: VmState = persist::decode(&persist::encode(&saved).unwrap()).unwrap();
    let b = Vm::build(config.clone(), copy_memory(&config, a.memory())).unwrap();
    b.restore_state(&state).unwrap();
    assert_eq!(b.migrations(), 0, "restore keeps the saved count");
    assert_eq!(b.count_incoming_migration().unwrap(), 1);
    a.stop();
    b.start().unwrap();
    assert!(
        matches!(b.count_incoming_migration(), Err(VmError::WrongState(_))),
        "only before start"
    );
    wait_until("memtouch tasks done", &b, || {
        b.metrics().unwrap().tasks_done(0) == 4
    });
    let m = b.metrics().unwrap();
    let signal = m.raw.workloads[0].signal_tsc;
    assert_ne!(signal, 0);
    for t in m.tasks() {
        assert_eq!(t.start_tsc, signal, "every task is timed from the move");
        assert!(t.end_tsc > signal);
        assert_eq!(t.progress, 8 * MIB);
    }
    assert_eq!(m.progress(0), 4 * 8 * MIB);
    assert!(b
        .console_lines()
        .iter()
        .any(|l| l.contains("after the move")));
}

/// Disks' device states ride after the rest of the state, only when there
/// are disks: a state without them is what builds before disks wrote (and
/// read); one with them is refused by a reader that knows no tail, never
/// taken with its disks dropped.
#[test]
fn a_tail_is_carried_only_when_there_is_one() {
    let head = vec![1u32, 2, 3];
    let plain = persist::encode(&head).unwrap();
    assert_eq!(
        persist::encode_with_tail::<_, Vec<u8>>(&head, None).unwrap(),
        plain
    );
    let (h, t) = persist::decode_with_tail::<Vec<u32>, Vec<u8>>(&plain).unwrap();
    assert_eq!((h, t), (head.clone(), None));
    let tailed = persist::encode_with_tail(&head, Some(&vec![9u8, 8])).unwrap();
    let (h, t) = persist::decode_with_tail::<Vec<u32>, Vec<u8>>(&tailed).unwrap();
    assert_eq!((h, t), (head, Some(vec![9, 8])));
    assert!(matches!(
        persist::decode::<Vec<u32>>(&tailed),
        Err(PersistError::Decode(_))
    ));
    let mut long = tailed.clone();
    long.push(0);
    assert!(persist::decode_with_tail::<Vec<u32>, Vec<u8>>(&long).is_err());
    assert!(persist::decode_with_tail::<Vec<u32>, Vec<u8>>(&tailed[..tailed.len() - 1]).is_err());
}
