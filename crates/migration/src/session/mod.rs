//! The session every mode runs in, on both sides: hello and version, the
//! layout check, the bulk connections, state transfer, verification and
//! Complete/Started, and the guard that decides what a failure leaves
//! behind. A mode adds its own phases in between (precopy: rounds with
//! barriers); see docs/architecture.md.

mod admission;
pub(crate) mod destination;
mod owner;
pub(crate) mod source;
pub(crate) mod state;

pub(crate) use destination::{DestSession, DestinationContext, DestinationMode};
pub(crate) use source::SourceSession;
pub(crate) use state::{DestPhase, SourcePhase};

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
    crate::memory::memory_hashes(regions, data_ranges)
}

/// Compares the source's hashes (a Verify body) with `mine`, page by page;
/// returns the pages compared. Missing or extra hashes fail it too.
pub(crate) fn compare_hashes(
    regions: &[RegionView],
    mine: &[u64],
    body: &[u8],
) -> Result<u64, crate::error::MigrationError> {
    let theirs = body
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()));
    let verify = |m: crate::memory::HashMismatch| crate::error::MigrationError::Verify {
        bad: m.bad,
        total: m.total,
        first: m.first,
    };
    let total = crate::memory::compare_page_hashes(regions, mine, theirs).map_err(verify)?;
    if !body.len().is_multiple_of(8) {
        return Err(verify(crate::memory::HashMismatch {
            bad: 0,
            total,
            first: 0,
        }));
    }
    Ok(total)
}
