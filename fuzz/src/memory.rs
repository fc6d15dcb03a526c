//! Guest RAM for the targets: a few small regions on the heap, offered to
//! the engine as a [`PageStore`] so pages land through its real sinks
//! ([`DirectSink`](ferry_migration::sink::DirectSink)) and are read back
//! with the engine's own bounds-checked copies.

use ferry_migration::sink::PageStore;
use ferry_migration::RegionView;
use ferry_migration::{GpaPages, VmOpError};

/// The layout most targets use: 16 pages at 0, 8 pages at 1 MiB, and 4
/// pages just under 4 GiB (a region ending where 32-bit arithmetic wraps).
pub const LAYOUT: [(u64, u64); 3] = [
    (0, 16 * 4096),
    (0x10_0000, 8 * 4096),
    (0xffff_c000, 4 * 4096),
];

/// Heap memory in a guest layout.
pub struct Memory {
    /// (pointer, bytes) of each region's buffer, owned here.
    bufs: Vec<(*mut u8, usize)>,
    views: Vec<RegionView>,
}

// SAFETY: the buffers are plain heap memory owned by this value; every
// access goes through RegionView's raw copies, which the engine already
// shares between threads.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Memory {
    /// Zeroed memory in `layout` (gpa, bytes), each size a multiple of 4096.
    pub fn new(layout: &[(u64, u64)]) -> Memory {
        let mut bufs = Vec::new();
        let mut views = Vec::new();
        for &(gpa, size) in layout {
            let mut v = vec![0u8; size as usize].into_boxed_slice();
            let ptr = v.as_mut_ptr();
            std::mem::forget(v);
            bufs.push((ptr, size as usize));
            // SAFETY: `ptr .. ptr + size` is a live heap buffer owned by
            // this value until drop, which outlives every view handed out
            // (the targets drop the memory last).
            views.push(unsafe { RegionView::new(gpa, size, ptr) });
        }
        Memory { bufs, views }
    }

    /// Memory in [`LAYOUT`].
    pub fn standard() -> Memory {
        Memory::new(&LAYOUT)
    }

    /// The regions.
    pub fn views(&self) -> Vec<RegionView> {
        self.views.clone()
    }

    /// The page at `gpa`, if it lies in one region.
    pub fn page(&self, gpa: u64) -> Option<Vec<u8>> {
        let mut out = vec![0u8; 4096];
        self.views
            .iter()
            .any(|r| r.read(gpa, &mut out))
            .then_some(out)
    }

    /// Writes `data` at `gpa`; false if it does not fit one region.
    pub fn write(&self, gpa: u64, data: &[u8]) -> bool {
        self.views.iter().any(|r| r.write(gpa, data))
    }

    /// Every page address, region by region.
    pub fn page_addrs(&self) -> Vec<u64> {
        self.views
            .iter()
            .flat_map(|r| (0..r.pages()).map(move |i| r.gpa() + i * 4096))
            .collect()
    }

    /// A copy of all of memory, region by region.
    pub fn snapshot(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for r in &self.views {
            let mut b = vec![0u8; r.size() as usize];
            r.read(r.gpa(), &mut b);
            out.extend(b);
        }
        out
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        for &(ptr, len) in &self.bufs {
            // SAFETY: `ptr, len` came from a leaked Box<[u8]> of that length
            // made in `new`, freed once here.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) });
        }
    }
}

impl PageStore for Memory {
    fn regions(&self) -> Vec<RegionView> {
        self.views.clone()
    }

    fn discard(&self, run: GpaPages) -> Result<(), VmOpError> {
        let zeros = vec![0u8; 4096];
        for gpa in run.page_addrs() {
            if !self.write(gpa, &zeros) {
                return Err(format!("discard of {gpa:#x} outside memory").into());
            }
        }
        Ok(())
    }
}
