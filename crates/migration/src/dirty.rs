//! Page sets to send, from what the VM reports: round 0's data ranges and
//! holes, dirty bitmaps as runs, and a random sample of pages.

use crate::memory::{is_zero, RegionView};
use crate::ranges::{GpaPages, OffsetBytes, PAGE};

/// Round 0: the pages that may hold data, and the holes (known zeros).
pub(crate) fn first_round(
    regions: &[RegionView],
    data_ranges: impl Fn(usize) -> Vec<OffsetBytes>,
) -> (Vec<GpaPages>, Vec<GpaPages>) {
    let (mut data, mut holes) = (Vec::new(), Vec::new());
    for (i, r) in regions.iter().enumerate() {
        let mut at = 0;
        for d in data_ranges(i) {
            if d.offset > at {
                holes.push(GpaPages::new(r.gpa() + at, (d.offset - at) / PAGE));
            }
            data.push(GpaPages::new(r.gpa() + d.offset, d.bytes / PAGE));
            at = d.end();
        }
        if at < r.size() {
            holes.push(GpaPages::new(r.gpa() + at, (r.size() - at) / PAGE));
        }
    }
    (data, holes)
}

/// Runs of set bits in per-region dirty bitmaps, and how many pages.
pub(crate) fn dirty_runs(regions: &[RegionView], bitmaps: &[Vec<u64>]) -> (Vec<GpaPages>, u64) {
    let mut runs = Vec::new();
    let mut total = 0;
    for (r, bm) in regions.iter().zip(bitmaps) {
        let pages = r.pages();
        let mut start: Option<u64> = None;
        let mut mark = |i: u64, set: bool, start: &mut Option<u64>| match (set, *start) {
            (true, None) => *start = Some(i),
            (false, Some(s)) => {
                runs.push(GpaPages::new(r.gpa() + s * PAGE, i - s));
                *start = None;
            }
            _ => {}
        };
        let mut i = 0;
        while i < pages {
            let w = bm.get((i / 64) as usize).copied().unwrap_or(0);
            // This runs in the stop-and-copy too: skip whole empty or full
            // words (64 pages) instead of testing every bit of a large VM.
            if i % 64 == 0 && i + 64 <= pages && (w == 0 || w == u64::MAX) {
                mark(i, w != 0, &mut start);
                total += if w == 0 { 0 } else { 64 };
                i += 64;
                continue;
            }
            let set = w >> (i % 64) & 1 == 1;
            mark(i, set, &mut start);
            total += set as u64;
            i += 1;
        }
        if let Some(s) = start {
            runs.push(GpaPages::new(r.gpa() + s * PAGE, pages - s));
        }
    }
    (runs, total)
}

/// Up to `max` non-zero pages picked at random over the VM's data, for the
/// compression policy to measure its codecs on. Random, not strided: a
/// regular stride can alias with a regular layout and see one kind of page.
pub(crate) fn sample_pages(
    regions: &[RegionView],
    data_ranges: impl Fn(usize) -> Vec<OffsetBytes>,
    max: usize,
) -> Vec<u8> {
    let mut ranges = Vec::new();
    for (i, r) in regions.iter().enumerate() {
        for d in data_ranges(i) {
            ranges.push((r, d.offset / PAGE, d.bytes / PAGE));
        }
    }
    let total: u64 = ranges.iter().map(|c| c.2).sum();
    let page = PAGE as usize;
    let mut out = Vec::with_capacity(max * page);
    if total == 0 {
        return out;
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..4 * max {
        if out.len() >= max * page {
            break;
        }
        // xorshift64: cheap, and the same sample every run.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut k = x % total;
        for &(r, first, n) in &ranges {
            if k < n {
                let at = out.len();
                r.copy_page(first + k, &mut out);
                if is_zero(&out[at..]) {
                    out.truncate(at);
                }
                break;
            }
            k -= n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_from_bitmaps() {
        let mut mem = vec![0u8; 8 * PAGE as usize];
        // SAFETY: `mem` outlives the views; only address ranges are used.
        let r = unsafe { RegionView::new(0x10000, 8 * PAGE, mem.as_mut_ptr()) };
        let (runs, n) = dirty_runs(&[r], &[vec![0b1011_0110]]);
        assert_eq!(n, 5);
        let p = GpaPages::new;
        assert_eq!(runs, vec![p(0x11000, 2), p(0x14000, 2), p(0x17000, 1)]);
        // Whole words, full and empty, across word boundaries.
        // SAFETY: as above (the view is never read here).
        let big = unsafe { RegionView::new(0, 200 * PAGE, mem.as_mut_ptr()) };
        let (runs, n) = dirty_runs(&[big], &[vec![u64::MAX, 0, 1 << 63, 0b111]]);
        assert_eq!(n, 64 + 1 + 3);
        assert_eq!(runs, vec![p(0, 64), p(191 * PAGE, 4)]);
        let (data, holes) = first_round(&[r], |_| vec![OffsetBytes::new(PAGE, 2 * PAGE)]);
        assert_eq!(data, vec![p(0x11000, 2)]);
        assert_eq!(holes, vec![p(0x10000, 1), p(0x13000, 5)]);
    }
}
