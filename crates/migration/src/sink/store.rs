//! The memory a sink lands pages in, as the VMM (or a memory server)
//! offers it: the page part of a destination. A trait of the sink's, so the
//! landing seam depends on nothing above it; `vm.rs` re-exports it beside
//! the VM traits.

use crate::memory::RegionView;
use crate::ranges::{GpaBytes, GpaPages, OffsetBytes};
use crate::vm_error::VmOpError;

/// Memory that receives pages: the page part of a destination.
pub trait PageStore: Send + Sync {
    /// Guest RAM regions.
    fn regions(&self) -> Vec<RegionView>;
    /// As [`crate::vm::MigratableVm::data_ranges`].
    fn data_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        crate::memory::whole_region(&self.regions(), index)
    }
    /// The parts of region `index` that may hold non-zero bytes before the
    /// migration writes anything (what the VMM itself wrote); zero ranges
    /// from the source clear only these and the pages the migration wrote.
    /// Memory populated with zeros (preallocation) belongs outside them.
    fn nonzero_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        self.data_ranges(index)
    }
    /// Guest ranges the VMM's devices may write at any time, even while the
    /// VM waits for its migration (a device posting requests): zero ranges
    /// always clear them.
    fn device_written_ranges(&self) -> Vec<GpaBytes> {
        Vec::new()
    }
    /// Makes pages read as zeros, giving their memory back where it can.
    fn discard(&self, run: GpaPages) -> Result<(), VmOpError>;
}
