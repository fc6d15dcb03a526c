//! The KVM VM: in-kernel irqchip and PIT, guest RAM as memslots.

use ferry_memory::GuestMemory;
use std::os::fd::AsRawFd;

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_enable_cap, kvm_pit_config, kvm_userspace_memory_region,
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};

use super::kvm::KvmError;

/// Where KVM may put its TSS for real-mode emulation on VMX: inside the 32-bit hole.
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

fn ioctl(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> KvmError {
    move |source| KvmError::Ioctl { op, source }
}

/// Creates a VM with an in-kernel irqchip (LAPICs, IOAPIC, PIC) and PIT.
pub fn create_vm(kvm: &Kvm) -> Result<VmFd, KvmError> {
    let vm = kvm.create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
    vm.set_tss_address(KVM_TSS_ADDRESS)
        .map_err(ioctl("KVM_SET_TSS_ADDR"))?;
    vm.create_irq_chip().map_err(ioctl("KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(ioctl("KVM_CREATE_PIT2"))?;
    Ok(vm)
}

/// Registers every memory region as a memslot (slot n = region n), with
/// KVM's dirty page log on or off.
pub fn register_memory(vm: &VmFd, memory: &GuestMemory, dirty_log: bool) -> Result<(), KvmError> {
    for (slot, region) in memory.regions().iter().enumerate() {
        let mem_region = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: if dirty_log {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
            guest_phys_addr: region.gpa(),
            memory_size: region.size(),
            userspace_addr: region.host_addr() as u64,
        };
        // SAFETY: the region's mapping stays valid as long as `memory`, which the
        // VMM keeps alive for longer than the VM fd; the slots do not overlap
        // because GuestMemory refuses overlapping regions.
        unsafe { vm.set_user_memory_region(mem_region) }
            .map_err(ioctl("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(())
}

/// Per memslot, the pages written since the last call (KVM clears the log).
pub fn take_dirty_log(vm: &VmFd, memory: &GuestMemory) -> Result<Vec<Vec<u64>>, KvmError> {
    memory
        .regions()
        .iter()
        .enumerate()
        .map(|(slot, r)| {
            vm.get_dirty_log(slot as u32, r.size() as usize)
                .map_err(ioctl("KVM_GET_DIRTY_LOG"))
        })
        .collect()
}

/// Switches the VM's dirty log to manual protection
/// (KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, with INITIALLY_SET where offered):
/// reading the log leaves pages writable, and [`clear_dirty_log`]
/// re-protects only the pages it is given, so a reader that wants some
/// pages' writes does not make the guest pay a fault for every page it
/// writes. With INITIALLY_SET, turning logging on marks every page dirty
/// instead of write-protecting them all. False where KVM lacks the
/// capability (the classic log stays: each read re-protects what it
/// returns). Enabling it again (a VM handed over) is allowed.
pub fn enable_manual_dirty_log(vm: &VmFd) -> Result<bool, KvmError> {
    let offered = vm.check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into());
    if offered <= 0 {
        return Ok(false);
    }
    let mut flags = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE);
    if offered as u64 & u64::from(KVM_DIRTY_LOG_INITIALLY_SET) != 0 {
        flags |= u64::from(KVM_DIRTY_LOG_INITIALLY_SET);
    }
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
        ..Default::default()
    };
    cap.args[0] = flags;
    vm.enable_cap(&cap)
        .map_err(ioctl("KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)"))?;
    Ok(true)
}

/// KVM_CLEAR_DIRTY_LOG: `_IOWR(KVMIO, 0xc0, struct kvm_clear_dirty_log)`.
const KVM_CLEAR_DIRTY_LOG: u64 =
    (3 << 30) | ((std::mem::size_of::<kvm_clear_dirty_log>() as u64) << 16) | (0xAE << 8) | 0xc0;

/// Manual-protect mode only: clears the dirty bits set in `bits` (per
/// memslot, bit i of word i/64 = page i) and write-protects those pages
/// again, so their next write is logged. Pages whose bit is not given are
/// left as they are; give only bits a read of the log returned, or a write
/// that landed after it would be cleared unseen.
pub fn clear_dirty_log(vm: &VmFd, memory: &GuestMemory, bits: &[Vec<u64>]) -> Result<(), KvmError> {
    for (slot, (region, words)) in memory.regions().iter().zip(bits).enumerate() {
        if words.iter().all(|&w| w == 0) {
            continue;
        }
        let pages = region.size() / ferry_memory::PAGE_SIZE;
        // KVM reads num_pages/64 words (rounded up) from the bitmap, and
        // writes none. A bitmap of KVM's own shape (what a read of the log
        // returns) goes as it is: copying it meant a fresh buffer, whose
        // first touches cost more than the rest of the call (in the pause).
        let words_needed = pages.div_ceil(64) as usize;
        let mut padded;
        let bitmap: &[u64] = if words.len() >= words_needed {
            words
        } else {
            padded = words.clone();
            padded.resize(words_needed, 0);
            &padded
        };
        let mut arg = kvm_clear_dirty_log {
            slot: slot as u32,
            num_pages: pages as u32,
            first_page: 0,
            ..Default::default()
        };
        arg.__bindgen_anon_1.dirty_bitmap = bitmap.as_ptr().cast_mut().cast();
        // SAFETY: KVM_CLEAR_DIRTY_LOG takes a kvm_clear_dirty_log, whose
        // bitmap pointer covers num_pages bits: `bitmap` holds at least
        // ceil(pages/64) words and outlives the call; KVM only reads it
        // (copy_from_user); the fd is the VM's.
        let r = unsafe { libc::ioctl(vm.as_raw_fd(), KVM_CLEAR_DIRTY_LOG as _, &mut arg) };
        if r < 0 {
            return Err(KvmError::Ioctl {
                op: "KVM_CLEAR_DIRTY_LOG",
                source: kvm_ioctls::Error::last(),
            });
        }
    }
    Ok(())
}
