//! Page-in: a MISSING fault on a remote chunk brings the whole chunk from
//! one of its servers, the faulting page first (its vCPU is woken as soon
//! as that page is in), then the rest; the server keeps its copy. Pages the
//! server did not hold, and never-written pages of a chunk held here, become
//! zero pages. Every page lands through the sink's [`UffdPlacer`], the one
//! landing seam: runs of consecutive pages go in one ioctl, and a page the
//! kernel already holds is left as it is.
//!
//! [`UffdPlacer`]: crate::sink::UffdPlacer

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::error::MigrationError;
use crate::ranges::{GpaPages, PAGE};

use super::chunks::ON_MAIN;
use super::stats::record_latency;
use super::worker::Worker;
use super::{bad_gpa, host_of, sink_err};

impl Worker {
    /// Maps zero pages over every hole of chunk `c` (waking whoever waits
    /// on one).
    pub(super) fn fill_holes(&self, c: usize) -> Result<(), MigrationError> {
        self.fill_holes_as(c, false)
    }

    /// [`fill_holes`](Self::fill_holes), or with `protect` the zero pages
    /// land write-protected and nobody is woken (the caller wakes the
    /// chunk).
    fn fill_holes_as(&self, c: usize, protect: bool) -> Result<(), MigrationError> {
        let run = self.map.run(c);
        let (_, resident) = self.residency(c)?;
        let holes: Vec<bool> = resident.iter().map(|&r| !r).collect();
        let mut filled = 0;
        for (i, n) in runs_of(&holes) {
            let hole = GpaPages::new(run.gpa + i as u64 * PAGE, n as u64);
            let placed = if protect {
                self.placer.zero_missing_protected(hole)
            } else {
                self.placer.zero_missing(hole)
            };
            filled += placed.map_err(|e| sink_err("zero page", e))?.new;
        }
        self.shared
            .counters
            .zero_fills
            .fetch_add(filled, Ordering::Relaxed);
        Ok(())
    }

    /// Chunk `c`'s first host address, and which of its pages are in the
    /// memfd (asked with mincore: nothing is touched).
    pub(super) fn residency(&self, c: usize) -> Result<(u64, Vec<bool>), MigrationError> {
        let run = self.map.run(c);
        let host = host_of(&self.regions, run.gpa).ok_or_else(|| bad_gpa(run.gpa))?;
        // SAFETY: the chunk lies inside this VM's guest mapping (host_of).
        let resident = unsafe { ferry_memory::mapping::resident_pages(host, run.bytes()) }
            .map_err(|e| MigrationError::vm("mincore")(e.to_string()))?;
        Ok((host, resident))
    }

    /// Brings chunk `c` from `server`: the page at `gpa` first (its vCPU
    /// is woken as soon as it is in), then the rest. The servers keep
    /// their copies. Brought by a read, it lands write-protected: it is
    /// clean ([`super::clean`]).
    pub(super) fn page_in(
        &mut self,
        c: usize,
        gpa: u64,
        server: usize,
        t: Instant,
        write: bool,
    ) -> Result<(), MigrationError> {
        let run = self.map.run(c);
        let runs = fault_first(run, gpa);
        let (placer, shared) = (&self.placer, &self.shared);
        let mut pages = 0u64;
        // A chunk brought by a read lands write-protected, so its first
        // write is seen (super::clean); one brought by a write is dirty at
        // once. Either way the servers keep their copies: the room stays
        // this VM's (room a server frees goes back to all its VMs, and a
        // later page-out could find it taken), and a clean chunk goes out
        // again with nothing sent.
        let protect = self.track_clean && !write;
        self.stores[server].fetch_runs(&runs, false, |i, gpas, data| {
            // One copy per run of consecutive pages (a chunk is one run in
            // one region): a page at a time costs an ioctl each. A page
            // mapped already counts as brought.
            let placed = if protect {
                placer.copy_pages_protected(gpas, data, i == 0)
            } else {
                placer.copy_pages(gpas, data, i == 0)
            }
            .map_err(|e| sink_err("copy", e))?;
            pages += placed.new + placed.present;
            if i == 0 {
                if gpas.is_empty() {
                    // A zero page: the server held nothing for it.
                    let first = GpaPages::new(gpa, 1);
                    if protect {
                        placer
                            .zero_missing_protected(first)
                            .map_err(|e| sink_err("zero page", e))?;
                        placer.wake(first);
                    } else {
                        placer
                            .zero_missing(first)
                            .map_err(|e| sink_err("zero page", e))?;
                    }
                }
                record_latency(&shared.latency_us, t.elapsed().as_secs_f64() * 1e6);
            }
            Ok(())
        })?;
        // The pages the server did not hold are zero pages.
        self.fill_holes_as(c, protect)?;
        // A vCPU that faulted on a page of the chunk while it came in
        // waits for a wake (the copies did not wake): give it now, not
        // after the page-out that may follow.
        self.placer.wake(run);
        self.set_place(c, ON_MAIN);
        self.clean[c] = protect;
        self.kept[c] = true;
        self.aging[c] |= 0x80;
        let k = &self.shared.counters;
        k.resident.fetch_add(1, Ordering::Relaxed);
        k.page_ins.fetch_add(1, Ordering::Relaxed);
        k.pages_in.fetch_add(pages, Ordering::Relaxed);
        Ok(())
    }
}

/// What to ask the server for on a fault at `gpa` in chunk `run`: the
/// faulting page, then the rest of the chunk after it, then the part
/// before it (empty parts left out).
fn fault_first(run: GpaPages, gpa: u64) -> Vec<GpaPages> {
    [
        GpaPages::new(gpa, 1),
        GpaPages::new(gpa + PAGE, (run.end() - gpa) / PAGE - 1),
        GpaPages::new(run.gpa, (gpa - run.gpa) / PAGE),
    ]
    .into_iter()
    .filter(|r| r.pages > 0)
    .collect()
}

/// Runs of `true` in `v` as (start, length).
pub(super) fn runs_of(v: &[bool]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < v.len() {
        if v[i] {
            let s = i;
            while i < v.len() && v[i] {
                i += 1;
            }
            out.push((s, i - s));
        } else {
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_finds_every_run_and_only_those() {
        assert_eq!(runs_of(&[]), []);
        assert_eq!(runs_of(&[false, false]), []);
        assert_eq!(runs_of(&[true; 3]), [(0, 3)]);
        assert_eq!(
            runs_of(&[true, false, false, true, true, false, true]),
            [(0, 1), (3, 2), (6, 1)]
        );
    }

    #[test]
    fn the_faulting_page_comes_first_then_the_rest_then_the_head() {
        let run = GpaPages::new(0x10000, 8);
        let middle = 0x10000 + 3 * PAGE;
        assert_eq!(
            fault_first(run, middle),
            [
                GpaPages::new(middle, 1),
                GpaPages::new(middle + PAGE, 4),
                GpaPages::new(0x10000, 3),
            ]
        );
        // At either end, the empty part is left out.
        assert_eq!(
            fault_first(run, 0x10000),
            [GpaPages::new(0x10000, 1), GpaPages::new(0x10000 + PAGE, 7)]
        );
        let last = 0x10000 + 7 * PAGE;
        assert_eq!(
            fault_first(run, last),
            [GpaPages::new(last, 1), GpaPages::new(0x10000, 7)]
        );
        // Every page of the chunk exactly once.
        let mut pages: Vec<u64> = fault_first(run, middle)
            .iter()
            .flat_map(|r| r.page_addrs())
            .collect();
        pages.sort_unstable();
        assert_eq!(pages, run.page_addrs().collect::<Vec<_>>());
    }
}
