//! Guest RAM as rust-vmm's `vm-memory` sees it, so the `virtio-queue` crate
//! can walk the rings: a `GuestMemoryMmap` over ferry's own memfd mappings
//! (no second mapping, nothing copied). Cheap because ferry's regions are
//! plain shared mappings with a guest address and a size each; the adapter
//! keeps an `Arc` of ferry's memory so the mappings outlive it.

use std::sync::Arc;

use ferry_memory::GuestMemory;
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

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

/// The adapter: vm-memory's view, and ferry's memory kept alive under it.
pub struct GuestRam {
    mem: Mem,
    _owner: Arc<GuestMemory>,
}

impl GuestRam {
    /// Describes `memory`'s regions to vm-memory.
    pub fn new(memory: Arc<GuestMemory>) -> Result<Self, AdaptError> {
        let mut regions = Vec::new();
        for r in memory.regions() {
            let err = |why: String| AdaptError::Region { gpa: r.gpa(), why };
            // SAFETY: the region's mapping is live, page-aligned, `size`
            // bytes, read-write and MAP_SHARED (ferry-memory maps every
            // region so), and `_owner` keeps it mapped for as long as this
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
            _owner: memory,
        })
    }

    /// vm-memory's view.
    pub fn mem(&self) -> &Mem {
        &self.mem
    }
}
