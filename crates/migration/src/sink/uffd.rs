//! Pages landed in memory registered with userfaultfd (MISSING mode).
//!
//! A vCPU (or any thread) touching a missing page blocks in the kernel until
//! the page is supplied. UFFDIO_COPY supplies it atomically and wakes the
//! waiters, so a page is either absent or whole, never half written; a
//! receiver writing through the mapping instead would fault on its own write.
//!
//! The sink keeps one bit per page: set once the page is present (landed,
//! or known present when the sink was made). Claiming the bit decides who
//! lands a page, so two streams delivering the same page (a demand fetch
//! and the background push) land it once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ferry_memory::Userfaultfd;

use super::place::{already_mapped, UffdPlacer};
use super::{PageSink, SinkError};
use crate::memory::RegionView;
use crate::ranges::{GpaPages, OffsetBytes, PAGE};

/// What to do with a page that is already present.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LandPolicy {
    /// Write it again (a newer copy: precopy rounds before the VM runs).
    Overwrite,
    /// Keep what is there (postcopy: the running guest may have written it
    /// since; the source sends each page's final content only once).
    KeepFirst,
}

/// What the sink did, in pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct UffdSinkStats {
    /// Missing pages filled by UFFDIO_COPY.
    pub copied: u64,
    /// Missing pages filled by UFFDIO_ZEROPAGE.
    pub zero_filled: u64,
    /// Present pages written again (Overwrite).
    pub overwritten: u64,
    /// Present pages left alone (KeepFirst).
    pub kept: u64,
}

/// Told of every page a [`UffdSink`] supplies (postcopy's fault accounting
/// and verification hook in here).
pub trait LandObserver: Send + Sync {
    /// `run` was missing and now holds `data` (None: zeros).
    fn supplied(&self, run: GpaPages, data: Option<&[u8]>);
}

/// Lands pages into userfaultfd-registered guest memory.
pub struct UffdSink {
    placer: UffdPlacer,
    observer: Option<Arc<dyn LandObserver>>,
    present: Vec<Vec<AtomicU64>>,
    policy: LandPolicy,
    copied: AtomicU64,
    zero_filled: AtomicU64,
    overwritten: AtomicU64,
    kept: AtomicU64,
}

/// How one page of a landing is handled.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Missing: this call claimed it and supplies it through the uffd.
    Supply,
    /// Present: write it through the mapping.
    Overwrite,
    /// Present: leave it.
    Keep,
}

impl UffdSink {
    /// A sink over `regions`, all registered with `uffd` for MISSING faults;
    /// `present[i]` lists region i's ranges that already hold pages.
    pub fn new(
        uffd: Arc<Userfaultfd>,
        regions: Vec<RegionView>,
        present: &[Vec<OffsetBytes>],
        policy: LandPolicy,
    ) -> Self {
        let bits: Vec<Vec<AtomicU64>> = regions
            .iter()
            .map(|r| {
                (0..r.pages().div_ceil(64))
                    .map(|_| AtomicU64::new(0))
                    .collect()
            })
            .collect();
        for (ri, ranges) in present.iter().enumerate().take(bits.len()) {
            for range in ranges {
                let end = range.end().div_ceil(PAGE).min(regions[ri].pages());
                for p in range.offset / PAGE..end {
                    bits[ri][(p / 64) as usize].fetch_or(1 << (p % 64), Ordering::Relaxed);
                }
            }
        }
        UffdSink {
            placer: UffdPlacer::new(uffd, regions),
            observer: None,
            present: bits,
            policy,
            copied: AtomicU64::new(0),
            zero_filled: AtomicU64::new(0),
            overwritten: AtomicU64::new(0),
            kept: AtomicU64::new(0),
        }
    }

    /// The placement under this sink: for pages that land outside the
    /// streams (a never-sent page's zeros at its first fault, a wake).
    pub fn placer(&self) -> &UffdPlacer {
        &self.placer
    }

    /// Tells `observer` of every page supplied from now on.
    pub fn with_observer(mut self, observer: Arc<dyn LandObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// True if the page at `gpa` was claimed: landed, being landed, or
    /// present from the start.
    pub fn is_present(&self, gpa: u64) -> bool {
        self.locate(gpa).is_some_and(|(ri, p)| {
            self.present[ri][(p / 64) as usize].load(Ordering::Acquire) & (1 << (p % 64)) != 0
        })
    }

    /// Pages still missing.
    pub fn missing_pages(&self) -> u64 {
        let total: u64 = self.placer.regions().iter().map(|r| r.pages()).sum();
        let present: u64 = self
            .present
            .iter()
            .flatten()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum();
        total - present
    }

    /// What the sink did so far.
    pub fn stats(&self) -> UffdSinkStats {
        UffdSinkStats {
            copied: self.copied.load(Ordering::Relaxed),
            zero_filled: self.zero_filled.load(Ordering::Relaxed),
            overwritten: self.overwritten.load(Ordering::Relaxed),
            kept: self.kept.load(Ordering::Relaxed),
        }
    }

    fn locate(&self, gpa: u64) -> Option<(usize, u64)> {
        crate::memory::region_of(self.placer.regions(), gpa)
            .map(|(i, r)| (i, (gpa - r.gpa()) / PAGE))
    }

    /// Checks the run and claims each page: the steps for every page.
    fn claim(&self, run: GpaPages) -> Result<(usize, Vec<Step>), SinkError> {
        let out = SinkError::OutOfRange {
            gpa: run.gpa,
            pages: run.pages,
        };
        let (ri, first) = self.locate(run.gpa).ok_or(out)?;
        if !run.gpa.is_multiple_of(PAGE)
            || !self.placer.regions()[ri].contains_range(run.gpa, run.bytes())
        {
            return Err(SinkError::OutOfRange {
                gpa: run.gpa,
                pages: run.pages,
            });
        }
        let steps = (first..first + run.pages)
            .map(|p| {
                let mask = 1u64 << (p % 64);
                let was = self.present[ri][(p / 64) as usize].fetch_or(mask, Ordering::AcqRel);
                match (was & mask != 0, self.policy) {
                    (false, _) => Step::Supply,
                    (true, LandPolicy::Overwrite) => Step::Overwrite,
                    (true, LandPolicy::KeepFirst) => Step::Keep,
                }
            })
            .collect();
        Ok((ri, steps))
    }

    /// Lands `run` page by page or in stretches of equal steps; `data`
    /// holds the run's pages, or is None for zeros.
    fn land(&self, run: GpaPages, data: Option<&[u8]>) -> Result<(), SinkError> {
        let (ri, steps) = self.claim(run)?;
        let region = self.placer.regions()[ri];
        let mut i = 0usize;
        while i < steps.len() {
            let mut n = 1;
            while i + n < steps.len() && steps[i + n] == steps[i] {
                n += 1;
            }
            let part = GpaPages::new(run.gpa + i as u64 * PAGE, n as u64);
            let bytes = data.map(|d| &d[i * PAGE as usize..(i + n) * PAGE as usize]);
            match steps[i] {
                Step::Supply => self.supply(&region, part, bytes)?,
                Step::Overwrite => self.overwrite(&region, part, bytes),
                Step::Keep => {
                    self.kept.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
            i += n;
        }
        Ok(())
    }

    /// UFFDIO_COPY / ZEROPAGE for missing pages this call claimed. A page
    /// the kernel already holds (present before the sink knew of it) is
    /// written through the mapping under Overwrite, left under KeepFirst.
    fn supply(
        &self,
        region: &RegionView,
        part: GpaPages,
        data: Option<&[u8]>,
    ) -> Result<(), SinkError> {
        let whole = match data {
            Some(d) => self.placer.copy(part, d, true),
            None => self.placer.zero(part),
        };
        let counter = if data.is_some() {
            &self.copied
        } else {
            &self.zero_filled
        };
        if whole.is_ok() {
            counter.fetch_add(part.pages, Ordering::Relaxed);
            if let Some(o) = &self.observer {
                o.supplied(part, data);
            }
            return Ok(());
        }
        // Some page of the stretch exists already: go page by page.
        for (k, gpa) in part.page_addrs().enumerate() {
            let one = data.map(|d| &d[k * PAGE as usize..(k + 1) * PAGE as usize]);
            let page = GpaPages::new(gpa, 1);
            let r = match one {
                Some(d) => self.placer.copy(page, d, true),
                None => self.placer.zero(page),
            };
            match r {
                Ok(_) => {
                    counter.fetch_add(1, Ordering::Relaxed);
                    if let Some(o) = &self.observer {
                        o.supplied(GpaPages::new(gpa, 1), one);
                    }
                }
                Err(e) if already_mapped(&e) => match self.policy {
                    LandPolicy::Overwrite => self.overwrite(region, GpaPages::new(gpa, 1), one),
                    LandPolicy::KeepFirst => {
                        self.kept.fetch_add(1, Ordering::Relaxed);
                    }
                },
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes present pages through the mapping (they cannot fault MISSING).
    fn overwrite(&self, region: &RegionView, part: GpaPages, data: Option<&[u8]>) {
        let zeros;
        let bytes = match data {
            Some(d) => d,
            None => {
                zeros = vec![0u8; part.bytes() as usize];
                &zeros
            }
        };
        let ok = region.write(part.gpa, bytes);
        debug_assert!(ok, "claimed pages lie inside the region");
        self.overwritten.fetch_add(part.pages, Ordering::Relaxed);
    }
}

impl PageSink for UffdSink {
    fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), SinkError> {
        if data.len() as u64 != run.bytes() {
            return Err(SinkError::Shape {
                pages: run.pages,
                bytes: data.len(),
            });
        }
        self.land(run, Some(data))
    }

    fn zero(&self, run: GpaPages) -> Result<(), SinkError> {
        self.land(run, None)
    }
}
