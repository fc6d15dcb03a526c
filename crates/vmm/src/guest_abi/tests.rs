//! The Rust mirror of the guest contract against the C header: a C
//! program built on `guest/include/ferry_abi.h` prints its view of every
//! offset and constant, and each must agree with `guest_abi.rs`.

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
