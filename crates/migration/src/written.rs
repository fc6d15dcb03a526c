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

use crate::protocol::PAGE;
use crate::vm::RegionView;

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
    pub fn new(regions: &[RegionView], nonzero: &[Vec<(u64, u64)>], sticky: &[(u64, u64)]) -> Self {
        let mut map = MaybeNonZero {
            regions: regions
                .iter()
                .map(|r| {
                    let words = r.pages().div_ceil(64) as usize;
                    RegionBits {
                        gpa: r.gpa,
                        pages: r.pages(),
                        bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
                        sticky: vec![0; words],
                    }
                })
                .collect(),
        };
        for (r, ranges) in regions.iter().zip(nonzero) {
            for &(off, len) in ranges {
                map.mark(r.gpa + off, pages_of(off, len));
            }
        }
        for &(gpa, len) in sticky {
            if let Some((i, first, end)) = map.span(gpa, pages_of(gpa, len)) {
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

    /// Records that `pages` pages from `gpa` may now hold data (clipped to
    /// the region holding `gpa`).
    pub fn mark(&self, gpa: u64, pages: u64) {
        let Some((i, first, end)) = self.span(gpa, pages) else {
            return;
        };
        let bits = &self.regions[i].bits;
        for_words(first, end, |w, mask| {
            bits[w].fetch_or(mask, Ordering::Relaxed);
        });
    }

    /// The runs of `pages` pages from `gpa` that may hold data, as
    /// (gpa, pages); their bits are cleared (the caller zeroes them).
    pub fn take(&self, gpa: u64, pages: u64) -> Vec<(u64, u64)> {
        let Some((i, first, end)) = self.span(gpa, pages) else {
            return Vec::new();
        };
        let rb = &self.regions[i];
        let base = rb.gpa;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for_words(first, end, |w, mask| {
            let set = (rb.bits[w].fetch_and(!mask, Ordering::Relaxed) | rb.sticky[w]) & mask;
            let mut rest = set;
            while rest != 0 {
                let bit = rest.trailing_zeros() as u64;
                let len = (rest >> bit).trailing_ones() as u64;
                let page = w as u64 * 64 + bit;
                let at = base + page * PAGE as u64;
                match runs.last_mut() {
                    Some((g, n)) if *g + *n * PAGE as u64 == at => *n += len,
                    _ => runs.push((at, len)),
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
        RegionView {
            gpa,
            size: pages * PAGE as u64,
            host: std::ptr::null_mut(),
        }
    }

    const P: u64 = PAGE as u64;

    #[test]
    fn starts_from_the_given_ranges_and_takes_what_was_marked() {
        let regions = [region(0, 200), region(0x1_0000_0000, 70)];
        let map = MaybeNonZero::new(&regions, &[vec![(3 * P, 2 * P)], vec![]], &[]);
        assert_eq!(map.take(0, 200), vec![(3 * P, 2)]);
        assert!(map.take(0, 200).is_empty(), "taking clears");
        map.mark(60 * P, 10); // across a word boundary
        map.mark(0x1_0000_0000 + 68 * P, 5); // clipped to the region
        assert_eq!(map.take(0, 65), vec![(60 * P, 5)]);
        assert_eq!(map.take(65 * P, 100), vec![(65 * P, 5)]);
        assert_eq!(
            map.take(0x1_0000_0000, 70),
            vec![(0x1_0000_0000 + 68 * P, 2)]
        );
        assert!(map.take(0x2_0000_0000, 1).is_empty(), "outside guest RAM");
    }

    #[test]
    fn runs_split_where_bits_are_clear() {
        let regions = [region(0, 256)];
        let map = MaybeNonZero::new(&regions, &[vec![]], &[]);
        for p in [0u64, 1, 2, 63, 64, 65, 130, 255] {
            map.mark(p * P, 1);
        }
        assert_eq!(
            map.take(0, 256),
            vec![(0, 3), (63 * P, 3), (130 * P, 1), (255 * P, 1)]
        );
        map.mark(0, 256);
        assert_eq!(map.take(10 * P, 100), vec![(10 * P, 100)]);
        assert_eq!(map.take(0, 256), vec![(0, 10), (110 * P, 146)]);
    }

    #[test]
    fn sticky_ranges_are_taken_every_time() {
        let base = 0x1000_0000;
        let regions = [region(base, 128)];
        let map = MaybeNonZero::new(&regions, &[vec![]], &[(base + 70 * P, 3 * P)]);
        for _ in 0..3 {
            assert_eq!(map.take(base, 128), vec![(base + 70 * P, 3)]);
        }
        map.mark(base + 73 * P, 1);
        assert_eq!(map.take(base + 60 * P, 20), vec![(base + 70 * P, 4)]);
        assert_eq!(map.take(base + 60 * P, 20), vec![(base + 70 * P, 3)]);
        assert_eq!(map.take(base + 71 * P, 1), vec![(base + 71 * P, 1)]);
    }
}
