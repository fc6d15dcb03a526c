//! The contract with the test guest: memory layout, boot info, metrics page,
//! ports and vectors. The C side is `guest/include/ferry_abi.h`; a test
//! (`guest_abi/tests.rs`) compiles that header and checks that every offset
//! and constant agrees.

/// Version of this contract; the guest refuses boot info of another version.
pub const ABI_VERSION: u32 = 3;

/// Boot info page (VMM → guest).
pub const BOOT_INFO_GPA: u64 = 0x1000;
/// Global descriptor table.
pub const GDT_GPA: u64 = 0x2000;
/// Array of 64-bit TSSs, one per vCPU.
pub const TSS_GPA: u64 = 0x3000;
/// Bytes between two vCPUs' TSSs.
pub const TSS_STRIDE: u64 = 0x80;
/// Metrics page (guest → VMM).
pub const METRICS_GPA: u64 = 0x4000;
/// Bytes reserved for the metrics page.
pub const METRICS_SIZE: u64 = 0x4000;
/// Per-vCPU boot stacks, 4 KiB each.
pub const BOOT_STACKS_GPA: u64 = 0x8000;
/// Page tables built by the VMM.
pub const PAGE_TABLES_GPA: u64 = 0x10000;
/// Where the kernel image must be linked.
pub const KERNEL_GPA: u64 = 0x10_0000;
/// Service ring: header then slots (see `devices::service`).
pub const SVC_GPA: u64 = 0x80_0000;
/// Bytes reserved for the service ring.
pub const SVC_SIZE: u64 = 0x40_0000;
/// Slots in the ring.
pub const SVC_SLOTS: usize = 128;
/// Bytes per slot.
pub const SVC_SLOT_SIZE: u64 = 0x4000;
/// Bytes of slot header before the body.
pub const SVC_SLOT_HEADER: u64 = 64;
/// Largest request or response body a slot holds.
pub const SVC_MAX_BODY: u64 = SVC_SLOT_SIZE - SVC_SLOT_HEADER;
/// Bytes of ring header before the first slot.
pub const SVC_HEADER_SIZE: u64 = 0x1000;
/// Service ring magic ("FERRYSV1").
pub const SVC_MAGIC: u64 = 0x3156_5359_5252_4546;
/// Doorbell (MMIO in the 32-bit hole): a task stores a slot index when its response is DONE.
pub const SVC_DOORBELL_GPA: u64 = 0xD000_0000;
/// Host info page: VMM memory (not guest RAM, never migrated) the guest reads.
pub const HOST_INFO_GPA: u64 = 0xD000_1000;
/// Disk 0's virtio-mmio register window (disk i: [`BLK_MMIO_STRIDE`] × i on).
pub const BLK_MMIO_GPA: u64 = 0xD000_2000;
/// Bytes between two disks' windows.
pub const BLK_MMIO_STRIDE: u64 = 0x1000;
/// The disk workload's counters ([`DiskMetrics`]), after the metrics page.
pub const DISK_METRICS_GPA: u64 = METRICS_GPA + 0x2000;
/// [`DiskMetrics::magic`] once the disk workload is set up.
pub const DISK_MAGIC: u64 = 0x314b_5344_5952_5246;
/// The magic of a block stamp ([`BlkStamp`]).
pub const BLK_STAMP_MAGIC: u64 = 0x3130_4b4c_4259_5246;

/// The disk workload's counters (see `struct ferry_disk_metrics`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[allow(missing_docs)]
pub struct DiskMetrics {
    pub magic: u64,
    pub tag: u64,
    pub block_bytes: u64,
    pub blocks: u64,
    pub phase: u64,
    pub blocks_written: u64,
    pub blocks_read: u64,
    pub blocks_checked: u64,
    pub bad_blocks: u64,
    pub bad_lost: u64,
    pub bad_foreign: u64,
    pub bad_stale: u64,
    pub bad_torn: u64,
    pub io_errors: u64,
    pub ops: u64,
    pub lat_tsc_sum: u64,
    pub lat_tsc_max: u64,
    pub first_bad_lba: u64,
    pub capacity: u64,
    #[serde(skip)]
    pub reserved: [u64; 13],
}

impl DiskMetrics {
    /// Number of 64-bit words.
    pub const WORDS: usize = std::mem::size_of::<DiskMetrics>() / 8;
}

/// The stamp at the start of every block the disk workload writes (see
/// `struct ferry_blk_stamp`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct BlkStamp {
    pub magic: u64,
    pub tag: u64,
    pub lba: u64,
    pub generation: u64,
    pub checksum: u64,
}

/// Modes of the disk workload (its `p[0]`).
#[allow(missing_docs)]
pub mod disk_mode {
    pub const RANDWRITE: u64 = 0;
    pub const RANDREAD: u64 = 1;
    pub const SEQWRITE: u64 = 2;
    pub const MIXED: u64 = 3;
}

/// Phases of the disk workload ([`DiskMetrics::phase`]).
#[allow(missing_docs)]
pub mod disk_phase {
    pub const SETUP: u64 = 0;
    pub const FILL: u64 = 1;
    pub const RUN: u64 = 2;
    pub const VERIFY: u64 = 3;
    pub const DONE: u64 = 4;
}

/// Vector the VMM raises when it posts a request to parked workers.
pub const VEC_SVC: u32 = 0x41;

/// Slot states.
#[allow(missing_docs)]
pub mod slot_state {
    pub const FREE: u32 = 0;
    pub const POSTED: u32 = 1;
    pub const TAKEN: u32 = 2;
    pub const DONE: u32 = 3;
}

/// Service ring header (see `struct ferry_svc_header`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct SvcHeader {
    pub magic: u64,
    pub version: u64,
    pub ready: u64,
    pub posted: u64,
    pub taken: u64,
    pub completed: u64,
    pub keys: u64,
    pub value_size: u64,
    pub sleepers: [u64; MAX_CPUS],
    pub spinner: u64,
}

/// Byte offsets of `SvcHeader` fields the VMM touches while the guest runs.
#[allow(missing_docs)]
pub mod svc_off {
    pub const READY: u64 = 16;
    pub const POSTED: u64 = 24;
    pub const TAKEN: u64 = 32;
    pub const COMPLETED: u64 = 40;
    pub const KEYS: u64 = 48;
    pub const VALUE_SIZE: u64 = 56;
    pub const SLEEPERS: u64 = 64;
    pub const SPINNER: u64 = 128;
    /// Within a slot.
    pub const SLOT_STATE: u64 = 0;
    pub const SLOT_LEN: u64 = 4;
    pub const SLOT_TAG: u64 = 8;
    pub const SLOT_POST_TSC: u64 = 16;
    pub const SLOT_DONE_TSC: u64 = 24;
}

/// Guest physical address of slot `i`.
pub const fn svc_slot_gpa(i: usize) -> u64 {
    SVC_GPA + SVC_HEADER_SIZE + i as u64 * SVC_SLOT_SIZE
}

/// Start of the workload arena: memory only CPL3 tasks touch.
pub const ARENA_BASE: u64 = 0x100_0000;
/// RAM above this address continues at [`HIGH_RAM_BASE`].
pub const LOW_RAM_MAX: u64 = 0xC000_0000;
/// Start of RAM above the 32-bit hole.
pub const HIGH_RAM_BASE: u64 = 0x1_0000_0000;

/// Kernel code segment selector.
pub const SEL_KCODE: u16 = 0x08;
/// Kernel data segment selector.
pub const SEL_KDATA: u16 = 0x10;
/// First TSS selector (vCPU n uses `SEL_TSS0 + 16 * n`).
pub const SEL_TSS0: u16 = 0x28;

/// Most vCPUs the guest supports.
pub const MAX_CPUS: usize = 8;
/// Most tasks the guest supports.
pub const MAX_TASKS: usize = 64;
/// Most workloads one VM runs at once.
pub const MAX_WORKLOADS: usize = 4;
/// Parameters per workload.
pub const MAX_PARAMS: usize = 8;
/// RAM ranges in the boot info.
pub const MAX_RAM_RANGES: usize = 4;

/// COM1 data port: console bytes.
pub const PORT_SERIAL: u16 = 0x3f8;
/// Guest exit port: a 32-bit write ends the VM with that code.
pub const PORT_EXIT: u16 = 0xf4;
/// Exit code the guest writes after a panic.
pub const EXIT_PANIC: u32 = 0xdead;

/// Boot info magic ("FERROBI1").
pub const BOOT_MAGIC: u64 = 0x3149_424f_5252_4546;
/// Metrics page magic ("NFERRYM1").
pub const METRICS_MAGIC: u64 = 0x314d_5952_5245_464e;

/// Boot flag: enable KVM asynchronous page faults.
pub const BOOT_APF: u32 = 1;

/// Workload kinds as the guest numbers them.
#[allow(missing_docs)]
pub mod kind {
    pub const IDLE: u32 = 1;
    pub const DIRTY: u32 = 2;
    pub const MEMTOUCH: u32 = 3;
    pub const COMPUTE: u32 = 4;
    pub const SORT: u32 = 5;
    pub const FILL: u32 = 6;
    pub const KV: u32 = 7;
    pub const DISK: u32 = 8;
}

/// When memtouch's timed pass starts (its `p[2]`).
#[allow(missing_docs)]
pub mod memtouch_after {
    pub const START: u64 = 0;
    pub const MIGRATE: u64 = 1;
}

/// Guest states in the metrics page.
#[allow(missing_docs)]
pub mod state {
    pub const BOOTING: u64 = 0;
    pub const RUNNING: u64 = 1;
    pub const PANIC: u64 = 3;
}

/// Task states in the metrics page.
#[allow(missing_docs)]
pub mod task_state {
    pub const UNUSED: u64 = 0;
    pub const RUNNABLE: u64 = 1;
    pub const SLEEPING: u64 = 2;
    pub const APF_WAIT: u64 = 3;
    pub const DONE: u64 = 4;
    pub const SVC_WAIT: u64 = 5;
}

/// One RAM range.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RamRange {
    /// Guest physical base.
    pub base: u64,
    /// Bytes.
    pub size: u64,
}

/// One workload as the guest receives it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Workload {
    /// One of [`kind`].
    pub kind: u32,
    /// Zero.
    pub reserved: u32,
    /// Kind-specific parameters (see `ferry_abi.h`).
    pub p: [u64; MAX_PARAMS],
}

/// The boot info page.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BootInfo {
    /// [`BOOT_MAGIC`].
    pub magic: u64,
    /// [`ABI_VERSION`].
    pub version: u32,
    /// vCPUs.
    pub ncpus: u32,
    /// Guest TSC frequency.
    pub tsc_khz: u64,
    /// [`BOOT_APF`] and friends.
    pub flags: u32,
    /// Timer interrupts per second per vCPU.
    pub tick_hz: u32,
    /// Seed for the workloads' random numbers.
    pub seed: u64,
    /// Used entries of `ram`.
    pub nranges: u32,
    /// Used entries of `workloads`.
    pub nworkloads: u32,
    /// Guest RAM.
    pub ram: [RamRange; MAX_RAM_RANGES],
    /// What to run.
    pub workloads: [Workload; MAX_WORKLOADS],
}

/// The host info page (VMM → guest; see `devices::host_info`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostInfo {
    /// Incoming migrations this VM has had: each destination sets the
    /// source's count plus one before its vCPUs run.
    pub migrations: u64,
    /// Zero.
    pub reserved: [u64; 7],
}

/// Per-vCPU counters (see `struct ferry_cpu_metrics`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct CpuMetrics {
    pub ticks: u64,
    pub context_switches: u64,
    pub syscalls: u64,
    pub idle_tsc: u64,
    pub apf_not_present: u64,
    pub apf_ready: u64,
    pub apf_double: u64,
    pub apf_wake_all: u64,
    pub apf_waiting: u64,
    pub apf_early_ready: u64,
    pub apf_inline: u64,
    pub reserved: [u64; 5],
}

/// Per-workload state (see `struct ferry_workload_metrics`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct WorkloadMetrics {
    pub kind: u64,
    pub tasks: u64,
    pub tasks_done: u64,
    pub result: u64,
    pub ready: u64,
    pub signal_tsc: u64,
    pub reserved: [u64; 2],
}

/// Per-task counters (see `struct ferry_task_metrics`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct TaskMetrics {
    pub workload: u64,
    pub state: u64,
    pub cpu: u64,
    pub progress: u64,
    pub start_tsc: u64,
    pub end_tsc: u64,
    pub reserved: [u64; 2],
}

/// The metrics page.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Metrics {
    pub magic: u64,
    pub version: u64,
    pub state: u64,
    pub ncpus: u64,
    pub tsc_khz: u64,
    pub boot_tsc: u64,
    pub guest_tsc: u64,
    pub ntasks: u64,
    pub cpu: [CpuMetrics; MAX_CPUS],
    pub workloads: [WorkloadMetrics; MAX_WORKLOADS],
    pub tasks: [TaskMetrics; MAX_TASKS],
}

impl Metrics {
    /// Number of 64-bit words in the page: it is read word by word.
    pub const WORDS: usize = std::mem::size_of::<Metrics>() / 8;
}

// The metrics page is made only of u64 words; reading it word by word relies on it.
const _: () = assert!(std::mem::size_of::<Metrics>().is_multiple_of(8));
const _: () = assert!(std::mem::size_of::<Metrics>() as u64 <= METRICS_SIZE);
const _: () = assert!(std::mem::size_of::<BootInfo>() <= 4096);
const _: () = assert!(SVC_HEADER_SIZE + SVC_SLOTS as u64 * SVC_SLOT_SIZE <= SVC_SIZE);
const _: () = assert!(SVC_GPA + SVC_SIZE <= ARENA_BASE);
// The host info page shares the doorbell's 2 MiB mapping (boot::setup maps that one).
const _: () = assert!(HOST_INFO_GPA >> 21 == SVC_DOORBELL_GPA >> 21);
const _: () = assert!(HOST_INFO_GPA > SVC_DOORBELL_GPA && HOST_INFO_GPA.is_multiple_of(4096));
const _: () = assert!(HOST_INFO_GPA >= LOW_RAM_MAX && HOST_INFO_GPA < HIGH_RAM_BASE);
const _: () = assert!(std::mem::size_of::<HostInfo>() <= 4096);
// The disk counters sit after the metrics page, inside its area.
const _: () = assert!(METRICS_GPA + std::mem::size_of::<Metrics>() as u64 <= DISK_METRICS_GPA);
const _: () = assert!(
    DISK_METRICS_GPA + std::mem::size_of::<DiskMetrics>() as u64 <= METRICS_GPA + METRICS_SIZE
);
const _: () = assert!(BLK_MMIO_GPA >> 21 == SVC_DOORBELL_GPA >> 21 && BLK_MMIO_GPA > HOST_INFO_GPA);

#[cfg(test)]
mod tests;
