//! A paused VM's memory as the standby holds it: the pages its source sent
//! at the switch, in memfd regions laid out as the guest's, and the page
//! hashes when verifying. To the postcopy engine it is a VM that is
//! paused for good, so the source's own resume path serves from it.

use ferry_memory::GuestMemory;

use crate::memory::RegionView;
use crate::ranges::{GpaBytes, GpaPages};
use crate::sink::{PageSink, SinkError};
use crate::vm::MigratableVm;
use crate::vm_error::VmOpError;

/// Guest RAM beyond this is refused (a plan names its own layout).
pub(crate) const MAX_IMAGE_BYTES: u64 = 1 << 40;
/// Regions beyond this are refused.
pub(crate) const MAX_REGIONS: usize = 64;

/// The held memory.
pub(crate) struct Image {
    memory: GuestMemory,
    /// Per-page hashes from the source (in its order), when verifying.
    pub(crate) hashes: Option<Vec<u64>>,
}

impl Image {
    /// Fresh (zero) memory laid out as `layout`, after checking it: page
    /// aligned, in order, not overlapping, within the limits.
    pub(crate) fn new(layout: &[(u64, u64)]) -> Result<Image, String> {
        if layout.is_empty() || layout.len() > MAX_REGIONS {
            return Err(format!(
                "a layout of {} regions (1 to {MAX_REGIONS})",
                layout.len()
            ));
        }
        let mut total = 0u64;
        let mut end = 0u64;
        for &(gpa, size) in layout {
            let page = crate::ranges::PAGE;
            if size == 0 || !gpa.is_multiple_of(page) || !size.is_multiple_of(page) || gpa < end {
                return Err(format!(
                    "region {gpa:#x} + {size:#x} is empty, unaligned or out of order"
                ));
            }
            end = gpa.checked_add(size).ok_or("a region wraps")?;
            total = total.checked_add(size).ok_or("the layout wraps")?;
        }
        if total > MAX_IMAGE_BYTES {
            return Err(format!(
                "{total} bytes of guest RAM (at most {MAX_IMAGE_BYTES})"
            ));
        }
        let memory = GuestMemory::new(layout).map_err(|e| e.to_string())?;
        Ok(Image {
            memory,
            hashes: None,
        })
    }

    fn views(&self) -> Vec<RegionView> {
        self.memory
            .regions()
            .iter()
            // SAFETY: each view covers one live memfd mapping of `memory`,
            // which outlives every use of the views (they are taken for
            // the hold and the resume, both inside the image's life).
            .map(|r| unsafe { RegionView::new(r.gpa(), r.size(), r.host_addr()) })
            .collect()
    }

    /// Where received pages land.
    pub(crate) fn sink(&self) -> ImageSink {
        ImageSink {
            regions: self.views(),
        }
    }
}

/// Lands pages in the image by copies; zero pages are already zero.
pub(crate) struct ImageSink {
    regions: Vec<RegionView>,
}

impl PageSink for ImageSink {
    fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), SinkError> {
        if data.len() as u64 != run.bytes() {
            return Err(SinkError::Shape {
                pages: run.pages,
                bytes: data.len(),
            });
        }
        let dst = crate::sink::host_of(&self.regions, run)?;
        // SAFETY: `dst .. dst + len` lies inside one live region (checked
        // above); `data` is the receiver's buffer, not the image.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    fn zero(&self, _run: GpaPages) -> Result<(), SinkError> {
        // A fresh image reads as zeros, and each page is sent once.
        Ok(())
    }
}

impl MigratableVm for Image {
    fn regions(&self) -> Vec<RegionView> {
        self.views()
    }
    fn vcpus(&self) -> u32 {
        1
    }
    fn start_dirty_log(&self) -> Result<(), VmOpError> {
        Ok(())
    }
    fn take_dirty(&self) -> Result<Vec<Vec<u64>>, VmOpError> {
        Ok(Vec::new())
    }
    fn stop_dirty_log(&self) -> Result<(), VmOpError> {
        Ok(())
    }
    fn pause(&self) -> Result<(), VmOpError> {
        Ok(())
    }
    fn resume(&self) -> Result<(), VmOpError> {
        Err(VmOpError::from("a standby's image never runs".to_string()))
    }
    fn save_state(&self) -> Result<Vec<u8>, VmOpError> {
        Err(VmOpError::from(
            "a standby holds memory, not a VM's state".to_string(),
        ))
    }
    fn host_written_ranges(&self) -> Vec<GpaBytes> {
        Vec::new()
    }
    fn page_hashes(&self) -> Option<Vec<u64>> {
        self.hashes.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_that_cannot_be_guest_ram_are_refused_before_any_memory() {
        let top = !4095u64;
        for bad in [
            vec![],
            vec![(0, 0)],
            vec![(1, 4096)],
            vec![(0, 4097)],
            vec![(8192, 4096), (0, 4096)],
            vec![(0, 8192), (4096, 4096)],
            vec![(0, 2 << 40)],
            vec![(top, 8192)],
            vec![(0, 4096); MAX_REGIONS + 1],
        ] {
            assert!(Image::new(&bad).is_err(), "{bad:?}");
        }
        let image = Image::new(&[(0, 1 << 20), (1 << 32, 1 << 20)]).unwrap();
        let sink = image.sink();
        let page = vec![7u8; 4096];
        sink.write(GpaPages::new(1 << 32, 1), &page).unwrap();
        assert!(sink.write(GpaPages::new(1 << 20, 1), &page).is_err());
        assert!(sink.write(GpaPages::new(0, 2), &page).is_err());
        let views = image.regions();
        // SAFETY: the view covers the image's live second region.
        let landed =
            unsafe { std::slice::from_raw_parts(views[1].host_start() as *const u8, 4096) };
        assert_eq!(landed, &page[..]);
    }
}
