//! Access tracking for LRU ranking (split migration sends hot chunks to the
//! main host): which guest pages were used, period by period, at low cost.
//!
//! Writes come from the caller (KVM's dirty log, handed to
//! [`AccessTracker::end_period`]). Reads are sampled: [`AccessTracker::arm`]
//! drops this process's page table entries for one share of the pages
//! (MADV_DONTNEED on the shared memfd mapping: the data stays in the page
//! cache), so the next access to such a page raises a userfaultfd MINOR
//! fault; whoever owns the userfaultfd calls [`AccessTracker::record`] and
//! resolves the fault with UFFDIO_CONTINUE. Shares rotate, so every page is
//! sampled once every `share` periods and only `1/share` of the working set
//! pays a fault per period.
//!
//! Per page the tracker keeps a 1-bit clock (accessed in the last period)
//! and an 8-bit aging history (shifted right every period, that period's
//! access in the top bit). It owns no thread and no userfaultfd: a VMM's
//! tracking thread drives it on a source, a remote pager could on a main
//! host.
//!
//! Files: this one (the tracker, its state and construction), `shares.rs`
//! (which pages each share holds and how they rotate), `arm.rs` (arming a
//! share and recording its faults, writes from the dirty log),
//! `sampled.rs` (the same with writes sampled too, for a caller without a
//! full dirty log), `period.rs` (closing a period into the clock and aging
//! histories), `stats.rs` (what tracking costs), `bits.rs` (the per-page
//! bitmaps), `tests.rs` (the tracker over real memfd memory).

mod arm;
mod bits;
mod period;
mod sampled;
mod shares;
mod stats;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::guest_memory::GuestMemory;
use crate::region::PAGE_SIZE;

pub use period::AccessSnapshot;
pub use shares::valid_grain;
pub use stats::{AccessStats, ArmReport};

/// Pages armed as one unit (2 MiB): share `s` of a region is every chunk
/// whose index is `s` modulo the share count, so a share is spread over
/// the whole region and still madvised in large runs.
pub const CHUNK_PAGES: u64 = 512;

/// Pages one sampled fault answers for by default (256 KiB): the fault
/// maps the whole aligned group back and marks it read. One fault per page
/// cost a radix sort 98% of its speed here (every armed page it touched
/// took a ~100-250 µs round trip through the tracking thread); one per
/// group costs it a few percent, and split ranks whole chunks anyway.
pub const DEFAULT_GRAIN_PAGES: u64 = 64;

/// Why tracking failed.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// The grain is not a power of two of at most [`CHUNK_PAGES`] pages.
    #[error("access grain of {0} pages: must be a power of two from 1 to {CHUNK_PAGES}")]
    BadGrain(u64),
    /// A region is empty or not page-aligned.
    #[error("region at {addr:#x} of {bytes:#x} bytes is empty or not 4 KiB aligned")]
    BadRegion {
        /// Host address.
        addr: u64,
        /// Length.
        bytes: u64,
    },
    /// madvise(MADV_DONTNEED) refused a range.
    #[error("madvise(MADV_DONTNEED) of {len:#x} bytes at {addr:#x} failed: {source}")]
    Madvise {
        /// Start of the range.
        addr: u64,
        /// Length.
        len: u64,
        /// OS error (errno).
        source: std::io::Error,
    },
}

/// One tracked range of host memory.
#[derive(Clone, Copy, Debug)]
struct Range {
    host: u64,
    pages: u64,
}

impl Range {
    fn words(self) -> usize {
        self.pages.div_ceil(64) as usize
    }
}

/// State changed once per period (and read by snapshots).
struct Periodic {
    clock: Vec<Vec<u8>>,
    aging: Vec<Vec<u8>>,
    periods: u64,
    /// The share the next arm drops.
    next_share: u32,
    /// The share the last arm dropped (None before the first).
    armed_share: Option<u32>,
    arms: u64,
    pages_armed_total: u64,
    pages_skipped_total: u64,
    /// Per range, the pages the last period's dirty log reported.
    written: Vec<Vec<u64>>,
    arm_us_last: f64,
    arm_us_total: f64,
    end_period_us_last: f64,
    accessed_last: u64,
    tracked: Duration,
    period_start: Instant,
}

/// Per-page clock and aging histories from sampled reads and logged writes.
pub struct AccessTracker {
    ranges: Vec<Range>,
    share: u32,
    /// Pages one fault answers for (a power of two dividing CHUNK_PAGES,
    /// so a group lies within one share).
    grain: u64,
    /// Per range, bit per page: read (faulted) since the page was last
    /// armed. Atomic so the fault thread records without a lock.
    seen: Vec<Vec<AtomicU64>>,
    faults: AtomicU64,
    fault_ns: AtomicU64,
    periodic: Mutex<Periodic>,
    /// Keeps the mappings alive when built from guest memory.
    _memory: Option<Arc<GuestMemory>>,
}

impl AccessTracker {
    /// Tracks `regions` (host address, bytes), arming 1/`share` of each
    /// region's pages per period (`share` 0 counts as 1).
    ///
    /// # Safety
    ///
    /// Each range must be a shared file mapping (a memfd, as guest RAM is)
    /// that stays mapped as long as the tracker lives: [`arm`](Self::arm)
    /// drops its page table entries, which on such a mapping only costs a
    /// fault, but would zero private anonymous memory or touch whatever
    /// was mapped at the address later.
    /// A fault answers for one page (see [`with_grain`](Self::with_grain)).
    pub unsafe fn new(regions: Vec<(u64, u64)>, share: u32) -> Result<Self, AccessError> {
        Self::build(regions, share, None)
    }

    /// Tracks all of `memory` (memfd regions, kept mapped by the tracker).
    /// A fault answers for one page (see [`with_grain`](Self::with_grain)).
    pub fn for_memory(memory: &Arc<GuestMemory>, share: u32) -> Result<Self, AccessError> {
        let regions = memory
            .regions()
            .iter()
            .map(|r| (r.host_addr() as u64, r.size()))
            .collect();
        Self::build(regions, share, Some(memory.clone()))
    }

    /// One fault answers for the aligned group of `pages` pages around it
    /// (a power of two, at most [`CHUNK_PAGES`]): [`record`](Self::record)
    /// marks the whole group read and returns it for the caller to map
    /// back, so a task streaming through armed memory faults once per
    /// group, not once per page.
    pub fn with_grain(mut self, pages: u64) -> Result<Self, AccessError> {
        if !valid_grain(pages) {
            return Err(AccessError::BadGrain(pages));
        }
        self.grain = pages;
        Ok(self)
    }

    /// Pages one fault answers for.
    pub fn grain(&self) -> u64 {
        self.grain
    }

    fn build(
        regions: Vec<(u64, u64)>,
        share: u32,
        memory: Option<Arc<GuestMemory>>,
    ) -> Result<Self, AccessError> {
        let mut ranges = Vec::new();
        for (addr, bytes) in regions {
            if bytes == 0 || !addr.is_multiple_of(PAGE_SIZE) || !bytes.is_multiple_of(PAGE_SIZE) {
                return Err(AccessError::BadRegion { addr, bytes });
            }
            ranges.push(Range {
                host: addr,
                pages: bytes / PAGE_SIZE,
            });
        }
        let per_page =
            |v: u8| -> Vec<Vec<u8>> { ranges.iter().map(|r| vec![v; r.pages as usize]).collect() };
        Ok(AccessTracker {
            seen: ranges
                .iter()
                .map(|r| (0..r.words()).map(|_| AtomicU64::new(0)).collect())
                .collect(),
            periodic: Mutex::new(Periodic {
                clock: per_page(0),
                aging: per_page(0),
                periods: 0,
                next_share: 0,
                armed_share: None,
                arms: 0,
                pages_armed_total: 0,
                pages_skipped_total: 0,
                written: Vec::new(),
                arm_us_last: 0.0,
                arm_us_total: 0.0,
                end_period_us_last: 0.0,
                accessed_last: 0,
                tracked: Duration::ZERO,
                period_start: Instant::now(),
            }),
            ranges,
            share: share.max(1),
            grain: 1,
            faults: AtomicU64::new(0),
            fault_ns: AtomicU64::new(0),
            _memory: memory,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Periodic> {
        self.periodic.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tracked ranges as (host address, bytes).
    pub fn regions(&self) -> Vec<(u64, u64)> {
        self.ranges
            .iter()
            .map(|r| (r.host, r.pages * PAGE_SIZE))
            .collect()
    }
}

#[cfg(test)]
mod tests;
