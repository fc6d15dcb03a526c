//! The destination's index of the pages its host's other VMs hold: built
//! once per migration under a fresh seed, offered by key, and consulted as
//! references arrive.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use ferry_memory::PeerRegion;

use super::{key, page_id, MAX_OFFER_KEYS};
use crate::memory::is_zero;
use crate::protocol::PAGE;

/// Bytes a build thread reads at a time.
const STRETCH: u64 = 4 << 20;
/// The longest an index build takes: what is hashed by then is offered
/// (the source waits for the offer under its control timeout).
pub const BUILD_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Other VMs' RAM on this host, by page key.
pub struct SiblingIndex {
    regions: Vec<PeerRegion>,
    /// Key → (region, byte offset) of the first page found with it.
    at: HashMap<u64, (u32, u64)>,
}

impl SiblingIndex {
    /// Hashes every page with data in `regions` (zero pages travel as
    /// ranges anyway) under `seed`, on as many threads as the host has
    /// cores (up to 4), until [`MAX_OFFER_KEYS`] keys or [`BUILD_LIMIT`]:
    /// the source waits for the offer before its first page.
    pub fn build(regions: Vec<PeerRegion>, seed: u64) -> Self {
        // Every stretch with data, dealt to the threads.
        let mut stretches: Vec<(u32, u64, u64)> = Vec::new();
        for (i, r) in regions.iter().enumerate() {
            for (start, len) in r.data_ranges() {
                for at in (start..start + len).step_by(STRETCH as usize) {
                    stretches.push((i as u32, at, (start + len - at).min(STRETCH)));
                }
            }
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 4)
            .min(stretches.len().max(1));
        let until = std::time::Instant::now() + BUILD_LIMIT;
        // Keys found by all threads (a thread's repeats count too: a bound,
        // not a tally).
        let found = std::sync::atomic::AtomicUsize::new(0);
        let parts: Vec<HashMap<u64, (u32, u64)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (regions, stretches, found) = (&regions, &stretches, &found);
                    s.spawn(move || {
                        let mut at = HashMap::new();
                        let mut buf = vec![0u8; STRETCH as usize];
                        for &(i, start, len) in stretches.iter().skip(t).step_by(threads) {
                            let buf = &mut buf[..len as usize];
                            if found.load(Ordering::Relaxed) >= MAX_OFFER_KEYS
                                || std::time::Instant::now() > until
                            {
                                break;
                            }
                            if !regions[i as usize].read_pages(start, buf) {
                                continue;
                            }
                            let before = at.len();
                            for (k, page) in buf.chunks_exact(PAGE).enumerate() {
                                if !is_zero(page) {
                                    let off = start + (k * PAGE) as u64;
                                    at.entry(key(page, seed)).or_insert((i, off));
                                }
                            }
                            found.fetch_add(at.len() - before, Ordering::Relaxed);
                        }
                        at
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut at: HashMap<u64, (u32, u64)> = HashMap::new();
        for part in parts {
            for (k, v) in part {
                if at.len() >= MAX_OFFER_KEYS {
                    break;
                }
                at.entry(k).or_insert(v);
            }
        }
        SiblingIndex { regions, at }
    }

    /// Every key, ascending (what the offer carries).
    pub fn keys(&self) -> Vec<u64> {
        let mut k: Vec<u64> = self.at.keys().copied().collect();
        k.sort_unstable();
        k
    }

    /// Copies the page `key` names into `out`; true only if what was copied
    /// is the page `id` names (the other VM may have changed it since).
    pub(crate) fn resolve(&self, key: u64, id: &[u8; 16], out: &mut [u8; PAGE]) -> bool {
        let Some(&(r, off)) = self.at.get(&key) else {
            return false;
        };
        self.regions[r as usize].copy_page(off, out) && page_id(out) == *id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_memory::MemfdRegion;

    #[test]
    fn a_page_resolves_only_while_it_still_holds_what_was_referenced() {
        let owner = MemfdRegion::new("other-vm", 0, 8 * PAGE as u64).unwrap();
        let page = |i: usize| owner.host_addr().wrapping_add(i * PAGE);
        for i in [1usize, 4] {
            // SAFETY: pages 1 and 4 of the owner's live mapping.
            unsafe { std::ptr::write_bytes(page(i), i as u8 + 10, PAGE) };
        }
        // Page 6 is written as zeros: it holds data, but is not indexed.
        // SAFETY: page 6 of the mapping.
        unsafe { std::ptr::write_bytes(page(6), 0, PAGE) };
        let fd = owner.fd().try_clone_to_owned().unwrap();
        let idx = SiblingIndex::build(
            vec![PeerRegion::open("peer", 8 * PAGE as u64, fd).unwrap()],
            7,
        );
        assert_eq!(idx.keys().len(), 2);
        let want = [11u8; PAGE];
        let (k, id) = (key(&want, 7), page_id(&want));
        assert!(idx.keys().contains(&k));
        let mut out = [0u8; PAGE];
        assert!(idx.resolve(k, &id, &mut out));
        assert_eq!(out, want);
        // The other VM writes the page: the reference misses.
        // SAFETY: page 1 of the mapping.
        unsafe { *page(1) = 0 };
        assert!(!idx.resolve(k, &id, &mut out));
        // A key it never offered, or a key with someone else's id.
        assert!(!idx.resolve(k ^ 1, &id, &mut out));
        let other = [14u8; PAGE];
        assert!(!idx.resolve(key(&other, 7), &id, &mut out));
        assert!(idx.resolve(key(&other, 7), &page_id(&other), &mut out));
    }
}
