//! Building a VM: the KVM VM around guest memory (memslots, vCPUs with
//! CPUID and long-mode registers, devices), and the boot image that gives a
//! fresh VM something to run. A VM built around memory that already holds
//! a guest gets its saved state instead (`state.rs`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_memory::GuestMemory;
use kvm_bindings::KVM_MAX_CPUID_ENTRIES;

use super::{Vm, VmConfig, VmError};
use crate::access::AccessSlot;
use crate::boot::loader::load_kernel;
use crate::boot::setup;
use crate::devices::block::BlockDevice;
use crate::devices::host_info::HostInfoPage;
use crate::devices::service::ServiceDevice;
use crate::devices::Devices;
use crate::guest_abi::{self, BootInfo, BOOT_APF};
use crate::vstate::dirty::{DirtyLog, KvmLog};
use crate::vstate::kvm::{has_async_pf, open_kvm, KvmError};
use crate::vstate::persist;
use crate::vstate::run_control::VmShared;
use crate::vstate::{vcpu, vm};

impl Vm {
    /// Builds a VM ready to start: fresh memory ([`VmConfig::new_memory`]),
    /// [`build`](Self::build) around it, then
    /// [`install_boot_image`](Self::install_boot_image).
    pub fn create(config: VmConfig) -> Result<Vm, VmError> {
        config.check()?;
        let image = config.kernel_image()?;
        let memory = config.new_memory()?;
        let vm = Vm::build(config, memory)?;
        vm.install_image(&image)?;
        Ok(vm)
    }

    /// Builds a VM around existing guest memory without writing to it: KVM
    /// VM, memslots, vCPUs (CPUID, long-mode special registers), devices.
    /// The memory must have the config's RAM layout. The VM then needs
    /// something to run before [`start`](Self::start): a boot image
    /// ([`install_boot_image`](Self::install_boot_image)) or, for memory that
    /// holds a guest already, its saved state ([`restore_state`](Self::restore_state)).
    pub fn build(config: VmConfig, memory: Arc<GuestMemory>) -> Result<Vm, VmError> {
        Self::build_with(config, memory, None)
    }

    /// Like [`build`](Self::build), with the service device on a listening
    /// socket another VMM process handed over (a handover), instead of one
    /// bound from the config's address.
    pub fn build_adopting(
        config: VmConfig,
        memory: Arc<GuestMemory>,
        service_listener: Option<std::net::TcpListener>,
    ) -> Result<Vm, VmError> {
        Self::build_with(config, memory, service_listener)
    }

    fn build_with(
        config: VmConfig,
        memory: Arc<GuestMemory>,
        service_listener: Option<std::net::TcpListener>,
    ) -> Result<Vm, VmError> {
        let layout = config.check()?;
        let found: Vec<(u64, u64)> = memory
            .regions()
            .iter()
            .map(|r| (r.gpa(), r.size()))
            .collect();
        if found != layout.ranges() {
            return Err(VmError::MemoryMismatch {
                mem_bytes: config.mem_bytes,
                expected: layout.ranges().to_vec(),
                found,
            });
        }
        let kvm = open_kvm(&config.kvm_path)?;
        if config.apf && !has_async_pf(&kvm) {
            return Err(VmError::NoAsyncPf);
        }

        let vm_fd = Arc::new(vm::create_vm(&kvm)?);
        vm::register_memory(&vm_fd, &memory, false)?;
        let host_info = HostInfoPage::new(&vm_fd)?;
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| KvmError::Ioctl {
                op: "KVM_GET_SUPPORTED_CPUID",
                source,
            })?;
        let mut vcpus = Vec::new();
        for id in 0..config.vcpus {
            let fd = vm_fd
                .create_vcpu(id as u64)
                .map_err(|source| KvmError::Ioctl {
                    op: "KVM_CREATE_VCPU",
                    source,
                })?;
            vcpu::configure(&fd, id, &cpuid)?;
            vcpus.push(fd);
        }
        let msr_indices = persist::saveable_msrs(&kvm, &vcpus[0])?;
        let tsc_khz = match vcpus[0].get_tsc_khz() {
            Ok(khz) if khz > 0 => khz as u64,
            _ => measure_tsc_khz(),
        };

        let serve = config.serve.or_else(|| {
            (config.vm_address.is_some() || config.workloads.serves())
                .then(|| SocketAddr::from(([127, 0, 0, 1], 0)))
        });
        // A device is built held: nothing goes into the ring before the VM
        // starts, as the memory may hold a guest whose state (and ring) is
        // still arriving or being handed over.
        let service = match (service_listener, serve, config.vm_address) {
            (Some(l), _, _) => Some(ServiceDevice::adopt(
                l,
                memory.clone(),
                vm_fd.clone(),
                config.vcpus,
            )?),
            (None, Some(addr), Some(ip)) => Some(ServiceDevice::start_on_address(
                ip,
                addr.port(),
                memory.clone(),
                vm_fd.clone(),
                config.vcpus,
            )?),
            (None, Some(addr), None) => Some(ServiceDevice::start(
                addr,
                memory.clone(),
                vm_fd.clone(),
                config.vcpus,
            )?),
            (None, None, _) => None,
        };
        let dirty = Arc::new(DirtyLog::new(Box::new(KvmLog::new(
            vm_fd.clone(),
            memory.clone(),
        ))));
        // The disks' writes into guest RAM go into the dirty log beside the
        // guest's own (KVM logs only those), so a migration sends them too.
        let log = dirty.clone();
        let marker: crate::devices::block::memory::WriteMarker =
            Arc::new(move |region, first, pages| log.mark(region, first, pages));
        let disks = config
            .disks
            .iter()
            .enumerate()
            .map(|(i, spec)| BlockDevice::new(i, spec, memory.clone(), Some(marker.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(d) = config.workloads.disk() {
            let have = disks[d.disk as usize].info().size;
            if d.mib << 20 > have {
                return Err(VmError::DiskTooSmall {
                    index: d.disk,
                    need: d.mib << 20,
                    have,
                });
            }
        }
        let shared = Arc::new(VmShared::new(
            config.vcpus,
            msr_indices,
            Devices::new(config.console.clone(), service).with_disks(disks),
        ));
        Ok(Vm {
            config,
            layout,
            memory,
            shared,
            vcpus: Mutex::new(vcpus),
            handles: Mutex::new(Vec::new()),
            tsc_khz,
            loaded: AtomicBool::new(false),
            started: Mutex::new(None),
            data_before_prealloc: Mutex::new(None),
            background_prealloc: Default::default(),
            watch: Default::default(),
            pager: Mutex::new(None),
            pager_final: Mutex::new(None),
            dirty,
            access: AccessSlot::default(),
            waiting: Mutex::new(None),
            sharing: Mutex::new(None),
            owner: std::sync::OnceLock::new(),
            vm_fd,
            _kvm: kvm,
            host_info,
        })
    }

    /// Writes the boot image into guest memory (kernel ELF, GDT and TSSs,
    /// page tables, boot info) and points the vCPUs at the kernel entry.
    /// Expects fresh memory (the kernel's bss is not cleared) and a VM that
    /// has not started.
    pub fn install_boot_image(&self) -> Result<(), VmError> {
        let image = self.config.kernel_image()?;
        self.install_image(&image)
    }

    fn install_image(&self, image: &[u8]) -> Result<(), VmError> {
        let vcpus = self.vcpus.lock().unwrap_or_else(|e| e.into_inner());
        if vcpus.len() != self.config.vcpus as usize {
            return Err(VmError::WrongState(
                "already started: install the boot image before start",
            ));
        }
        let (config, memory) = (&self.config, &*self.memory);
        let entry = load_kernel(memory, image)?;
        setup::write_gdt(memory, config.vcpus)?;
        setup::write_page_tables(memory, &self.layout)?;
        let mut info = BootInfo {
            magic: guest_abi::BOOT_MAGIC,
            version: guest_abi::ABI_VERSION,
            ncpus: config.vcpus,
            tsc_khz: self.tsc_khz,
            flags: if config.apf { BOOT_APF } else { 0 },
            tick_hz: config.tick_hz,
            seed: config.seed,
            nworkloads: config.workloads.0.len() as u32,
            ..Default::default()
        };
        for (slot, w) in info.workloads.iter_mut().zip(&config.workloads.0) {
            *slot = w.to_guest(config.vcpus);
        }
        setup::write_boot_info(memory, &self.layout, info)?;
        for (id, fd) in vcpus.iter().enumerate() {
            vcpu::set_entry(fd, id as u32, entry)?;
        }
        self.loaded.store(true, Ordering::Release);
        Ok(())
    }
}

/// Fallback when KVM cannot say: the host TSC rate measured over 20 ms.
fn measure_tsc_khz() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86-64.
    let t0 = unsafe { core::arch::x86_64::_rdtsc() };
    let start = Instant::now();
    std::thread::sleep(Duration::from_millis(20));
    // SAFETY: as above.
    let t1 = unsafe { core::arch::x86_64::_rdtsc() };
    ((t1 - t0) as f64 / start.elapsed().as_secs_f64() / 1000.0) as u64
}
