//! Writes sampled like reads, for a caller that does not keep a full
//! dirty log: one page per group is armed, the dirty log watches only the
//! share armed last, and a write, like a read, stands until its share
//! comes round again.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::arm::drop_ptes;
use super::bits::{clear_bits, for_words};
use super::shares::share_runs;
use super::{AccessError, AccessTracker, ArmReport};
use crate::region::PAGE_SIZE;

impl AccessTracker {
    /// [`arm`](Self::arm) for a caller that samples writes too
    /// ([`end_period_sampled`](Self::end_period_sampled)): of each group
    /// of the share (see [`with_grain`](Self::with_grain)) only one page is
    /// armed, a different one each time the share comes round, and its
    /// fault marks the group read. Arming a page costs the guest a refault
    /// of it even when no userfaultfd fault follows (KVM drops its mapping
    /// with ours): arming all of a 512 MiB guest's share (16 Ki pages) cost
    /// a radix sort ~25% of its speed, one page per 64 a few percent.
    pub fn arm_sampled(&self) -> Result<ArmReport, AccessError> {
        let t = Instant::now();
        let mut p = self.lock();
        let share = p.take_share(self.share);
        let round = p.arms / u64::from(self.share);
        let (mut pages, mut runs) = (0, 0);
        for (range, seen) in self.ranges.iter().zip(&self.seen) {
            for (start, end) in share_runs(range.pages, share, self.share) {
                let mut group = start;
                while group < end {
                    let len = self.grain.min(end - group);
                    // Forget the last sample first: a fault after the
                    // madvise below is this sample's.
                    clear_bits(seen, group, group + len);
                    let page = group + sample_offset(round, group / self.grain, len);
                    drop_ptes(range.host + page * PAGE_SIZE, PAGE_SIZE)?;
                    pages += 1;
                    runs += 1;
                    group += len;
                }
            }
        }
        Ok(p.count_arm(t, pages, 0, runs))
    }

    /// Per range, the bits of the pages the next [`arm`](Self::arm) drops:
    /// the pages whose writes a caller that samples writes too should ask
    /// the dirty log to watch from now on.
    pub fn next_share_mask(&self) -> Vec<Vec<u64>> {
        let share = self.lock().next_share;
        self.ranges
            .iter()
            .map(|r| {
                let mut bits = vec![0u64; r.words()];
                for (start, end) in share_runs(r.pages, share, self.share) {
                    for_words(start, end, |word, mask| bits[word] |= mask);
                }
                bits
            })
            .collect()
    }

    /// Closes a period where writes are sampled like reads: the dirty log
    /// watched only the share armed last (see
    /// [`next_share_mask`](Self::next_share_mask)), so `dirty` counts for
    /// those pages alone (its other bits may be periods old) and, like a
    /// read, stands until the page's share is armed again. Otherwise as
    /// [`end_period`](Self::end_period).
    pub fn end_period_sampled(&self, dirty: &[Vec<u64>]) -> u64 {
        let armed = self.lock().armed_share;
        if let Some(share) = armed {
            for ((range, seen), dirty) in self.ranges.iter().zip(&self.seen).zip(dirty) {
                for (start, end) in share_runs(range.pages, share, self.share) {
                    for_words(start, end, |word, mask| {
                        let w = dirty.get(word).copied().unwrap_or(0) & mask;
                        seen[word].fetch_or(w, Ordering::Relaxed);
                    });
                }
            }
        }
        self.end_period(None)
    }
}

/// Which page of a group of `len` pages the `round`-th arm of its share
/// samples: spread over the group across rounds, and differing between
/// neighbouring groups so a strided access pattern is not missed forever.
fn sample_offset(round: u64, group: u64, len: u64) -> u64 {
    round
        .wrapping_mul(0x9e37_79b9)
        .wrapping_add(group.wrapping_mul(0x85eb_ca6b))
        .rotate_right(13)
        % len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_pages_move_round_by_round_and_differ_between_groups() {
        for round in 0..100 {
            for group in 0..100 {
                assert_eq!(sample_offset(round, group, 1), 0);
                assert!(sample_offset(round, group, 64) < 64);
                // A short last group (a region's tail) stays inside itself.
                assert!(sample_offset(round, group, 5) < 5);
            }
        }
        // Over as many rounds as it has pages, a group is sampled at most
        // of them (not the same page each time round).
        let pages: std::collections::HashSet<u64> =
            (0..64).map(|round| sample_offset(round, 5, 64)).collect();
        assert!(pages.len() >= 48, "only {} pages sampled", pages.len());
        // In one round, neighbouring groups sample different offsets, so a
        // stride of the group size is not missed forever.
        let offsets: std::collections::HashSet<u64> =
            (0..8).map(|group| sample_offset(0, group, 64)).collect();
        assert_eq!(offsets.len(), 8, "{offsets:?}");
    }
}
