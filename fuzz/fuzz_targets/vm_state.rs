//! A VM's state from a source (the State message; also a handover's): the
//! versioned envelope and its postcard `VmState` (every vCPU's registers,
//! XSAVE, MSRs, LAPIC, events; the irqchips, PIT and clock; the service
//! device's ring state; the migration count; after it, each disk's device
//! state when there are disks), decoded by `VmState::decode` as the
//! destination does, then each part's own check
//! before KVM would take it (`persist::restore_parts`: the MSR list and
//! the XSAVE region; `ServiceState::check`: the ring's slots).
//!
//! Checks: a decoded state re-encodes stably; restore_parts accepts
//! exactly a 1024-word XSAVE region and an MSR list KVM's structure holds,
//! and builds them from the state's own values; a service state is
//! accepted exactly when its slots are distinct ring slots and its next id
//! is not 0.
#![no_main]

use ferry_vmm::vstate::persist;
use ferry_vmm::VmState;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_fuzz::init();
    let Ok(state) = VmState::decode(data) else {
        return;
    };
    let once = state.encode().expect("a decoded state encodes");
    let again = VmState::decode(&once).expect("and decodes");
    assert_eq!(again.encode().expect("encodes"), once, "unstable encoding");
    assert_eq!(again.disks, state.disks);
    for v in &state.vcpus {
        match persist::restore_parts(v) {
            Ok((msrs, xsave)) => {
                assert_eq!(v.xsave.len(), 1024);
                assert_eq!(&xsave.region[..], &v.xsave[..]);
                assert_eq!(msrs.as_slice(), &v.msrs[..]);
            }
            Err(e) => {
                assert!(v.xsave.len() != 1024 || v.msrs.len() > 256, "refused: {e}");
            }
        }
    }
    if let Some(s) = &state.service {
        let mut seen = std::collections::HashSet::new();
        let fine = s.next_conn != 0
            && s.free_slots
                .iter()
                .all(|&i| usize::from(i) < ferry_vmm::guest_abi::SVC_SLOTS && seen.insert(i));
        assert_eq!(s.check().is_ok(), fine);
    }
});
