//! The host info page: one page of VMM memory mapped into the guest at
//! [`HOST_INFO_GPA`] (in the 32-bit hole, outside RAM), which the VMM writes
//! and the guest reads with plain loads, without exits
//! (`struct ferry_host_info`).
//!
//! It is not guest RAM, so no migration copies it (and no postcopy fault can
//! stall a write to it): each VMM fills it itself. A booted VM starts at
//! zero; a restored one gets the count from its saved state
//! ([`crate::vm::VmState::migrations`]), and an incoming migration then adds
//! one before the vCPUs run, so the guest can tell the moment it runs on a
//! new host (memtouch `after=migrate` waits for it).

use std::mem::offset_of;

use ferry_memory::{MemfdRegion, RegionError};
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;

use crate::guest_abi::{HostInfo, HOST_INFO_GPA, MAX_RAM_RANGES};

/// The page's memslot: after every RAM slot (RAM uses slots 0 to
/// [`MAX_RAM_RANGES`] - 1).
const SLOT: u32 = 16;
const _: () = assert!((MAX_RAM_RANGES as u32) < SLOT);

const PAGE: u64 = 4096;

/// Why the page could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum HostInfoError {
    /// The page's memory could not be made.
    #[error("host info page: {0}")]
    Memory(#[from] RegionError),
    /// KVM refused the memslot.
    #[error("host info page: KVM KVM_SET_USER_MEMORY_REGION (host info page) failed: {0}")]
    Memslot(#[source] kvm_ioctls::Error),
}

/// The page, mapped into one VM.
pub struct HostInfoPage {
    page: MemfdRegion,
}

impl HostInfoPage {
    /// Makes a zeroed page and maps it into `vm` at [`HOST_INFO_GPA`]. The
    /// page must outlive the VM fd (the memslot points at it).
    pub fn new(vm: &VmFd) -> Result<Self, HostInfoError> {
        let page = MemfdRegion::new("ferry-host-info", HOST_INFO_GPA, PAGE)?;
        let region = kvm_userspace_memory_region {
            slot: SLOT,
            flags: 0,
            guest_phys_addr: HOST_INFO_GPA,
            memory_size: PAGE,
            userspace_addr: page.host_addr() as u64,
        };
        // SAFETY: the mapping lives as long as `page`, which the VM keeps
        // until after its VM fd is closed (field order in `Vm`); the slot
        // overlaps no RAM slot (the page is in the 32-bit hole).
        unsafe { vm.set_user_memory_region(region) }.map_err(HostInfoError::Memslot)?;
        Ok(HostInfoPage { page })
    }

    fn word(&self, offset: usize) -> *mut u64 {
        // SAFETY: `offset` is a field offset inside HostInfo, which fits in
        // the mapped page (checked in guest_abi), and 8-aligned.
        unsafe { self.page.host_addr().add(offset).cast::<u64>() }
    }

    /// Incoming migrations the guest has been told of.
    pub fn migrations(&self) -> u64 {
        // SAFETY: an aligned word of the live mapping (see `word`); the
        // guest only reads it, the VMM writes it with volatile stores.
        unsafe { self.word(offset_of!(HostInfo, migrations)).read_volatile() }
    }

    /// Sets the count the guest reads.
    pub fn set_migrations(&self, n: u64) {
        // SAFETY: as in `migrations`.
        unsafe {
            self.word(offset_of!(HostInfo, migrations))
                .write_volatile(n)
        }
    }
}
