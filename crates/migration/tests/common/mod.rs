//! What the engine tests share: guest memory on memfds, seen the way a
//! VMM shows it to the engine.
// Each test file uses its own subset of these.
#![allow(dead_code)]

use ferry_memory::MemfdRegion;
use ferry_migration::{GpaPages, OffsetBytes, RegionView, VmOpError};

/// Fresh memfd regions in `layout` ((gpa, bytes) each).
pub fn memfd_regions(name: &str, layout: &[(u64, u64)]) -> Vec<MemfdRegion> {
    layout
        .iter()
        .map(|&(gpa, size)| MemfdRegion::new(name, gpa, size).unwrap())
        .collect()
}

/// The engine's views of `regions` (PageStore::regions).
pub fn views(regions: &[MemfdRegion]) -> Vec<RegionView> {
    regions
        .iter()
        // SAFETY: callers keep the regions alive as long as the views.
        .map(|r| unsafe { RegionView::new(r.gpa(), r.size(), r.host_addr()) })
        .collect()
}

/// The parts of region `index` that hold data (PageStore::data_ranges).
pub fn data_ranges(regions: &[MemfdRegion], index: usize) -> Vec<OffsetBytes> {
    regions[index]
        .data_ranges()
        .into_iter()
        .map(|(o, l)| OffsetBytes::new(o, l))
        .collect()
}

/// Punches `run` out of the region holding it (PageStore::discard).
pub fn discard(regions: &[MemfdRegion], run: GpaPages) -> Result<(), VmOpError> {
    let r = regions
        .iter()
        .find(|r| r.contains(run.gpa, run.bytes()))
        .ok_or("outside")?;
    Ok(r.punch_hole(run.gpa - r.gpa(), run.bytes())?)
}
