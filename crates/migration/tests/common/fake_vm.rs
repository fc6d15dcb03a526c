//! The one fake VM every engine test migrates: guest memory on memfds (so a
//! destination can sit under real userfaultfd and hand its fds to a split
//! pager), seen through the engine's traits on both sides: [`MigratableVm`]
//! as a source, [`DestinationVm`]/[`PageStore`] as a destination.
//!
//! [`FakeVm::new`] gives a 1-vCPU VM of zeroed memory that reports whole
//! regions as data and whose guest never writes; the `with_*` methods set
//! what a test varies (content, holes, a guest that keeps writing, clients,
//! failures...). What the engine did to it (pauses, resumes, throttles,
//! the state it restored, pages it cleared...) is recorded in the public
//! fields for the test to check.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ferry_memory::MemfdRegion;
use ferry_migration::{
    AccessHistory, ClientsAnswer, ClientsPlan, DestinationVm, GpaBytes, GpaPages, MigratableVm,
    OffsetBytes, PageStore, RegionView, VmOpError,
};
use ferry_migration::{RemotePager, Telemetry};

const PAGE: usize = 4096;

/// A page-touching "vCPU" thread: (gpa, byte 17 read) per page.
type Toucher = JoinHandle<Vec<(u64, u8)>>;

/// A guest that writes the same pages of region 0 before every dirty-log
/// read: byte 9 of each becomes `step` of what it was.
struct KeepsWriting {
    pages: Vec<u64>,
    step: fn(u8) -> u8,
}

/// A memfd-backed VM for the engine's tests (see the module doc).
pub struct FakeVm {
    /// Guest RAM, one memfd per region of the layout.
    pub regions: Vec<MemfdRegion>,
    vcpus: u32,
    /// data_ranges reports the memfds' holes (pages never written) rather
    /// than whole regions.
    holes: bool,
    /// Pages of region 0 "dirtied" per take_dirty call (byte 0 flipped),
    /// popped from the end: the last list is the first call's.
    dirty_script: Mutex<Vec<Vec<u64>>>,
    keeps_writing: Option<KeepsWriting>,
    host_written: Vec<GpaBytes>,
    access_history: Option<AccessHistory>,
    /// How long start() takes (a destination that hangs while starting).
    start_delay: Duration,
    /// What PageStore::nonzero_ranges reports (None: data_ranges).
    nonzero: Option<Vec<Vec<OffsetBytes>>>,
    /// Threads start() runs that touch every page (and how often the first
    /// one writes), the threads running and their ids.
    touchers: Option<(u64, u64)>,
    running: Mutex<Vec<Toucher>>,
    tids: Mutex<Vec<u32>>,
    /// Clients: the source's plan; the destination's answer to a plan and
    /// whether its restore fails.
    clients_plan: Option<ClientsPlan>,
    accepts_clients: Result<(), String>,
    restore_fails: bool,
    /// A page of region 0 written as the VM pauses but never reported
    /// dirty: a hole in the dirty log, for verification to find.
    unlogged_write: Option<u64>,
    /// Where the engine reports live figures (None: nobody watches).
    pub telemetry: Option<Arc<Telemetry>>,
    // What the engine did to it.
    pub pauses: AtomicU32,
    /// Whether the engine has the dirty log on.
    pub dirty_log_on: std::sync::atomic::AtomicBool,
    pub resumes: AtomicU32,
    pub throttles: Mutex<Vec<u32>>,
    /// The state save_state gives and restore_state replaced.
    pub state: Mutex<Vec<u8>>,
    pub started: AtomicU32,
    /// Pages PageStore::discard was asked to clear.
    pub zeroed: AtomicU64,
    /// The clients answer the source was told, how often it checkpointed
    /// them, and what the destination restored (with `started` then).
    pub decided: Mutex<Option<ClientsAnswer>>,
    pub clients_saved: AtomicU32,
    pub restored_clients: Mutex<Option<(Vec<u8>, u32)>>,
    /// The destination's phase (its telemetry's) when restore_clients came.
    pub clients_restored_in: Mutex<Option<&'static str>>,
    /// The destination's phase (its telemetry's) when restore_state came.
    pub restored_in: Mutex<Option<&'static str>>,
    /// The split pager this VM adopted as a main host.
    pub pager: Mutex<Option<Arc<RemotePager>>>,
    /// Another VM's regions (fd, size) this destination may share pages
    /// from; None: it does not share.
    siblings: Option<Vec<(std::os::fd::OwnedFd, u64)>>,
    /// Run at take_dirty calls, popped from the end like `dirty_script`.
    dirty_hooks: Mutex<Vec<Option<DirtyHook>>>,
}

/// What a test does at a take_dirty call (another VM writing, say).
type DirtyHook = Box<dyn FnOnce() + Send>;

impl FakeVm {
    /// A VM of zeroed memory in `layout` ((gpa, bytes) per region).
    pub fn new(layout: &[(u64, u64)]) -> FakeVm {
        FakeVm {
            regions: layout
                .iter()
                .map(|&(gpa, size)| MemfdRegion::new("fake-vm", gpa, size).unwrap())
                .collect(),
            vcpus: 1,
            holes: false,
            dirty_script: Mutex::new(Vec::new()),
            keeps_writing: None,
            host_written: Vec::new(),
            access_history: None,
            start_delay: Duration::ZERO,
            nonzero: None,
            touchers: None,
            running: Mutex::new(Vec::new()),
            tids: Mutex::new(Vec::new()),
            clients_plan: None,
            accepts_clients: Err("a fake VM has no clients".into()),
            restore_fails: false,
            unlogged_write: None,
            telemetry: None,
            pauses: AtomicU32::new(0),
            dirty_log_on: std::sync::atomic::AtomicBool::new(false),
            resumes: AtomicU32::new(0),
            throttles: Mutex::new(Vec::new()),
            state: Mutex::new(b"vcpu state".to_vec()),
            started: AtomicU32::new(0),
            zeroed: AtomicU64::new(0),
            decided: Mutex::new(None),
            clients_saved: AtomicU32::new(0),
            restored_clients: Mutex::new(None),
            restored_in: Mutex::new(None),
            clients_restored_in: Mutex::new(None),
            pager: Mutex::new(None),
            siblings: None,
            dirty_hooks: Mutex::new(Vec::new()),
        }
    }

    /// A destination that shares pages with `other` (as `--share-pages`
    /// does with the host's other VMs).
    pub fn with_sibling(mut self, other: &FakeVm) -> FakeVm {
        self.siblings = Some(
            other
                .regions
                .iter()
                .map(|r| (r.fd().try_clone_to_owned().unwrap(), r.size()))
                .collect(),
        );
        self
    }

    /// Runs `hooks` at the take_dirty calls, the last one at the first call
    /// (None: nothing at that call).
    pub fn with_dirty_hooks(self, hooks: Vec<Option<DirtyHook>>) -> FakeVm {
        *self.dirty_hooks.lock().unwrap() = hooks;
        self
    }

    /// Fills memory with `byte(region gpa, offset in region)`; pages that
    /// come out all zero are left unwritten (holes).
    pub fn with_fill(self, byte: fn(u64, usize) -> u8) -> FakeVm {
        let mut page = vec![0u8; PAGE];
        for r in &self.regions {
            for (p, off) in (0..r.size() as usize).step_by(PAGE).enumerate() {
                for (i, b) in page.iter_mut().enumerate() {
                    *b = byte(r.gpa(), off + i);
                }
                if page.iter().any(|&b| b != 0) {
                    // SAFETY: page `p` lies inside the region's live mapping.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            page.as_ptr(),
                            r.host_addr().add(p * PAGE),
                            PAGE,
                        )
                    };
                }
            }
        }
        self
    }

    pub fn with_vcpus(mut self, n: u32) -> FakeVm {
        self.vcpus = n;
        self
    }

    /// data_ranges (and so nonzero_ranges) report only the pages that were
    /// ever written: zero pages are holes, as in a VMM's memfd.
    pub fn with_holes(mut self) -> FakeVm {
        self.holes = true;
        self
    }

    /// Per take_dirty call, the pages of region 0 whose byte 0 flips and
    /// that are reported dirty, popped from the end (the last list is the
    /// first call's); once it runs out, nothing is dirtied.
    pub fn with_dirty_script(self, script: Vec<Vec<u64>>) -> FakeVm {
        *self.dirty_script.lock().unwrap() = script;
        self
    }

    /// A guest that never lets up: before every take_dirty call, byte 9 of
    /// each of `pages` of region 0 becomes `step` of itself, and they are
    /// reported dirty.
    pub fn with_guest_writing(mut self, pages: Vec<u64>, step: fn(u8) -> u8) -> FakeVm {
        self.keeps_writing = Some(KeepsWriting { pages, step });
        self
    }

    /// What host_written_ranges reports (the VMM's own writes).
    pub fn with_host_written(mut self, ranges: Vec<GpaBytes>) -> FakeVm {
        self.host_written = ranges;
        self
    }

    pub fn with_access_history(mut self, history: AccessHistory) -> FakeVm {
        self.access_history = Some(history);
        self
    }

    pub fn with_start_delay(mut self, delay: Duration) -> FakeVm {
        self.start_delay = delay;
        self
    }

    /// What nonzero_ranges reports, per region (the VMM wrote there).
    pub fn with_nonzero(mut self, ranges: Vec<Vec<OffsetBytes>>) -> FakeVm {
        self.nonzero = Some(ranges);
        self
    }

    /// start() runs `threads` "vCPUs" that read byte 17 of every page, each
    /// in its own random order; the first writes byte 1 of every
    /// `write_every`-th page it touches (0xAB). [`FakeVm::join_touchers`]
    /// gives what they read.
    pub fn with_touchers(mut self, threads: u64, write_every: u64) -> FakeVm {
        self.touchers = Some((threads, write_every));
        self
    }

    /// A source whose clients may move with it.
    pub fn with_clients(mut self, plan: ClientsPlan) -> FakeVm {
        self.clients_plan = Some(plan);
        self
    }

    /// A destination's answer to a clients plan.
    pub fn with_clients_answer(mut self, answer: Result<(), String>) -> FakeVm {
        self.accepts_clients = answer;
        self
    }

    /// A destination that takes clients but fails to restore them.
    pub fn with_failing_client_restore(mut self) -> FakeVm {
        self.restore_fails = true;
        self
    }

    /// Page `p` of region 0 changes as the VM pauses, and no dirty log
    /// says so (a dirty-tracking bug, as verification must see it).
    pub fn with_unlogged_write(mut self, p: u64) -> FakeVm {
        self.unlogged_write = Some(p);
        self
    }

    /// Live figures of the migration go to a fresh [`Telemetry`].
    pub fn with_telemetry(mut self) -> FakeVm {
        self.telemetry = Some(Telemetry::new());
        self
    }

    /// Where guest address `gpa` is mapped.
    pub fn host(&self, gpa: u64) -> *mut u8 {
        let r = self.regions.iter().find(|r| r.contains(gpa, 1)).unwrap();
        // SAFETY: `gpa` lies in `r` (checked above).
        unsafe { r.host_addr().add((gpa - r.gpa()) as usize) }
    }

    /// Byte `off` of the page at `gpa` (reading a hole fills it: ask the
    /// region whether it holds data first where that matters).
    pub fn byte(&self, gpa: u64, off: usize) -> u8 {
        // SAFETY: the address lies in a live mapping (host checks the
        // region); a volatile read, as the guest may write it.
        unsafe { self.host(gpa).add(off).read_volatile() }
    }

    /// A copy of region `index`'s bytes (its holes get filled, as with
    /// [`FakeVm::byte`]).
    pub fn bytes(&self, index: usize) -> Vec<u8> {
        let r = &self.regions[index];
        let mut out = vec![0u8; r.size() as usize];
        // SAFETY: the mapping is live and `size` bytes long.
        unsafe { std::ptr::copy_nonoverlapping(r.host_addr(), out.as_mut_ptr(), out.len()) };
        out
    }

    /// Sets bytes `range` of region `index` to `byte`.
    pub fn fill(&self, index: usize, range: std::ops::Range<usize>, byte: u8) {
        let r = &self.regions[index];
        assert!(range.end as u64 <= r.size());
        // SAFETY: the range lies inside the region's live mapping (checked).
        unsafe {
            r.host_addr()
                .add(range.start)
                .write_bytes(byte, range.len())
        };
    }

    /// Waits for the touchers start() ran: (gpa, byte read) per page each
    /// touched.
    pub fn join_touchers(&self) -> Vec<(u64, u8)> {
        let mut out = Vec::new();
        for t in self.running.lock().unwrap().drain(..) {
            out.extend(t.join().unwrap());
        }
        out
    }

    /// The guest pages in layout order.
    fn pages(&self) -> Vec<u64> {
        self.regions
            .iter()
            .flat_map(|r| (0..r.size() / PAGE as u64).map(move |i| r.gpa() + i * PAGE as u64))
            .collect()
    }

    fn spawn_touchers(&self, threads: u64, write_every: u64) {
        let pages = self.pages();
        for t in 0..threads {
            // Each thread its own random order over all pages.
            let mut order = pages.clone();
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t;
            for i in (1..order.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let hosts: Vec<(u64, usize)> =
                order.iter().map(|&g| (g, self.host(g) as usize)).collect();
            let (tx, rx) = std::sync::mpsc::channel();
            let h = std::thread::spawn(move || {
                // SAFETY: gettid has no preconditions.
                tx.send(unsafe { libc::gettid() } as u32).unwrap();
                let mut seen = Vec::new();
                for (k, &(gpa, host)) in hosts.iter().enumerate() {
                    let p = (host + 17) as *mut u8;
                    // SAFETY: `host` points into a live memfd mapping; a
                    // missing page blocks this thread until it lands.
                    let v = unsafe { p.read_volatile() };
                    seen.push((gpa, v));
                    if t == 0 && (k as u64).is_multiple_of(write_every) {
                        // SAFETY: as above; byte 1 is this test's guest write.
                        unsafe { ((host + 1) as *mut u8).write_volatile(0xAB) };
                    }
                }
                seen
            });
            self.tids.lock().unwrap().push(rx.recv().unwrap());
            self.running.lock().unwrap().push(h);
        }
    }

    fn views(&self) -> Vec<RegionView> {
        self.regions
            .iter()
            // SAFETY: the regions live as long as the FakeVm, and the
            // engine uses the views only while it borrows the VM.
            .map(|r| unsafe { RegionView::new(r.gpa(), r.size(), r.host_addr()) })
            .collect()
    }

    fn data(&self, index: usize) -> Vec<OffsetBytes> {
        let r = &self.regions[index];
        if !self.holes {
            return vec![OffsetBytes::new(0, r.size())];
        }
        r.data_ranges()
            .into_iter()
            .map(|(o, l)| OffsetBytes::new(o, l))
            .collect()
    }
}

impl MigratableVm for FakeVm {
    fn regions(&self) -> Vec<RegionView> {
        self.views()
    }
    fn vcpus(&self) -> u32 {
        self.vcpus
    }
    fn start_dirty_log(&self) -> Result<(), VmOpError> {
        self.dirty_log_on.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn data_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        self.data(index)
    }
    fn take_dirty(&self) -> Result<Vec<Vec<u64>>, VmOpError> {
        let mut out: Vec<Vec<u64>> = self
            .regions
            .iter()
            .map(|r| vec![0u64; (r.size() as usize / PAGE).div_ceil(64)])
            .collect();
        let base = self.regions[0].gpa();
        let mut dirty = |p: u64, at: usize, step: &dyn Fn(u8) -> u8| {
            let b = self.host(base + p * PAGE as u64).wrapping_add(at);
            // SAFETY: page `p` lies in region 0 (host checks it); the
            // engine may read it meanwhile, as it would a guest's write.
            unsafe { b.write_volatile(step(b.read_volatile())) };
            out[0][(p / 64) as usize] |= 1 << (p % 64);
        };
        if let Some(Some(hook)) = self.dirty_hooks.lock().unwrap().pop() {
            hook();
        }
        // Each call: the scripted pages get new content and are reported dirty.
        for p in self.dirty_script.lock().unwrap().pop().unwrap_or_default() {
            dirty(p, 0, &|b| b ^ 0xff);
        }
        if let Some(w) = &self.keeps_writing {
            for &p in &w.pages {
                dirty(p, 9, &w.step);
            }
        }
        Ok(out)
    }
    fn stop_dirty_log(&self) -> Result<(), VmOpError> {
        self.dirty_log_on.store(false, Ordering::SeqCst);
        Ok(())
    }
    fn pause(&self) -> Result<(), VmOpError> {
        self.pauses.fetch_add(1, Ordering::SeqCst);
        if let Some(p) = self.unlogged_write {
            let b = self
                .host(self.regions[0].gpa() + p * PAGE as u64)
                .wrapping_add(17);
            // SAFETY: page `p` lies in region 0 (host checks it).
            unsafe { b.write_volatile(b.read_volatile() ^ 0x5a) };
        }
        Ok(())
    }
    fn resume(&self) -> Result<(), VmOpError> {
        self.resumes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn save_state(&self) -> Result<Vec<u8>, VmOpError> {
        Ok(self.state.lock().unwrap().clone())
    }
    fn throttle(&self, pct: u32) -> Result<(), VmOpError> {
        self.throttles.lock().unwrap().push(pct);
        Ok(())
    }
    fn host_written_ranges(&self) -> Vec<GpaBytes> {
        self.host_written.clone()
    }
    fn telemetry(&self) -> Option<Arc<Telemetry>> {
        self.telemetry.clone()
    }
    fn access_history(&self) -> Option<AccessHistory> {
        self.access_history.clone()
    }
    /// A split VM's main host is in turn the source of a gather.
    fn pager(&self) -> Option<Arc<RemotePager>> {
        self.pager.lock().unwrap().clone()
    }
    fn clients_plan(&self) -> Option<ClientsPlan> {
        self.clients_plan.clone()
    }
    fn clients_decided(&self, answer: &ClientsAnswer) {
        *self.decided.lock().unwrap() = Some(answer.clone());
    }
    fn save_clients(&self) -> Result<Vec<u8>, VmOpError> {
        assert_eq!(
            self.pauses.load(Ordering::SeqCst),
            1,
            "checkpointed while paused"
        );
        self.clients_saved.fetch_add(1, Ordering::SeqCst);
        Ok(b"checkpointed connections".to_vec())
    }
}

impl PageStore for FakeVm {
    fn regions(&self) -> Vec<RegionView> {
        self.views()
    }
    fn data_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        self.data(index)
    }
    fn nonzero_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        match &self.nonzero {
            Some(r) => r[index].clone(),
            None => self.data(index),
        }
    }
    /// Punches `run` out of the region holding it.
    fn discard(&self, run: GpaPages) -> Result<(), VmOpError> {
        self.zeroed.fetch_add(run.pages, Ordering::SeqCst);
        let r = self
            .regions
            .iter()
            .find(|r| r.contains(run.gpa, run.bytes()))
            .ok_or("zero outside memory")?;
        Ok(r.punch_hole(run.gpa - r.gpa(), run.bytes())?)
    }
}

impl DestinationVm for FakeVm {
    fn vcpus(&self) -> u32 {
        self.vcpus
    }
    fn restore_state(&self, state: &[u8]) -> Result<(), VmOpError> {
        *self.restored_in.lock().unwrap() = self.telemetry.as_ref().map(|t| t.phase().name());
        *self.state.lock().unwrap() = state.to_vec();
        Ok(())
    }
    fn start(&self) -> Result<(), VmOpError> {
        std::thread::sleep(self.start_delay);
        if let Some((threads, write_every)) = self.touchers {
            self.spawn_touchers(threads, write_every);
        }
        self.started.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn vcpu_tids(&self) -> Vec<u32> {
        self.tids.lock().unwrap().clone()
    }
    fn telemetry(&self) -> Option<Arc<Telemetry>> {
        self.telemetry.clone()
    }
    fn memory_fds(&self) -> Option<Vec<std::os::fd::OwnedFd>> {
        self.regions
            .iter()
            .map(|r| r.fd().try_clone_to_owned().ok())
            .collect()
    }
    fn sibling_memory(&self) -> Option<Vec<ferry_memory::PeerRegion>> {
        let siblings = self.siblings.as_ref()?;
        Some(
            siblings
                .iter()
                .map(|(fd, size)| {
                    ferry_memory::PeerRegion::open("sibling", *size, fd.try_clone().unwrap())
                        .unwrap()
                })
                .collect(),
        )
    }
    fn adopt_pager(&self, pager: RemotePager) -> Result<(), VmOpError> {
        *self.pager.lock().unwrap() = Some(Arc::new(pager));
        Ok(())
    }
    fn prepare_clients(&self, _plan: &ClientsPlan) -> Result<(), String> {
        self.accepts_clients.clone()
    }
    fn restore_clients(&self, clients: &[u8]) -> Result<String, VmOpError> {
        if self.restore_fails {
            return Err("the fake destination cannot restore its clients".into());
        }
        let started = self.started.load(Ordering::SeqCst);
        *self.restored_clients.lock().unwrap() = Some((clients.to_vec(), started));
        *self.clients_restored_in.lock().unwrap() =
            self.telemetry.as_ref().map(|t| t.phase().name());
        Ok("3 connections restored".into())
    }
}
