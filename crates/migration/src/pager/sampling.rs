//! Access sampling (where the kernel gives MINOR faults with MISSING+WP):
//! every [`PERIOD`] a share of the chunks held here loses its page table
//! entries (the memfd keeps the pages); the first access to one raises a
//! MINOR fault, which marks the chunk referenced and maps all its pages
//! back. The aging ranking shifts each period's references into an 8-bit
//! history per chunk; the clock reads the same arming as "touched since".
//! Map-back lands through the sink's [`UffdPlacer`] (UFFDIO_CONTINUE).
//!
//! [`UffdPlacer`]: crate::sink::UffdPlacer

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::ranges::{GpaPages, PAGE};

use super::chunks::{ChunkMap, ON_MAIN};
use super::host_of;
use super::page_in::runs_of;
use super::worker::Worker;

/// Most chunks armed for sampling per period (a MINOR fault costs a vCPU
/// 30-90 µs here, so the share stays small).
const ARM_MAX: usize = 64;

impl Worker {
    /// A sampled chunk was touched (the fault at `gpa`): maps all its
    /// resident pages back at once (sampling dropped their page table
    /// entries), so the chunk costs one MINOR fault per period, not one per
    /// page; then wakes the fault.
    pub(super) fn map_back(&mut self, c: usize, gpa: u64) -> Result<(), MigrationError> {
        let run = self.map.run(c);
        let (_, resident) = self.residency(c)?;
        let runs: Vec<GpaPages> = runs_of(&resident)
            .into_iter()
            .map(|(i, n)| GpaPages::new(run.gpa + i as u64 * PAGE, n as u64))
            .collect();
        // A clean chunk stays write-protected as it comes back; if the
        // kernel refuses that, the chunk is dirty and maps back as any.
        if self.clean[c] {
            let refused = runs
                .iter()
                .find_map(|&r| self.placer.map_back_protected(r).err());
            let Some(e) = refused else {
                self.placer.wake(GpaPages::new(gpa, 1));
                return Ok(());
            };
            tracing::warn!(%e, "this kernel cannot map pages back write-protected: every chunk paged in from now on is taken for written");
            self.track_clean = false;
            self.mark_dirty(c)?;
        }
        for &r in &runs {
            // Pages mapped already are left (one by one); a run that cannot
            // be mapped back faults MINOR again on its next access.
            let _ = self.placer.map_back(r);
        }
        self.placer.wake(GpaPages::new(gpa, 1));
        Ok(())
    }

    /// Ends a sampling period: ages the chunks armed in it and arms the
    /// next share of the chunks held here.
    pub(super) fn period(&mut self) {
        for &c in &self.armed {
            self.aging[c] = (self.aging[c] >> 1) | if self.referenced[c] { 0x80 } else { 0 };
        }
        self.armed.clear();
        if !self.sampling {
            return;
        }
        let places = self.shared.places();
        let n = places.len();
        let want =
            (self.shared.counters.resident.load(Ordering::Relaxed) as usize / 4).clamp(1, ARM_MAX);
        let mut seen = 0;
        while self.armed.len() < want && seen < n {
            let c = self.cursor;
            self.cursor = (self.cursor + 1) % n;
            seen += 1;
            if places[c] != ON_MAIN {
                continue;
            }
            if drop_ptes(&self.map, &self.regions, c) {
                self.referenced[c] = false;
                self.clock.armed(c, Instant::now());
                self.armed.push(c);
            }
        }
    }
}

/// Drops chunk `c`'s page table entries (the memfd keeps its pages): its
/// next access raises a MINOR fault.
pub(super) fn drop_ptes(map: &ChunkMap, regions: &[RegionView], c: usize) -> bool {
    let run = map.run(c);
    let Some(host) = host_of(regions, run.gpa) else {
        return false;
    };
    // SAFETY: the chunk lies inside this VM's shared guest mapping;
    // only page table entries go, the memfd keeps the pages.
    unsafe { ferry_memory::mapping::drop_ptes(host, run.bytes()) }.is_ok()
}
