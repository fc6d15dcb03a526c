//! A Prometheus endpoint for one VMM (`ferry run --metrics ADDR`): the
//! migration's figures, named after KubeVirt's `kubevirt_vmi_migration_*`
//! metrics with ferry's prefix, and the guest's own counters, in text
//! exposition format 0.0.4. It shows figures only, never guest memory.
//! The HTTP side, bounded against slow and hostile clients, is [`http`].

pub mod http;

use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_migration::{LivePhase, Telemetry};

use crate::vm::Vm;

/// Serves `GET /metrics` for `vm` on `addr` until the VM is gone, over
/// mutual TLS with `tls`'s certificate if given; returns the address it
/// listens on (port 0 picks one).
pub fn serve(
    vm: &Arc<Vm>,
    addr: SocketAddr,
    tls: Option<Arc<ferry_tls::Credentials>>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    let vm = Arc::downgrade(vm);
    let rate: RateMark = Mutex::new(None);
    http::serve(listener, http::Limits::default(), tls, move || {
        vm.upgrade().map(|vm| render(&vm, &rate))
    })?;
    Ok(local)
}

/// The last scrape's (time, bytes sent): the transfer rate is measured
/// between two scrapes.
type RateMark = Mutex<Option<(Instant, u64)>>;

fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, v) in samples {
        let _ = writeln!(out, "{name}{labels} {v}");
    }
}

fn one(v: f64) -> Vec<(String, f64)> {
    vec![(String::new(), v)]
}

/// The exposition text now.
pub fn render(vm: &Vm, rate: &RateMark) -> String {
    let mut o = String::new();
    let c = vm.config();
    metric(
        &mut o,
        "ferry_vmi_memory_bytes",
        "gauge",
        "Guest RAM.",
        &one(c.mem_bytes as f64),
    );
    metric(
        &mut o,
        "ferry_vmi_vcpus",
        "gauge",
        "vCPUs.",
        &one(f64::from(c.vcpus)),
    );
    metric(
        &mut o,
        "ferry_vmi_running",
        "gauge",
        "1 while the VM's vCPUs run on this host.",
        &one(f64::from(u8::from(
            vm.reported_state() == crate::ReportedState::Running,
        ))),
    );
    if let Ok(m) = vm.metrics() {
        if m.valid() {
            let progress = c
                .workloads
                .0
                .iter()
                .enumerate()
                .map(|(i, w)| (format!("{{workload=\"{w}\"}}"), m.progress(i) as f64))
                .collect::<Vec<_>>();
            metric(
                &mut o,
                "ferry_vmi_guest_workload_progress_total",
                "counter",
                "The guest's own progress counter per workload (it moves with the VM).",
                &progress,
            );
            metric(
                &mut o,
                "ferry_vmi_guest_ticks_total",
                "counter",
                "Timer ticks the guest handled, all vCPUs.",
                &one(m.cpu_totals().ticks as f64),
            );
        }
    }
    if let Some(s) = vm.service() {
        metric(
            &mut o,
            "ferry_vmi_service_requests_answered_total",
            "counter",
            "Requests the VM's service answered on this host.",
            &one(s.stats.responses.load(Ordering::Relaxed) as f64),
        );
    }
    if let Some(t) = vm.watch().latest() {
        migration(&mut o, &t, rate);
    }
    o
}

/// The latest migration's figures, from its telemetry on this side.
fn migration(o: &mut String, t: &Telemetry, rate: &RateMark) {
    let snap = t.snapshot();
    let phase = t.phase();
    let sent: u64 = snap.links.iter().map(|(_, s, _)| s).sum();
    let transfer = {
        let mut last = rate.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let r = match *last {
            Some((at, b)) if sent >= b && now > at => (sent - b) as f64 / (now - at).as_secs_f64(),
            _ => 0.0,
        };
        *last = Some((now, sent));
        r
    };
    // What crossed: every byte this side wrote to or read from the
    // migration's connections, as `ferry migrate`'s "on the wire" counts
    // the source's pages and state (the control messages add a few KiB);
    // not the guest memory the rounds went through (zero pages cross as
    // ranges, unchanged ones not at all, compressed ones as less).
    let crossed: u64 = snap.links.iter().map(|(_, s, r)| s + r).sum();
    let remaining = snap.remaining_pages * 4096;
    metric(
        o,
        "ferry_vmi_migration_data_total_bytes",
        "gauge",
        "Guest memory the migration covers.",
        &one(snap.total_bytes as f64),
    );
    metric(
        o,
        "ferry_vmi_migration_data_processed_bytes",
        "gauge",
        "Bytes that crossed the migration's connections so far, both ways.",
        &one(crossed as f64),
    );
    metric(
        o,
        "ferry_vmi_migration_data_remaining_bytes",
        "gauge",
        "Page bytes left in the current round (source).",
        &one(remaining as f64),
    );
    metric(
        o,
        "ferry_vmi_migration_dirty_memory_rate_bytes",
        "gauge",
        "Guest dirty rate over the last precopy round (bytes/s).",
        &one(snap.dirty_rate as f64),
    );
    metric(
        o,
        "ferry_vmi_migration_memory_transfer_rate_bytes",
        "gauge",
        "Bytes/s sent on every connection since the previous scrape.",
        &one(transfer),
    );
    metric(
        o,
        "ferry_vmi_migration_round",
        "gauge",
        "Current precopy round (0 = the full copy).",
        &one(f64::from(snap.round)),
    );
    metric(
        o,
        "ferry_vmi_migration_throttle_percent",
        "gauge",
        "vCPU time auto-converge takes away.",
        &one(f64::from(snap.throttle_pct)),
    );
    let phases: Vec<(String, f64)> = LivePhase::ALL
        .iter()
        .map(|p| {
            (
                format!("{{phase=\"{}\"}}", p.name()),
                f64::from(u8::from(*p == phase)),
            )
        })
        .collect();
    metric(
        o,
        "ferry_vmi_migration_phase",
        "gauge",
        "1 for the phase the latest migration of this VM is in.",
        &phases,
    );
    let running = matches!(
        phase,
        LivePhase::Running | LivePhase::Switching | LivePhase::Postcopy | LivePhase::Paused
    );
    metric(
        o,
        "ferry_vmi_migrations_in_running_phase",
        "gauge",
        "Migrations of this VM running now.",
        &one(f64::from(u8::from(running))),
    );
    metric(
        o,
        "ferry_vmi_migration_succeeded",
        "gauge",
        "1 if the latest migration succeeded.",
        &one(f64::from(u8::from(phase == LivePhase::Succeeded))),
    );
    metric(
        o,
        "ferry_vmi_migration_failed",
        "gauge",
        "1 if the latest migration failed.",
        &one(f64::from(u8::from(phase == LivePhase::Failed))),
    );
    let links: Vec<(String, f64)> = snap
        .links
        .iter()
        .map(|(n, s, _)| (format!("{{link=\"{n}\"}}"), *s as f64))
        .collect();
    metric(
        o,
        "ferry_vmi_migration_link_sent_bytes",
        "counter",
        "Bytes each connection of the latest migration sent.",
        &links,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, name: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
    }

    /// Issue 56: the counter grew to 77.7 MB while 46.9 MB crossed the
    /// link; it counted guest pages gone through (zero and unchanged pages
    /// at 4 KiB each), not bytes.
    #[test]
    fn processed_bytes_are_the_bytes_that_crossed() {
        let t = Telemetry::new();
        t.set_total_bytes(256 << 20);
        t.round_began(0, 65536);
        // 10,000 pages gone through: most went as zero ranges or compressed.
        t.add_pages(10_000);
        t.link("bulk0").sent.fetch_add(3_000_000, Ordering::Relaxed);
        t.link("bulk1").sent.fetch_add(2_000_000, Ordering::Relaxed);
        let control = t.link("control");
        control.sent.fetch_add(1_234, Ordering::Relaxed);
        control.received.fetch_add(566, Ordering::Relaxed);
        let mut o = String::new();
        migration(&mut o, &t, &Mutex::new(None));
        assert_eq!(
            value(&o, "ferry_vmi_migration_data_processed_bytes"),
            5_001_800.0
        );
        assert_eq!(
            value(&o, "ferry_vmi_migration_data_remaining_bytes"),
            ((65536 - 10_000) * 4096) as f64
        );
        assert_eq!(
            value(&o, "ferry_vmi_migration_link_sent_bytes{link=\"bulk0\"}"),
            3_000_000.0
        );
    }
}
