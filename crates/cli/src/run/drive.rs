//! The run loop: samples the running VM every 10 ms (timeline lines, the
//! live line) until the run ends (its duration, its workloads, Ctrl-C, a
//! migration or a handover), then prints the summary.

use std::fs::File;
use std::io::{IsTerminal, LineWriter, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use ferry_vmm::metrics::{rate, MetricsSnapshot};
use ferry_vmm::{Vm, VmExit};
use serde_json::json;

use super::front::Carried;
use super::summary::{print_summary, summary_json, Ending};
use crate::format;

const SAMPLE_EVERY: Duration = Duration::from_millis(10);
const LIVE_EVERY: Duration = Duration::from_millis(500);

/// Samples the running VM until the run ends, then reports.
pub(super) fn drive(
    vm: &Arc<Vm>,
    front: &Carried,
    mut timeline: Option<LineWriter<File>>,
    t_create: Instant,
    t_start: Instant,
    summary_extra: serde_json::Map<String, serde_json::Value>,
) -> Result<ExitCode> {
    let quiet = front.quiet;
    let duration = front.duration_ms.map(Duration::from_millis);
    // The next migration's timeline starts with the seconds before it.
    ferry_vmm::timeline::keep_history(vm);
    // Only now catch Ctrl-C / SIGTERM (to end with a summary): while an
    // incoming VMM waits for its migration, they simply end the process.
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())?;
    }
    let mut first: Option<MetricsSnapshot> = None;
    // Per workload: the first sample where it had made progress. Rates are
    // measured from there, so set-up (e.g. dirty touching its working set
    // once) does not dilute them.
    let nworkloads = vm.config().workloads.0.len();
    let mut started: Vec<Option<MetricsSnapshot>> = vec![None; nworkloads];
    let mut boot_ms = None;
    let mut last_live = Instant::now();
    let mut live_base: Option<MetricsSnapshot> = None;
    let mut next = Instant::now();
    let live = !quiet && std::io::stderr().is_terminal();
    let ending = loop {
        next += SAMPLE_EVERY;
        if let Some(exit) = vm.wait_exit(next.saturating_duration_since(Instant::now())) {
            break match exit {
                VmExit::Stopped if interrupted.load(Ordering::Relaxed) => Ending::Interrupted,
                VmExit::Stopped => Ending::ControlQuit,
                VmExit::Migrated { .. } => Ending::Migrated,
                VmExit::HandedOver { .. } => Ending::HandedOver,
                _ => Ending::GuestStopped,
            };
        }
        let snap = vm.metrics()?;
        if !snap.valid() {
            continue;
        }
        if first.is_none() {
            boot_ms = Some(t_create.elapsed().as_secs_f64() * 1e3);
            first = Some(snap.clone());
            live_base = Some(snap.clone());
        }
        for (i, s) in started.iter_mut().enumerate() {
            if s.is_none() && snap.progress(i) > 0 {
                *s = Some(snap.clone());
            }
        }
        if let Some(w) = timeline.as_mut() {
            write_sample(w, vm, &snap, t_start)?;
        }
        if live && last_live.elapsed() >= LIVE_EVERY {
            if let Some(base) = &live_base {
                eprint!("\r\x1b[2K{}", live_line(vm, base, &snap, t_start));
            }
            live_base = Some(snap.clone());
            last_live = Instant::now();
        }
        if interrupted.load(Ordering::Relaxed) {
            break Ending::Interrupted;
        }
        if duration.is_some_and(|d| t_start.elapsed() >= d) {
            break Ending::Duration;
        }
        let done =
            (0..vm.config().workloads.0.len()).all(|i| snap.tasks_done(i) >= snap.tasks_of(i));
        if duration.is_none() && vm.config().workloads.finishes() && done {
            break Ending::WorkloadsDone;
        }
    };
    // (Only then is the VM stopped here: a migrated VM's device still
    // forwards its clients below.)
    let handed_over = match ending {
        Ending::HandedOver => match vm.stop() {
            VmExit::HandedOver { pid } => Some(pid),
            _ => None,
        },
        _ => None,
    };
    if let Some(pid) = handed_over {
        // The run goes on in the new process (same stdout, same control
        // socket path); guest memory is its now, so nothing here reads it.
        if live {
            eprint!("\r\x1b[2K");
        }
        if !quiet {
            eprintln!(
                "ferry: the VM was handed over to VMM process {pid}, which carries on this run; this process exits"
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    if let (Ending::Migrated, Some(svc)) = (ending, vm.service()) {
        let moved = svc.stats.moved_out.load(Ordering::Relaxed);
        if svc.redirected_to().is_none() && !quiet {
            eprintln!(
                "ferry: VM migrated with its clients ({moved} connections moved); this VMM exits"
            );
        }
        if let Some(to) = svc.redirected_to() {
            // Like a moved IP address: this host keeps the VM's service port and
            // forwards to the new host until the run's time is up (or Ctrl-C).
            if !quiet {
                eprintln!(
                    "ferry: VM migrated; forwarding its service port {} to {to}",
                    svc.local_addr()
                );
            }
            while !interrupted.load(Ordering::Relaxed)
                && duration.is_none_or(|d| t_start.elapsed() < d)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    let ran = t_start.elapsed();
    let last = vm.metrics()?;
    let exit = vm.stop();
    if live {
        eprint!("\r\x1b[2K");
    }
    if let Some(mut w) = timeline {
        w.flush()?;
    }
    let mut summary = summary_json(vm, &started, &last, ending, &exit, boot_ms, ran);
    if let Some(obj) = summary.as_object_mut() {
        obj.extend(summary_extra);
    }
    if front.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_summary(vm, &summary, &exit);
    }
    let failed = exit.is_error() || (0..vm.config().workloads.0.len()).any(|i| last.result(i) == 2);
    Ok(if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}

fn write_sample(w: &mut impl Write, vm: &Vm, s: &MetricsSnapshot, t_start: Instant) -> Result<()> {
    let progress: Vec<u64> = (0..vm.config().workloads.0.len())
        .map(|i| s.progress(i))
        .collect();
    let c = s.cpu_totals();
    let line = json!({
        "t_ms": s.at.saturating_duration_since(t_start).as_secs_f64() * 1e3,
        "guest_ms": s.guest_ms(),
        "progress": progress,
        "apf_not_present": c.apf_not_present,
        "apf_ready": c.apf_ready,
        "apf_waiting": c.apf_waiting,
        "apf_inline": c.apf_inline,
        "context_switches": c.context_switches,
        "idle_ms": c.idle_ms,
    });
    writeln!(w, "{line}")?;
    Ok(())
}

fn live_line(vm: &Vm, base: &MetricsSnapshot, now: &MetricsSnapshot, t_start: Instant) -> String {
    let mut parts = vec![format!("[{:6.1}s]", t_start.elapsed().as_secs_f64())];
    for (i, w) in vm.config().workloads.0.iter().enumerate() {
        let r = rate(base, now, base.progress(i), now.progress(i));
        let label = if w.name() == "dirty" {
            "dirty rate"
        } else {
            w.name()
        };
        let done = now.tasks_done(i);
        let tasks = now.tasks_of(i);
        if tasks > 0 && done == tasks {
            parts.push(format!("{} done", w.name()));
        } else if tasks > 0 {
            parts.push(format!("{label} {}", format::rate(r, w.unit())));
        }
    }
    let (a, b) = (base.cpu_totals(), now.cpu_totals());
    let span =
        now.at.saturating_duration_since(base.at).as_secs_f64() * 1e3 * vm.config().vcpus as f64;
    if span > 0.0 {
        parts.push(format!(
            "idle {:.0}%",
            100.0 * (b.idle_ms - a.idle_ms).max(0.0) / span
        ));
    }
    if b.apf_not_present > 0 {
        parts.push(format!(
            "APF {} ({} waiting)",
            b.apf_not_present, b.apf_waiting
        ));
    }
    parts.join(" | ")
}
