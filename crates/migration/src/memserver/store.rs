//! One VM's pages on a memory server: sparse memfds in the VM's layout (a
//! page not held takes no memory) and a bitmap of the pages held. Pages land
//! through the engine's [`PageSink`] seam, so a memory server reads Pages
//! frames with the same checked code as a destination.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ferry_memory::MemfdRegion;

use crate::memory::RegionView;
use crate::ranges::{GpaPages, PAGE};
use crate::sink::{PageSink, SinkError};

/// Pages held by all the VMs of one server, against its capacity.
#[derive(Debug)]
pub struct Capacity {
    /// Most pages the server may hold.
    pub total: u64,
    held: AtomicU64,
}

impl Capacity {
    /// Room for `total` pages.
    pub fn new(total: u64) -> Arc<Self> {
        Arc::new(Capacity {
            total,
            held: AtomicU64::new(0),
        })
    }

    /// Pages held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Pages still free.
    pub fn free(&self) -> u64 {
        self.total.saturating_sub(self.held())
    }

    /// Takes `n` pages if there is room.
    fn take(&self, n: u64) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                (h + n <= self.total).then_some(h + n)
            })
            .is_ok()
    }

    fn give(&self, n: u64) {
        self.held.fetch_sub(n, Ordering::AcqRel);
    }
}

/// One VM's store.
pub struct VmStore {
    regions: Vec<MemfdRegion>,
    views: Vec<RegionView>,
    /// One bit per page, pages numbered across the regions in order.
    bits: Vec<AtomicU64>,
    held: AtomicU64,
    capacity: Arc<Capacity>,
}

/// Why a store could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The layout is not one a VM can have.
    #[error("bad layout: {0}")]
    Layout(String),
    /// A sparse memfd could not be made.
    #[error(transparent)]
    Region(#[from] ferry_memory::RegionError),
}

impl VmStore {
    /// An empty store shaped like `regions` (gpa, bytes).
    pub fn new(
        name: &str,
        regions: &[(u64, u64)],
        capacity: Arc<Capacity>,
    ) -> Result<Self, StoreError> {
        if regions.is_empty() || regions.len() > 16 {
            return Err(StoreError::Layout(format!("{} regions", regions.len())));
        }
        let mut made = Vec::new();
        for (i, &(gpa, size)) in regions.iter().enumerate() {
            if size == 0 || !size.is_multiple_of(PAGE) || !gpa.is_multiple_of(PAGE) {
                return Err(StoreError::Layout(format!(
                    "region {i} at {gpa:#x} of {size} bytes"
                )));
            }
            made.push(MemfdRegion::new(&format!("{name}-{i}"), gpa, size)?);
        }
        // SAFETY: each view covers exactly its region's mapping, which lives
        // as long as the store (the views are dropped with it).
        let views: Vec<RegionView> = made
            .iter()
            .map(|r| unsafe { RegionView::new(r.gpa(), r.size(), r.host_addr()) })
            .collect();
        let pages: u64 = views.iter().map(|v| v.pages()).sum();
        Ok(VmStore {
            regions: made,
            views,
            bits: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            held: AtomicU64::new(0),
            capacity,
        })
    }

    /// The store's regions, as the engine's page code takes them.
    pub fn regions(&self) -> &[RegionView] {
        &self.views
    }

    /// The layout, as StoreOpen carries it.
    pub fn layout(&self) -> Vec<(u64, u64)> {
        self.views.iter().map(|v| (v.gpa(), v.size())).collect()
    }

    /// Pages held.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// (region index, page number across regions) of a page address.
    fn index(&self, gpa: u64) -> Option<(usize, u64)> {
        let mut base = 0;
        for (i, v) in self.views.iter().enumerate() {
            if v.contains(gpa) {
                return Some((i, base + (gpa - v.gpa()) / PAGE));
            }
            base += v.pages();
        }
        None
    }

    fn check(&self, run: GpaPages) -> Result<(usize, u64), SinkError> {
        let out = || SinkError::OutOfRange {
            gpa: run.gpa,
            pages: run.pages,
        };
        let (region, first) = self.index(run.gpa).ok_or_else(out)?;
        if !self.views[region].contains_range(run.gpa, run.pages * PAGE) {
            return Err(out());
        }
        Ok((region, first))
    }

    /// Sets (or clears) the bits of pages `first ..+ n`; returns how many
    /// changed.
    fn mark(&self, first: u64, n: u64, set: bool) -> u64 {
        let mut changed = 0;
        for p in first..first + n {
            let bit = 1u64 << (p % 64);
            let w = &self.bits[(p / 64) as usize];
            let old = if set {
                w.fetch_or(bit, Ordering::AcqRel)
            } else {
                w.fetch_and(!bit, Ordering::AcqRel)
            };
            changed += u64::from((old & bit != 0) != set);
        }
        changed
    }

    /// True if the page at `gpa` is held.
    pub fn holds(&self, gpa: u64) -> bool {
        self.index(gpa).is_some_and(|(_, p)| {
            self.bits[(p / 64) as usize].load(Ordering::Acquire) & (1 << (p % 64)) != 0
        })
    }

    /// Copies the held page at `gpa` into `out` (4096 bytes); false if the
    /// page is not held here.
    pub fn read_page(&self, gpa: u64, out: &mut [u8]) -> bool {
        if !self.holds(gpa) || out.len() != PAGE as usize {
            return false;
        }
        let Some((region, _)) = self.index(gpa) else {
            return false;
        };
        self.views[region].read(gpa, out);
        true
    }

    /// Forgets pages (they were paged in elsewhere, or are zero): their
    /// memory goes back to the server.
    pub fn drop_run(&self, run: GpaPages) -> Result<u64, SinkError> {
        let (region, first) = self.check(run)?;
        let n = self.mark(first, run.pages, false);
        self.held.fetch_sub(n, Ordering::AcqRel);
        self.capacity.give(n);
        let r = &self.regions[region];
        r.punch_hole(run.gpa - r.gpa(), run.pages * PAGE)
            .map_err(|e| SinkError::Discard {
                gpa: run.gpa,
                pages: run.pages,
                source: Box::new(e),
            })?;
        Ok(n)
    }

    /// Runs of held pages, in address order.
    pub fn held_runs(&self) -> Vec<GpaPages> {
        let mut out: Vec<GpaPages> = Vec::new();
        let mut base = 0;
        for v in &self.views {
            for i in 0..v.pages() {
                let p = base + i;
                if self.bits[(p / 64) as usize].load(Ordering::Acquire) & (1 << (p % 64)) == 0 {
                    continue;
                }
                let gpa = v.gpa() + i * PAGE;
                match out.last_mut() {
                    Some(r) if r.end() == gpa => r.pages += 1,
                    _ => out.push(GpaPages::new(gpa, 1)),
                }
            }
            base += v.pages();
        }
        out
    }
}

impl Drop for VmStore {
    fn drop(&mut self) {
        self.capacity.give(self.held());
    }
}

impl PageSink for VmStore {
    fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), SinkError> {
        if data.len() as u64 != run.pages * PAGE {
            return Err(SinkError::Shape {
                pages: run.pages,
                bytes: data.len(),
            });
        }
        let (region, first) = self.check(run)?;
        // Room first, for every page of the run (the ones already held are
        // given back after marking).
        if !self.capacity.take(run.pages) {
            return Err(SinkError::Full {
                pages: run.pages,
                free: self.capacity.free(),
            });
        }
        self.views[region].write(run.gpa, data);
        let new = self.mark(first, run.pages, true);
        self.held.fetch_add(new, Ordering::AcqRel);
        self.capacity.give(run.pages - new);
        Ok(())
    }

    fn zero(&self, run: GpaPages) -> Result<(), SinkError> {
        self.drop_run(run).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_held_counted_and_given_back() {
        let cap = Capacity::new(4);
        let s = VmStore::new("t", &[(0, 64 << 10), (1 << 20, 16 << 10)], cap.clone()).unwrap();
        let page = |b: u8| vec![b; PAGE as usize];
        s.write(GpaPages::new(0x1000, 2), &[page(1), page(2)].concat())
            .unwrap();
        s.write(GpaPages::new(1 << 20, 1), &page(3)).unwrap();
        // Writing a held page again costs no room.
        s.write(GpaPages::new(0x2000, 1), &page(4)).unwrap();
        assert_eq!((s.held(), cap.free()), (3, 1));
        let mut out = page(0);
        assert!(s.read_page(0x2000, &mut out));
        assert_eq!(out, page(4));
        assert!(!s.read_page(0x3000, &mut out), "never held");
        // Full: two new pages with one free.
        let e = s.write(GpaPages::new(0x5000, 2), &[page(5), page(6)].concat());
        assert!(matches!(e, Err(SinkError::Full { .. })), "{e:?}");
        assert_eq!(cap.free(), 1, "a refused write takes nothing");
        assert_eq!(
            s.held_runs(),
            [GpaPages::new(0x1000, 2), GpaPages::new(1 << 20, 1)]
        );
        // Out of range, across a region's end.
        assert!(s
            .write(GpaPages::new(0xf000, 2), &[page(0), page(0)].concat())
            .is_err());
        assert_eq!(s.drop_run(GpaPages::new(0x1000, 4)).unwrap(), 2);
        assert!(!s.holds(0x1000));
        assert_eq!((s.held(), cap.free()), (1, 3));
        drop(s);
        assert_eq!(cap.free(), 4);
    }
}
