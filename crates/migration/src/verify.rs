//! `--verify` without hashing guest memory in the pause (protocol v12).
//!
//! Each side keeps one hash per guest page: the source of every page as it
//! sends it (hashed in the batch, while the copy is in cache), the
//! destination of every page as it lands (through [`HashingSink`]). Pages
//! not sent yet hash as zero pages on both sides, as their memory reads.
//!
//! - In the pause, the two tables are compared by their digests, one per
//!   4096 pages: what landed is what was sent, page for page, for a few
//!   hundred bytes on the wire and no pass over memory. A mismatch fails
//!   the migration before the VM starts there.
//! - After the destination started the VM, the source hashes its memory,
//!   frozen since the pause, against what it sent: a page the guest wrote
//!   after its last send without being sent again (a hole in the dirty
//!   log) fails the migration then, with the VM kept paused here, whole.
//!
//! A digest adds each page's entry by XOR (a zero page adds nothing), so
//! setting a page again is two XORs and the tables never have to be walked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::error::MigrationError;
use crate::memory::{HashMismatch, RegionView};
use crate::postcopy::pages::PageIndex;
use crate::protocol::{page_hash, Frame, Kind};
use crate::ranges::{GpaPages, PAGE};
use crate::sink::{InPlace, PageSink, SinkError};

/// Pages one digest covers (16 MiB of guest memory).
pub(crate) const DIGEST_PAGES: u64 = 4096;

/// The hash of a page of zeros.
pub(crate) fn zero_hash() -> u64 {
    static ZERO: OnceLock<u64> = OnceLock::new();
    *ZERO.get_or_init(|| page_hash(&[0u8; PAGE as usize]))
}

/// Page `n`'s share of its digest when it hashes to `h` (a zero page's is
/// 0, so fresh memory digests to 0).
fn entry(n: u64, h: u64) -> u64 {
    if h == zero_hash() {
        0
    } else {
        mix(h ^ mix(n.wrapping_add(0x9e37_79b9_7f4a_7c15)))
    }
}

/// splitmix64's finalizer: every input bit moves every output bit.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Where two sides' tables differ, by digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DigestMismatch {
    /// Digests (of [`DIGEST_PAGES`] pages each) that differ.
    pub digests: u64,
    /// Digests compared.
    pub total: u64,
    /// The first guest address of the first one that differs.
    pub first: u64,
}

/// One hash per guest page, and their digests.
pub(crate) struct PageHashes {
    index: PageIndex,
    hashes: Vec<AtomicU64>,
    digests: Vec<AtomicU64>,
}

impl PageHashes {
    /// Every page of `regions` as a zero page.
    pub(crate) fn new(regions: &[RegionView]) -> Self {
        let index = PageIndex::new(regions);
        let total = index.total();
        PageHashes {
            hashes: (0..total).map(|_| AtomicU64::new(zero_hash())).collect(),
            digests: (0..total.div_ceil(DIGEST_PAGES))
                .map(|_| AtomicU64::new(0))
                .collect(),
            index,
        }
    }

    /// Page `gpa` now hashes to `h` (a page outside guest RAM is ignored:
    /// the landing checks refuse it first).
    pub(crate) fn set(&self, gpa: u64, h: u64) {
        let Some(n) = self.index.page_of(gpa) else {
            return;
        };
        let old = self.hashes[n as usize].swap(h, Ordering::AcqRel);
        if old != h {
            self.digests[(n / DIGEST_PAGES) as usize]
                .fetch_xor(entry(n, old) ^ entry(n, h), Ordering::AcqRel);
        }
    }

    /// Every page of `run` is now zero.
    pub(crate) fn set_zero(&self, run: GpaPages) {
        for gpa in run.page_addrs() {
            self.set(gpa, zero_hash());
        }
    }

    /// Hashes each page of `data` (landed or sent at `run`).
    pub(crate) fn set_pages(&self, run: GpaPages, data: &[u8]) {
        for (gpa, page) in run.page_addrs().zip(data.chunks_exact(PAGE as usize)) {
            self.set(gpa, page_hash(page));
        }
    }

    /// The digests, in page order.
    pub(crate) fn digests(&self) -> Vec<u64> {
        self.digests
            .iter()
            .map(|d| d.load(Ordering::Acquire))
            .collect()
    }

    /// Compares the peer's digests with this side's; the pages covered.
    pub(crate) fn compare(&self, theirs: &[u64]) -> Result<u64, DigestMismatch> {
        let mine = self.digests();
        let differ: Vec<usize> = (0..mine.len().max(theirs.len()))
            .filter(|&i| mine.get(i) != theirs.get(i))
            .collect();
        match differ.first() {
            None => Ok(self.index.total()),
            Some(&i) => Err(DigestMismatch {
                digests: differ.len() as u64,
                total: mine.len() as u64,
                first: self.index.gpa_of(i as u64 * DIGEST_PAGES),
            }),
        }
    }

    /// Holds a VerifyDigests frame from the peer against this side's
    /// digests; the pages covered, or the refusal that names the first
    /// stretch that differs.
    pub(crate) fn check_digests(&self, f: &Frame) -> Result<u64, MigrationError> {
        let theirs: Vec<u64> = crate::protocol::decode(f, Kind::VerifyDigests)?;
        self.compare(&theirs)
            .map_err(|m| MigrationError::VerifyLanded {
                digests: m.digests,
                total: m.total,
                first: m.first,
            })
    }

    /// Hashes `regions` (this side's memory, frozen) page by page against
    /// the table; the pages compared.
    pub(crate) fn check_memory(
        &self,
        regions: &[RegionView],
        data_ranges: impl Fn(usize) -> Vec<crate::ranges::OffsetBytes>,
    ) -> Result<u64, HashMismatch> {
        let now = crate::memory::memory_hashes(regions, data_ranges);
        crate::memory::compare_page_hashes(
            regions,
            &now,
            self.hashes.iter().map(|h| h.load(Ordering::Acquire)),
        )
    }
}

/// A sink that hashes every page it lands into a [`PageHashes`] (the
/// destination's side of a verified migration).
pub(crate) struct HashingSink<'a> {
    pub(crate) inner: &'a dyn PageSink,
    pub(crate) hashes: &'a PageHashes,
}

impl PageSink for HashingSink<'_> {
    fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), SinkError> {
        self.inner.write(run, data)?;
        self.hashes.set_pages(run, data);
        Ok(())
    }

    fn zero(&self, run: GpaPages) -> Result<(), SinkError> {
        self.inner.zero(run)?;
        self.hashes.set_zero(run);
        Ok(())
    }

    fn in_place(&self, run: GpaPages) -> Option<InPlace<'_>> {
        self.inner.in_place(run)
    }

    fn landed(&self, run: GpaPages, data: &[u8]) {
        self.inner.landed(run, data);
        self.hashes.set_pages(run, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pages: u64) -> (PageHashes, Vec<u8>) {
        let mut mem = vec![0u8; (pages * PAGE) as usize];
        // SAFETY: the view is only used for its addresses here.
        let r = [unsafe { RegionView::new(0x10_0000, pages * PAGE, mem.as_mut_ptr()) }];
        (PageHashes::new(&r), mem)
    }

    #[test]
    fn the_same_pages_set_in_any_order_give_the_same_digests() {
        let (a, _ma) = table(3 * DIGEST_PAGES);
        let (b, _mb) = table(3 * DIGEST_PAGES);
        assert_eq!(a.digests(), vec![0; 3], "fresh memory digests to 0");
        let page = |x: u8| vec![x; PAGE as usize];
        let at = |n: u64| 0x10_0000 + n * PAGE;
        // a: page 5 twice (the later copy counts), page 5000 once.
        a.set_pages(GpaPages::new(at(5), 1), &page(1));
        a.set_pages(GpaPages::new(at(5000), 1), &page(2));
        a.set_pages(GpaPages::new(at(5), 1), &page(3));
        // b: the same end state, another way round, with a zero run on the way.
        b.set_pages(GpaPages::new(at(5000), 1), &page(2));
        b.set_pages(GpaPages::new(at(4), 2), &[page(9), page(9)].concat());
        b.set_zero(GpaPages::new(at(4), 1));
        b.set_pages(GpaPages::new(at(5), 1), &page(3));
        assert_eq!(a.compare(&b.digests()), Ok(3 * DIGEST_PAGES));
        // One page apart: its digest, and only its, differs.
        b.set_pages(GpaPages::new(at(2 * DIGEST_PAGES + 7), 1), &page(4));
        let e = a.compare(&b.digests()).unwrap_err();
        assert_eq!((e.digests, e.first), (1, at(2 * DIGEST_PAGES)));
        // A page set back to zero adds nothing again.
        b.set_zero(GpaPages::new(at(2 * DIGEST_PAGES + 7), 1));
        assert_eq!(a.compare(&b.digests()), Ok(3 * DIGEST_PAGES));
        // A table of another size never matches.
        assert!(a.compare(&b.digests()[..2]).is_err());
    }

    #[test]
    fn memory_that_changed_after_it_was_hashed_is_found() {
        let (t, mut mem) = table(8);
        mem[3 * PAGE as usize] = 1;
        // SAFETY: `mem` outlives the views.
        let r = [unsafe { RegionView::new(0x10_0000, 8 * PAGE, mem.as_mut_ptr()) }];
        let all = |_| vec![crate::ranges::OffsetBytes::new(0, 8 * PAGE)];
        // Page 3 was never recorded: its memory is not a zero page.
        let e = t.check_memory(&r, all).unwrap_err();
        assert_eq!((e.bad, e.first), (1, 0x10_0000 + 3 * PAGE));
        t.set_pages(
            GpaPages::new(0x10_0000 + 3 * PAGE, 1),
            &mem[3 * PAGE as usize..4 * PAGE as usize],
        );
        assert_eq!(t.check_memory(&r, all), Ok(8));
    }
}
