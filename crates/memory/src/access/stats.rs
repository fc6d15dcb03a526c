//! What tracking costs: per-arm reports and the running statistics a
//! VMM shows in its status (arm times, faults, and the vCPU time they
//! take, estimated).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{AccessTracker, Periodic};

/// What one [`AccessTracker::arm`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArmReport {
    /// Pages whose next access raises a MINOR fault.
    pub pages: u64,
    /// Pages of the share left mapped because the last period's dirty
    /// log says they were written (their access is known without a fault).
    pub skipped: u64,
    /// madvise calls made.
    pub runs: u64,
    /// Time taken.
    pub micros: f64,
}

/// The tracker's own cost, for status reports.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct AccessStats {
    /// Periods closed.
    pub periods: u64,
    /// Shares the pages rotate through (each page is sampled every `share` periods).
    pub share: u32,
    /// Pages one sampled fault answers for.
    pub grain_pages: u64,
    /// Pages tracked.
    pub pages: u64,
    /// Calls to arm.
    pub arms: u64,
    /// Pages armed over all arms.
    pub pages_armed_total: u64,
    /// Mean pages armed per arm.
    pub pages_armed_per_arm: f64,
    /// Pages of the armed shares skipped as just written, over all arms.
    pub pages_skipped_total: u64,
    /// MINOR faults recorded.
    pub minor_faults_total: u64,
    /// Time the last arm took (µs).
    pub arm_us_last: f64,
    /// Mean arm time (µs).
    pub arm_us_mean: f64,
    /// Time the last end_period took (µs).
    pub end_period_us_last: f64,
    /// Fault service time the caller reported, all faults (µs).
    pub fault_service_us_total: f64,
    /// Mean service time per fault (µs).
    pub fault_service_us_mean: f64,
    /// Time covered by the closed periods (s).
    pub tracked_s: f64,
    /// MINOR faults per second of tracked time.
    pub minor_faults_per_s: f64,
    /// Estimated vCPU time lost to the faults, as a percentage of one CPU:
    /// fault count x mean service time / tracked time. The service time is
    /// the handler's (from its wake-up to UFFDIO_CONTINUE), so this is a
    /// lower bound: the faulting thread's wake-ups, KVM's exits and a
    /// guest task's wait behind an async page fault are not in it (on the
    /// PVM development host a guest lost ~90 µs of vCPU time per fault
    /// while handlers measured ~10 µs).
    pub vcpu_time_lost_pct: f64,
    /// Pages counted as accessed in the last period.
    pub accessed_last_period: u64,
}

impl Periodic {
    /// Counts an arm begun at `t` in the statistics.
    pub(super) fn count_arm(
        &mut self,
        t: Instant,
        pages: u64,
        skipped: u64,
        runs: u64,
    ) -> ArmReport {
        let micros = t.elapsed().as_secs_f64() * 1e6;
        self.arms += 1;
        self.pages_armed_total += pages;
        self.pages_skipped_total += skipped;
        self.arm_us_last = micros;
        self.arm_us_total += micros;
        ArmReport {
            pages,
            skipped,
            runs,
            micros,
        }
    }
}

impl AccessTracker {
    /// What tracking has cost so far.
    pub fn stats(&self) -> AccessStats {
        let p = self.lock();
        let faults = self.faults.load(Ordering::Relaxed);
        let service_us = self.fault_ns.load(Ordering::Relaxed) as f64 / 1e3;
        let tracked_s = p.tracked.as_secs_f64();
        let per = |x: f64, n: u64| if n == 0 { 0.0 } else { x / n as f64 };
        let rate = |x: f64| if tracked_s > 0.0 { x / tracked_s } else { 0.0 };
        AccessStats {
            periods: p.periods,
            share: self.share,
            grain_pages: self.grain,
            pages: self.ranges.iter().map(|r| r.pages).sum(),
            arms: p.arms,
            pages_armed_total: p.pages_armed_total,
            pages_armed_per_arm: per(p.pages_armed_total as f64, p.arms),
            pages_skipped_total: p.pages_skipped_total,
            minor_faults_total: faults,
            arm_us_last: p.arm_us_last,
            arm_us_mean: per(p.arm_us_total, p.arms),
            end_period_us_last: p.end_period_us_last,
            fault_service_us_total: service_us,
            fault_service_us_mean: per(service_us, faults),
            tracked_s,
            minor_faults_per_s: rate(faults as f64),
            vcpu_time_lost_pct: 100.0 * rate(service_us / 1e6),
            accessed_last_period: p.accessed_last,
        }
    }
}
