//! Arming the phase at the start: all guest RAM registered with
//! userfaultfd (MISSING), the fault account over the plan, and the sink
//! that lands pages through userfaultfd, with every page outside the plan
//! counting as present. Apart from the hooks so that the present ranges
//! the sink starts from are tested without a VM.

use std::sync::Arc;

use ferry_memory::{Features, RegisterMode, Userfaultfd};

use super::super::fault_account::Tracker;
use super::super::pages::PageIndex;
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::ranges::{GpaPages, OffsetBytes};
use crate::sink::{LandPolicy, UffdSink};

/// What [`arm`] set up: the userfaultfd, the account, the sink.
pub(super) struct Armed {
    pub(super) uffd: Arc<Userfaultfd>,
    pub(super) tracker: Arc<Tracker>,
    pub(super) sink: Arc<UffdSink>,
}

/// Registers `regions` with a new userfaultfd and builds the account and
/// the sink for the pages `plan` says are still to come (`hashes`: this
/// side's page hashes, with verification).
pub(super) fn arm(
    regions: &[RegionView],
    plan: &[GpaPages],
    hashes: Option<Vec<u64>>,
) -> Result<Armed, MigrationError> {
    let uffd = Arc::new(
        Userfaultfd::new(Features {
            missing_shmem: true,
            thread_id: true,
            ..Default::default()
        })
        .map_err(|e| MigrationError::Unsupported(format!("postcopy needs userfaultfd: {e}")))?,
    );
    for r in regions {
        uffd.register(
            r.host_start(),
            r.size(),
            RegisterMode {
                missing: true,
                ..Default::default()
            },
        )
        .map_err(|e| {
            MigrationError::Unsupported(format!("postcopy needs userfaultfd on guest RAM: {e}"))
        })?;
    }
    let index = PageIndex::new(regions);
    let tracker = Arc::new(Tracker::new(index, plan, hashes));
    // Every page but the pending ones counts as present for the sink.
    let present = present_ranges(regions, plan);
    let sink = Arc::new(
        UffdSink::new(
            uffd.clone(),
            regions.to_vec(),
            &present,
            LandPolicy::KeepFirst,
        )
        .with_observer(tracker.clone()),
    );
    Ok(Armed {
        uffd,
        tracker,
        sink,
    })
}

/// Per region, the ranges outside `pending` (present for the sink).
fn present_ranges(regions: &[RegionView], pending: &[GpaPages]) -> Vec<Vec<OffsetBytes>> {
    let mut sorted = pending.to_vec();
    sorted.sort_unstable();
    regions
        .iter()
        .map(|r| {
            let mut out = Vec::new();
            let mut at = 0u64;
            for run in sorted.iter().filter(|p| r.contains(p.gpa)) {
                let off = run.gpa - r.gpa();
                if off > at {
                    out.push(OffsetBytes::new(at, off - at));
                }
                at = at.max(off + run.bytes());
            }
            if at < r.size() {
                out.push(OffsetBytes::new(at, r.size() - at));
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ranges::PAGE;

    fn regions() -> [RegionView; 2] {
        // SAFETY: only the views' address ranges are used, never their memory.
        unsafe {
            [
                RegionView::new(0, 16 * PAGE, std::ptr::null_mut()),
                RegionView::new(1 << 32, 8 * PAGE, std::ptr::null_mut()),
            ]
        }
    }

    fn bytes(offset_pages: u64, pages: u64) -> OffsetBytes {
        OffsetBytes::new(offset_pages * PAGE, pages * PAGE)
    }

    #[test]
    fn nothing_pending_leaves_every_region_present() {
        let r = regions();
        assert_eq!(
            present_ranges(&r, &[]),
            vec![vec![bytes(0, 16)], vec![bytes(0, 8)]]
        );
    }

    #[test]
    fn pending_runs_are_cut_out_of_their_own_region_in_any_order() {
        let r = regions();
        let hi = 1u64 << 32;
        let pending = [
            GpaPages::new(hi + 7 * PAGE, 1), // the second region's last page
            GpaPages::new(10 * PAGE, 2),
            GpaPages::new(0, 3), // the first region's start
            GpaPages::new(hi + 2 * PAGE, 1),
        ];
        assert_eq!(
            present_ranges(&r, &pending),
            vec![
                vec![bytes(3, 7), bytes(12, 4)],
                vec![bytes(0, 2), bytes(3, 4)],
            ]
        );
    }

    #[test]
    fn overlapping_and_adjacent_runs_leave_no_empty_or_doubled_range() {
        let r = regions();
        let pending = [
            GpaPages::new(2 * PAGE, 4),
            GpaPages::new(3 * PAGE, 1), // inside the one before
            GpaPages::new(6 * PAGE, 2), // right after it
            GpaPages::new(8 * PAGE, 8), // to the region's end
        ];
        assert_eq!(
            present_ranges(&r, &pending),
            vec![vec![bytes(0, 2)], vec![bytes(0, 8)]]
        );
    }

    #[test]
    fn a_region_wholly_pending_has_nothing_present() {
        let r = regions();
        let pending = [GpaPages::new(1 << 32, 8)];
        assert_eq!(
            present_ranges(&r, &pending),
            vec![vec![bytes(0, 16)], vec![]]
        );
    }
}
