//! The contract with the test guest: memory layout, boot info, metrics page,
//! ports and vectors. The C side is `guest/include/ferry_abi.h`; a test below
//! compiles that header and checks that every offset and constant agrees.

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
mod tests {
    use super::*;
    use crate::devices::service::wire;
    use std::mem::{offset_of, size_of};
    use std::process::Command;

    /// Compiles a C program against ferry_abi.h that prints the C view of the
    /// layout, and compares it with this module's.
    #[test]
    fn rust_mirror_matches_c_header() {
        let dir = std::env::temp_dir().join(format!("ferry-abi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("abi.c");
        let include = concat!(env!("CARGO_MANIFEST_DIR"), "/../../guest/include");
        std::fs::write(
            &src,
            r#"#include <stdio.h>
#include <stddef.h>
#include "ferry_abi.h"
#define P(x) printf("%s=%llu\n", #x, (unsigned long long)(x))
int main(void) {
  P(FERRY_ABI_VERSION); P(FERRY_BOOT_INFO_GPA); P(FERRY_GDT_GPA); P(FERRY_TSS_GPA);
  P(FERRY_TSS_STRIDE); P(FERRY_METRICS_GPA); P(FERRY_METRICS_SIZE); P(FERRY_BOOT_STACKS_GPA);
  P(FERRY_PAGE_TABLES_GPA); P(FERRY_KERNEL_GPA); P(FERRY_ARENA_BASE); P(FERRY_LOW_RAM_MAX);
  P(FERRY_HIGH_RAM_BASE); P(FERRY_SEL_KCODE); P(FERRY_SEL_KDATA); P(FERRY_SEL_TSS0);
  P(FERRY_MAX_CPUS); P(FERRY_MAX_TASKS); P(FERRY_MAX_WORKLOADS); P(FERRY_MAX_PARAMS);
  P(FERRY_MAX_RAM_RANGES); P(FERRY_PORT_SERIAL); P(FERRY_PORT_EXIT); P(FERRY_EXIT_PANIC);
  P(FERRY_BOOT_MAGIC); P(FERRY_METRICS_MAGIC); P(FERRY_BOOT_APF);
  P(FERRY_WL_IDLE); P(FERRY_WL_DIRTY); P(FERRY_WL_MEMTOUCH); P(FERRY_WL_COMPUTE);
  P(FERRY_WL_SORT); P(FERRY_WL_FILL); P(FERRY_STATE_RUNNING); P(FERRY_STATE_PANIC);
  P(FERRY_TASK_DONE); P(FERRY_TASK_APF_WAIT);
  P(sizeof(struct ferry_boot_info)); P(offsetof(struct ferry_boot_info, ram));
  P(offsetof(struct ferry_boot_info, workloads)); P(sizeof(struct ferry_workload));
  P(sizeof(struct ferry_metrics)); P(offsetof(struct ferry_metrics, cpu));
  P(offsetof(struct ferry_metrics, workloads)); P(offsetof(struct ferry_metrics, tasks));
  P(sizeof(struct ferry_cpu_metrics)); P(sizeof(struct ferry_task_metrics));
  P(offsetof(struct ferry_cpu_metrics, apf_not_present));
  P(offsetof(struct ferry_task_metrics, progress));
  P(FERRY_SVC_GPA); P(FERRY_SVC_SIZE); P(FERRY_SVC_SLOTS); P(FERRY_SVC_SLOT_SIZE);
  P(FERRY_SVC_SLOT_HEADER); P(FERRY_SVC_MAX_BODY); P(FERRY_SVC_HEADER_SIZE); P(FERRY_SVC_MAGIC);
  P(FERRY_SVC_DOORBELL_GPA); P(FERRY_VEC_SVC); P(FERRY_WL_KV); P(FERRY_TASK_SVC_WAIT);
  P(FERRY_SLOT_DONE); P(FERRY_SLOT_POSTED);
  P(FERRY_AFTER_START); P(FERRY_AFTER_MIGRATE);
  P(FERRY_HOST_INFO_GPA); P(offsetof(struct ferry_host_info, migrations));
  P(sizeof(struct ferry_host_info));
  P(offsetof(struct ferry_workload_metrics, ready));
  P(offsetof(struct ferry_workload_metrics, signal_tsc)); P(sizeof(struct ferry_workload_metrics));
  P(offsetof(struct ferry_svc_header, ready)); P(offsetof(struct ferry_svc_header, posted));
  P(offsetof(struct ferry_svc_header, taken)); P(offsetof(struct ferry_svc_header, completed));
  P(offsetof(struct ferry_svc_header, keys)); P(offsetof(struct ferry_svc_header, value_size));
  P(offsetof(struct ferry_svc_header, sleepers)); P(sizeof(struct ferry_svc_header));
  P(offsetof(struct ferry_svc_header, spinner));
  P(offsetof(struct ferry_svc_slot, len)); P(offsetof(struct ferry_svc_slot, tag));
  P(offsetof(struct ferry_svc_slot, post_tsc)); P(offsetof(struct ferry_svc_slot, done_tsc));
  P(offsetof(struct ferry_svc_slot, data)); P(sizeof(struct ferry_svc_slot));
  P(sizeof(struct ferry_svc_request)); P(sizeof(struct ferry_svc_response));
  P(offsetof(struct ferry_svc_response, checksum));
  P(FERRY_BLK_MMIO_GPA); P(FERRY_BLK_MMIO_STRIDE); P(FERRY_DISK_METRICS_GPA); P(FERRY_DISK_MAGIC);
  P(FERRY_BLK_STAMP_MAGIC); P(FERRY_WL_DISK); P(FERRY_DISK_SEQWRITE); P(FERRY_DISK_MIXED);
  P(FERRY_DISK_RUN); P(FERRY_DISK_DONE); P(sizeof(struct ferry_disk_metrics));
  P(offsetof(struct ferry_disk_metrics, bad_blocks)); P(offsetof(struct ferry_disk_metrics, capacity));
  P(sizeof(struct ferry_blk_stamp));
  {
    unsigned char b[4096];
    for (int i = 0; i < 4096; i++) b[i] = (unsigned char)(i * 7);
    P(ferry_blk_checksum(b, sizeof b, 3, 5, 9));
  }
  {
    unsigned char v[100];
    ferry_value(v, sizeof v, 5, 7);
    P(ferry_csum(v, sizeof v));
    P(ferry_csum(v, 0));
    P(v[99]);
  }
  return 0;
}
"#,
        )
        .unwrap();
        let exe = dir.join("abi");
        let out = Command::new("cc")
            .arg(format!("-I{include}"))
            .arg(&src)
            .arg("-o")
            .arg(&exe)
            .output()
            .expect("a C compiler (cc) is needed to check the guest ABI");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = Command::new(&exe).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let c: std::collections::HashMap<&str, u64> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k, v.parse().unwrap()))
            .collect();
        let expect: &[(&str, u64)] = &[
            ("FERRY_ABI_VERSION", ABI_VERSION as u64),
            ("FERRY_BOOT_INFO_GPA", BOOT_INFO_GPA),
            ("FERRY_GDT_GPA", GDT_GPA),
            ("FERRY_TSS_GPA", TSS_GPA),
            ("FERRY_TSS_STRIDE", TSS_STRIDE),
            ("FERRY_METRICS_GPA", METRICS_GPA),
            ("FERRY_METRICS_SIZE", METRICS_SIZE),
            ("FERRY_BOOT_STACKS_GPA", BOOT_STACKS_GPA),
            ("FERRY_PAGE_TABLES_GPA", PAGE_TABLES_GPA),
            ("FERRY_KERNEL_GPA", KERNEL_GPA),
            ("FERRY_ARENA_BASE", ARENA_BASE),
            ("FERRY_LOW_RAM_MAX", LOW_RAM_MAX),
            ("FERRY_HIGH_RAM_BASE", HIGH_RAM_BASE),
            ("FERRY_SEL_KCODE", SEL_KCODE as u64),
            ("FERRY_SEL_KDATA", SEL_KDATA as u64),
            ("FERRY_SEL_TSS0", SEL_TSS0 as u64),
            ("FERRY_MAX_CPUS", MAX_CPUS as u64),
            ("FERRY_MAX_TASKS", MAX_TASKS as u64),
            ("FERRY_MAX_WORKLOADS", MAX_WORKLOADS as u64),
            ("FERRY_MAX_PARAMS", MAX_PARAMS as u64),
            ("FERRY_MAX_RAM_RANGES", MAX_RAM_RANGES as u64),
            ("FERRY_PORT_SERIAL", PORT_SERIAL as u64),
            ("FERRY_PORT_EXIT", PORT_EXIT as u64),
            ("FERRY_EXIT_PANIC", EXIT_PANIC as u64),
            ("FERRY_BOOT_MAGIC", BOOT_MAGIC),
            ("FERRY_METRICS_MAGIC", METRICS_MAGIC),
            ("FERRY_BOOT_APF", BOOT_APF as u64),
            ("FERRY_WL_IDLE", kind::IDLE as u64),
            ("FERRY_WL_DIRTY", kind::DIRTY as u64),
            ("FERRY_WL_MEMTOUCH", kind::MEMTOUCH as u64),
            ("FERRY_WL_COMPUTE", kind::COMPUTE as u64),
            ("FERRY_WL_SORT", kind::SORT as u64),
            ("FERRY_WL_FILL", kind::FILL as u64),
            ("FERRY_STATE_RUNNING", state::RUNNING),
            ("FERRY_STATE_PANIC", state::PANIC),
            ("FERRY_TASK_DONE", task_state::DONE),
            ("FERRY_TASK_APF_WAIT", task_state::APF_WAIT),
            (
                "sizeof(struct ferry_boot_info)",
                size_of::<BootInfo>() as u64,
            ),
            (
                "offsetof(struct ferry_boot_info, ram)",
                offset_of!(BootInfo, ram) as u64,
            ),
            (
                "offsetof(struct ferry_boot_info, workloads)",
                offset_of!(BootInfo, workloads) as u64,
            ),
            (
                "sizeof(struct ferry_workload)",
                size_of::<Workload>() as u64,
            ),
            ("sizeof(struct ferry_metrics)", size_of::<Metrics>() as u64),
            (
                "offsetof(struct ferry_metrics, cpu)",
                offset_of!(Metrics, cpu) as u64,
            ),
            (
                "offsetof(struct ferry_metrics, workloads)",
                offset_of!(Metrics, workloads) as u64,
            ),
            (
                "offsetof(struct ferry_metrics, tasks)",
                offset_of!(Metrics, tasks) as u64,
            ),
            (
                "sizeof(struct ferry_cpu_metrics)",
                size_of::<CpuMetrics>() as u64,
            ),
            (
                "sizeof(struct ferry_task_metrics)",
                size_of::<TaskMetrics>() as u64,
            ),
            (
                "offsetof(struct ferry_cpu_metrics, apf_not_present)",
                offset_of!(CpuMetrics, apf_not_present) as u64,
            ),
            (
                "offsetof(struct ferry_task_metrics, progress)",
                offset_of!(TaskMetrics, progress) as u64,
            ),
            ("FERRY_SVC_GPA", SVC_GPA),
            ("FERRY_SVC_SIZE", SVC_SIZE),
            ("FERRY_SVC_SLOTS", SVC_SLOTS as u64),
            ("FERRY_SVC_SLOT_SIZE", SVC_SLOT_SIZE),
            ("FERRY_SVC_SLOT_HEADER", SVC_SLOT_HEADER),
            ("FERRY_SVC_MAX_BODY", SVC_MAX_BODY),
            ("FERRY_SVC_HEADER_SIZE", SVC_HEADER_SIZE),
            ("FERRY_SVC_MAGIC", SVC_MAGIC),
            ("FERRY_SVC_DOORBELL_GPA", SVC_DOORBELL_GPA),
            ("FERRY_VEC_SVC", VEC_SVC as u64),
            ("FERRY_WL_KV", kind::KV as u64),
            ("FERRY_TASK_SVC_WAIT", task_state::SVC_WAIT),
            ("FERRY_SLOT_DONE", slot_state::DONE as u64),
            ("FERRY_SLOT_POSTED", slot_state::POSTED as u64),
            ("FERRY_AFTER_START", memtouch_after::START),
            ("FERRY_AFTER_MIGRATE", memtouch_after::MIGRATE),
            ("FERRY_HOST_INFO_GPA", HOST_INFO_GPA),
            (
                "offsetof(struct ferry_host_info, migrations)",
                offset_of!(HostInfo, migrations) as u64,
            ),
            (
                "sizeof(struct ferry_host_info)",
                size_of::<HostInfo>() as u64,
            ),
            (
                "offsetof(struct ferry_workload_metrics, ready)",
                offset_of!(WorkloadMetrics, ready) as u64,
            ),
            (
                "offsetof(struct ferry_workload_metrics, signal_tsc)",
                offset_of!(WorkloadMetrics, signal_tsc) as u64,
            ),
            (
                "sizeof(struct ferry_workload_metrics)",
                size_of::<WorkloadMetrics>() as u64,
            ),
            ("offsetof(struct ferry_svc_header, ready)", svc_off::READY),
            ("offsetof(struct ferry_svc_header, posted)", svc_off::POSTED),
            ("offsetof(struct ferry_svc_header, taken)", svc_off::TAKEN),
            (
                "offsetof(struct ferry_svc_header, completed)",
                svc_off::COMPLETED,
            ),
            ("offsetof(struct ferry_svc_header, keys)", svc_off::KEYS),
            (
                "offsetof(struct ferry_svc_header, value_size)",
                svc_off::VALUE_SIZE,
            ),
            (
                "offsetof(struct ferry_svc_header, sleepers)",
                svc_off::SLEEPERS,
            ),
            (
                "sizeof(struct ferry_svc_header)",
                size_of::<SvcHeader>() as u64,
            ),
            (
                "offsetof(struct ferry_svc_header, spinner)",
                svc_off::SPINNER,
            ),
            ("offsetof(struct ferry_svc_slot, len)", svc_off::SLOT_LEN),
            ("offsetof(struct ferry_svc_slot, tag)", svc_off::SLOT_TAG),
            (
                "offsetof(struct ferry_svc_slot, post_tsc)",
                svc_off::SLOT_POST_TSC,
            ),
            (
                "offsetof(struct ferry_svc_slot, done_tsc)",
                svc_off::SLOT_DONE_TSC,
            ),
            ("offsetof(struct ferry_svc_slot, data)", SVC_SLOT_HEADER),
            ("sizeof(struct ferry_svc_slot)", SVC_SLOT_SIZE),
            (
                "sizeof(struct ferry_svc_request)",
                wire::REQUEST_HEADER as u64,
            ),
            (
                "sizeof(struct ferry_svc_response)",
                wire::RESPONSE_HEADER as u64,
            ),
            ("offsetof(struct ferry_svc_response, checksum)", 32),
            (
                "ferry_csum(v, sizeof v)",
                wire::csum(&wire::value(100, 5, 7)),
            ),
            ("ferry_csum(v, 0)", wire::csum(&[])),
            ("v[99]", wire::value(100, 5, 7)[99] as u64),
            ("FERRY_BLK_MMIO_GPA", BLK_MMIO_GPA),
            ("FERRY_BLK_MMIO_STRIDE", BLK_MMIO_STRIDE),
            ("FERRY_DISK_METRICS_GPA", DISK_METRICS_GPA),
            ("FERRY_DISK_MAGIC", DISK_MAGIC),
            ("FERRY_BLK_STAMP_MAGIC", BLK_STAMP_MAGIC),
            ("FERRY_WL_DISK", kind::DISK as u64),
            ("FERRY_DISK_SEQWRITE", disk_mode::SEQWRITE),
            ("FERRY_DISK_MIXED", disk_mode::MIXED),
            ("FERRY_DISK_RUN", disk_phase::RUN),
            ("FERRY_DISK_DONE", disk_phase::DONE),
            (
                "sizeof(struct ferry_disk_metrics)",
                size_of::<DiskMetrics>() as u64,
            ),
            (
                "offsetof(struct ferry_disk_metrics, bad_blocks)",
                offset_of!(DiskMetrics, bad_blocks) as u64,
            ),
            (
                "offsetof(struct ferry_disk_metrics, capacity)",
                offset_of!(DiskMetrics, capacity) as u64,
            ),
            (
                "sizeof(struct ferry_blk_stamp)",
                size_of::<BlkStamp>() as u64,
            ),
            ("ferry_blk_checksum(b, sizeof b, 3, 5, 9)", {
                let b: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
                crate::workload::disk::blk_checksum(&b, 3, 5, 9)
            }),
        ];
        for (name, rust) in expect {
            assert_eq!(c.get(name), Some(rust), "{name}: C and Rust disagree");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
