//! Clean chunks: a chunk stays on its servers when it is paged in, and
//! one paged in by a read lands write-protected, so while the guest only
//! reads it, the servers' copies are still its bytes and paging it out
//! again is a drop: punched here, nothing sent. The first write faults
//! WP; the chunk is then dirty (unprotected whole, so it costs one fault)
//! and its next page-out sends it as before. A chunk paged in by a write
//! is dirty from the start (no protection: nothing is paid for it).
//! Sampling maps a clean chunk's pages back write-protected too
//! ([`super::sampling`]); a kernel that refuses that (before 6.4) turns
//! clean tracking off for later page-ins.
//!
//! On this PVM host nearly every vCPU fault on guest RAM reaches
//! userfaultfd as a write (2,254 of 2,255 page-ins of bench/split.py's
//! sort), so a KVM guest here gains little; readers outside the vCPUs and
//! read faults elsewhere do.

use std::sync::atomic::Ordering;

use crate::error::MigrationError;

use super::worker::Worker;
use super::{bad_gpa, host_of, uffd_err};

impl Worker {
    /// Chunk `c` (held here) is written: it is dirty from now on, and its
    /// protection comes off (which wakes its writers).
    pub(super) fn mark_dirty(&mut self, c: usize) -> Result<(), MigrationError> {
        self.clean[c] = false;
        let run = self.map.run(c);
        let host = host_of(&self.regions, run.gpa).ok_or_else(|| bad_gpa(run.gpa))?;
        self.uffd
            .write_protect(host, run.bytes(), false)
            .map_err(|e| uffd_err("unprotect a written chunk", e))
    }

    /// Pages out clean chunk `c`: its servers hold its bytes already, so
    /// it is only punched out here. It is write-protected the whole time,
    /// so a writer waits on this thread and, unprotected after the punch,
    /// faults MISSING and pages it back in. (The caller holds
    /// `paging_out`.)
    pub(super) fn drop_clean(&mut self, c: usize) -> Result<(), MigrationError> {
        let run = self.map.run(c);
        let host = host_of(&self.regions, run.gpa).ok_or_else(|| bad_gpa(run.gpa))?;
        // SAFETY: the chunk lies inside this VM's shared guest mapping
        // (host_of), and its servers hold its bytes.
        let punched = unsafe { ferry_memory::mapping::remove_range(host, run.bytes()) }
            .map_err(|e| MigrationError::vm("punch a clean chunk")(e.to_string()));
        self.clean[c] = false;
        self.uffd
            .write_protect(host, run.bytes(), false)
            .map_err(|e| uffd_err("unprotect", e))?;
        self.placer.wake(run);
        punched?;
        self.paged_out(c);
        self.shared
            .counters
            .clean_drops
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
