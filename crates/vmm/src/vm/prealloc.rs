//! Guest RAM populated ahead of need, so that the first touch of host
//! memory (a kernel fault, and on a nested host the host's own) happens
//! outside the guest's and the migration's time.
//!
//! - `--prealloc now`: all of it before the VM boots or waits.
//! - `--prealloc waiting` (the default for a VMM started with --incoming):
//!   on a background thread at the lowest priority while the VM waits for
//!   its migration, 4 MiB at a time, stopped when a source is admitted
//!   (from then on the memory is the migration's: a postcopy discards the
//!   pages still to come and must not see them populated again). It leaves
//!   the host a reserve of free memory (a split VM's main host has no room
//!   for all of it), so it may stop early. It was opt-in from session 41 to
//!   54 for multi-ms pauses at 16 GiB; their cause was not the populated
//!   memory but the timeline's SEEK_HOLE over it on every metrics read
//!   (`MemfdRegion::holds_data` now asks page by page).
//!
//! Either way what held data before is remembered: the rest is known to
//! read as zeros (`data_before_prealloc`). A source that may switch to
//! postcopy or split says so at the opening (protocol v13), and the
//! destination gives back what it populated before any page lands
//! (`release_prealloc`), so the switch finds those pages missing without
//! punching them out in the pause.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::Vm;
use ferry_memory::GuestMemory;

/// Populated per step of the background thread: a step is what a stop
/// waits for (about 2 ms of CPU).
const STEP: u64 = 4 << 20;
/// Free memory the background thread leaves the host: at least this, and
/// at least a tenth of its memory.
const RESERVE_MIN: u64 = 1 << 30;

/// The background thread, if one runs, and what it populated so far.
#[derive(Default)]
pub(super) struct Slot {
    running: Mutex<Option<Running>>,
    bytes: Arc<AtomicU64>,
}

/// A running background thread: its stop flag, its thread id (0 until it
/// has one), its handle.
struct Running {
    stop: Arc<AtomicBool>,
    tid: Arc<AtomicU32>,
    handle: JoinHandle<()>,
}

impl Vm {
    /// Populates every page of guest RAM now (`--prealloc now`). What held
    /// data before is remembered: the rest is known to read as zeros.
    pub fn prealloc(&self) -> Result<(), ferry_memory::RegionError> {
        self.remember_data();
        for r in self.memory.regions() {
            r.populate(0, r.size())?;
            self.background_prealloc
                .bytes
                .fetch_add(r.size(), Ordering::AcqRel);
        }
        Ok(())
    }

    /// Stops any preallocation and gives back what it populated: every
    /// page that held no data before it and lies outside `keep` (guest
    /// physical (address, length) ranges the VMM may write, such as the
    /// service ring) becomes a hole again, so an incoming postcopy finds it
    /// missing. Only for a VM no migration has written yet. Returns the
    /// bytes populated ahead (0 without preallocation).
    pub fn release_prealloc(&self, keep: &[(u64, u64)]) -> Result<u64, ferry_memory::RegionError> {
        let populated = self.stop_prealloc();
        if populated == 0 {
            return Ok(0);
        }
        for (i, r) in self.memory.regions().iter().enumerate() {
            let mut kept = self.data_before_prealloc(i).unwrap_or_default();
            kept.extend(keep.iter().filter_map(|&(gpa, len)| {
                let start = gpa.max(r.gpa());
                let end = gpa.saturating_add(len).min(r.gpa() + r.size());
                (start < end).then(|| (start - r.gpa(), end - start))
            }));
            for (offset, len) in gaps(r.size(), kept) {
                r.punch_hole(offset, len)?;
            }
        }
        self.background_prealloc.bytes.store(0, Ordering::Release);
        Ok(populated)
    }

    /// Starts populating guest RAM on a background thread until all of it
    /// is, the host's free memory runs down to its reserve, or
    /// [`Vm::stop_prealloc`].
    pub fn prealloc_in_background(&self) {
        self.remember_data();
        let memory = self.memory.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let tid = Arc::new(AtomicU32::new(0));
        let (flag, bytes, id) = (
            stop.clone(),
            self.background_prealloc.bytes.clone(),
            tid.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("prealloc".into())
            .spawn(move || {
                id.store(ferry_migration::priority::thread_id(), Ordering::Release);
                ferry_migration::priority::lowest();
                populate_until(&memory, &flag, &bytes)
            });
        match spawned {
            Ok(handle) => {
                *self
                    .background_prealloc
                    .running
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(Running { stop, tid, handle })
            }
            Err(e) => tracing::warn!("no background preallocation: {e}"),
        }
    }

    /// Guest RAM the background preallocation populated so far, and
    /// whether it still runs (None: none was started).
    pub fn preallocated(&self) -> Option<(u64, bool)> {
        let running = self
            .background_prealloc
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|r| !r.handle.is_finished());
        let bytes = self.background_prealloc.bytes.load(Ordering::Acquire);
        match running {
            Some(r) => Some((bytes, r)),
            None if bytes > 0 => Some((bytes, false)),
            None => None,
        }
    }

    /// Stops the background preallocation, if any, and waits for its last
    /// step; returns the bytes it populated. The thread is raised back to
    /// the normal nice value first: at the lowest, on cores busy with the
    /// guest and its clients, its last step took seconds (an incoming
    /// postcopy waited 1.4 s for it).
    pub fn stop_prealloc(&self) -> u64 {
        let bg = self
            .background_prealloc
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(r) = bg {
            r.stop.store(true, Ordering::Release);
            let tid = r.tid.load(Ordering::Acquire);
            if tid != 0 {
                ferry_migration::priority::nice_normal(tid);
            }
            let _ = r.handle.join();
        }
        self.background_prealloc.bytes.load(Ordering::Acquire)
    }

    /// What held data in region `index` when guest RAM was preallocated
    /// (None without preallocation). Only an incoming migration writes a
    /// waiting VM (besides its service ring), and it receives at most one:
    /// a failed migration ends the destination VMM.
    pub fn data_before_prealloc(&self, index: usize) -> Option<Vec<(u64, u64)>> {
        let before = self
            .data_before_prealloc
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        before
            .as_ref()
            .map(|ranges| ranges.get(index).cloned().unwrap_or_default())
    }

    fn remember_data(&self) {
        let before = self
            .memory
            .regions()
            .iter()
            .map(|r| r.data_ranges())
            .collect();
        *self
            .data_before_prealloc
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(before);
    }
}

/// The background thread's work: step by step, while not stopped and the
/// host has more than its reserve free, counting into `done`.
fn populate_until(memory: &GuestMemory, stop: &AtomicBool, done: &AtomicU64) {
    for r in memory.regions() {
        let mut at = 0;
        while at < r.size() {
            if stop.load(Ordering::Acquire) || !room_for(STEP) {
                return;
            }
            let len = STEP.min(r.size() - at);
            if r.populate(at, len).is_err() {
                return;
            }
            at += len;
            done.fetch_add(len, Ordering::AcqRel);
        }
    }
}

/// The parts of `0..size` outside every `keep` range (offset, length).
fn gaps(size: u64, mut keep: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    keep.sort_unstable();
    let mut out = Vec::new();
    let mut at = 0;
    for (offset, len) in keep {
        let offset = offset.min(size);
        if offset > at {
            out.push((at, offset - at));
        }
        at = at.max(offset.saturating_add(len).min(size));
    }
    if at < size {
        out.push((at, size - at));
    }
    out
}

/// True if the host keeps its reserve after `bytes` more are used (a host
/// whose /proc/meminfo cannot be read is given the benefit of the doubt).
fn room_for(bytes: u64) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/meminfo") else {
        return true;
    };
    let kib = |key: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .map(|v| v << 10)
    };
    let (Some(total), Some(available)) = (kib("MemTotal:"), kib("MemAvailable:")) else {
        return true;
    };
    available.saturating_sub(bytes) > RESERVE_MIN.max(total / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_given_back_is_what_no_range_keeps() {
        assert_eq!(gaps(100, vec![]), vec![(0, 100)]);
        assert_eq!(gaps(100, vec![(0, 100)]), vec![]);
        // Unsorted, overlapping, touching and running past the end.
        assert_eq!(
            gaps(100, vec![(50, 10), (10, 5), (12, 8), (20, 5), (90, 40)]),
            vec![(0, 10), (25, 25), (60, 30)]
        );
    }

    #[test]
    fn the_reserve_is_kept() {
        // No host has this much free memory to give.
        assert!(!room_for(u64::MAX / 2));
        assert!(room_for(0) || !room_for(STEP), "more room for less");
    }
}
