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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{GuestMemory, PAGE_SIZE};

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

/// Most runs one chunk is split into around pages just written (which
/// arm skips); past it the whole chunk is armed, as one madvise call costs
/// less than many for scattered writes.
const MAX_RUNS_PER_CHUNK: usize = 8;

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

/// The histories so far, per region (in the order given) and page.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessSnapshot {
    /// 1 if the page was accessed in the last period, else 0.
    pub clock: Vec<Vec<u8>>,
    /// Aging history: bit 7 = last period, bit 6 = the one before, ...
    pub aging: Vec<Vec<u8>>,
    /// Periods closed so far.
    pub periods: u64,
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

impl Periodic {
    /// The share an arm starting now drops (of `shares`); the next arm
    /// takes the one after it.
    fn take_share(&mut self, shares: u32) -> u32 {
        let share = self.next_share;
        self.next_share = (share + 1) % shares;
        self.armed_share = Some(share);
        share
    }

    /// Counts an arm begun at `t` in the statistics.
    fn count_arm(&mut self, t: Instant, pages: u64, skipped: u64, runs: u64) -> ArmReport {
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

    /// [`arm`](Self::arm) for a caller that samples writes too
    /// ([`end_period_sampled`](Self::end_period_sampled)): of each group
    /// of the share (see [`with_grain`](Self::with_grain)) only one page is
    /// armed, a different one each time the share comes round, and its
    /// fault marks the group read. Arming a page costs the guest a refault
    /// of it even when no userfaultfd fault follows (KVM drops its mapping
    /// with ours): arming all of a 512 MiB guest's share (16 Ki pages) cost
    /// a radix sort ~25% of its speed, one page per 64 a few percent.
    pub fn arm_sampled(&self) -> Result<ArmReport, AccessError> {
        let t = Instant::now();
        let mut p = self.lock();
        let share = p.take_share(self.share);
        let round = p.arms / u64::from(self.share);
        let (mut pages, mut runs) = (0, 0);
        for (range, seen) in self.ranges.iter().zip(&self.seen) {
            for (start, end) in share_runs(range.pages, share, self.share) {
                let mut group = start;
                while group < end {
                    let len = self.grain.min(end - group);
                    // Forget the last sample first: a fault after the
                    // madvise below is this sample's.
                    clear_bits(seen, group, group + len);
                    let page = group + sample_offset(round, group / self.grain, len);
                    drop_ptes(range.host + page * PAGE_SIZE, PAGE_SIZE)?;
                    pages += 1;
                    runs += 1;
                    group += len;
                }
            }
        }
        Ok(p.count_arm(t, pages, 0, runs))
    }

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

    /// Closes a period. A page was accessed in it if `dirty` says it was
    /// written (per region, bit i of word i/64 = page i) or it was read
    /// since it was last armed (pages armed in this period: whether they
    /// faulted; the others keep their latest sample's answer). Then
    /// clock = accessed, aging = aging >> 1 | accessed << 7. Returns the
    /// number of pages accessed.
    pub fn end_period(&self, dirty: Option<&[Vec<u64>]>) -> u64 {
        let t = Instant::now();
        let mut guard = self.lock();
        let p = &mut *guard;
        let mut accessed = 0u64;
        for (i, (range, seen)) in self.ranges.iter().zip(&self.seen).enumerate() {
            let written = dirty.and_then(|d| d.get(i));
            let (clock, aging) = (&mut p.clock[i], &mut p.aging[i]);
            for (w, seen) in seen.iter().enumerate() {
                let bits = seen.load(Ordering::Relaxed)
                    | written.and_then(|d| d.get(w)).copied().unwrap_or(0);
                let first = w * 64;
                let last = (first + 64).min(range.pages as usize);
                for page in first..last {
                    let a = ((bits >> (page - first)) & 1) as u8;
                    clock[page] = a;
                    aging[page] = (aging[page] >> 1) | (a << 7);
                }
                // Bits past the region's end are never set: count them all.
                accessed += u64::from(bits.count_ones());
            }
        }
        p.written = dirty.map(<[Vec<u64>]>::to_vec).unwrap_or_default();
        let now = Instant::now();
        p.tracked += now.saturating_duration_since(p.period_start);
        p.period_start = now;
        p.periods += 1;
        p.accessed_last = accessed;
        p.end_period_us_last = t.elapsed().as_secs_f64() * 1e6;
        accessed
    }

    /// Per range, the bits of the pages the next [`arm`](Self::arm) drops:
    /// the pages whose writes a caller that samples writes too should ask
    /// the dirty log to watch from now on.
    pub fn next_share_mask(&self) -> Vec<Vec<u64>> {
        let share = self.lock().next_share;
        self.ranges
            .iter()
            .map(|r| {
                let mut bits = vec![0u64; r.words()];
                for (start, end) in share_runs(r.pages, share, self.share) {
                    for_words(start, end, |word, mask| bits[word] |= mask);
                }
                bits
            })
            .collect()
    }

    /// Closes a period where writes are sampled like reads: the dirty log
    /// watched only the share armed last (see
    /// [`next_share_mask`](Self::next_share_mask)), so `dirty` counts for
    /// those pages alone (its other bits may be periods old) and, like a
    /// read, stands until the page's share is armed again. Otherwise as
    /// [`end_period`](Self::end_period).
    pub fn end_period_sampled(&self, dirty: &[Vec<u64>]) -> u64 {
        let armed = self.lock().armed_share;
        if let Some(share) = armed {
            for ((range, seen), dirty) in self.ranges.iter().zip(&self.seen).zip(dirty) {
                for (start, end) in share_runs(range.pages, share, self.share) {
                    for_words(start, end, |word, mask| {
                        let w = dirty.get(word).copied().unwrap_or(0) & mask;
                        seen[word].fetch_or(w, Ordering::Relaxed);
                    });
                }
            }
        }
        self.end_period(None)
    }

    /// The time since the last closed period is not tracked time (the
    /// caller paused tracking and goes on now).
    pub fn restart_period(&self) {
        self.lock().period_start = Instant::now();
    }

    /// The histories so far.
    pub fn snapshot(&self) -> AccessSnapshot {
        let p = self.lock();
        AccessSnapshot {
            clock: p.clock.clone(),
            aging: p.aging.clone(),
            periods: p.periods,
        }
    }

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

/// The page runs [start, end) of share `share` (of `shares`) in a range of
/// `pages` pages: every chunk whose index is `share` modulo `shares`,
/// adjacent chunks merged.
fn share_runs(pages: u64, share: u32, shares: u32) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let chunks = pages.div_ceil(CHUNK_PAGES);
    let mut c = u64::from(share);
    while c < chunks {
        let (start, end) = (c * CHUNK_PAGES, ((c + 1) * CHUNK_PAGES).min(pages));
        match runs.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => runs.push((start, end)),
        }
        c += u64::from(shares);
    }
    runs
}

/// The runs arm drops for share `share` of a range: the share's chunks
/// less the pages `written` (bit per page) marks, merged where adjacent. A
/// chunk that would split into more than [`MAX_RUNS_PER_CHUNK`] runs is
/// armed whole.
fn arm_runs(pages: u64, share: u32, shares: u32, written: Option<&[u64]>) -> Vec<(u64, u64)> {
    let is_written = |p: u64| {
        written
            .and_then(|w| w.get((p / 64) as usize))
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
    };
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut c = u64::from(share);
    while c * CHUNK_PAGES < pages {
        let (start, end) = (c * CHUNK_PAGES, ((c + 1) * CHUNK_PAGES).min(pages));
        c += u64::from(shares);
        let mut parts = Vec::new();
        let mut open: Option<u64> = None;
        for p in start..end {
            match (is_written(p), open) {
                (false, None) => open = Some(p),
                (true, Some(s)) => {
                    parts.push((s, p));
                    open = None;
                }
                _ => {}
            }
        }
        if let Some(s) = open {
            parts.push((s, end));
        }
        if parts.len() > MAX_RUNS_PER_CHUNK {
            parts = vec![(start, end)];
        }
        for (s, e) in parts {
            match runs.last_mut() {
                Some(last) if last.1 == s => last.1 = e,
                _ => runs.push((s, e)),
            }
        }
    }
    runs
}

/// Whether one fault may answer for `pages` pages: a power of two of at
/// most [`CHUNK_PAGES`] (so a group lies within one share).
pub fn valid_grain(pages: u64) -> bool {
    pages.is_power_of_two() && pages <= CHUNK_PAGES
}

/// Which page of a group of `len` pages the `round`-th arm of its share
/// samples: spread over the group across rounds, and differing between
/// neighbouring groups so a strided access pattern is not missed forever.
fn sample_offset(round: u64, group: u64, len: u64) -> u64 {
    round
        .wrapping_mul(0x9e37_79b9)
        .wrapping_add(group.wrapping_mul(0x85eb_ca6b))
        .rotate_right(13)
        % len
}

/// Clears the bits of pages [start, end).
fn clear_bits(bits: &[AtomicU64], start: u64, end: u64) {
    for_words(start, end, |word, mask| {
        bits[word].fetch_and(!mask, Ordering::Relaxed);
    });
}

/// Sets the bits of pages [start, end).
fn set_bits(bits: &[AtomicU64], start: u64, end: u64) {
    for_words(start, end, |word, mask| {
        bits[word].fetch_or(mask, Ordering::Relaxed);
    });
}

/// Calls `f(word, mask)` for each word of the bits of pages [start, end).
fn for_words(start: u64, end: u64, mut f: impl FnMut(usize, u64)) {
    let mut p = start;
    while p < end {
        let (word, bit) = ((p / 64) as usize, p % 64);
        let n = (64 - bit).min(end - p);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << bit
        };
        f(word, mask);
        p += n;
    }
}

/// MADV_DONTNEED on one tracked run.
fn drop_ptes(addr: u64, len: u64) -> Result<(), AccessError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Event, Features, RegisterMode, UffdError, Userfaultfd};
    use std::sync::atomic::AtomicBool;

    const PAGES: u64 = 2 * CHUNK_PAGES;

    fn memory(pages: u64) -> Arc<GuestMemory> {
        let m = Arc::new(GuestMemory::new(&[(0, pages * PAGE_SIZE)]).unwrap());
        let r = &m.regions()[0];
        for p in 0..pages {
            // SAFETY: the first byte of page p < pages of the live mapping.
            unsafe {
                r.host_addr()
                    .add((p * PAGE_SIZE) as usize)
                    .write_volatile(p as u8 | 1)
            };
        }
        m
    }

    #[test]
    fn shares_cover_every_page_once_in_large_runs() {
        let pages = 5 * CHUNK_PAGES + 7;
        let mut count = vec![0u32; pages as usize];
        for share in 0..3 {
            for (s, e) in share_runs(pages, share, 3) {
                assert!(s < e && e <= pages);
                for p in s..e {
                    count[p as usize] += 1;
                }
            }
        }
        assert!(
            count.iter().all(|&c| c == 1),
            "each page in exactly one share"
        );
        assert_eq!(share_runs(pages, 0, 3), vec![(0, 512), (1536, 2048)]);
        assert_eq!(share_runs(pages, 2, 3), vec![(1024, 1536), (2560, 2567)]);
        assert_eq!(
            share_runs(pages, 0, 1),
            vec![(0, pages)],
            "one share: one run"
        );
        assert!(
            share_runs(100, 1, 8).is_empty(),
            "a small region sits some shares out"
        );
        for share in 0..3 {
            assert_eq!(arm_runs(pages, share, 3, None), share_runs(pages, share, 3));
        }
    }

    #[test]
    fn arm_skips_pages_just_written_unless_scattered() {
        let pages = 3 * CHUNK_PAGES;
        let mut written = vec![0u64; (pages / 64) as usize];
        let mut write = |p: u64| written[(p / 64) as usize] |= 1 << (p % 64);
        // Chunk 0: a written stretch in the middle; chunk 2: written
        // every other page at its start (too scattered to skip).
        (100..300).for_each(&mut write);
        (1024..1024 + 40).step_by(2).for_each(&mut write);
        assert_eq!(
            arm_runs(pages, 0, 2, Some(&written)),
            vec![(0, 100), (300, 512), (1024, 1536)]
        );
        assert_eq!(arm_runs(pages, 1, 2, Some(&written)), vec![(512, 1024)]);
        let bits: Vec<AtomicU64> = (0..3).map(|_| AtomicU64::new(u64::MAX)).collect();
        clear_bits(&bits, 3, 130);
        let words: Vec<u64> = bits.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        assert_eq!(words, vec![0b111, 0, u64::MAX << 2]);
    }

    #[test]
    fn a_fault_answers_for_its_group_and_sampling_arms_one_page_per_group() {
        let pages = 2 * CHUNK_PAGES;
        let m = memory(pages);
        let base = m.regions()[0].host_addr() as u64;
        assert!(matches!(
            AccessTracker::for_memory(&m, 2).unwrap().with_grain(48),
            Err(AccessError::BadGrain(48))
        ));
        let t = AccessTracker::for_memory(&m, 2)
            .unwrap()
            .with_grain(64)
            .unwrap();
        assert_eq!(t.grain(), 64);
        // Share 0 is the first 2 MiB chunk: 8 groups of 64, one page each.
        let mask = t.next_share_mask();
        assert_eq!(mask[0][..8], [u64::MAX; 8]);
        assert_eq!(mask[0][8..], [0; 8]);
        let report = t.arm_sampled().unwrap();
        assert_eq!((report.pages, report.runs), (8, 8));
        // A fault on page 70 marks pages 64..128 and hands them back.
        assert_eq!(
            t.record(base + 70 * PAGE_SIZE + 5),
            Some((base + 64 * PAGE_SIZE, 64 * PAGE_SIZE))
        );
        assert_eq!(t.record(0x10), None);
        // Writes count only inside the share armed last (pages 0..512):
        // page 3 counts, page 600's bit may be periods old and does not.
        let mut dirty = vec![0u64; (pages / 64) as usize];
        dirty[0] |= 1 << 3;
        dirty[600 / 64] |= 1 << (600 % 64);
        assert_eq!(t.end_period_sampled(&[dirty]), 64 + 1);
        let s = t.snapshot();
        assert_eq!(
            (s.clock[0][64], s.clock[0][127], s.clock[0][128]),
            (1, 1, 0)
        );
        assert_eq!((s.clock[0][3], s.clock[0][600]), (1, 0));
        // Unarmed since, the group keeps its sample; the next arm of its
        // share forgets it.
        assert_eq!(t.end_period(None), 65);
        t.arm_sampled().unwrap(); // share 1
        t.arm_sampled().unwrap(); // share 0 again
        assert_eq!(t.end_period(None), 0);
        assert_eq!(t.stats().grain_pages, 64);
    }

    #[test]
    fn dirty_bitmaps_count_as_accesses_and_aging_shifts() {
        let m = memory(130);
        let t = AccessTracker::for_memory(&m, 4).unwrap();
        let dirty = |pages: &[u64]| {
            let mut words = vec![0u64; 3];
            for &p in pages {
                words[(p / 64) as usize] |= 1 << (p % 64);
            }
            vec![words]
        };
        assert_eq!(t.end_period(Some(&dirty(&[0, 65, 129]))), 3);
        assert_eq!(t.end_period(Some(&dirty(&[65]))), 1);
        assert_eq!(t.end_period(None), 0);
        let s = t.snapshot();
        assert_eq!(s.periods, 3);
        assert_eq!((s.clock[0][65], s.aging[0][65]), (0, 0b0110_0000));
        assert_eq!((s.clock[0][129], s.aging[0][129]), (0, 0b0010_0000));
        assert_eq!(s.aging[0][1], 0);
        assert_eq!(s.clock[0].len(), 130);
        // A fault outside the tracked memory is ignored.
        t.record(0x10);
        assert_eq!(t.stats().minor_faults_total, 0);
        assert!(matches!(
            // SAFETY: rejected before anything is mapped or advised.
            unsafe { AccessTracker::new(vec![(0x1001, 4096)], 1) },
            Err(AccessError::BadRegion { .. })
        ));
    }

    fn uffd() -> Option<Userfaultfd> {
        match Userfaultfd::new(Features {
            minor_shmem: true,
            ..Default::default()
        }) {
            Ok(u) => Some(u),
            Err(e @ (UffdError::Open { .. } | UffdError::MissingFeatures { .. })) => {
                eprintln!("SKIP: access tracking needs userfaultfd MINOR faults on shmem: {e}");
                None
            }
            Err(e) => panic!("userfaultfd handshake: {e}"),
        }
    }

    /// Serves MINOR faults until stopped, as a VMM's tracking thread does.
    fn serve(
        u: Arc<Userfaultfd>,
        t: Arc<AccessTracker>,
        stop: Arc<AtomicBool>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let mut events = Vec::new();
            while !stop.load(Ordering::Acquire) {
                if !u.poll(Duration::from_millis(5)).unwrap() {
                    continue;
                }
                let woke = Instant::now();
                events.clear();
                u.read_events(&mut events).unwrap();
                for ev in &events {
                    let Event::PageFault {
                        addr, minor: true, ..
                    } = *ev
                    else {
                        panic!("unexpected event {ev:?}")
                    };
                    // Record before waking the reader, which may end the
                    // period as soon as its read returns.
                    t.record(addr);
                    let page = addr & !(PAGE_SIZE - 1);
                    match u.continue_range(page, PAGE_SIZE) {
                        Ok(_) | Err(UffdError::AlreadyMapped { .. }) => {}
                        Err(e) => panic!("continue: {e}"),
                    }
                    t.add_fault_cost(woke.elapsed().as_nanos() as u64);
                }
            }
        })
    }

    /// Reads the first byte of each page on another thread; fails rather
    /// than hang if a fault is never served.
    fn touch(m: &Arc<GuestMemory>, pages: &[u64]) {
        let (m2, pages) = (m.clone(), pages.to_vec());
        let h = std::thread::spawn(move || {
            let base = m2.regions()[0].host_addr();
            for p in pages {
                // SAFETY: page p of the live mapping, held by the Arc.
                let v = unsafe { base.add((p * PAGE_SIZE) as usize).read_volatile() };
                assert_eq!(v, p as u8 | 1, "page {p} keeps its data");
            }
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while !h.is_finished() {
            assert!(
                Instant::now() < deadline,
                "a touched page stayed blocked 5 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        h.join().unwrap();
    }

    #[test]
    fn sampled_reads_set_clock_and_aging() {
        let Some(u) = uffd() else { return };
        let m = memory(PAGES);
        let base = m.regions()[0].host_addr() as u64;
        let minor = RegisterMode {
            minor: true,
            ..Default::default()
        };
        if let Err(e) = u.register(base, PAGES * PAGE_SIZE, minor) {
            eprintln!("SKIP: this kernel cannot register memfd memory for MINOR faults: {e}");
            return;
        }
        let u = Arc::new(u);
        let t = Arc::new(AccessTracker::for_memory(&m, 2).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let server = serve(u.clone(), t.clone(), stop.clone());

        // Period 1: share 0 (the first chunk) is armed. Reads there fault;
        // reads of the other chunk (still mapped) do not.
        let arm = t.arm().unwrap();
        assert_eq!((arm.pages, arm.runs), (CHUNK_PAGES, 1));
        touch(&m, &[3, 100, 511, 600, 700]);
        assert_eq!(t.end_period(None), 3);
        let s = t.snapshot();
        for p in 0..PAGES as usize {
            let hit = [3, 100, 511].contains(&p);
            assert_eq!(s.clock[0][p], u8::from(hit), "clock of page {p}");
            assert_eq!(
                s.aging[0][p],
                if hit { 0x80 } else { 0 },
                "aging of page {p}"
            );
        }

        // Period 2: nothing armed; a write from the dirty log counts, and
        // the read pages keep their sample.
        let mut dirty = vec![vec![0u64; (PAGES / 64) as usize]];
        dirty[0][700 / 64] |= 1 << (700 % 64);
        assert_eq!(t.end_period(Some(&dirty)), 4);
        let s = t.snapshot();
        assert_eq!((s.clock[0][700], s.aging[0][700]), (1, 0x80));
        assert_eq!((s.clock[0][3], s.aging[0][3]), (1, 0xc0));
        assert_eq!((s.clock[0][600], s.aging[0][600]), (0, 0));

        // Period 3: share 1 is armed, but for 700, just written (so it
        // stays mapped and its read below raises no fault); 600 is read.
        let arm = t.arm().unwrap();
        assert_eq!((arm.pages, arm.skipped), (CHUNK_PAGES - 1, 1));
        touch(&m, &[600, 3, 700]);
        t.end_period(None);
        let s = t.snapshot();
        assert_eq!((s.clock[0][600], s.aging[0][600]), (1, 0x80));
        assert_eq!((s.clock[0][700], s.aging[0][700]), (0, 0x40));
        assert_eq!((s.clock[0][3], s.aging[0][3]), (1, 0xe0));

        // Period 4: share 0 again, untouched: its pages age out.
        t.arm().unwrap();
        t.end_period(None);
        let s = t.snapshot();
        assert_eq!((s.clock[0][3], s.aging[0][3]), (0, 0x70));
        assert_eq!((s.clock[0][600], s.aging[0][600]), (1, 0xc0));
        assert_eq!(s.periods, 4);

        stop.store(true, Ordering::Release);
        server.join().unwrap();
        let st = t.stats();
        assert_eq!(st.minor_faults_total, 4, "{st:?}");
        assert_eq!(
            (
                st.arms,
                st.pages_armed_total,
                st.pages_skipped_total,
                st.periods
            ),
            (3, 3 * CHUNK_PAGES - 1, 1, 4)
        );
        assert!(
            st.fault_service_us_total > 0.0 && st.arm_us_mean > 0.0,
            "{st:?}"
        );
        eprintln!("access tracker on {PAGES} pages: {st:?}");
    }
}
