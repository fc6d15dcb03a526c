//! The KVM VM: in-kernel irqchip and PIT, guest RAM as memslots.

use ferry_memory::GuestMemory;
use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
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
