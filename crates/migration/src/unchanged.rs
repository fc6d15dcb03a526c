//! Pages dirtied without being changed: precopy's rounds do not send them.
//!
//! The dirty log says a page was written, not that its bytes differ from
//! what the destination holds. Many writes leave a page as it was: a lock
//! taken and released (a kv store's GETs take one per entry: ~90% of its
//! requests dirty a page and change nothing), a counter raised and lowered,
//! a buffer rewritten with the same bytes. On the lab's 1 Gbit link such a
//! guest dirtied ~0.8 of what each round could send, so its rounds barely
//! shrank and auto-converge had to throttle it.
//!
//! The sender keeps one key per guest page: the hash (XXH3-64) of the bytes
//! it last sent there, or 0 for "unknown". A dirty page whose copy hashes
//! to its key is the destination's already, and is left out of the round.
//! Everything that can make the destination's page differ from the last
//! bytes sent forgets the key: a page sent by reference (the reference may
//! miss) and a hole sent as zeros.
//!
//! A changed page is taken for unchanged only if its new bytes collide with
//! its old ones in 64 bits (about 2^-64 per page). A guest that forged such
//! a collision would only damage its own memory, as it could by writing it.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::memory::RegionView;
use crate::postcopy::pages::PageIndex;
use crate::ranges::GpaPages;

/// Per guest page: the key of the bytes last sent there (0: unknown).
pub(crate) struct SentContent {
    index: PageIndex,
    keys: Vec<AtomicU64>,
}

impl std::fmt::Debug for SentContent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentContent")
            .field("pages", &self.keys.len())
            .finish()
    }
}

/// A page hash as a key: never 0, which means unknown (a hash of 0 shares
/// its key with a hash of 1).
fn key(hash: u64) -> u64 {
    hash.max(1)
}

impl SentContent {
    /// Nothing known of any page of `regions`.
    pub(crate) fn new(regions: &[RegionView]) -> Self {
        let index = PageIndex::new(regions);
        SentContent {
            keys: (0..index.total()).map(|_| AtomicU64::new(0)).collect(),
            index,
        }
    }

    fn slot(&self, gpa: u64) -> Option<&AtomicU64> {
        self.index
            .page_of(gpa)
            .and_then(|n| self.keys.get(n as usize))
    }

    /// True if the bytes last sent to page `gpa` hash to `hash`: the
    /// destination holds them, and they need not go again.
    pub(crate) fn holds(&self, gpa: u64, hash: u64) -> bool {
        self.slot(gpa)
            .is_some_and(|k| k.load(Ordering::Acquire) == key(hash))
    }

    /// Page `gpa` goes now as bytes that hash to `hash`.
    pub(crate) fn record(&self, gpa: u64, hash: u64) {
        if let Some(k) = self.slot(gpa) {
            k.store(key(hash), Ordering::Release);
        }
    }

    /// What the destination holds at page `gpa` is no longer known.
    pub(crate) fn forget(&self, gpa: u64) {
        if let Some(k) = self.slot(gpa) {
            k.store(0, Ordering::Release);
        }
    }

    /// [`Self::forget`] for every page of `runs`.
    pub(crate) fn forget_runs(&self, runs: &[GpaPages]) {
        for run in runs {
            run.page_addrs().for_each(|gpa| self.forget(gpa));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ranges::PAGE;

    #[test]
    fn a_page_is_held_only_as_last_sent_until_forgotten() {
        // SAFETY: only the views' address ranges are used, never memory.
        let regions = unsafe {
            [
                RegionView::new(0, 4 * PAGE, std::ptr::null_mut()),
                RegionView::new(1 << 32, 4 * PAGE, std::ptr::null_mut()),
            ]
        };
        let t = SentContent::new(&regions);
        let high = (1 << 32) + PAGE;
        assert!(!t.holds(high, 7), "nothing sent yet: unknown");
        assert!(!t.holds(high, 0), "unknown is not the hash 0");
        t.record(high, 7);
        assert!(t.holds(high, 7));
        assert!(!t.holds(high, 8), "changed bytes go again");
        assert!(!t.holds(PAGE, 7), "another page knows nothing of it");
        t.record(high, 0);
        assert!(t.holds(high, 0), "a hash of 0 is a key too");
        t.record(2 * PAGE, 5);
        t.forget_runs(&[GpaPages::new(PAGE, 2), GpaPages::new(1 << 32, 2)]);
        assert!(!t.holds(2 * PAGE, 5) && !t.holds(high, 0));
        // Outside guest RAM: never held, and recording it changes nothing.
        t.record(64 * PAGE, 3);
        assert!(!t.holds(64 * PAGE, 3));
    }
}
