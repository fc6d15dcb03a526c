//! Guest RAM as the engine sees it: regions it may copy pages out of and
//! into, never a Rust reference into memory the guest writes concurrently.

use crate::ranges::{OffsetBytes, PAGE};

/// One guest RAM region: where it lives in guest physical space and in this
/// process. Every access is a raw copy of whole pages, bounds-checked.
#[derive(Clone, Copy, Debug)]
pub struct RegionView {
    gpa: u64,
    size: u64,
    host: *mut u8,
}

// SAFETY: a RegionView names a shared mapping that its creator keeps alive
// for as long as the view is used (the promise of `RegionView::new`); the
// engine only copies bytes in and out of it, and races with a running guest
// are what dirty tracking is for.
unsafe impl Send for RegionView {}
// SAFETY: as above: no method hands out a reference into the mapping.
unsafe impl Sync for RegionView {}

impl RegionView {
    /// A view of `size` bytes (whole pages) at host address `host`, holding
    /// guest physical addresses from `gpa`.
    ///
    /// # Safety
    /// `host .. host + size` must be a readable and writable mapping that
    /// stays mapped for as long as this view or a copy of it is used.
    pub unsafe fn new(gpa: u64, size: u64, host: *mut u8) -> Self {
        debug_assert!(size.is_multiple_of(PAGE));
        RegionView { gpa, size, host }
    }

    /// Guest physical base.
    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    /// Bytes (a multiple of 4 KiB).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Pages in the region.
    pub fn pages(&self) -> u64 {
        self.size / PAGE
    }

    /// True if `gpa` lies in this region.
    pub fn contains(&self, gpa: u64) -> bool {
        gpa >= self.gpa && gpa - self.gpa < self.size
    }

    /// True if `bytes` from `gpa` lie inside this region (checked arithmetic).
    pub fn contains_range(&self, gpa: u64, bytes: u64) -> bool {
        gpa.checked_sub(self.gpa)
            .and_then(|off| off.checked_add(bytes))
            .is_some_and(|end| end <= self.size)
    }

    /// The host address of `bytes` from guest address `gpa`, if inside.
    /// For the landing code that hands memory to read(2) or to the kernel.
    pub(crate) fn host_range(&self, gpa: u64, bytes: u64) -> Option<*mut u8> {
        self.contains_range(gpa, bytes)
            // SAFETY: the offset lies inside the mapping (checked above).
            .then(|| unsafe { self.host.add((gpa - self.gpa) as usize) })
    }

    /// The region's first host address (to register it with userfaultfd).
    pub(crate) fn host_start(&self) -> u64 {
        self.host as u64
    }

    /// The guest address of host address `host`, if it lies in this region
    /// (a fault address read from userfaultfd).
    pub(crate) fn gpa_of_host(&self, host: u64) -> Option<u64> {
        let off = host.checked_sub(self.host as u64)?;
        (off < self.size).then_some(self.gpa + off)
    }

    /// Copies `dst.len()` bytes from guest address `gpa` into `dst`; false
    /// (and nothing copied) if the range is not inside the region.
    pub fn read(&self, gpa: u64, dst: &mut [u8]) -> bool {
        let Some(src) = self.host_range(gpa, dst.len() as u64) else {
            return false;
        };
        // SAFETY: `src .. src + len` is inside the live mapping (checked);
        // `dst` is our own buffer and cannot overlap guest RAM. The guest
        // may write concurrently: the copy then holds a mix, which the dirty
        // log sends again.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// Copies `data` to guest address `gpa`; false (and nothing written) if
    /// the range is not inside the region.
    pub fn write(&self, gpa: u64, data: &[u8]) -> bool {
        let Some(dst) = self.host_range(gpa, data.len() as u64) else {
            return false;
        };
        // SAFETY: `dst .. dst + len` is inside the live mapping (checked).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        true
    }

    /// Appends page `index` of the region to `out` (nothing if the page
    /// lies beyond the region). This is the source's hottest copy: it goes
    /// straight into the vector's spare capacity, without zeroing it first.
    pub fn copy_page(&self, index: u64, out: &mut Vec<u8>) {
        let Some(src) = index
            .checked_mul(PAGE)
            .and_then(|off| self.host_range(self.gpa + off, PAGE))
        else {
            debug_assert!(false, "page {index} beyond the region");
            return;
        };
        out.reserve(PAGE as usize);
        let at = out.len();
        // SAFETY: `src` is a whole page inside the live mapping (checked);
        // `reserve` made room for PAGE bytes after `at`, which the copy
        // initializes before `set_len` exposes them. The guest may write the
        // page concurrently (the dirty log sends it again).
        unsafe {
            std::ptr::copy_nonoverlapping(src, out.as_mut_ptr().add(at), PAGE as usize);
            out.set_len(at + PAGE as usize);
        }
    }
}

/// True if `n` pages from `gpa` are whole pages inside one region (checked
/// arithmetic: the range comes from the wire).
pub(crate) fn range_inside(regions: &[RegionView], gpa: u64, n: u64) -> bool {
    gpa.is_multiple_of(PAGE)
        && n.checked_mul(PAGE).is_some_and(|l| {
            regions
                .iter()
                .any(|r| r.contains(gpa) && r.contains_range(gpa, l))
        })
}

/// The region of `regions` holding `gpa`.
pub fn region_of(regions: &[RegionView], gpa: u64) -> Option<(usize, &RegionView)> {
    regions.iter().enumerate().find(|(_, r)| r.contains(gpa))
}

/// True if every byte of `page` is zero.
pub fn is_zero(page: &[u8]) -> bool {
    page.chunks_exact(8).all(|c| c == [0u8; 8])
}

/// Per-page hashes of a region, reading only its data ranges (holes hash
/// as zero pages): both sides of a verified migration use this.
pub fn region_hashes(r: &RegionView, data: &[OffsetBytes]) -> Vec<u64> {
    let zero = crate::protocol::page_hash(&[0u8; PAGE as usize]);
    let mut out = vec![zero; r.pages() as usize];
    let mut page = vec![0u8; PAGE as usize];
    for d in data {
        for i in d.offset / PAGE..(d.end() / PAGE).min(r.pages()) {
            r.read(r.gpa() + i * PAGE, &mut page);
            out[i as usize] = crate::protocol::page_hash(&page);
        }
    }
    out
}

/// Per-page hashes of every region in order (what a verified move
/// compares on both sides).
pub fn memory_hashes(
    regions: &[RegionView],
    data_ranges: impl Fn(usize) -> Vec<OffsetBytes>,
) -> Vec<u64> {
    regions
        .iter()
        .enumerate()
        .flat_map(|(i, r)| region_hashes(r, &data_ranges(i)))
        .collect()
}

/// Pages whose hashes differ between two views of the same memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashMismatch {
    /// Pages that differ (or have no hash on the other side).
    pub bad: u64,
    /// Pages compared.
    pub total: u64,
    /// The first guest address that differs.
    pub first: u64,
}

/// Compares `theirs` with `mine` ([`memory_hashes`] of `regions`) page by
/// page; returns the pages compared. Missing or extra hashes fail it too.
pub fn compare_page_hashes(
    regions: &[RegionView],
    mine: &[u64],
    theirs: impl IntoIterator<Item = u64>,
) -> Result<u64, HashMismatch> {
    let mut theirs = theirs.into_iter();
    let gpas = regions
        .iter()
        .flat_map(|r| (0..r.pages()).map(move |i| r.gpa() + i * PAGE));
    let (mut bad, mut first) = (0u64, 0u64);
    for (h, gpa) in mine.iter().zip(gpas) {
        if theirs.next() != Some(*h) {
            if bad == 0 {
                first = gpa;
            }
            bad += 1;
        }
    }
    let total = mine.len() as u64;
    if bad > 0 || theirs.next().is_some() {
        return Err(HashMismatch { bad, total, first });
    }
    Ok(total)
}

/// All of region `index` as one range that may hold data (none if there is
/// no such region): what a VM says when it knows no better.
pub(crate) fn whole_region(
    regions: &[RegionView],
    index: usize,
) -> Vec<crate::ranges::OffsetBytes> {
    regions.get(index).map_or(Vec::new(), |r| {
        vec![crate::ranges::OffsetBytes::new(0, r.size())]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_bounds_checked() {
        let mut mem = vec![0u8; 4 * PAGE as usize];
        // SAFETY: `mem` outlives the view and is not moved while it is used.
        let r = unsafe { RegionView::new(0x10000, 4 * PAGE, mem.as_mut_ptr()) };
        assert!(r.write(0x11000, &[7u8; 4096]));
        assert!(!r.write(0x13001, &[7u8; 4096]), "past the end");
        assert!(!r.write(0xf000, &[7u8; 16]), "before the start");
        assert!(!r.contains_range(0x10000, u64::MAX), "overflow");
        let mut out = Vec::new();
        r.copy_page(1, &mut out);
        assert!(out.iter().all(|&b| b == 7));
        let mut small = [0u8; 8];
        assert!(r.read(0x11ff8, &mut small) && small == [7u8; 8]);
        assert!(!is_zero(&out) && is_zero(&[0u8; 4096]));
        let h = region_hashes(&r, &[OffsetBytes::new(0, 4 * PAGE)]);
        assert_eq!(h[0], h[2]);
        assert_ne!(h[0], h[1]);
    }
}
