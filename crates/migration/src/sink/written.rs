//! The destination's record of which guest pages may hold non-zero bytes.
//!
//! An incoming VM's memory starts as zeros (apart from what its VMM wrote
//! before the migration), so most of the zero ranges a source sends land on
//! pages that already read as zeros. Zeroing them anyway costs a hole punch
//! per range, frees memory a `--prealloc` destination paid to populate, and
//! makes the next write fault it in again. This map remembers every page
//! that may be non-zero (written before the migration, or by it); a zero
//! range only touches those.
//!
//! Threads: each bulk stream marks and clears bits. Within a round the source
//! sends each page once, and rounds are separated by barriers, so no two
//! streams race on one page's bit; the atomics only keep neighbouring bits
//! (one word) from racing.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::ranges::{GpaBytes, GpaPages, OffsetBytes};

const PAGE: usize = crate::ranges::PAGE as usize;
use crate::memory::RegionView;

/// One region's bits.
struct RegionBits {
    gpa: u64,
    pages: u64,
    /// Pages written before or by the migration; cleared when zeroed.
    bits: Vec<AtomicU64>,
    /// Pages the VMM may write at any time; never cleared.
    sticky: Vec<u64>,
}

/// One bit per guest page, per region.
pub struct MaybeNonZero {
    regions: Vec<RegionBits>,
}

impl MaybeNonZero {
    /// A map of `regions` where `nonzero[i]` lists region i's (offset, length)
    /// ranges that may hold data, and `sticky` lists (gpa, length) ranges
    /// the VMM may write at any time: those are taken every time.
    pub fn new(regions: &[RegionView], nonzero: &[Vec<OffsetBytes>], sticky: &[GpaBytes]) -> Self {
        let mut map = MaybeNonZero {
            regions: regions
                .iter()
                .map(|r| {
                    let words = r.pages().div_ceil(64) as usize;
                    RegionBits {
                        gpa: r.gpa(),
                        pages: r.pages(),
                        bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
                        sticky: vec![0; words],
                    }
                })
                .collect(),
        };
        for (r, ranges) in regions.iter().zip(nonzero) {
            for range in ranges {
                map.mark(GpaPages::new(
                    r.gpa() + range.offset,
                    pages_of(range.offset, range.bytes),
                ));
            }
        }
        for s in sticky {
            if let Some((i, first, end)) = map.span(s.gpa, pages_of(s.gpa, s.bytes)) {
                let sticky = &mut map.regions[i].sticky;
                for_words(first, end, |w, mask| sticky[w] |= mask);
            }
        }
        map
    }

    /// The region holding `gpa` and its pages `first..end` covered by
    /// `pages` pages from `gpa` (clipped to the region).
    fn span(&self, gpa: u64, pages: u64) -> Option<(usize, u64, u64)> {
        self.regions.iter().enumerate().find_map(|(i, rb)| {
            let first = gpa.checked_sub(rb.gpa)? / PAGE as u64;
            (first < rb.pages).then(|| (i, first, first.saturating_add(pages).min(rb.pages)))
        })
    }

    /// Records that the pages of `run` may now hold data (clipped to the
    /// region holding its first page).
    pub fn mark(&self, run: GpaPages) {
        let Some((i, first, end)) = self.span(run.gpa, run.pages) else {
            return;
        };
        let bits = &self.regions[i].bits;
        for_words(first, end, |w, mask| {
            bits[w].fetch_or(mask, Ordering::Relaxed);
        });
    }

    /// The runs of `pages` pages from `gpa` that may hold data, as
    /// runs; their bits are cleared (the caller zeroes them).
    pub fn take(&self, run: GpaPages) -> Vec<GpaPages> {
        let Some((i, first, end)) = self.span(run.gpa, run.pages) else {
            return Vec::new();
        };
        let rb = &self.regions[i];
        let base = rb.gpa;
        let mut runs: Vec<GpaPages> = Vec::new();
        for_words(first, end, |w, mask| {
            let set = (rb.bits[w].fetch_and(!mask, Ordering::Relaxed) | rb.sticky[w]) & mask;
            let mut rest = set;
            while rest != 0 {
                let bit = rest.trailing_zeros() as u64;
                let len = (rest >> bit).trailing_ones() as u64;
                let page = w as u64 * 64 + bit;
                let at = base + page * PAGE as u64;
                match runs.last_mut() {
                    Some(r) if r.end() == at => r.pages += len,
                    _ => runs.push(GpaPages::new(at, len)),
                }
                rest &= !(((1u128 << (bit + len)) - 1) as u64);
            }
        });
        runs
    }
}

/// Pages touched by the byte range `off..off + len`.
fn pages_of(off: u64, len: u64) -> u64 {
    (off % PAGE as u64 + len).div_ceil(PAGE as u64)
}

/// Calls `f(word, mask)` for the bits of pages `first..end`.
fn for_words(first: u64, end: u64, mut f: impl FnMut(usize, u64)) {
    let mut page = first;
    while page < end {
        let w = page / 64;
        let lo = page % 64;
        let hi = (end - w * 64).min(64);
        let mask = if hi - lo == 64 {
            u64::MAX
        } else {
            ((1u64 << (hi - lo)) - 1) << lo
        };
        f(w as usize, mask);
        page = w * 64 + hi;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(gpa: u64, pages: u64) -> RegionView {
        // SAFETY: the map only reads the view's address range, never its memory.
        unsafe { RegionView::new(gpa, pages * PAGE as u64, std::ptr::null_mut()) }
    }

    fn run(gpa: u64, pages: u64) -> GpaPages {
        GpaPages::new(gpa, pages)
    }

    const P: u64 = PAGE as u64;

    #[test]
    fn starts_from_the_given_ranges_and_takes_what_was_marked() {
        let regions = [region(0, 200), region(0x1_0000_0000, 70)];
        let map = MaybeNonZero::new(
            &regions,
            &[vec![OffsetBytes::new(3 * P, 2 * P)], vec![]],
            &[],
        );
        assert_eq!(map.take(run(0, 200)), vec![run(3 * P, 2)]);
        assert!(map.take(run(0, 200)).is_empty(), "taking clears");
        map.mark(run(60 * P, 10)); // across a word boundary
        map.mark(run(0x1_0000_0000 + 68 * P, 5)); // clipped to the region
        assert_eq!(map.take(run(0, 65)), vec![run(60 * P, 5)]);
        assert_eq!(map.take(run(65 * P, 100)), vec![run(65 * P, 5)]);
        assert_eq!(
            map.take(run(0x1_0000_0000, 70)),
            vec![run(0x1_0000_0000 + 68 * P, 2)]
        );
        assert!(
            map.take(run(0x2_0000_0000, 1)).is_empty(),
            "outside guest RAM"
        );
    }

    #[test]
    fn runs_split_where_bits_are_clear() {
        let regions = [region(0, 256)];
        let map = MaybeNonZero::new(&regions, &[vec![]], &[]);
        for p in [0u64, 1, 2, 63, 64, 65, 130, 255] {
            map.mark(run(p * P, 1));
        }
        assert_eq!(
            map.take(run(0, 256)),
            vec![run(0, 3), run(63 * P, 3), run(130 * P, 1), run(255 * P, 1)]
        );
        map.mark(run(0, 256));
        assert_eq!(map.take(run(10 * P, 100)), vec![run(10 * P, 100)]);
        assert_eq!(map.take(run(0, 256)), vec![run(0, 10), run(110 * P, 146)]);
    }

    #[test]
    fn sticky_ranges_are_taken_every_time() {
        let base = 0x1000_0000;
        let regions = [region(base, 128)];
        let map = MaybeNonZero::new(&regions, &[vec![]], &[GpaBytes::new(base + 70 * P, 3 * P)]);
        for _ in 0..3 {
            assert_eq!(map.take(run(base, 128)), vec![run(base + 70 * P, 3)]);
        }
        map.mark(run(base + 73 * P, 1));
        assert_eq!(
            map.take(run(base + 60 * P, 20)),
            vec![run(base + 70 * P, 4)]
        );
        assert_eq!(
            map.take(run(base + 60 * P, 20)),
            vec![run(base + 70 * P, 3)]
        );
        assert_eq!(map.take(run(base + 71 * P, 1)), vec![run(base + 71 * P, 1)]);
    }
}
