//! Reading the guest's metrics page, and the figures derived from it.
//!
//! The guest writes plain 64-bit counters into a page the VMM reads whenever it
//! likes (every 10 ms when sampling): no exits, no guest cooperation. Each word
//! is read with a volatile load; words may come from slightly different
//! moments, which is fine for counters that only grow.

use std::time::Instant;

use ferry_memory::{GuestMemory, MemoryError, PAGE_SIZE};

use crate::guest_abi::{self, Metrics, METRICS_GPA};

/// The metrics page at one moment.
#[derive(Clone, Debug)]
pub struct MetricsSnapshot {
    /// When the host read it.
    pub at: Instant,
    /// The page.
    pub raw: Metrics,
}

impl MetricsSnapshot {
    /// Reads the page from guest memory, touching only its pages that are in
    /// memory (asked with [`GuestMemory::holds_data`]); words on the others
    /// read as zero, which is what such a page holds. A postcopy
    /// destination's pages still on their way are registered with
    /// userfaultfd: a read of one from a VMM thread (a timeline sample, a
    /// metrics scrape) would wait on a fault nobody serves before the vCPUs
    /// start, and reading a hole would fill it with zeros. Until the page
    /// with the counters arrives the snapshot is simply not `valid()`.
    pub fn read(memory: &GuestMemory) -> Result<Self, MemoryError> {
        const PAGE_WORDS: usize = (PAGE_SIZE / 8) as usize;
        memory.region_for(METRICS_GPA, (Metrics::WORDS * 8) as u64)?;
        let mut words = [0u64; Metrics::WORDS];
        for (p, page_words) in words.chunks_mut(PAGE_WORDS).enumerate() {
            let page = METRICS_GPA + p as u64 * PAGE_SIZE;
            if !memory.holds_data(page, PAGE_SIZE) {
                continue;
            }
            for (i, w) in page_words.iter_mut().enumerate() {
                *w = memory.read_u64_volatile(page + 8 * i as u64)?;
            }
        }
        // SAFETY: Metrics is repr(C), made only of u64 fields and arrays of them
        // (checked by a const assertion in guest_abi), so any bit pattern of
        // the same size is a valid value.
        let raw: Metrics = unsafe { std::mem::transmute(words) };
        Ok(MetricsSnapshot {
            at: Instant::now(),
            raw,
        })
    }

    /// True once the guest kernel has set the page up.
    pub fn valid(&self) -> bool {
        self.raw.magic == guest_abi::METRICS_MAGIC
    }

    /// True after a guest panic.
    pub fn panicked(&self) -> bool {
        self.raw.state == guest_abi::state::PANIC
    }

    fn cpus(&self) -> &[guest_abi::CpuMetrics] {
        let n = (self.raw.ncpus as usize).min(guest_abi::MAX_CPUS);
        &self.raw.cpu[..n]
    }

    /// Tasks the guest created.
    pub fn tasks(&self) -> &[guest_abi::TaskMetrics] {
        let n = (self.raw.ntasks as usize).min(guest_abi::MAX_TASKS);
        &self.raw.tasks[..n]
    }

    /// Sum of the progress counters of workload `w`'s tasks.
    pub fn progress(&self, w: usize) -> u64 {
        self.tasks()
            .iter()
            .filter(|t| t.workload == w as u64)
            .map(|t| t.progress)
            .sum()
    }

    /// Tasks of workload `w` that have finished.
    pub fn tasks_done(&self, w: usize) -> u64 {
        self.raw.workloads.get(w).map_or(0, |m| m.tasks_done)
    }

    /// Tasks of workload `w` done with their set-up and waiting for their
    /// signal (memtouch `after=migrate`: region filled, waiting to be moved).
    pub fn tasks_ready(&self, w: usize) -> u64 {
        self.raw.workloads.get(w).map_or(0, |m| m.ready)
    }

    /// Tasks of workload `w`.
    pub fn tasks_of(&self, w: usize) -> u64 {
        self.raw.workloads.get(w).map_or(0, |m| m.tasks)
    }

    /// Workload `w`'s own verdict (sort: 1 = verified sorted, 2 = wrong).
    pub fn result(&self, w: usize) -> u64 {
        self.raw.workloads.get(w).map_or(0, |m| m.result)
    }

    /// Guest time since the kernel started, in milliseconds (from its TSC).
    pub fn guest_ms(&self) -> f64 {
        if self.raw.tsc_khz == 0 || self.raw.guest_tsc < self.raw.boot_tsc {
            return 0.0;
        }
        (self.raw.guest_tsc - self.raw.boot_tsc) as f64 / self.raw.tsc_khz as f64
    }

    /// Milliseconds a task ran (start to end, or to now's guest time if running).
    pub fn task_ms(&self, t: &guest_abi::TaskMetrics) -> Option<f64> {
        if t.start_tsc == 0 || self.raw.tsc_khz == 0 {
            return None;
        }
        let end = if t.end_tsc != 0 {
            t.end_tsc
        } else {
            self.raw.guest_tsc.max(t.start_tsc)
        };
        Some((end - t.start_tsc) as f64 / self.raw.tsc_khz as f64)
    }

    /// Counters summed over vCPUs.
    pub fn cpu_totals(&self) -> CpuTotals {
        let mut t = CpuTotals::default();
        for c in self.cpus() {
            t.ticks += c.ticks;
            t.context_switches += c.context_switches;
            t.syscalls += c.syscalls;
            t.idle_ms += if self.raw.tsc_khz > 0 {
                c.idle_tsc as f64 / self.raw.tsc_khz as f64
            } else {
                0.0
            };
            t.apf_not_present += c.apf_not_present;
            t.apf_ready += c.apf_ready;
            t.apf_double += c.apf_double;
            t.apf_wake_all += c.apf_wake_all;
            t.apf_waiting += c.apf_waiting;
            t.apf_inline += c.apf_inline;
        }
        t
    }
}

/// Guest kernel counters summed over all vCPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct CpuTotals {
    /// Timer ticks.
    pub ticks: u64,
    /// Task switches.
    pub context_switches: u64,
    /// Syscalls.
    pub syscalls: u64,
    /// Time vCPUs spent idle (halted), ms.
    pub idle_ms: f64,
    /// APF 'page not present' events.
    pub apf_not_present: u64,
    /// APF 'page ready' events.
    pub apf_ready: u64,
    /// APF not-present for a token already awaited.
    pub apf_double: u64,
    /// APF wake-all events.
    pub apf_wake_all: u64,
    /// Tasks blocked on APF now.
    pub apf_waiting: u64,
    /// APF not-present events the vCPU waited out in KVM (no other task
    /// could run): no task switch in the guest.
    pub apf_inline: u64,
}

/// Per-second rate of a counter between two snapshots.
pub fn rate(older: &MetricsSnapshot, newer: &MetricsSnapshot, older_v: u64, newer_v: u64) -> f64 {
    let dt = newer.at.saturating_duration_since(older.at).as_secs_f64();
    if dt <= 0.0 {
        return 0.0;
    }
    newer_v.saturating_sub(older_v) as f64 / dt
}
