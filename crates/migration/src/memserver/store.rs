//! One VM's pages on a memory server: sparse memfds in the VM's layout (a
//! page not held takes no memory) and a bitmap of the pages held, bound to
//! the owner's secret. Pages land through the engine's [`PageSink`] seam,
//! so a memory server reads Pages frames with the same checked code as a
//! destination. Every run a peer names is checked (checked arithmetic,
//! inside one region, page aligned) before a bit or a byte changes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ferry_memory::MemfdRegion;

use super::error::StoreError;
use super::limits::{LAYOUT_PER_CAPACITY, MAX_RUNS};
use super::secret::StoreSecret;
use crate::memory::RegionView;
use crate::protocol::Kind;
use crate::ranges::{GpaPages, PAGE};
use crate::sink::{PageSink, SinkError};

/// Most regions in a store's layout.
pub const MAX_REGIONS: usize = 16;
/// Pages to MiB: a right shift by this.
const PAGES_PER_MIB_SHIFT: u32 = 8;

/// Room of one server, shared by all its VMs: pages held or reserved
/// against its capacity, and the layout pages its stores map (each costs a
/// bitmap bit and address space, held or not).
#[derive(Debug)]
pub struct Capacity {
    /// Most pages the server may hold.
    pub total: u64,
    /// Pages held or reserved.
    used: AtomicU64,
    /// Layout pages of all live stores.
    mapped: AtomicU64,
}

impl Capacity {
    /// Room for `total` pages.
    pub fn new(total: u64) -> Arc<Self> {
        Arc::new(Capacity {
            total,
            used: AtomicU64::new(0),
            mapped: AtomicU64::new(0),
        })
    }

    /// Pages held or reserved now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Pages neither held nor reserved.
    pub fn free(&self) -> u64 {
        self.total.saturating_sub(self.used())
    }

    /// Most layout pages all stores may map together.
    pub fn map_limit(&self) -> u64 {
        self.total.saturating_mul(LAYOUT_PER_CAPACITY)
    }

    /// Takes `n` pages if there is room.
    fn take(&self, n: u64) -> bool {
        add_within(&self.used, n, self.total)
    }

    fn give(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// Adds `n` to `a` if the sum stays within `most`.
fn add_within(a: &AtomicU64, n: u64, most: u64) -> bool {
    a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
        h.checked_add(n).filter(|&s| s <= most)
    })
    .is_ok()
}

/// One VM's store.
pub struct VmStore {
    vm: String,
    secret: StoreSecret,
    regions: Vec<MemfdRegion>,
    views: Vec<RegionView>,
    /// One bit per page, pages numbered across the regions in order.
    bits: Vec<AtomicU64>,
    pages: u64,
    held: AtomicU64,
    /// Pages reserved by an open and not held yet (counted in the
    /// capacity's `used`).
    reserved: AtomicU64,
    capacity: Arc<Capacity>,
}

/// Checks a layout as a peer sent it: 1 to [`MAX_REGIONS`] regions, each
/// page aligned, non-empty, not wrapping and not overlapping another.
/// Returns its pages.
pub fn check_layout(regions: &[(u64, u64)]) -> Result<u64, StoreError> {
    if regions.is_empty() || regions.len() > MAX_REGIONS {
        return Err(StoreError::Layout(format!(
            "{} regions (1 to {MAX_REGIONS})",
            regions.len()
        )));
    }
    let mut pages = 0u64;
    for (i, &(gpa, size)) in regions.iter().enumerate() {
        let bad = size == 0
            || !size.is_multiple_of(PAGE)
            || !gpa.is_multiple_of(PAGE)
            || gpa.checked_add(size).is_none();
        if bad {
            return Err(StoreError::Layout(format!(
                "region {i} at {gpa:#x} of {size} bytes"
            )));
        }
        let overlaps = regions[..i]
            .iter()
            .any(|&(g, s)| gpa < g + s && g < gpa + size);
        if overlaps {
            return Err(StoreError::Layout(format!(
                "region {i} at {gpa:#x} overlaps another"
            )));
        }
        pages += size / PAGE;
    }
    Ok(pages)
}

impl VmStore {
    /// An empty store shaped like `regions` (gpa, bytes), owned by whoever
    /// knows `secret`. The layout is checked, and counted against what the
    /// server maps, before its bitmap or memfds are made.
    pub fn new(
        vm: &str,
        regions: &[(u64, u64)],
        capacity: Arc<Capacity>,
        secret: StoreSecret,
    ) -> Result<Self, StoreError> {
        let pages = check_layout(regions)?;
        if !add_within(&capacity.mapped, pages, capacity.map_limit()) {
            return Err(StoreError::Layout(format!(
                "{} MiB of guest memory: this memory server maps at most {} MiB of VM layouts ({}× its capacity), {} MiB of them already",
                pages >> PAGES_PER_MIB_SHIFT,
                capacity.map_limit() >> PAGES_PER_MIB_SHIFT,
                LAYOUT_PER_CAPACITY,
                capacity.mapped.load(Ordering::Relaxed) >> PAGES_PER_MIB_SHIFT
            )));
        }
        let unmap = || capacity.mapped.fetch_sub(pages, Ordering::AcqRel);
        let words = pages.div_ceil(64) as usize;
        let mut bits: Vec<AtomicU64> = Vec::new();
        if bits.try_reserve_exact(words).is_err() {
            unmap();
            return Err(StoreError::Layout(format!(
                "no memory for the bitmap of {pages} pages"
            )));
        }
        bits.resize_with(words, || AtomicU64::new(0));
        let mut made = Vec::new();
        for (i, &(gpa, size)) in regions.iter().enumerate() {
            match MemfdRegion::new(&format!("{vm}-{i}"), gpa, size) {
                Ok(r) => made.push(r),
                Err(e) => {
                    unmap();
                    return Err(e.into());
                }
            }
        }
        // SAFETY: each view covers exactly its region's mapping, which lives
        // as long as the store (the views are dropped with it).
        let views: Vec<RegionView> = made
            .iter()
            .map(|r| unsafe { RegionView::new(r.gpa(), r.size(), r.host_addr()) })
            .collect();
        Ok(VmStore {
            vm: vm.to_string(),
            secret,
            regions: made,
            views,
            bits,
            pages,
            held: AtomicU64::new(0),
            reserved: AtomicU64::new(0),
            capacity,
        })
    }

    /// True if `secret` is this store's owner's.
    pub fn owned_by(&self, secret: &StoreSecret) -> bool {
        self.secret.matches(secret)
    }

    /// Reserves `n` more pages for this VM, if the server has them free.
    pub fn reserve(&self, n: u64) -> Result<(), StoreError> {
        if !self.capacity.take(n) {
            return Err(StoreError::NoRoom {
                vm: self.vm.clone(),
                asked: n,
                free: self.capacity.free(),
            });
        }
        self.reserved.fetch_add(n, Ordering::AcqRel);
        Ok(())
    }

    /// Gives back what is reserved and not held yet; how many pages.
    pub fn unreserve(&self) -> u64 {
        let n = self.reserved.swap(0, Ordering::AcqRel);
        self.capacity.give(n);
        n
    }

    /// The store's regions, as the engine's page code takes them.
    pub fn regions(&self) -> &[RegionView] {
        &self.views
    }

    /// The layout, as StoreOpen carries it.
    pub fn layout(&self) -> Vec<(u64, u64)> {
        self.views.iter().map(|v| (v.gpa(), v.size())).collect()
    }

    /// Pages of the layout.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Pages held.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Pages reserved and not held yet.
    pub fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Relaxed)
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

    /// (region, first page number) of a run wholly inside one region and
    /// page aligned; the run's length in bytes is computed checked.
    fn check(&self, run: GpaPages) -> Result<(usize, u64), SinkError> {
        let out = || SinkError::OutOfRange {
            gpa: run.gpa,
            pages: run.pages,
        };
        if !run.gpa.is_multiple_of(PAGE) {
            return Err(out());
        }
        let bytes = run.pages.checked_mul(PAGE).ok_or_else(out)?;
        let (region, first) = self.index(run.gpa).ok_or_else(out)?;
        if !self.views[region].contains_range(run.gpa, bytes) {
            return Err(out());
        }
        Ok((region, first))
    }

    /// Checks every run of a request before any is acted on: at most
    /// [`MAX_RUNS`] runs, each inside the VM's memory, and no more pages
    /// in all than the VM has.
    pub fn check_runs(&self, kind: Kind, runs: &[GpaPages]) -> Result<(), StoreError> {
        if runs.len() > MAX_RUNS {
            return Err(StoreError::TooMany {
                kind,
                what: "runs",
                count: runs.len() as u64,
                most: MAX_RUNS as u64,
            });
        }
        let mut total = 0u64;
        for r in runs {
            self.check(*r).map_err(|_| StoreError::Outside {
                vm: self.vm.clone(),
                gpa: r.gpa,
                pages: r.pages,
            })?;
            total = total.saturating_add(r.pages);
        }
        if total > self.pages {
            return Err(StoreError::TooMany {
                kind,
                what: "pages",
                count: total,
                most: self.pages,
            });
        }
        Ok(())
    }

    /// Sets (or clears) the bits of pages `first ..+ n` (inside the
    /// bitmap: checked by the caller), a word at a time; returns how many
    /// changed.
    fn mark(&self, first: u64, n: u64, set: bool) -> u64 {
        let end = first + n;
        let mut p = first;
        let mut changed = 0u64;
        while p < end {
            let word = p / 64;
            let lo = p % 64;
            let hi = (end - word * 64).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            let w = &self.bits[word as usize];
            let old = if set {
                w.fetch_or(mask, Ordering::AcqRel)
            } else {
                w.fetch_and(!mask, Ordering::AcqRel)
            };
            let flipped = if set { !old & mask } else { old & mask };
            changed += u64::from(flipped.count_ones());
            p = word * 64 + hi;
        }
        changed
    }

    fn bit(&self, p: u64) -> bool {
        self.bits[(p / 64) as usize].load(Ordering::Acquire) & (1 << (p % 64)) != 0
    }

    /// True if the page at `gpa` is held.
    pub fn holds(&self, gpa: u64) -> bool {
        gpa.is_multiple_of(PAGE) && self.index(gpa).is_some_and(|(_, p)| self.bit(p))
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
    /// memory goes back to the server. The run is checked first.
    pub fn drop_run(&self, run: GpaPages) -> Result<u64, SinkError> {
        let (region, first) = self.check(run)?;
        let n = self.mark(first, run.pages, false);
        self.held.fetch_sub(n, Ordering::AcqRel);
        self.capacity.give(n);
        let r = &self.regions[region];
        // `check` proved the run's bytes fit in the region.
        r.punch_hole(run.gpa - r.gpa(), run.pages * PAGE)
            .map_err(|e| SinkError::Discard {
                gpa: run.gpa,
                pages: run.pages,
                source: Box::new(e),
            })?;
        Ok(n)
    }

    /// Calls `f` with each run of held pages, in address order.
    pub fn each_held_run<E>(&self, mut f: impl FnMut(GpaPages) -> Result<(), E>) -> Result<(), E> {
        let mut base = 0;
        for v in &self.views {
            let mut run: Option<GpaPages> = None;
            for i in 0..v.pages() {
                if !self.bit(base + i) {
                    if let Some(r) = run.take() {
                        f(r)?;
                    }
                    continue;
                }
                match run.as_mut() {
                    Some(r) => r.pages += 1,
                    None => run = Some(GpaPages::new(v.gpa() + i * PAGE, 1)),
                }
            }
            if let Some(r) = run {
                f(r)?;
            }
            base += v.pages();
        }
        Ok(())
    }

    /// Runs of held pages, in address order.
    pub fn held_runs(&self) -> Vec<GpaPages> {
        let mut out = Vec::new();
        let _ = self.each_held_run(|r| {
            out.push(r);
            Ok::<(), ()>(())
        });
        out
    }
}

impl Drop for VmStore {
    fn drop(&mut self) {
        self.capacity.give(self.held() + self.reserved());
        self.capacity.mapped.fetch_sub(self.pages, Ordering::AcqRel);
    }
}

impl PageSink for VmStore {
    fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), SinkError> {
        let shape = SinkError::Shape {
            pages: run.pages,
            bytes: data.len(),
        };
        if run.pages.checked_mul(PAGE) != Some(data.len() as u64) {
            return Err(shape);
        }
        let (region, first) = self.check(run)?;
        // Room first, for every page of the run: this VM's reservation,
        // then the server's free room (pages already held are given back
        // after marking, to the reservation first).
        let mine = self
            .reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                Some(r - r.min(run.pages))
            })
            .map_or(0, |r| r.min(run.pages));
        if !self.capacity.take(run.pages - mine) {
            self.reserved.fetch_add(mine, Ordering::AcqRel);
            return Err(SinkError::Full {
                pages: run.pages,
                free: self.capacity.free(),
            });
        }
        self.views[region].write(run.gpa, data);
        let new = self.mark(first, run.pages, true);
        self.held.fetch_add(new, Ordering::AcqRel);
        let surplus = run.pages - new;
        let back = surplus.min(mine);
        self.reserved.fetch_add(back, Ordering::AcqRel);
        self.capacity.give(surplus - back);
        Ok(())
    }

    fn zero(&self, run: GpaPages) -> Result<(), SinkError> {
        self.drop_run(run).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> StoreSecret {
        StoreSecret([7; 32])
    }

    #[test]
    fn pages_are_held_counted_and_given_back() {
        let cap = Capacity::new(4);
        let s = VmStore::new(
            "t",
            &[(0, 64 << 10), (1 << 20, 16 << 10)],
            cap.clone(),
            secret(),
        )
        .unwrap();
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
        assert!(!s.read_page(0x2001, &mut out), "not aligned");
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

    #[test]
    fn a_reservation_is_room_others_cannot_take_and_writes_use_it_first() {
        let cap = Capacity::new(8);
        let a = VmStore::new("a", &[(0, 64 << 10)], cap.clone(), secret()).unwrap();
        let b = VmStore::new("b", &[(0, 64 << 10)], cap.clone(), secret()).unwrap();
        a.reserve(5).unwrap();
        assert_eq!(cap.free(), 3);
        let e = b.reserve(4).unwrap_err().to_string();
        assert!(e.contains("3 pages free, 4 asked for VM b"), "{e}");
        let page = vec![1u8; PAGE as usize];
        for i in 0..3 {
            a.write(GpaPages::new(i * PAGE, 1), &page).unwrap();
        }
        // Three of a's five reserved pages are held now: no new room used.
        assert_eq!((a.held(), a.reserved(), cap.free()), (3, 2, 3));
        // Writing a held page again gives its room back to the reservation.
        a.write(GpaPages::new(0, 1), &page).unwrap();
        assert_eq!((a.reserved(), cap.free()), (2, 3));
        // b cannot eat into a's reservation.
        for i in 0..3 {
            b.write(GpaPages::new(i * PAGE, 1), &page).unwrap();
        }
        assert!(b.write(GpaPages::new(3 * PAGE, 1), &page).is_err());
        drop(a);
        assert_eq!(cap.free(), 5);
    }

    #[test]
    fn runs_that_wrap_or_leave_the_layout_are_refused_before_any_bit_changes() {
        let cap = Capacity::new(64);
        let s = VmStore::new("t", &[(0, 64 << 10)], cap, secret()).unwrap();
        let page = vec![1u8; PAGE as usize];
        s.write(GpaPages::new(0, 1), &page).unwrap();
        // (0, 2^52 + 1): its bytes wrap to one page in 64 bits.
        let wrap = GpaPages::new(0, (1 << 52) + 1);
        assert!(matches!(
            s.drop_run(wrap),
            Err(SinkError::OutOfRange { .. })
        ));
        let e = s.check_runs(Kind::StoreDrop, &[GpaPages::new(0, 1), wrap]);
        assert!(matches!(e, Err(StoreError::Outside { .. })), "{e:?}");
        assert!(s
            .check_runs(Kind::StoreFetch, &[GpaPages::new(1, 1)])
            .is_err());
        let twice = [GpaPages::new(0, 16), GpaPages::new(0, 16)];
        let e = s.check_runs(Kind::StoreFetch, &twice).unwrap_err();
        assert!(
            e.to_string().contains("32 pages, over the limit of 16"),
            "{e}"
        );
        assert!(s.holds(0), "nothing was cleared");
        assert_eq!(s.held(), 1);
    }

    #[test]
    fn layouts_are_checked_and_what_all_stores_map_is_bounded() {
        let cap = Capacity::new(16); // maps at most 1024 pages (4 MiB)
        for bad in [
            vec![],
            vec![(0, 0)],
            vec![(0, 4097)],
            vec![(1, 4096)],
            vec![(u64::MAX - 4095, 8192)],
            vec![(0, 8192), (4096, 8192)],
            vec![(0, 4096); 17],
        ] {
            assert!(
                VmStore::new("t", &bad, cap.clone(), secret()).is_err(),
                "{bad:?}"
            );
        }
        let tib = vec![(0u64, 1u64 << 40)];
        let e = VmStore::new("t", &tib, cap.clone(), secret())
            .err()
            .unwrap();
        assert!(e.to_string().contains("maps at most"), "{e}");
        let a = VmStore::new("a", &[(0, 3 << 20)], cap.clone(), secret()).unwrap();
        assert!(VmStore::new("b", &[(0, 2 << 20)], cap.clone(), secret()).is_err());
        drop(a);
        assert!(VmStore::new("b", &[(0, 2 << 20)], cap, secret()).is_ok());
    }

    #[test]
    fn marking_a_word_at_a_time_counts_like_page_by_page() {
        let cap = Capacity::new(1024);
        let s = VmStore::new("t", &[(0, 1 << 20)], cap, secret()).unwrap();
        assert_eq!(s.mark(3, 200, true), 200);
        assert_eq!(s.mark(0, 256, true), 56);
        assert_eq!(s.mark(60, 8, false), 8);
        assert_eq!(s.mark(0, 256, false), 248);
        assert!((0..256).all(|p| !s.bit(p)));
    }
}
