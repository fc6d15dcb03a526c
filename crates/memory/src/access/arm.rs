//! Sampling reads: arming a share (dropping this process's page table
//! entries, so the next access raises a userfaultfd MINOR fault) and
//! recording the faults that follow. Writes come from the caller's dirty
//! log, so pages it just reported written are left mapped.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::bits::{clear_bits, set_bits};
use super::shares::{arm_runs, share_runs};
use super::{AccessError, AccessTracker, ArmReport};
use crate::region::PAGE_SIZE;

impl AccessTracker {
    /// Drops the page table entries of the next share of pages, so each
    /// one's next access raises a MINOR fault (a hole stays a hole: its
    /// access is a MISSING fault, allocated as usual where only MINOR is
    /// registered). Those pages count as not read until they fault.
    ///
    /// Pages the last period's dirty log reported written are left mapped
    /// and keep their previous sample: a page written again is known
    /// accessed without a fault, and sampling it would only cost the
    /// writer a fault (a write-heavy working set would pay one per page).
    pub fn arm(&self) -> Result<ArmReport, AccessError> {
        let t = Instant::now();
        let mut p = self.lock();
        let share = p.take_share(self.share);
        let (mut pages, mut skipped, mut runs) = (0, 0, 0);
        for (i, (range, seen)) in self.ranges.iter().zip(&self.seen).enumerate() {
            let written = p.written.get(i).map(Vec::as_slice);
            let share_pages: u64 = share_runs(range.pages, share, self.share)
                .iter()
                .map(|(s, e)| e - s)
                .sum();
            let mut armed = 0;
            for (start, end) in arm_runs(range.pages, share, self.share, written) {
                // Forget the last sample first: a fault after the madvise
                // below is this sample's.
                clear_bits(seen, start, end);
                drop_ptes(range.host + start * PAGE_SIZE, (end - start) * PAGE_SIZE)?;
                armed += end - start;
                runs += 1;
            }
            pages += armed;
            skipped += share_pages - armed;
        }
        Ok(p.count_arm(t, pages, skipped, runs))
    }

    /// A MINOR fault on the page holding `host_addr`: that page's group
    /// (the grain's aligned pages, within its region) was read (or
    /// written) since it was armed; all of it is marked. Returns the
    /// group as (host address, bytes) for the caller to map back, None
    /// for an address outside the tracked ranges. Lock-free.
    pub fn record(&self, host_addr: u64) -> Option<(u64, u64)> {
        for (range, seen) in self.ranges.iter().zip(&self.seen) {
            let Some(off) = host_addr.checked_sub(range.host) else {
                continue;
            };
            let page = off / PAGE_SIZE;
            if page < range.pages {
                let start = page & !(self.grain - 1);
                let end = (start + self.grain).min(range.pages);
                set_bits(seen, start, end);
                self.faults.fetch_add(1, Ordering::Relaxed);
                return Some((range.host + start * PAGE_SIZE, (end - start) * PAGE_SIZE));
            }
        }
        None
    }

    /// [`record`](Self::record), with the time the caller took to serve
    /// the fault.
    pub fn record_timed(&self, host_addr: u64, service_ns: u64) -> Option<(u64, u64)> {
        let group = self.record(host_addr);
        self.add_fault_cost(service_ns);
        group
    }

    /// Adds fault service time (ns) to the statistics.
    pub fn add_fault_cost(&self, service_ns: u64) {
        self.fault_ns.fetch_add(service_ns, Ordering::Relaxed);
    }
}

/// MADV_DONTNEED on one tracked run.
pub(super) fn drop_ptes(addr: u64, len: u64) -> Result<(), AccessError> {
    // SAFETY: the range lies inside a tracked region (the caller computes it
    // from one), which `new`'s contract or `for_memory`'s Arc keeps mapped
    // as a shared memfd mapping; on such a mapping MADV_DONTNEED only drops
    // page table entries and the data stays in the file, so no memory any
    // Rust value owns changes.
    let r = unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_DONTNEED) };
    if r < 0 {
        return Err(AccessError::Madvise {
            addr,
            len,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}
