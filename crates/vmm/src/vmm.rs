//! One VM: builds it around guest memory (KVM VM, vCPUs, devices), installs
//! the boot image or restores a saved state, runs its vCPU threads,
//! pauses, resumes and stops it, and says why it ended.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_memory::{GuestMemory, MemoryError};
use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vmm_sys_util::signal::Killable;

use crate::access::{AccessConfig, AccessSlot};
use crate::boot::layout::{LayoutError, MemoryLayout};
use crate::boot::loader::{load_kernel, KernelError};
use crate::boot::setup;
use crate::devices::host_info::{HostInfoError, HostInfoPage};
use crate::devices::serial::ConsoleSink;
use crate::devices::service::{ServiceDevice, ServiceError};
use crate::devices::Devices;
use crate::guest_abi::{self, BootInfo, BOOT_APF};
use crate::metrics::MetricsSnapshot;
use crate::vstate::dirty::{DirtyLog, KvmLog};
use crate::vstate::kvm::{has_async_pf, open_kvm, KvmError};
use crate::vstate::persist::{self, KvmVmState, PersistError, VcpuState};
use crate::vstate::{vcpu, vm};
use crate::workload::{SpecError, WorkloadSet};

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
        }
    }

    /// Fresh (zeroed, unpopulated) guest memory in this config's RAM layout,
    /// the memory [`Vm::create`] builds its VM around.
    pub fn new_memory(&self) -> Result<Arc<GuestMemory>, VmError> {
        let layout = MemoryLayout::for_size(self.mem_bytes)?;
        Ok(Arc::new(GuestMemory::new(layout.ranges())?))
    }

    /// The guest kernel image: the file given, or the built-in one.
    fn kernel_image(&self) -> Result<std::borrow::Cow<'static, [u8]>, KernelError> {
        match &self.kernel {
            Some(path) => std::fs::read(path)
                .map(Into::into)
                .map_err(|source| KernelError::Read {
                    path: path.display().to_string(),
                    source,
                }),
            None => Ok(crate::GUEST_KERNEL.into()),
        }
    }

    /// Checks what can be checked without KVM; returns the RAM layout.
    fn check(&self) -> Result<MemoryLayout, VmError> {
        if self.vcpus == 0 || self.vcpus as usize > guest_abi::MAX_CPUS {
            return Err(VmError::VcpuCount(self.vcpus));
        }
        if !(1..=1000).contains(&self.tick_hz) {
            return Err(VmError::TickRate(self.tick_hz));
        }
        let layout = MemoryLayout::for_size(self.mem_bytes)?;
        self.workloads
            .check_fits(self.vcpus, layout.arena_bytes())?;
        Ok(layout)
    }
}

/// Why a VM could not be built or driven.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// Bad RAM size.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Bad workload.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Bad guest image.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// KVM refused.
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// Guest memory could not be set up.
    #[error("guest memory: {0}")]
    Memory(#[from] MemoryError),
    /// The memory handed to [`Vm::build`] is not laid out as the config's RAM size needs.
    #[error("guest memory regions {found:#x?} (gpa, size) do not match the layout of a {mem_bytes}-byte VM: {expected:#x?}")]
    MemoryMismatch {
        /// The config's RAM size.
        mem_bytes: u64,
        /// (gpa, size) of each region the layout needs.
        expected: Vec<(u64, u64)>,
        /// (gpa, size) of each region handed over.
        found: Vec<(u64, u64)>,
    },
    /// vCPU count out of range.
    #[error("--vcpus {0} is out of range: the guest supports 1 to {max}", max = guest_abi::MAX_CPUS)]
    VcpuCount(u32),
    /// Tick rate out of range.
    #[error("tick rate {0} Hz is out of range (1 to 1000)")]
    TickRate(u32),
    /// APF asked for but not available.
    #[error(
        "KVM on this host lacks KVM_CAP_ASYNC_PF_INT (asynchronous page faults): run with --no-apf"
    )]
    NoAsyncPf,
    /// A thread or signal handler could not be set up.
    #[error("cannot start vCPU threads: {0}")]
    Thread(std::io::Error),
    /// The vCPUs did not stop in time.
    #[error("vCPUs did not pause within {0:?}")]
    PauseTimeout(Duration),
    /// A vCPU thread could not save its state.
    #[error("saving vCPU state failed: {0}")]
    SaveFailed(String),
    /// The operation needs a VM in another state.
    #[error("the VM is {0}")]
    WrongState(&'static str),
    /// Saving or restoring state failed.
    #[error(transparent)]
    Persist(#[from] PersistError),
    /// The service device could not start or take over a saved state.
    #[error(transparent)]
    Service(#[from] ServiceError),
    /// The saved state has a service device and this VM has none.
    #[error("the saved state has a service device and this VM has none (give it a serve address or a kv workload)")]
    ServiceMissing,
    /// This VM has a service device and the saved state has none.
    #[error("this VM has a service device and the saved state has none")]
    ServiceUnexpected,
    /// The host info page could not be set up.
    #[error(transparent)]
    HostInfo(#[from] HostInfoError),
}

/// A whole VM's state besides guest memory.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct VmState {
    /// Every vCPU.
    pub vcpus: Vec<VcpuState>,
    /// irqchip, PIT, clock.
    pub kvm: KvmVmState,
    /// The service device, if any.
    pub service: Option<crate::devices::service::ServiceState>,
    /// Incoming migrations the guest had been told of (its host info page).
    pub migrations: u64,
}

/// What the vCPUs are asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    /// Run the guest.
    Running,
    /// Stay out of KVM_RUN until resumed.
    Paused,
    /// Leave the run loop.
    Stopped,
}

/// Why a VM stopped.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VmExit {
    /// The host asked it to stop.
    Stopped,
    /// It now runs on another host; this copy was released.
    Migrated {
        /// Where it went.
        to: String,
    },
    /// Another VMM process on this host runs it now (a handover).
    HandedOver {
        /// That process.
        pid: u32,
    },
    /// The guest wrote its exit port.
    GuestExit {
        /// vCPU that wrote it.
        cpu: u32,
        /// Exit code.
        code: u32,
    },
    /// The guest kernel panicked.
    GuestPanic {
        /// vCPU that panicked.
        cpu: u32,
        /// The guest's own message.
        message: String,
        /// Registers at the exit.
        regs: vcpu::RegsReport,
    },
    /// Triple fault.
    TripleFault {
        /// vCPU.
        cpu: u32,
        /// Registers.
        regs: vcpu::RegsReport,
    },
    /// KVM_EXIT_INTERNAL_ERROR, e.g. an instruction KVM could not emulate.
    InternalError {
        /// vCPU.
        cpu: u32,
        /// KVM's suberror (1 = emulation failure).
        suberror: u32,
        /// KVM's extra data.
        data: Vec<u64>,
        /// Registers.
        regs: vcpu::RegsReport,
    },
    /// KVM_EXIT_FAIL_ENTRY.
    FailEntry {
        /// vCPU.
        cpu: u32,
        /// Hardware reason.
        reason: u64,
    },
    /// An exit ferry does not handle.
    UnexpectedExit {
        /// vCPU.
        cpu: u32,
        /// The exit.
        exit: String,
        /// Registers.
        regs: vcpu::RegsReport,
    },
    /// KVM_RUN itself failed.
    RunFailed {
        /// vCPU.
        cpu: u32,
        /// The error.
        error: String,
    },
}

impl VmExit {
    /// True unless the host stopped the VM or the guest exited with code 0.
    pub fn is_error(&self) -> bool {
        !matches!(
            self,
            VmExit::Stopped
                | VmExit::Migrated { .. }
                | VmExit::HandedOver { .. }
                | VmExit::GuestExit { code: 0, .. }
        )
    }
}

impl fmt::Display for VmExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmExit::Stopped => write!(f, "stopped by the host"),
            VmExit::Migrated { to } => write!(f, "migrated to {to}"),
            VmExit::HandedOver { pid } => write!(f, "handed over to VMM process {pid}"),
            VmExit::GuestExit { cpu, code } => write!(f, "guest exited with code {code} (vCPU {cpu})"),
            VmExit::GuestPanic { cpu, message, regs } => {
                write!(f, "guest panic on vCPU {cpu}: {message}\n  registers: {regs}")
            }
            VmExit::TripleFault { cpu, regs } => {
                write!(f, "triple fault (KVM_EXIT_SHUTDOWN) on vCPU {cpu}\n  registers: {regs}")
            }
            VmExit::InternalError { cpu, suberror, data, regs } => write!(
                f,
                "KVM_EXIT_INTERNAL_ERROR on vCPU {cpu}: suberror {suberror}{} data {data:x?}\n  registers: {regs}",
                if *suberror == 1 { " (instruction emulation failed)" } else { "" }
            ),
            VmExit::FailEntry { cpu, reason } => {
                write!(f, "KVM_EXIT_FAIL_ENTRY on vCPU {cpu}: hardware reason {reason:#x}")
            }
            VmExit::UnexpectedExit { cpu, exit, regs } => {
                write!(f, "unhandled exit {exit} on vCPU {cpu}\n  registers: {regs}")
            }
            VmExit::RunFailed { cpu, error } => write!(f, "KVM_RUN failed on vCPU {cpu}: {error}"),
        }
    }
}

struct Control {
    parked: u32,
    running_threads: u32,
    exit: Option<VmExit>,
    /// Per vCPU: a state save asked of its parked thread, and the answer.
    save_requested: Vec<bool>,
    saved: Vec<Option<Result<VcpuState, String>>>,
}

/// State shared between the VM handle and its vCPU threads.
pub struct VmShared {
    requested: AtomicU8,
    /// Auto-converge: percent of each THROTTLE_PERIOD the vCPUs sit out.
    throttle_pct: std::sync::atomic::AtomicU32,
    /// Per vCPU: a throttle period has started and it has not slept yet.
    throttle_pending: Vec<std::sync::atomic::AtomicBool>,
    control: Mutex<Control>,
    changed: Condvar,
    threads: Mutex<Vec<libc::pthread_t>>,
    /// Kernel thread ids of the vCPU threads, as each starts (index = vCPU).
    tids: Vec<std::sync::atomic::AtomicU32>,
    /// MSRs saved with each vCPU.
    pub msr_indices: Vec<u32>,
    /// The VM's devices.
    pub devices: Devices,
}

impl VmShared {
    /// Records the calling thread as vCPU `id`'s.
    pub fn set_vcpu_tid(&self, id: u32) {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        if let Some(t) = self.tids.get(id as usize) {
            t.store(tid, Ordering::Release);
        }
    }

    /// What the vCPUs should do now.
    pub fn requested(&self) -> RunState {
        match self.requested.load(Ordering::Acquire) {
            0 => RunState::Running,
            1 => RunState::Paused,
            _ => RunState::Stopped,
        }
    }

    fn set_requested(&self, s: RunState) {
        self.requested.store(s as u8, Ordering::Release);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Called by a vCPU thread: wait while the VM is paused.
    /// True (once per period) if vCPU `id` should sleep for the throttle.
    pub fn throttle_due(&self, id: u32) -> bool {
        self.throttle_pending
            .get(id as usize)
            .is_some_and(|p| p.swap(false, Ordering::AcqRel))
    }

    /// How long a throttled vCPU sleeps each period.
    pub fn throttle_sleep(&self) -> Duration {
        THROTTLE_PERIOD * self.throttle_pct.load(Ordering::Relaxed) / 100
    }

    /// Waits up to `timeout` for `done` to hold; gives the guard back either
    /// way (Err on timeout).
    fn wait_until<'a>(
        &self,
        mut c: std::sync::MutexGuard<'a, Control>,
        timeout: Duration,
        done: impl Fn(&Control) -> bool,
    ) -> Result<std::sync::MutexGuard<'a, Control>, std::sync::MutexGuard<'a, Control>> {
        let deadline = Instant::now() + timeout;
        while !done(&c) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(c);
            }
            c = self
                .changed
                .wait_timeout(c, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(c)
    }

    /// Called by a vCPU thread: wait while the VM is paused, saving the
    /// vCPU's state with `save` whenever the VMM asks (vCPU fds live on their
    /// threads, and KVM state can only be read while the vCPU is out of KVM_RUN).
    pub fn park(&self, id: u32, save: &mut dyn FnMut() -> Result<VcpuState, String>) {
        let id = id as usize;
        let mut c = self.lock();
        c.parked += 1;
        self.changed.notify_all();
        while self.requested() == RunState::Paused {
            if c.save_requested.get(id).copied().unwrap_or(false) {
                c.save_requested[id] = false;
                drop(c);
                let state = save();
                c = self.lock();
                c.saved[id] = Some(state);
                self.changed.notify_all();
                continue;
            }
            c = self.changed.wait(c).unwrap_or_else(|e| e.into_inner());
        }
        c.parked -= 1;
    }

    /// Records why the VM stops (the first reason wins) and stops every vCPU.
    pub fn finish(&self, exit: VmExit) {
        {
            let mut c = self.lock();
            c.exit.get_or_insert(exit);
            self.set_requested(RunState::Stopped);
            self.changed.notify_all();
        }
        self.kick_all();
    }

    /// Called by a vCPU thread as it leaves its loop.
    pub fn vcpu_exited(&self) {
        let mut c = self.lock();
        c.running_threads -= 1;
        self.changed.notify_all();
    }

    fn kick_all(&self) {
        let threads = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        for &t in threads.iter() {
            // SAFETY: `t` is the pthread id of a vCPU thread we spawned and have
            // not joined yet (ids are removed before joining).
            unsafe { libc::pthread_kill(t, vcpu::kick_signal()) };
        }
    }
}

/// Throttle period: a throttled vCPU sleeps pct% of every period.
const THROTTLE_PERIOD: Duration = Duration::from_millis(10);

/// (offset, length) runs of one memory region that hold data.
type DataRanges = Vec<(u64, u64)>;

/// A VM and its vCPU threads.
pub struct Vm {
    config: VmConfig,
    layout: MemoryLayout,
    shared: Arc<VmShared>,
    vcpus: Mutex<Vec<VcpuFd>>,
    handles: Mutex<Vec<JoinHandle<VcpuFd>>>,
    tsc_khz: u64,
    /// The vCPUs have something to run: a boot image or a restored state.
    loaded: AtomicBool,
    started: Mutex<Option<Instant>>,
    /// Per region, what held data when `prealloc` populated the rest.
    data_before_prealloc: Mutex<Option<Vec<DataRanges>>>,
    /// The migration being recorded, if any (timeline and metrics).
    watch: crate::timeline::Watch,
    /// A split VM's remote paging (on its main host), kept while it runs.
    pager: Mutex<Option<Arc<ferry_migration::split::RemotePager>>>,
    /// Its last figures, once the VM stopped and the pager went.
    pager_final: Mutex<Option<ferry_migration::split::PagerStats>>,
    /// KVM's dirty log, shared by a migration and access tracking.
    dirty: Arc<DirtyLog>,
    /// Access tracking, when on.
    access: AccessSlot,
    // Fields drop in order: vCPU fds above, then the VM, then the memory it maps.
    vm_fd: Arc<VmFd>,
    _kvm: Kvm,
    host_info: HostInfoPage,
    memory: Arc<GuestMemory>,
}

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
        let shared = Arc::new(VmShared {
            requested: AtomicU8::new(RunState::Running as u8),
            throttle_pct: std::sync::atomic::AtomicU32::new(0),
            throttle_pending: (0..config.vcpus)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            control: Mutex::new(Control {
                parked: 0,
                running_threads: 0,
                exit: None,
                save_requested: vec![false; config.vcpus as usize],
                saved: vec![None; config.vcpus as usize],
            }),
            msr_indices,
            changed: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            tids: (0..config.vcpus)
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect(),
            devices: Devices::new(config.console.clone(), service),
        });
        let dirty = Arc::new(DirtyLog::new(Box::new(KvmLog::new(
            vm_fd.clone(),
            memory.clone(),
        ))));
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
            watch: crate::timeline::Watch::default(),
            pager: Mutex::new(None),
            pager_final: Mutex::new(None),
            dirty,
            access: AccessSlot::default(),
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

    /// Starts one thread per vCPU.
    pub fn start(&self) -> Result<(), VmError> {
        let t = Instant::now();
        self.start_threads()?;
        let threads_ms = t.elapsed().as_secs_f64() * 1e3;
        if let Some(s) = self.service() {
            s.release();
        }
        if let Some(access) = self.config.access {
            self.start_access(access);
        }
        tracing::debug!(
            threads_ms,
            release_ms = t.elapsed().as_secs_f64() * 1e3 - threads_ms,
            "VM started"
        );
        Ok(())
    }

    /// Starts the vCPU threads paused (a handover: everything is ready
    /// before the commit point, and [`resume`](Self::resume) is then all
    /// that runs the guest). The service device stays held.
    pub fn start_paused(&self) -> Result<(), VmError> {
        self.shared.set_requested(RunState::Paused);
        self.start_threads()
    }

    fn start_threads(&self) -> Result<(), VmError> {
        vcpu::install_kick_handler().map_err(VmError::Thread)?;
        let vcpus: Vec<VcpuFd> =
            std::mem::take(&mut *self.vcpus.lock().unwrap_or_else(|e| e.into_inner()));
        if vcpus.is_empty() {
            return Err(VmError::WrongState("already started"));
        }
        if !self.loaded.load(Ordering::Acquire) {
            *self.vcpus.lock().unwrap_or_else(|e| e.into_inner()) = vcpus;
            return Err(VmError::WrongState(
                "empty: install a boot image or restore a saved state before start",
            ));
        }
        *self.started.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        let mut handles = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        let mut threads = self
            .shared
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.shared.lock().running_threads = vcpus.len() as u32;
        for (id, fd) in vcpus.into_iter().enumerate() {
            let shared = self.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || vcpu::run_loop(fd, id as u32, shared))
                .map_err(VmError::Thread)?;
            threads.push(h.pthread_handle());
            handles.push(h);
        }
        Ok(())
    }

    /// The vCPU threads' kernel ids (0 for one not started yet).
    pub fn vcpu_tids(&self) -> Vec<u32> {
        self.shared
            .tids
            .iter()
            .map(|t| t.load(Ordering::Acquire))
            .collect()
    }

    /// Stops the vCPUs at their next exit and waits until all are parked.
    pub fn pause(&self) -> Result<(), VmError> {
        let timeout = Duration::from_secs(2);
        let n = self.config.vcpus;
        if self.shared.requested() == RunState::Stopped {
            return Err(VmError::WrongState("stopped"));
        }
        self.shared.set_requested(RunState::Paused);
        self.shared.kick_all();
        let c = self.shared.lock();
        let parked = self
            .shared
            .wait_until(c, timeout, |c| {
                c.parked >= c.running_threads.min(n) || c.exit.is_some()
            })
            .is_ok();
        if !parked {
            // Never leave a VM half-paused: let every vCPU run again.
            let _ = self.resume();
            return Err(VmError::PauseTimeout(timeout));
        }
        Ok(())
    }

    /// Lets paused vCPUs run again.
    pub fn resume(&self) -> Result<(), VmError> {
        let _c = self.shared.lock();
        match self.shared.requested() {
            RunState::Stopped => Err(VmError::WrongState("stopped")),
            _ => {
                self.shared.set_requested(RunState::Running);
                self.shared.changed.notify_all();
                Ok(())
            }
        }
    }

    /// Saves the whole VM state; the VM must be paused (or not started yet).
    pub fn save_state(&self) -> Result<VmState, VmError> {
        let n = self.config.vcpus as usize;
        let idle = self.vcpus.lock().unwrap_or_else(|e| e.into_inner());
        let vcpus = if idle.len() == n {
            // Not running: the fds are here.
            let mut out = Vec::new();
            for (id, fd) in idle.iter().enumerate() {
                out.push(persist::save_vcpu(fd, id as u32, &self.shared.msr_indices)?);
            }
            out
        } else {
            drop(idle);
            if self.shared.requested() != RunState::Paused {
                return Err(VmError::WrongState(
                    "not paused: pause it before saving its state",
                ));
            }
            let mut c = self.shared.lock();
            for id in 0..n {
                c.save_requested[id] = true;
                c.saved[id] = None;
            }
            self.shared.changed.notify_all();
            let timeout = Duration::from_secs(5);
            let mut c = self
                .shared
                .wait_until(c, timeout, |c| c.saved.iter().all(Option::is_some))
                .map_err(|_| VmError::PauseTimeout(timeout))?;
            let mut out = Vec::new();
            for s in c.saved.iter_mut() {
                match s.take() {
                    Some(Ok(state)) => out.push(state),
                    Some(Err(e)) => return Err(VmError::SaveFailed(e)),
                    None => return Err(VmError::SaveFailed("a vCPU gave no state".into())),
                }
            }
            out
        };
        Ok(VmState {
            vcpus,
            kvm: persist::save_vm(&self.vm_fd)?,
            service: self.service().map(|s| s.state()),
            migrations: self.host_info.migrations(),
        })
    }

    /// Restores a saved state into this VM, which must not have started:
    /// KVM state, every vCPU, the service device's own state (a saved
    /// service and this VM's device must both be there or both absent) and
    /// the host info page's migration count, as saved.
    /// Guest memory is restored separately (it is most of the migration);
    /// nothing here reads or writes it.
    pub fn restore_state(&self, state: &VmState) -> Result<(), VmError> {
        let vcpus = self.vcpus.lock().unwrap_or_else(|e| e.into_inner());
        if vcpus.len() != self.config.vcpus as usize {
            return Err(VmError::WrongState("already started: restore before start"));
        }
        if state.vcpus.len() != vcpus.len() {
            return Err(PersistError::Shape {
                saved: state.vcpus.len(),
                have: vcpus.len(),
            }
            .into());
        }
        match (&state.service, self.service()) {
            (Some(saved), Some(device)) => device.restore(saved)?,
            (None, None) => {}
            (Some(_), None) => return Err(VmError::ServiceMissing),
            (None, Some(_)) => return Err(VmError::ServiceUnexpected),
        }
        persist::restore_vm(&self.vm_fd, &state.kvm)?;
        for (fd, s) in vcpus.iter().zip(&state.vcpus) {
            if self.config.apf {
                persist::restore_vcpu(fd, s)?;
            } else {
                // APF off here: the guest may have enabled it where it ran
                // before; KVM then never delivers 'page not present', and
                // every host fault waits in the vCPU, as if the guest had
                // never been told of the feature.
                let mut s = s.clone();
                for m in &mut s.msrs {
                    if m.index == persist::MSR_KVM_ASYNC_PF_EN {
                        m.data = 0;
                    }
                }
                persist::restore_vcpu(fd, &s)?;
            }
        }
        self.host_info.set_migrations(state.migrations);
        self.loaded.store(true, Ordering::Release);
        Ok(())
    }

    /// Tells the guest it has been moved: adds one to the migration count
    /// on its host info page and returns the new count. A destination calls
    /// it after [`restore_state`](Self::restore_state) and before
    /// [`start`](Self::start), so the guest sees the change as soon as it
    /// runs here (memtouch `after=migrate` waits for it). The page is not
    /// guest RAM: nothing here waits for memory still at the source.
    pub fn count_incoming_migration(&self) -> Result<u64, VmError> {
        let vcpus = self.vcpus.lock().unwrap_or_else(|e| e.into_inner());
        if vcpus.len() != self.config.vcpus as usize {
            return Err(VmError::WrongState(
                "already started: count a migration before start",
            ));
        }
        let n = self.host_info.migrations().wrapping_add(1);
        self.host_info.set_migrations(n);
        Ok(n)
    }

    /// Incoming migrations this VM's guest has been told of.
    pub fn migrations(&self) -> u64 {
        self.host_info.migrations()
    }

    /// Releases a VM that now runs elsewhere (it is paused here).
    pub fn finish_migrated(&self, to: String) {
        self.shared.finish(VmExit::Migrated { to });
    }

    /// Releases a VM another process on this host runs now (it is paused
    /// here, and its memory is that process's as well: nothing here
    /// touches it again).
    pub fn finish_handed_over(&self, pid: u32) {
        self.shared.finish(VmExit::HandedOver { pid });
    }

    /// Slows the guest for auto-converge: every vCPU sits out `pct`% (0-99)
    /// of each 10 ms. A helper thread kicks the vCPUs out of KVM_RUN once per
    /// period while the throttle is on; 0 stops it.
    pub fn set_throttle(&self, pct: u32) {
        let pct = pct.min(99);
        let was = self.shared.throttle_pct.swap(pct, Ordering::AcqRel);
        if pct > 0 && was == 0 {
            let shared = self.shared.clone();
            let _ = std::thread::Builder::new()
                .name("throttle".into())
                .spawn(move || {
                    while shared.throttle_pct.load(Ordering::Acquire) > 0
                        && shared.requested() != RunState::Stopped
                    {
                        for p in &shared.throttle_pending {
                            p.store(true, Ordering::Release);
                        }
                        shared.kick_all();
                        std::thread::sleep(THROTTLE_PERIOD);
                    }
                });
        }
    }

    /// The current auto-converge throttle (percent).
    pub fn throttle(&self) -> u32 {
        self.shared.throttle_pct.load(Ordering::Acquire)
    }

    /// Asks the VM to stop without waiting (used by `quit`).
    pub fn request_stop(&self) {
        self.shared.finish(VmExit::Stopped);
    }

    /// Waits up to `timeout` for the VM to stop by itself or on request.
    pub fn wait_exit(&self, timeout: Duration) -> Option<VmExit> {
        let c = self.shared.lock();
        match self.shared.wait_until(c, timeout, |c| c.exit.is_some()) {
            Ok(c) => c.exit.clone(),
            Err(_) => None,
        }
    }

    /// Starts access tracking on this running VM (a failure is logged and
    /// shown in its status; the VM runs on without it).
    pub fn start_access(&self, config: AccessConfig) {
        let shared = self.shared.clone();
        self.access.start(
            &self.memory,
            self.dirty.clone(),
            config,
            Box::new(move || {
                shared
                    .tids
                    .iter()
                    .map(|t| t.load(Ordering::Acquire))
                    .collect()
            }),
        );
    }

    /// Access tracking (pause it before reading all of guest memory).
    pub fn access(&self) -> &AccessSlot {
        &self.access
    }

    /// KVM's dirty log and its consumers.
    pub fn dirty_log(&self) -> &Arc<DirtyLog> {
        &self.dirty
    }

    /// Stops the VM, joins the vCPU threads and says why it stopped.
    pub fn stop(&self) -> VmExit {
        // Tracking and remote paging first: no vCPU may be left waiting on
        // their faults (a split VM's page on a dead server never comes; with
        // the pager gone the vCPU's access completes and it can leave).
        self.access.stop();
        if let Some(pager) = self.pager.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // What it did stays readable (the run summary comes after).
            *self.pager_final.lock().unwrap_or_else(|e| e.into_inner()) = Some(pager.stats());
        }
        self.shared.finish(VmExit::Stopped);
        if let Some(s) = &self.shared.devices.service {
            s.shutdown();
        }
        let handles: Vec<_> =
            std::mem::take(&mut *self.handles.lock().unwrap_or_else(|e| e.into_inner()));
        // Keep kicking until every thread is out: a kick can race a thread that
        // is between checking its state and entering KVM_RUN. Less and less
        // often: the kick is a real-time signal, and they queue, so a thread
        // that cannot take them (stopped by a debugger) must not fill the
        // user's whole signal queue.
        let mut c = self.shared.lock();
        let mut pause = Duration::from_millis(1);
        while c.running_threads > 0 {
            drop(c);
            self.shared.kick_all();
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(100));
            c = self.shared.lock();
        }
        let exit = c.exit.clone().unwrap_or(VmExit::Stopped);
        drop(c);
        self.shared
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let mut vcpus = self.vcpus.lock().unwrap_or_else(|e| e.into_inner());
        for h in handles {
            if let Ok(fd) = h.join() {
                vcpus.push(fd);
            }
        }
        exit
    }

    /// What the vCPUs are asked to do now.
    pub fn run_state(&self) -> RunState {
        self.shared.requested()
    }

    /// Keeps a split VM's pager for as long as the VM lives.
    /// If paging fails for good (a memory server died with the only copy
    /// of some pages), the vCPUs stop: the VM cannot run on without them,
    /// and `ferry status` says which server (the pager's failure).
    pub fn keep_pager(&self, pager: ferry_migration::split::RemotePager) {
        let shared = self.shared.clone();
        pager.on_failure(move |why| {
            tracing::error!(%why, "the VM stops: part of its memory is out of reach");
            // Only asked, not waited for: a vCPU may be blocked on the
            // very page that cannot come.
            shared.set_requested(RunState::Paused);
            shared.kick_all();
        });
        *self.pager.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(pager));
    }

    /// A split VM's pager (gather reads from it).
    pub fn pager(&self) -> Option<Arc<ferry_migration::split::RemotePager>> {
        self.pager.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What remote paging did, for a split VM on its main host.
    pub fn pager_stats(&self) -> Option<ferry_migration::split::PagerStats> {
        let live = self
            .pager
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|p| p.stats());
        live.or_else(|| {
            self.pager_final
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
    }

    /// Guest memory.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.memory
    }

    /// Populates every page of guest RAM now (`--prealloc`: the first touch
    /// of host memory then costs nothing later). What held data before is
    /// remembered: the rest is known to read as zeros.
    pub fn prealloc(&self) -> Result<(), ferry_memory::RegionError> {
        let before = self
            .memory
            .regions()
            .iter()
            .map(|r| r.data_ranges())
            .collect();
        for r in self.memory.regions() {
            r.populate(0, r.size())?;
        }
        *self
            .data_before_prealloc
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(before);
        Ok(())
    }

    /// What held data in region `index` when `prealloc` populated the rest
    /// with zeros (None without preallocation). Only an incoming migration
    /// writes a waiting VM (besides its service ring), and it receives at
    /// most one: a failed migration ends the destination VMM.
    pub fn data_before_prealloc(&self, index: usize) -> Option<Vec<(u64, u64)>> {
        let before = self
            .data_before_prealloc
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        before
            .as_ref()
            .map(|ranges| ranges.get(index).cloned().unwrap_or_default())
    }

    /// The RAM layout.
    pub fn layout(&self) -> &MemoryLayout {
        &self.layout
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Guest TSC frequency.
    pub fn tsc_khz(&self) -> u64 {
        self.tsc_khz
    }

    /// True once the vCPUs were started (an incoming VM: the migration
    /// got that far).
    pub fn has_started(&self) -> bool {
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Time since start.
    pub fn uptime(&self) -> Duration {
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map_or(Duration::ZERO, |s| s.elapsed())
    }

    /// Reads the guest's metrics page now.
    pub fn metrics(&self) -> Result<MetricsSnapshot, MemoryError> {
        MetricsSnapshot::read(&self.memory)
    }

    /// The migration being recorded, if any.
    pub fn watch(&self) -> &crate::timeline::Watch {
        &self.watch
    }

    /// The service device, if the VM has one.
    pub fn service(&self) -> Option<&Arc<ServiceDevice>> {
        self.shared.devices.service.as_ref()
    }

    /// The KVM VM.
    pub fn vm_fd(&self) -> &Arc<VmFd> {
        &self.vm_fd
    }

    /// The guest's most recent console lines.
    pub fn console_lines(&self) -> Vec<String> {
        self.shared.devices.serial.lines()
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.stop();
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
