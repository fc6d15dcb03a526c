//! Shares: the tracker arms 1/`share` of the pages per period, a share
//! being every `share`-th 2 MiB chunk (spread over the region, madvised in
//! large runs), taken in turn so every page is sampled once every `share`
//! periods. Pure page arithmetic, apart from the tracker's rotation.

use super::{Periodic, CHUNK_PAGES};

/// Most runs one chunk is split into around pages just written (which
/// arm skips); past it the whole chunk is armed, as one madvise call costs
/// less than many for scattered writes.
const MAX_RUNS_PER_CHUNK: usize = 8;

impl Periodic {
    /// The share an arm starting now drops (of `shares`); the next arm
    /// takes the one after it.
    pub(super) fn take_share(&mut self, shares: u32) -> u32 {
        let share = self.next_share;
        self.next_share = (share + 1) % shares;
        self.armed_share = Some(share);
        share
    }
}

/// The page runs [start, end) of share `share` (of `shares`) in a range of
/// `pages` pages: every chunk whose index is `share` modulo `shares`,
/// adjacent chunks merged.
pub(super) fn share_runs(pages: u64, share: u32, shares: u32) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let chunks = pages.div_ceil(CHUNK_PAGES);
    let mut c = u64::from(share);
    while c < chunks {
        let (start, end) = (c * CHUNK_PAGES, ((c + 1) * CHUNK_PAGES).min(pages));
        match runs.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => runs.push((start, end)),
        }
        c += u64::from(shares);
    }
    runs
}

/// The runs arm drops for share `share` of a range: the share's chunks
/// less the pages `written` (bit per page) marks, merged where adjacent. A
/// chunk that would split into more than [`MAX_RUNS_PER_CHUNK`] runs is
/// armed whole.
pub(super) fn arm_runs(
    pages: u64,
    share: u32,
    shares: u32,
    written: Option<&[u64]>,
) -> Vec<(u64, u64)> {
    let is_written = |p: u64| {
        written
            .and_then(|w| w.get((p / 64) as usize))
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
    };
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut c = u64::from(share);
    while c * CHUNK_PAGES < pages {
        let (start, end) = (c * CHUNK_PAGES, ((c + 1) * CHUNK_PAGES).min(pages));
        c += u64::from(shares);
        let mut parts = Vec::new();
        let mut open: Option<u64> = None;
        for p in start..end {
            match (is_written(p), open) {
                (false, None) => open = Some(p),
                (true, Some(s)) => {
                    parts.push((s, p));
                    open = None;
                }
                _ => {}
            }
        }
        if let Some(s) = open {
            parts.push((s, end));
        }
        if parts.len() > MAX_RUNS_PER_CHUNK {
            parts = vec![(start, end)];
        }
        for (s, e) in parts {
            match runs.last_mut() {
                Some(last) if last.1 == s => last.1 = e,
                _ => runs.push((s, e)),
            }
        }
    }
    runs
}

/// Whether one fault may answer for `pages` pages: a power of two of at
/// most [`CHUNK_PAGES`] (so a group lies within one share).
pub fn valid_grain(pages: u64) -> bool {
    pages.is_power_of_two() && pages <= CHUNK_PAGES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_page_once_in_large_runs() {
        let pages = 5 * CHUNK_PAGES + 7;
        let mut count = vec![0u32; pages as usize];
        for share in 0..3 {
            for (s, e) in share_runs(pages, share, 3) {
                assert!(s < e && e <= pages);
                for p in s..e {
                    count[p as usize] += 1;
                }
            }
        }
        assert!(
            count.iter().all(|&c| c == 1),
            "each page in exactly one share"
        );
        assert_eq!(share_runs(pages, 0, 3), vec![(0, 512), (1536, 2048)]);
        assert_eq!(share_runs(pages, 2, 3), vec![(1024, 1536), (2560, 2567)]);
        assert_eq!(
            share_runs(pages, 0, 1),
            vec![(0, pages)],
            "one share: one run"
        );
        assert!(
            share_runs(100, 1, 8).is_empty(),
            "a small region sits some shares out"
        );
        for share in 0..3 {
            assert_eq!(arm_runs(pages, share, 3, None), share_runs(pages, share, 3));
        }
    }

    #[test]
    fn arm_skips_pages_just_written_unless_scattered() {
        let pages = 3 * CHUNK_PAGES;
        let mut written = vec![0u64; (pages / 64) as usize];
        let mut write = |p: u64| written[(p / 64) as usize] |= 1 << (p % 64);
        // Chunk 0: a written stretch in the middle; chunk 2: written
        // every other page at its start (too scattered to skip).
        (100..300).for_each(&mut write);
        (1024..1024 + 40).step_by(2).for_each(&mut write);
        assert_eq!(
            arm_runs(pages, 0, 2, Some(&written)),
            vec![(0, 100), (300, 512), (1024, 1536)]
        );
        assert_eq!(arm_runs(pages, 1, 2, Some(&written)), vec![(512, 1024)]);
    }

    #[test]
    fn grains_are_powers_of_two_within_a_chunk() {
        for ok in [1, 2, 64, CHUNK_PAGES] {
            assert!(valid_grain(ok), "{ok}");
        }
        for bad in [0, 3, 48, 2 * CHUNK_PAGES] {
            assert!(!valid_grain(bad), "{bad}");
        }
    }
}
