//! VM state save/restore on real KVM: a running guest is paused, its state
//! saved, encoded and decoded, and a second VM built from that state and a
//! copy of the memory carries on where the first stopped.

mod common;
use common::kvm_usable;

use std::time::{Duration, Instant};

use ferry_vmm::vstate::persist::{self, PersistError};
use ferry_vmm::{Vm, VmConfig, VmState};

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
    let mut buf = vec![0u8; 4 * MIB as usize];
    for r in a.memory().regions() {
        for off in (0..r.size()).step_by(buf.len()) {
            let n = buf.len().min((r.size() - off) as usize);
            a.memory().read_bytes(r.gpa() + off, &mut buf[..n]).unwrap();
            b.memory().write_bytes(r.gpa() + off, &buf[..n]).unwrap();
        }
    }
    b.restore_state(&state).unwrap();
    a.stop();
    b.start().unwrap();
    let start = b.metrics().unwrap();
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
    bytes[8] = 1;
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
