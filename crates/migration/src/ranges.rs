//! Ranges of guest memory, each with its unit in its name, so a pair of
//! numbers never has to be guessed at: pages from a guest address, bytes
//! from a region's start, bytes from a guest address.

use serde::{Deserialize, Serialize};

/// Bytes in a guest page, the unit of transfer.
pub const PAGE: u64 = 4096;

/// `pages` whole pages from guest physical address `gpa` (page aligned).
/// On the wire (ZeroRanges) it is the pair `(gpa, pages)`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct GpaPages {
    /// Guest physical address of the first page.
    pub gpa: u64,
    /// Number of pages.
    pub pages: u64,
}

impl GpaPages {
    /// `pages` pages from `gpa`.
    pub const fn new(gpa: u64, pages: u64) -> Self {
        GpaPages { gpa, pages }
    }
    /// The run's length in bytes.
    pub const fn bytes(&self) -> u64 {
        self.pages * PAGE
    }
    /// The guest address just past the run.
    pub const fn end(&self) -> u64 {
        self.gpa + self.bytes()
    }
    /// Guest addresses of each page, in order.
    pub fn page_addrs(&self) -> impl Iterator<Item = u64> {
        let gpa = self.gpa;
        (0..self.pages).map(move |i| gpa + i * PAGE)
    }
}

/// `bytes` bytes from `offset` into one memory region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OffsetBytes {
    /// Offset from the region's start.
    pub offset: u64,
    /// Length in bytes.
    pub bytes: u64,
}

impl OffsetBytes {
    /// `bytes` bytes from `offset`.
    pub const fn new(offset: u64, bytes: u64) -> Self {
        OffsetBytes { offset, bytes }
    }
    /// The offset just past the range.
    pub const fn end(&self) -> u64 {
        self.offset + self.bytes
    }
}

/// `bytes` bytes from guest physical address `gpa`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GpaBytes {
    /// Guest physical address.
    pub gpa: u64,
    /// Length in bytes.
    pub bytes: u64,
}

impl GpaBytes {
    /// `bytes` bytes from `gpa`.
    pub const fn new(gpa: u64, bytes: u64) -> Self {
        GpaBytes { gpa, bytes }
    }
    /// The pages the range touches (partial pages count whole).
    pub const fn pages(&self) -> GpaPages {
        let first = self.gpa / PAGE * PAGE;
        GpaPages::new(first, (self.gpa - first + self.bytes).div_ceil(PAGE))
    }
}

/// Merges sorted, possibly overlapping or touching runs into disjoint ones.
pub fn merge_runs(sorted: impl IntoIterator<Item = GpaPages>) -> Vec<GpaPages> {
    let mut out: Vec<GpaPages> = Vec::new();
    for r in sorted {
        match out.last_mut() {
            Some(last) if r.gpa <= last.end() => {
                let end = r.end().max(last.end());
                last.pages = (end - last.gpa) / PAGE;
            }
            _ => out.push(r),
        }
    }
    out
}

/// Runs in any order, possibly overlapping, as sorted disjoint ones.
pub fn union_runs(runs: impl IntoIterator<Item = GpaPages>) -> Vec<GpaPages> {
    let mut v: Vec<GpaPages> = runs.into_iter().collect();
    v.sort_unstable();
    merge_runs(v)
}

/// The pages of `runs` that a run of `of` covers too (both sorted and
/// disjoint, as merge_runs leaves them).
pub fn intersect_runs(runs: &[GpaPages], of: &[GpaPages]) -> Vec<GpaPages> {
    subtract_runs(runs, &subtract_runs(runs, of))
}

/// Appends page `gpa` to `runs`, extending the last run when it is the next page.
pub fn push_page(runs: &mut Vec<GpaPages>, gpa: u64) {
    match runs.last_mut() {
        Some(last) if last.end() == gpa => last.pages += 1,
        _ => runs.push(GpaPages::new(gpa, 1)),
    }
}

/// The pages of `runs` that no run of `minus` covers (both sorted and
/// disjoint, as merge_runs leaves them).
pub fn subtract_runs(runs: &[GpaPages], minus: &[GpaPages]) -> Vec<GpaPages> {
    let mut out = Vec::new();
    let mut k = 0;
    for r in runs {
        let mut at = r.gpa;
        while k < minus.len() && minus[k].end() <= at {
            k += 1;
        }
        let mut j = k;
        while at < r.end() {
            match minus.get(j) {
                Some(m) if m.gpa < r.end() => {
                    if m.gpa > at {
                        out.push(GpaPages::new(at, (m.gpa - at) / PAGE));
                    }
                    at = at.max(m.end());
                    j += 1;
                }
                _ => {
                    out.push(GpaPages::new(at, (r.end() - at) / PAGE));
                    at = r.end();
                }
            }
        }
    }
    out
}

/// Total pages in `runs`.
pub fn total_pages(runs: &[GpaPages]) -> u64 {
    runs.iter().map(|r| r.pages).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subtract_runs_leaves_what_no_run_covers() {
        let p = |n: u64| n * PAGE;
        let runs = [GpaPages::new(0, 10), GpaPages::new(p(20), 4)];
        let minus = [
            GpaPages::new(p(2), 2),
            GpaPages::new(p(9), 12),
            GpaPages::new(p(23), 1),
        ];
        assert_eq!(
            subtract_runs(&runs, &minus),
            vec![
                GpaPages::new(0, 2),
                GpaPages::new(p(4), 5),
                GpaPages::new(p(21), 2)
            ]
        );
        assert_eq!(subtract_runs(&runs, &[]), runs.to_vec());
        assert!(subtract_runs(&runs, &[GpaPages::new(0, 100)]).is_empty());
        assert!(subtract_runs(&[], &minus).is_empty());
    }

    #[test]
    fn runs_merge_and_grow() {
        let p = GpaPages::new;
        assert_eq!(
            merge_runs([p(0, 2), p(0x1000, 3), p(0x8000, 1), p(0x9000, 1)]),
            vec![p(0, 4), p(0x8000, 2)]
        );
        let mut runs = Vec::new();
        for g in [0, 0x1000, 0x3000] {
            push_page(&mut runs, g);
        }
        assert_eq!(runs, vec![p(0, 2), p(0x3000, 1)]);
        assert_eq!(total_pages(&runs), 3);
        assert_eq!(GpaBytes::new(0x1800, 0x1000).pages(), p(0x1000, 2));
        assert_eq!(
            p(0x2000, 3).page_addrs().collect::<Vec<_>>(),
            [0x2000, 0x3000, 0x4000]
        );
    }

    #[test]
    fn runs_unite_and_intersect() {
        let p = GpaPages::new;
        assert_eq!(
            union_runs([p(0x8000, 1), p(0, 2), p(0x1000, 3), p(0x9000, 1)]),
            vec![p(0, 4), p(0x8000, 2)]
        );
        assert_eq!(
            intersect_runs(&[p(0, 4), p(0x8000, 2)], &[p(0x3000, 6)]),
            vec![p(0x3000, 1), p(0x8000, 1)]
        );
        assert_eq!(intersect_runs(&[p(0, 4)], &[]), vec![]);
    }

    #[test]
    fn a_run_is_the_same_pair_on_the_wire() {
        let a = postcard::to_stdvec(&[GpaPages::new(0x5000, 7)]).unwrap();
        let b = postcard::to_stdvec(&[(0x5000u64, 7u64)]).unwrap();
        assert_eq!(a, b);
    }
}
