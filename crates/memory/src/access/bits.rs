//! Per-page bitmaps (bit i of word i/64 = page i), set and cleared by
//! page range with atomic word operations so the fault thread records
//! without a lock.

use std::sync::atomic::{AtomicU64, Ordering};

/// Clears the bits of pages [start, end).
pub(super) fn clear_bits(bits: &[AtomicU64], start: u64, end: u64) {
    for_words(start, end, |word, mask| {
        bits[word].fetch_and(!mask, Ordering::Relaxed);
    });
}

/// Sets the bits of pages [start, end).
pub(super) fn set_bits(bits: &[AtomicU64], start: u64, end: u64) {
    for_words(start, end, |word, mask| {
        bits[word].fetch_or(mask, Ordering::Relaxed);
    });
}

/// Calls `f(word, mask)` for each word of the bits of pages [start, end).
pub(super) fn for_words(start: u64, end: u64, mut f: impl FnMut(usize, u64)) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_ranges_become_word_masks() {
        let bits: Vec<AtomicU64> = (0..3).map(|_| AtomicU64::new(u64::MAX)).collect();
        clear_bits(&bits, 3, 130);
        let words: Vec<u64> = bits.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        assert_eq!(words, vec![0b111, 0, u64::MAX << 2]);
    }

    #[test]
    fn a_range_is_cut_at_word_boundaries() {
        let mut calls = Vec::new();
        for_words(60, 130, |w, m| calls.push((w, m)));
        assert_eq!(calls, vec![(0, 0xf << 60), (1, u64::MAX), (2, 0b11)]);
        calls.clear();
        for_words(64, 128, |w, m| calls.push((w, m)));
        assert_eq!(calls, vec![(1, u64::MAX)], "a whole word in one call");
        calls.clear();
        for_words(7, 7, |w, m| calls.push((w, m)));
        assert!(calls.is_empty(), "an empty range touches nothing");

        let bits: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(0)).collect();
        set_bits(&bits, 63, 66);
        set_bits(&bits, 0, 1);
        let words: Vec<u64> = bits.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        assert_eq!(words, vec![1 << 63 | 1, 0b11]);
    }
}
