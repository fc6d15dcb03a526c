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
        total += set_runs(bm, r.pages(), |first, pages| {
            runs.push(GpaPages::new(r.gpa() + first * PAGE, pages));
        });
    }
    (runs, total)
}

/// Calls `run(first, pages)` for each run of set bits among the first
/// `pages` bits of `bitmap` (bit i of word i/64 = page i; missing words
/// read as 0); returns how many bits are set.
///
/// This runs in the stop-and-copy: empty stretches are skipped a word
/// search at a time, full words inside a run are counted whole, and the
/// edges within a word are found by counting zeros, not bit by bit (a
/// 16 GiB VM has 65,536 words to pass).
fn set_runs(bitmap: &[u64], pages: u64, mut run: impl FnMut(u64, u64)) -> u64 {
    let words = pages.div_ceil(64) as usize;
    let word = |i: usize| {
        let w = bitmap.get(i).copied().unwrap_or(0);
        let base = i as u64 * 64;
        // Bits past the last page are not pages.
        if base + 64 > pages {
            w & ((1u64 << (pages - base)) - 1)
        } else {
            w
        }
    };
    let mut total = 0;
    let mut start: Option<u64> = None;
    let mut i = 0;
    while i < words {
        if start.is_none() {
            // Jump to the next word with a set bit.
            match bitmap
                .get(i..words.min(bitmap.len()))
                .and_then(|rest| rest.iter().position(|&w| w != 0))
            {
                Some(skip) => i += skip,
                None => break,
            }
        }
        let w = word(i);
        let base = i as u64 * 64;
        let mut bit = 0u32;
        while bit < 64 {
            match start {
                None => {
                    let rest = w >> bit;
                    if rest == 0 {
                        break;
                    }
                    bit += rest.trailing_zeros();
                    start = Some(base + u64::from(bit));
                }
                Some(first) => {
                    let rest = !w >> bit;
                    if rest == 0 {
                        // Set to the end of the word: the run goes on.
                        total += u64::from(64 - bit);
                        break;
                    }
                    let ones = rest.trailing_zeros();
                    total += u64::from(ones);
                    bit += ones;
                    run(first, base + u64::from(bit) - first);
                    start = None;
                }
            }
        }
        i += 1;
    }
    if let Some(first) = start {
        run(first, pages - first);
    }
    total
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

    /// The runs walked bit by bit.
    fn walked(bitmap: &[u64], pages: u64) -> (Vec<(u64, u64)>, u64) {
        let bit = |i: u64| {
            bitmap
                .get((i / 64) as usize)
                .is_some_and(|w| w >> (i % 64) & 1 == 1)
        };
        let (mut runs, mut total, mut start) = (Vec::new(), 0, None);
        for i in 0..pages {
            match (bit(i), start) {
                (true, None) => start = Some(i),
                (false, Some(s)) => {
                    runs.push((s, i - s));
                    start = None;
                }
                _ => {}
            }
            total += u64::from(bit(i));
        }
        if let Some(s) = start {
            runs.push((s, pages - s));
        }
        (runs, total)
    }

    #[test]
    fn runs_found_by_words_are_the_runs_walked_bit_by_bit() {
        let mut state = 0x853c_49e6_748f_ea9bu64;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            state >> 11
        };
        for round in 0..2000 {
            let words = (next() % 9) as usize;
            let bitmap: Vec<u64> = (0..words)
                .map(|_| match next() % 5 {
                    0 => 0,
                    1 => u64::MAX,
                    2 => next() << 11 ^ next(),
                    3 => !0u64 << (next() % 64),
                    _ => (1u64 << (next() % 64)).wrapping_sub(1),
                })
                .collect();
            // Pages that end inside, at and past the bitmap's words.
            let pages = (next() % (words as u64 * 64 + 70)).max(1);
            let mut runs = Vec::new();
            let total = set_runs(&bitmap, pages, |first, n| runs.push((first, n)));
            assert_eq!(
                (runs, total),
                walked(&bitmap, pages),
                "round {round}: {bitmap:x?}, {pages} pages"
            );
        }
    }
}
