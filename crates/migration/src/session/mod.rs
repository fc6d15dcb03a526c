//! The session every mode runs in, on both sides: hello and version, the
//! layout check, the bulk connections, state transfer, verification and
//! Complete/Started, and the guard that decides what a failure leaves
//! behind. A mode adds its own phases in between (precopy: rounds with
//! barriers); see docs/architecture.md.

pub(crate) mod destination;
pub(crate) mod source;

pub(crate) use destination::{DestSession, DestinationPhases};
pub(crate) use source::SourceSession;

use crate::memory::RegionView;
use crate::protocol::Layout;

/// The layout both sides compare: regions and vCPUs.
pub(crate) fn layout_of(regions: &[RegionView], vcpus: u32) -> Layout {
    Layout {
        regions: regions.iter().map(|r| (r.gpa(), r.size())).collect(),
        vcpus,
    }
}

/// Per-page hashes of all memory, as the Verify message carries them.
pub(crate) fn hashes(
    regions: &[RegionView],
    data_ranges: impl Fn(usize) -> Vec<crate::ranges::OffsetBytes>,
) -> Vec<u64> {
    regions
        .iter()
        .enumerate()
        .flat_map(|(i, r)| crate::memory::region_hashes(r, &data_ranges(i)))
        .collect()
}
