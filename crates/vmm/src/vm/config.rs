//! How to build a VM ([`VmConfig`]): size, vCPUs, workloads, devices, and
//! the checks that need no KVM. Apart from the VM so that what a front end
//! fills in, and what is refused before anything is built, reads on its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use ferry_memory::GuestMemory;

use super::VmError;
use crate::access::AccessConfig;
use crate::boot::layout::MemoryLayout;
use crate::boot::loader::KernelError;
use crate::devices::serial::ConsoleSink;
use crate::guest_abi;
use crate::workload::WorkloadSet;

/// How to build a VM.
#[derive(Clone)]
pub struct VmConfig {
    /// Guest RAM in bytes.
    pub mem_bytes: u64,
    /// Number of vCPUs (1..=8).
    pub vcpus: u32,
    /// What the guest runs.
    pub workloads: WorkloadSet,
    /// Guest kernel ELF; `None` = the one built into ferry.
    pub kernel: Option<PathBuf>,
    /// Let the guest use KVM asynchronous page faults.
    pub apf: bool,
    /// Guest timer interrupts per second per vCPU.
    pub tick_hz: u32,
    /// Seed for the workloads' random numbers.
    pub seed: u64,
    /// The KVM device.
    pub kvm_path: String,
    /// Where guest console lines go (besides being kept for reports).
    pub console: Option<ConsoleSink>,
    /// TCP address of the service device (port 0 picks one); `None` = no
    /// device, unless a `kv` workload runs (then 127.0.0.1, any port).
    pub serve: Option<SocketAddr>,
    /// The VM's own IP address on the hosts' network (added to the
    /// interface whose subnet holds it): the service listens there, and
    /// its clients move with the VM at a migration. Needs CAP_NET_ADMIN.
    pub vm_address: Option<std::net::Ipv4Addr>,
    /// Track page accesses while the VM runs (split migration ranks
    /// memory by them); `None` = off.
    pub access: Option<AccessConfig>,
    /// Virtio-blk disks, in order (docs/disks.md).
    pub disks: Vec<crate::devices::block::DiskSpec>,
}

impl VmConfig {
    /// A config with ferry's defaults for everything but size and workload.
    pub fn new(mem_bytes: u64, vcpus: u32, workloads: WorkloadSet) -> Self {
        VmConfig {
            mem_bytes,
            vcpus,
            workloads,
            kernel: None,
            apf: true,
            tick_hz: 100,
            seed: 0x5eed_f0e1,
            kvm_path: "/dev/kvm".into(),
            console: None,
            serve: None,
            vm_address: None,
            access: None,
            disks: Vec::new(),
        }
    }

    /// Fresh (zeroed, unpopulated) guest memory in this config's RAM layout,
    /// the memory [`Vm::create`](super::Vm::create) builds its VM around.
    pub fn new_memory(&self) -> Result<Arc<GuestMemory>, VmError> {
        let layout = MemoryLayout::for_size(self.mem_bytes)?;
        Ok(Arc::new(GuestMemory::new(layout.ranges())?))
    }

    /// The guest kernel image: the file given, or the built-in one.
    pub(super) fn kernel_image(&self) -> Result<std::borrow::Cow<'static, [u8]>, KernelError> {
        match &self.kernel {
            Some(path) => std::fs::read(path)
                .map(Into::into)
                .map_err(|source| KernelError::Read {
                    path: path.display().to_string(),
                    source,
                }),
            None => Ok(crate::boot::GUEST_KERNEL.into()),
        }
    }

    /// Checks what can be checked without KVM; returns the RAM layout.
    pub(super) fn check(&self) -> Result<MemoryLayout, VmError> {
        if self.vcpus == 0 || self.vcpus as usize > guest_abi::MAX_CPUS {
            return Err(VmError::VcpuCount(self.vcpus));
        }
        if !(1..=1000).contains(&self.tick_hz) {
            return Err(VmError::TickRate(self.tick_hz));
        }
        let layout = MemoryLayout::for_size(self.mem_bytes)?;
        self.workloads
            .check_fits(self.vcpus, layout.arena_bytes())?;
        if self.disks.len() > crate::devices::block::MAX_DISKS {
            return Err(VmError::Disk(crate::devices::block::BlockError::TooMany));
        }
        if let Some(d) = self.workloads.disk() {
            if d.disk as usize >= self.disks.len() {
                return Err(VmError::NoDisk {
                    index: d.disk,
                    disks: self.disks.len(),
                });
            }
        }
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boot::layout::LayoutError;
    use crate::workload::SpecError;

    const MIB: u64 = 1 << 20;

    fn config(mem: u64, vcpus: u32, workloads: &str) -> VmConfig {
        VmConfig::new(mem, vcpus, workloads.parse().unwrap())
    }

    #[test]
    fn defaults_are_ferrys() {
        let c = config(64 * MIB, 2, "idle");
        assert!(c.apf);
        assert_eq!(c.tick_hz, 100);
        assert_eq!(c.kvm_path, "/dev/kvm");
        assert!(c.kernel.is_none() && c.serve.is_none() && c.vm_address.is_none());
        assert!(c.access.is_none() && c.console.is_none());
    }

    #[test]
    fn a_good_config_gives_its_ram_layout() {
        let layout = config(64 * MIB, 2, "compute").check().unwrap();
        assert_eq!(layout.total(), 64 * MIB);
        let memory = config(64 * MIB, 2, "compute").new_memory().unwrap();
        let found: Vec<(u64, u64)> = memory
            .regions()
            .iter()
            .map(|r| (r.gpa(), r.size()))
            .collect();
        assert_eq!(found, layout.ranges());
    }

    #[test]
    fn vcpu_count_and_tick_rate_are_bounded() {
        let max = guest_abi::MAX_CPUS as u32;
        assert!(config(64 * MIB, max, "idle").check().is_ok());
        for n in [0, max + 1] {
            assert!(matches!(
                config(64 * MIB, n, "idle").check(),
                Err(VmError::VcpuCount(got)) if got == n
            ));
        }
        for hz in [0, 1001] {
            let mut c = config(64 * MIB, 1, "idle");
            c.tick_hz = hz;
            assert!(matches!(c.check(), Err(VmError::TickRate(got)) if got == hz));
        }
        let mut c = config(64 * MIB, 1, "idle");
        c.tick_hz = 1000;
        assert!(c.check().is_ok());
    }

    #[test]
    fn memory_size_and_workload_fit_are_checked() {
        assert!(matches!(
            config(64 * MIB + 1, 1, "idle").check(),
            Err(VmError::Layout(LayoutError::NotPageAligned { .. }))
        ));
        assert!(matches!(
            config(MIB, 1, "idle").new_memory(),
            Err(VmError::Layout(LayoutError::TooSmall { .. }))
        ));
        assert!(matches!(
            config(64 * MIB, 1, "memtouch:tasks=4,mib=64").check(),
            Err(VmError::Spec(SpecError::NoRoom { .. }))
        ));
    }

    #[test]
    fn the_kernel_is_the_built_in_one_unless_a_file_is_named() {
        let c = config(64 * MIB, 1, "idle");
        assert_eq!(&*c.kernel_image().unwrap(), crate::boot::GUEST_KERNEL);
        let mut c = c;
        c.kernel = Some("/nonexistent/ferry-kernel.elf".into());
        match c.kernel_image() {
            Err(KernelError::Read { path, .. }) => {
                assert_eq!(path, "/nonexistent/ferry-kernel.elf")
            }
            other => panic!("expected a read error, got {:?}", other.map(|i| i.len())),
        }
    }
}
