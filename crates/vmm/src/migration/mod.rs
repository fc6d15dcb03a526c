//! The VMM side of migration, both directions: a [`Vm`] as the engine sees
//! it (the `ferry-migration` traits), and the calls that run a migration
//! from the control socket ([`source`]) or from `ferry run --incoming`
//! ([`destination`]). KVM specifics (dirty log, state encoding, the service
//! device) stay here. This file holds what both sides read of a VM.

pub mod destination;
pub mod source;

pub use destination::WaitingDestination;
pub use source::{migrate, resume};

use ferry_migration::{GpaBytes, OffsetBytes, RegionView};

use crate::guest_abi::{SVC_GPA, SVC_HEADER_SIZE, SVC_SLOTS, SVC_SLOT_SIZE};
use crate::vm::Vm;

/// The service ring: the device writes requests into it from the host,
/// which KVM's dirty log does not see.
pub(crate) fn service_ring(vm: &Vm) -> Vec<GpaBytes> {
    match vm.service() {
        Some(_) => vec![GpaBytes::new(
            SVC_GPA,
            SVC_HEADER_SIZE + SVC_SLOTS as u64 * SVC_SLOT_SIZE,
        )],
        None => Vec::new(),
    }
}

pub(crate) fn views(vm: &Vm) -> Vec<RegionView> {
    vm.memory()
        .regions()
        .iter()
        // SAFETY: each view names a region of the VM's guest memory, which
        // the VM keeps mapped for as long as it lives; the engine's views
        // are used only while the engine holds a reference to the VM.
        .map(|r| unsafe { RegionView::new(r.gpa(), r.size(), r.host_addr()) })
        .collect()
}

pub(crate) fn data_ranges(vm: &Vm, index: usize) -> Vec<OffsetBytes> {
    vm.memory().regions().get(index).map_or(Vec::new(), |r| {
        r.data_ranges()
            .into_iter()
            .map(|(o, l)| OffsetBytes::new(o, l))
            .collect()
    })
}

/// The guest's 'page not present' events, all vCPUs (its metrics page):
/// both sides of a postcopy read it.
fn guest_apf_count(vm: &Vm) -> Option<u64> {
    let m = vm.metrics().ok()?;
    m.valid().then(|| m.cpu_totals().apf_not_present)
}
