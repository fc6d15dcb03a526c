//! The end of a run: its summary as JSON (`--json`) and as the table a
//! person reads.

use std::sync::atomic::Ordering;
use std::time::Duration;

use ferry_vmm::metrics::{rate, MetricsSnapshot};
use ferry_vmm::{Vm, VmExit};
use serde_json::json;

/// Why the run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Ending {
    Migrated,
    Duration,
    WorkloadsDone,
    Interrupted,
    ControlQuit,
    GuestStopped,
    HandedOver,
}

use crate::format;

pub(super) fn summary_json(
    vm: &Vm,
    started: &[Option<MetricsSnapshot>],
    last: &MetricsSnapshot,
    ending: Ending,
    exit: &VmExit,
    boot_ms: Option<f64>,
    ran: Duration,
) -> serde_json::Value {
    let workloads: Vec<_> = vm
        .config()
        .workloads
        .0
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let r = started[i]
                .as_ref()
                .map_or(0.0, |f| rate(f, last, f.progress(i), last.progress(i)));
            let task_ms: Vec<Option<f64>> = last
                .tasks()
                .iter()
                .filter(|t| t.workload == i as u64 && t.end_tsc != 0)
                .map(|t| last.task_ms(t))
                .collect();
            json!({
                "spec": w.to_string(),
                "unit": w.unit(),
                "progress": last.progress(i),
                "rate_per_s": r,
                "tasks": last.tasks_of(i),
                "tasks_done": last.tasks_done(i),
                "result": match last.result(i) { 1 => "ok", 2 => "FAILED", _ => "" },
                "finished_task_ms": task_ms,
            })
        })
        .collect();
    json!({
        "vm": {
            "mem_bytes": vm.config().mem_bytes,
            "vcpus": vm.config().vcpus,
            "apf": vm.config().apf,
            "tick_hz": vm.config().tick_hz,
            "tsc_khz": vm.tsc_khz(),
        },
        "ending": ending,
        "exit": exit,
        "boot_to_first_sample_ms": boot_ms,
        "ran_s": ran.as_secs_f64(),
        "guest_ms": last.guest_ms(),
        "workloads": workloads,
        "kernel": last.cpu_totals(),
        "service": vm.service().map(|s| service_json(s)),
        "disks": vm.disks().iter().map(|d| d.info()).collect::<Vec<_>>(),
        "disk_check": ferry_vmm::control::vm_control::disk_check_json(vm),
        "split": vm.pager_stats(),
        "access": vm.access().status(),
    })
}

fn service_json(s: &ferry_vmm::devices::service::ServiceDevice) -> serde_json::Value {
    let st = &s.stats;
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    json!({
        "address": s.local_addr().to_string(),
        "connections": n(&st.connections),
        "posted": n(&st.posted),
        "responses": n(&st.responses),
        "echoes": n(&st.echoes),
        "bad_frames": n(&st.bad_frames),
        "not_ready": n(&st.not_ready),
        "guest_errors": n(&st.guest_errors),
        "forwarded": n(&st.forwarded),
        "collected": n(&st.collected),
        "moved_out": n(&st.moved_out),
        "moved_in": n(&st.moved_in),
        "vm_address": s.vm_address().map(|a| a.to_string()),
        "redirected_to": s.redirected_to().map(|a| a.to_string()),
    })
}

pub(super) fn print_summary(vm: &Vm, s: &serde_json::Value, exit: &VmExit) {
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    println!("── ferry run summary ─────────────────────────────────────────────");
    println!(
        "VM           {} RAM, {} vCPU(s), APF {}, tick {} Hz",
        format::bytes(vm.config().mem_bytes as f64),
        vm.config().vcpus,
        if vm.config().apf { "on" } else { "off" },
        vm.config().tick_hz
    );
    println!(
        "ended        {} after {:.2} s ({exit})",
        s["ending"].as_str().unwrap_or("?"),
        f(&s["ran_s"])
    );
    match s["boot_to_first_sample_ms"].as_f64() {
        Some(ms) if s["incoming"] == true => {
            println!("incoming     guest running {ms:.1} ms after VM creation (includes waiting for the source)")
        }
        Some(ms) => println!("boot         first guest metrics {ms:.1} ms after VM creation began"),
        None => println!("boot         the guest never published metrics"),
    }
    println!(
        "{:<44} {:>12} {:>16} {:>8}",
        "workload", "total", "rate", "tasks"
    );
    for w in s["workloads"].as_array().into_iter().flatten() {
        let unit = w["unit"].as_str().unwrap_or("");
        let tasks = format!("{}/{}", w["tasks_done"], w["tasks"]);
        println!(
            "{:<44} {:>12} {:>16} {:>8} {}",
            w["spec"].as_str().unwrap_or(""),
            format::amount(f(&w["progress"]), unit),
            format::rate(f(&w["rate_per_s"]), unit),
            tasks,
            w["result"].as_str().unwrap_or("")
        );
        let times: Vec<String> = w["finished_task_ms"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_f64())
            .map(|t| format!("{t:.1}"))
            .collect();
        if !times.is_empty() {
            println!("{:<44} task times (ms): {}", "", times.join(" "));
        }
    }
    if let Some(svc) = s["service"].as_object() {
        println!(
            "service      {}: {} connections, {} requests to the guest, {} answered, {} echoes, {} bad frames",
            svc["address"].as_str().unwrap_or(""),
            svc["connections"], svc["posted"], svc["responses"], svc["echoes"], svc["bad_frames"]
        );
    }
    for d in s["disks"].as_array().into_iter().flatten() {
        println!(
            "disk {}       {} ({}, {}): {} read in {} requests, {} written in {}, {} flushes, {} I/O errors, {} bad requests",
            d["index"],
            d["path"].as_str().unwrap_or(""),
            format::bytes(f(&d["size"])),
            if d["direct_io"] == true { "O_DIRECT" } else { "buffered" },
            format::bytes(f(&d["read_bytes"])),
            d["reads"],
            format::bytes(f(&d["write_bytes"])),
            d["writes"],
            d["flushes"],
            d["io_errors"],
            d["bad_requests"]
        );
    }
    if let Some(c) = s["disk_check"].as_object() {
        println!(
            "disk check   {} blocks written, {} checked, {} bad (lost {}, foreign {}, stale {}, torn {}), {:.0} IOPS, mean latency {:.0} µs",
            c["blocks_written"], c["blocks_checked"], c["bad_blocks"], c["bad_lost"],
            c["bad_foreign"], c["bad_stale"], c["bad_torn"],
            c["iops"].as_f64().unwrap_or(0.0), c["latency_us_mean"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(line) = crate::status::access_line(&s["access"]) {
        println!("access       {line}");
    }
    let k = &s["kernel"];
    println!(
        "guest kernel ticks {}  switches {}  syscalls {}  idle {:.0} ms  APF not-present {} (waited in KVM {}) ready {} double {}",
        k["ticks"], k["context_switches"], k["syscalls"], f(&k["idle_ms"]),
        k["apf_not_present"], k["apf_inline"], k["apf_ready"], k["apf_double"]
    );
}
