//! What the engine needs from a VM, as traits the VMM implements.

/// One guest RAM region as the engine sees it: where it lives in guest
/// physical space and in this process.
#[derive(Clone, Copy, Debug)]
pub struct RegionView {
    /// Guest physical base.
    pub gpa: u64,
    /// Bytes (a multiple of 4 KiB).
    pub size: u64,
    /// Host address of the mapping.
    pub host: *mut u8,
}

// SAFETY: a RegionView names a shared mapping that the VMM keeps alive for the
// whole migration; the engine only copies pages in and out of it, and races
// with the running guest are what dirty tracking is for.
unsafe impl Send for RegionView {}
// SAFETY: as above.
unsafe impl Sync for RegionView {}

impl RegionView {
    /// Pages in the region.
    pub fn pages(&self) -> u64 {
        self.size / 4096
    }

    /// The page at index `i` (must be < pages()).
    pub fn page(&self, i: u64) -> &[u8] {
        assert!(i < self.pages(), "page {i} beyond region");
        // SAFETY: in bounds (checked); the mapping outlives the migration.
        unsafe { std::slice::from_raw_parts(self.host.add((i * 4096) as usize), 4096) }
    }

    /// Copies `data` (whole pages) to guest address `gpa` inside this region.
    pub fn write(&self, gpa: u64, data: &[u8]) -> bool {
        let Some(off) = gpa.checked_sub(self.gpa) else {
            return false;
        };
        if off
            .checked_add(data.len() as u64)
            .is_none_or(|end| end > self.size)
        {
            return false;
        }
        // SAFETY: the range was checked to lie inside the live mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.host.add(off as usize), data.len())
        };
        true
    }

    /// True if `gpa` lies in this region.
    pub fn contains(&self, gpa: u64) -> bool {
        gpa >= self.gpa && gpa - self.gpa < self.size
    }
}

/// Per-page hashes of a region, reading only its data ranges (holes hash
/// as zero pages): both sides of a verified migration use this.
pub fn region_hashes(r: &RegionView, data: &[(u64, u64)]) -> Vec<u64> {
    let zero = crate::protocol::page_hash(&[0u8; 4096]);
    let mut out = vec![zero; r.pages() as usize];
    for &(off, len) in data {
        for i in off / 4096..((off + len) / 4096).min(r.pages()) {
            out[i as usize] = crate::protocol::page_hash(r.page(i));
        }
    }
    out
}

/// A running VM that can be migrated away.
pub trait MigratableVm: Send + Sync {
    /// Guest RAM regions.
    fn regions(&self) -> Vec<RegionView>;
    /// Number of vCPUs.
    fn vcpus(&self) -> u32;
    /// Starts tracking guest writes (and clears what was tracked).
    fn start_dirty_log(&self) -> Result<(), String>;
    /// Per region, a bitmap of pages written since the last call (bit i of
    /// word i/64 = page i), clearing it.
    fn take_dirty(&self) -> Result<Vec<Vec<u64>>, String>;
    /// Stops tracking.
    fn stop_dirty_log(&self) -> Result<(), String>;
    /// Stops the vCPUs.
    fn pause(&self) -> Result<(), String>;
    /// Runs them again (after a failed migration).
    fn resume(&self) -> Result<(), String>;
    /// The VM's state besides memory (vCPUs, devices), encoded.
    fn save_state(&self) -> Result<Vec<u8>, String>;
    /// The parts of region `index` that may hold data, as (offset, length);
    /// the rest is known to read as zeros and need not be read at all.
    fn data_ranges(&self, index: usize) -> Vec<(u64, u64)> {
        self.regions()
            .get(index)
            .map_or(Vec::new(), |r| vec![(0, r.size)])
    }
    /// Auto-converge: slow the guest so it dirties memory more slowly
    /// (percent of vCPU time taken away, 0 = off). VMs that cannot throttle
    /// keep the default, which does nothing.
    fn throttle(&self, _pct: u32) -> Result<(), String> {
        Ok(())
    }
    /// Guest ranges the VMM itself writes (not seen by the dirty log): sent
    /// again in the final round.
    fn host_written_ranges(&self) -> Vec<(u64, u64)>;
}

/// A VM waiting to receive a migration.
pub trait IncomingVm: Send + Sync {
    /// Guest RAM regions.
    fn regions(&self) -> Vec<RegionView>;
    /// Number of vCPUs.
    fn vcpus(&self) -> u32;
    /// As [`MigratableVm::data_ranges`].
    fn data_ranges(&self, index: usize) -> Vec<(u64, u64)> {
        self.regions()
            .get(index)
            .map_or(Vec::new(), |r| vec![(0, r.size)])
    }
    /// The parts of region `index` that may hold non-zero bytes before the
    /// migration writes anything (what the VMM itself wrote); zero ranges
    /// from the source clear only these and the pages the migration wrote.
    /// Memory populated with zeros (preallocation) belongs outside them.
    fn nonzero_ranges(&self, index: usize) -> Vec<(u64, u64)> {
        self.data_ranges(index)
    }
    /// Guest ranges (gpa, length) the VMM's devices may write at any time,
    /// even while the VM waits for its migration (a device posting
    /// requests): zero ranges always clear them.
    fn device_written_ranges(&self) -> Vec<(u64, u64)> {
        Vec::new()
    }
    /// Writes received pages (whole pages inside one region). The default
    /// copies through the mapping; a VMM may write through the memory's file.
    fn write_pages(&self, gpa: u64, data: &[u8]) -> Result<(), String> {
        let ok = self
            .regions()
            .iter()
            .any(|r| r.contains(gpa) && r.write(gpa, data));
        if ok {
            Ok(())
        } else {
            Err(format!("{:#x}+{} is not in guest RAM", gpa, data.len()))
        }
    }
    /// Makes a range read as zeros.
    fn zero(&self, gpa: u64, len: u64) -> Result<(), String>;
    /// Restores the state `save_state` produced.
    fn restore_state(&self, state: &[u8]) -> Result<(), String>;
    /// Starts the vCPUs.
    fn start(&self) -> Result<(), String>;
    /// Where this VM's request service listens, told to the source so it
    /// can forward its clients here.
    fn service_addr(&self) -> Option<String> {
        None
    }
}
