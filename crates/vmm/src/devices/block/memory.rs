//! Guest RAM as rust-vmm's `vm-memory` sees it, so the `virtio-queue` crate
//! can walk the rings: a `GuestMemoryMmap` over ferry's own memfd mappings
//! (no second mapping, nothing copied). Cheap because ferry's regions are
//! plain shared mappings with a guest address and a size each; the adapter
//! keeps an `Arc` of ferry's memory so the mappings outlive it.

use std::sync::Arc;

use ferry_memory::GuestMemory;
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

const PAGE: u64 = 4096;

/// Guest memory for the virtio code.
pub type Mem = GuestMemoryMmap<()>;

/// Why the adapter could not be made.
#[derive(Debug, thiserror::Error)]
pub enum AdaptError {
    /// vm-memory refused a region.
    #[error("guest memory region at {gpa:#x} cannot be described to vm-memory: {why}")]
    Region {
        /// Where the region starts.
        gpa: u64,
        /// vm-memory's reason.
        why: String,
    },
}

/// Told of the pages a device wrote into guest RAM (region index, first
/// page, pages): KVM's dirty log sees only the guest's own writes, and a
/// migration must send these again too.
pub type WriteMarker = Arc<dyn Fn(usize, u64, u64) + Send + Sync>;

/// The adapter: vm-memory's view, and ferry's memory kept alive under it.
pub struct GuestRam {
    mem: Mem,
    owner: Arc<GuestMemory>,
    marker: Option<WriteMarker>,
}

impl GuestRam {
    /// Describes `memory`'s regions to vm-memory.
    pub fn new(memory: Arc<GuestMemory>) -> Result<Self, AdaptError> {
        let mut regions = Vec::new();
        for r in memory.regions() {
            let err = |why: String| AdaptError::Region { gpa: r.gpa(), why };
            // SAFETY: the region's mapping is live, page-aligned, `size`
            // bytes, read-write and MAP_SHARED (ferry-memory maps every
            // region so), and `owner` keeps it mapped for as long as this
            // adapter exists; vm-memory does not unmap a raw region.
            let mapping = unsafe {
                MmapRegion::build_raw(
                    r.host_addr(),
                    r.size() as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                )
            }
            .map_err(|e| err(e.to_string()))?;
            let region = GuestRegionMmap::new(mapping, GuestAddress(r.gpa()))
                .ok_or_else(|| err("it wraps past the end of the address space".into()))?;
            regions.push(region);
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(|e| AdaptError::Region {
            gpa: 0,
            why: e.to_string(),
        })?;
        Ok(GuestRam {
            mem,
            owner: memory,
            marker: None,
        })
    }

    /// The same, telling `marker` of every write the device makes.
    pub fn with_marker(mut self, marker: Option<WriteMarker>) -> Self {
        self.marker = marker;
        self
    }

    /// The device wrote `len` bytes at guest address `gpa`.
    pub fn wrote(&self, gpa: u64, len: u64) {
        let Some(mark) = &self.marker else { return };
        if len == 0 {
            return;
        }
        for (i, r) in self.owner.regions().iter().enumerate() {
            if gpa >= r.gpa() && gpa < r.gpa() + r.size() {
                let off = gpa - r.gpa();
                let end = (off + len).min(r.size());
                let first = off / PAGE;
                mark(i, first, (end - 1) / PAGE + 1 - first);
                return;
            }
        }
    }

    /// The device wrote `len` bytes at host address `ptr`, inside guest RAM.
    pub fn wrote_host(&self, ptr: *const u8, len: usize) {
        if self.marker.is_none() {
            return;
        }
        let at = ptr as u64;
        for r in self.owner.regions() {
            let host = r.host_addr() as u64;
            if at >= host && at < host + r.size() {
                self.wrote(r.gpa() + (at - host), len as u64);
                return;
            }
        }
    }

    /// vm-memory's view.
    pub fn mem(&self) -> &Mem {
        &self.mem
    }
}
