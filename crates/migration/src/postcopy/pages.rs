//! Pages numbered across all regions, and an atomic set of them: which
//! pages are still to send (source) or still to arrive (destination).
//! Claiming a page clears its bit, so of two threads offering the same
//! page exactly one wins.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::memory::RegionView;
use crate::ranges::{GpaPages, PAGE};

/// Maps guest addresses to page numbers 0..total and back.
#[derive(Clone, Debug)]
pub(crate) struct PageIndex {
    /// (gpa, first page number, pages) per region.
    regions: Vec<(u64, u64, u64)>,
    total: u64,
}

impl PageIndex {
    pub(crate) fn new(regions: &[RegionView]) -> Self {
        let mut at = 0;
        let regions = regions
            .iter()
            .map(|r| {
                let e = (r.gpa(), at, r.pages());
                at += r.pages();
                e
            })
            .collect();
        PageIndex { regions, total: at }
    }

    /// Pages in all regions.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// The page number of `gpa`, if it lies in guest RAM.
    pub(crate) fn page_of(&self, gpa: u64) -> Option<u64> {
        self.regions.iter().find_map(|&(base, first, pages)| {
            let off = gpa.checked_sub(base)? / PAGE;
            (off < pages).then_some(first + off)
        })
    }

    /// The guest address of page `n`.
    pub(crate) fn gpa_of(&self, n: u64) -> u64 {
        self.regions
            .iter()
            .find(|&&(_, first, pages)| n >= first && n < first + pages)
            .map_or(u64::MAX, |&(base, first, _)| base + (n - first) * PAGE)
    }

    /// The page numbers of the region holding page `n` (prefetch windows
    /// stay inside it).
    pub(crate) fn region_span(&self, n: u64) -> std::ops::Range<u64> {
        self.regions
            .iter()
            .find(|&&(_, first, pages)| n >= first && n < first + pages)
            .map_or(0..0, |&(_, first, pages)| first..first + pages)
    }
}

/// A set of page numbers with atomic claim.
pub(crate) struct PageSet {
    words: Vec<AtomicU64>,
    len: u64,
}

impl PageSet {
    /// An empty set over `len` pages.
    pub(crate) fn new(len: u64) -> Self {
        PageSet {
            words: (0..len.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            len,
        }
    }

    /// The pages of `runs` (addresses outside the index are ignored).
    pub(crate) fn of_runs(index: &PageIndex, runs: &[GpaPages]) -> Self {
        let set = PageSet::new(index.total());
        for run in runs {
            for gpa in run.page_addrs() {
                if let Some(n) = index.page_of(gpa) {
                    set.insert(n);
                }
            }
        }
        set
    }

    pub(crate) fn insert(&self, n: u64) {
        self.words[(n / 64) as usize].fetch_or(1 << (n % 64), Ordering::AcqRel);
    }

    pub(crate) fn contains(&self, n: u64) -> bool {
        n < self.len && self.words[(n / 64) as usize].load(Ordering::Acquire) & (1 << (n % 64)) != 0
    }

    /// Removes `n`; true if this call removed it.
    pub(crate) fn claim(&self, n: u64) -> bool {
        if n >= self.len {
            return false;
        }
        let mask = 1 << (n % 64);
        self.words[(n / 64) as usize].fetch_and(!mask, Ordering::AcqRel) & mask != 0
    }

    /// Members left.
    pub(crate) fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }

    /// The first member at or after `from`, wrapping around once.
    pub(crate) fn next_from(&self, from: u64) -> Option<u64> {
        let n = self.words.len();
        if n == 0 {
            return None;
        }
        let from = if from >= self.len { 0 } else { from };
        let start = (from / 64) as usize;
        for k in 0..=n {
            let i = (start + k) % n;
            let mut w = self.words[i].load(Ordering::Acquire);
            if k == 0 {
                w &= !0u64 << (from % 64);
            }
            if w != 0 {
                return Some(i as u64 * 64 + u64::from(w.trailing_zeros()));
            }
        }
        None
    }

    /// The members as runs of guest addresses.
    pub(crate) fn runs(&self, index: &PageIndex) -> Vec<GpaPages> {
        let mut out = Vec::new();
        for n in 0..self.len {
            if self.contains(n) {
                crate::ranges::push_page(&mut out, index.gpa_of(n));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_numbered_across_regions_and_claimed_once() {
        // SAFETY: only the views' address ranges are used, never their memory.
        let regions = unsafe {
            [
                RegionView::new(0, 100 * PAGE, std::ptr::null_mut()),
                RegionView::new(1 << 32, 50 * PAGE, std::ptr::null_mut()),
            ]
        };
        let ix = PageIndex::new(&regions);
        assert_eq!(ix.total(), 150);
        assert_eq!(ix.page_of((1 << 32) + 3 * PAGE + 5), Some(103));
        assert_eq!(ix.page_of(100 * PAGE), None, "in the gap");
        assert_eq!(ix.gpa_of(103), (1 << 32) + 3 * PAGE);
        assert_eq!(ix.region_span(120), 100..150);
        let set = PageSet::of_runs(
            &ix,
            &[GpaPages::new(98 * PAGE, 2), GpaPages::new(1 << 32, 3)],
        );
        assert_eq!(set.count(), 5);
        assert_eq!(set.next_from(0), Some(98));
        assert_eq!(set.next_from(99), Some(99));
        assert_eq!(set.next_from(103), Some(98), "wraps around");
        assert!(set.claim(99) && !set.claim(99));
        assert_eq!(
            set.runs(&ix),
            vec![GpaPages::new(98 * PAGE, 1), GpaPages::new(1 << 32, 3)]
        );
        for n in [98, 100, 101, 102] {
            assert!(set.claim(n));
        }
        assert_eq!(set.next_from(0), None);
        assert!(!set.claim(1000), "out of range");
    }
}
