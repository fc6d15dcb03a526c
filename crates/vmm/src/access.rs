//! Access tracking on a running VM (the source side of split migration's
//! LRU ranking): one thread owns a userfaultfd over all guest RAM in MINOR
//! mode, serves the faults the tracker's sampling raises (record, then
//! UFFDIO_CONTINUE), and every period hands KVM's dirty log (through the
//! [`DirtyLog`] arbiter) to the tracker and arms the next share of pages.
//!
//! A failure of the userfaultfd never stops the VM: tracking is logged,
//! unregistered and given up. An outgoing migration reads guest memory
//! through the same mapping, so it [`pauses`](AccessTracking::pause)
//! tracking first (RAM unregistered, histories kept).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_memory::{
    AccessError, AccessSnapshot, AccessStats, AccessTracker, Event, Features, GuestMemory,
    RegisterMode, UffdError, Userfaultfd, DEFAULT_GRAIN_PAGES, PAGE_SIZE,
};

use crate::vstate::dirty::{Consumer, DirtyLog, DirtyLogError};

/// Longest wait for a fault before the thread looks at its stop flag.
const POLL_AT_MOST: Duration = Duration::from_millis(50);

/// How often and how much to sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccessConfig {
    /// One period: histories shift and the next share is armed.
    pub period: Duration,
    /// Pages rotate through this many shares (each is sampled every
    /// `share` periods).
    pub share: u32,
    /// Pages one sampled fault answers for (power of two, at most 512).
    pub grain: u64,
    /// Where writes are seen.
    pub writes: WriteSource,
}

/// Where access tracking learns of writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WriteSource {
    /// The sampled faults alone (any access to an armed page raises one,
    /// a write too): no dirty log, so the guest pays only for the faults.
    /// The default: on this PVM host a memslot that logs writes slows a
    /// writing guest by ~25% however few pages are re-protected.
    #[default]
    Sample,
    /// KVM's dirty log as well: every page written is seen (in
    /// manual-protect mode, in the share being sampled).
    Log,
}

impl Default for AccessConfig {
    fn default() -> Self {
        AccessConfig {
            period: Duration::from_secs(1),
            share: 8,
            grain: DEFAULT_GRAIN_PAGES,
            writes: WriteSource::Sample,
        }
    }
}

/// Why tracking could not start.
#[derive(Debug, thiserror::Error)]
pub enum AccessStartError {
    /// No usable userfaultfd (or no MINOR faults on memfd memory).
    #[error("userfaultfd: {0}")]
    Uffd(#[from] UffdError),
    /// The kernel registered RAM but offers no UFFDIO_CONTINUE on it.
    #[error("userfaultfd cannot resolve MINOR faults (no UFFDIO_CONTINUE) on guest RAM")]
    NoContinue,
    /// The tracker refused the regions.
    #[error(transparent)]
    Tracker(#[from] AccessError),
    /// KVM's dirty log could not be started.
    #[error("dirty log: {0}")]
    Dirty(#[from] DirtyLogError),
    /// The thread could not be spawned.
    #[error("cannot start the access tracking thread: {0}")]
    Thread(std::io::Error),
}

/// Where tracking stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TrackingState {
    /// Sampling.
    Tracking,
    /// Stepped aside (a migration reads memory); histories kept.
    Paused,
    /// Given up after an error.
    Failed,
    /// Ended with the VM.
    Stopped,
}

/// What `ferry status` shows of tracking.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AccessStatus {
    /// Where tracking stands.
    pub state: TrackingState,
    /// Why it failed, or why it never started.
    pub error: Option<String>,
    /// Period length (ms).
    pub period_ms: u64,
    /// Where writes are seen.
    pub writes: WriteSource,
    /// MINOR faults taken in vCPU threads themselves. Most guest faults
    /// come from KVM's async page fault workers instead (KVM resolves a
    /// host fault off the vCPU thread where it can, whether or not the
    /// guest uses APF); the VMM's own threads make the rest.
    pub vcpu_faults: u64,
    /// The tracker's own figures.
    #[serde(flatten)]
    pub stats: AccessStats,
}

struct Phase {
    state: TrackingState,
    error: Option<String>,
}

struct Shared {
    tracker: AccessTracker,
    uffd: Userfaultfd,
    dirty: Arc<DirtyLog>,
    config: AccessConfig,
    phase: Mutex<Phase>,
    stop: AtomicBool,
    vcpu_tids: Box<dyn Fn() -> Vec<u32> + Send + Sync>,
    vcpu_faults: AtomicU64,
}

/// A VM's tracking thread and what it has seen.
pub struct AccessTracking {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl AccessTracking {
    /// Registers all of `memory` for MINOR faults, starts the dirty log's
    /// access consumer, and starts the thread. `vcpu_tids` names the vCPU
    /// threads (for the fault counts).
    pub fn start(
        memory: &Arc<GuestMemory>,
        dirty: Arc<DirtyLog>,
        config: AccessConfig,
        vcpu_tids: Box<dyn Fn() -> Vec<u32> + Send + Sync>,
    ) -> Result<Self, AccessStartError> {
        let tracker = AccessTracker::for_memory(memory, config.share)?.with_grain(config.grain)?;
        let uffd = Userfaultfd::new(Features {
            minor_shmem: true,
            thread_id: true,
            ..Default::default()
        })?;
        let shared = Arc::new(Shared {
            tracker,
            uffd,
            dirty,
            config,
            phase: Mutex::new(Phase {
                state: TrackingState::Paused,
                error: None,
            }),
            stop: AtomicBool::new(false),
            vcpu_tids,
            vcpu_faults: AtomicU64::new(0),
        });
        {
            let mut phase = shared.lock();
            shared.begin(&mut phase)?;
        }
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("access".into())
            .spawn(move || run(&s));
        match thread {
            Ok(t) => Ok(AccessTracking {
                shared,
                thread: Mutex::new(Some(t)),
            }),
            Err(e) => {
                shared.end(&mut shared.lock(), TrackingState::Stopped);
                Err(AccessStartError::Thread(e))
            }
        }
    }

    /// Steps aside: RAM is unregistered (accesses map pages as usual) and
    /// the dirty log's access consumer stops; histories are kept. True if
    /// it was tracking (so the caller knows to resume).
    pub fn pause(&self) -> bool {
        let mut phase = self.shared.lock();
        if phase.state != TrackingState::Tracking {
            return false;
        }
        self.shared.end(&mut phase, TrackingState::Paused);
        true
    }

    /// Samples again after [`pause`](Self::pause) (nothing if not paused).
    pub fn resume(&self) {
        let mut phase = self.shared.lock();
        if phase.state != TrackingState::Paused {
            return;
        }
        if let Err(e) = self.shared.begin(&mut phase) {
            tracing::warn!(error = %e, "access tracking cannot resume; the VM runs on without it");
            phase.state = TrackingState::Failed;
            phase.error = Some(format!("cannot resume: {e}"));
        }
    }

    /// Ends tracking and joins the thread.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let mut phase = self.shared.lock();
            if matches!(phase.state, TrackingState::Tracking | TrackingState::Paused) {
                self.shared.end(&mut phase, TrackingState::Stopped);
            }
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }

    /// Where tracking stands.
    pub fn state(&self) -> TrackingState {
        self.shared.lock().state
    }

    /// The histories so far.
    pub fn snapshot(&self) -> AccessSnapshot {
        self.shared.tracker.snapshot()
    }

    /// State and cost so far.
    pub fn status(&self) -> AccessStatus {
        let phase = self.shared.lock();
        AccessStatus {
            state: phase.state,
            error: phase.error.clone(),
            period_ms: self.shared.config.period.as_millis() as u64,
            writes: self.shared.config.writes,
            vcpu_faults: self.shared.vcpu_faults.load(Ordering::Relaxed),
            stats: self.shared.tracker.stats(),
        }
    }
}

impl Drop for AccessTracking {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn logs_writes(&self) -> bool {
        self.config.writes == WriteSource::Log
    }

    /// One page per group is armed (writes sampled, or not logged at all);
    /// else the whole share, less the pages just logged written.
    fn arms_samples(&self) -> bool {
        !self.logs_writes() || self.dirty.partial()
    }

    /// Starts the dirty log consumer and registers RAM: Tracking.
    ///
    /// Order matters (here and in `end`): turning the dirty log on changes
    /// KVM's memslots, which waits for every vCPU inside KVM, and a vCPU
    /// may sit in a fault on registered RAM that only the tracking thread
    /// resolves, while the caller holds the lock that thread needs. So
    /// memslots change only while RAM is not registered.
    fn begin(&self, phase: &mut Phase) -> Result<(), AccessStartError> {
        if self.logs_writes() {
            self.dirty.start_sampled(Consumer::Access)?;
        }
        let mode = RegisterMode {
            minor: true,
            ..Default::default()
        };
        let regions = self.tracker.regions();
        for (i, &(addr, len)) in regions.iter().enumerate() {
            let ok = match self.uffd.register(addr, len, mode) {
                Ok(ioctls) if ioctls.continue_range() => Ok(()),
                Ok(_) => Err(AccessStartError::NoContinue),
                Err(e) => Err(e.into()),
            };
            if let Err(e) = ok {
                for &(a, l) in &regions[..=i] {
                    let _ = self.uffd.unregister(a, l);
                }
                if self.logs_writes() {
                    let _ = self.dirty.stop(Consumer::Access);
                }
                return Err(e);
            }
        }
        self.tracker.restart_period();
        phase.state = TrackingState::Tracking;
        Ok(())
    }

    /// Unregisters RAM (waking anyone waiting on a fault) and then stops
    /// the dirty log consumer (see `begin` for why in this order).
    fn end(&self, phase: &mut Phase, to: TrackingState) {
        self.unregister();
        // Faults read before the unregistration are answered by it.
        let _ = self.uffd.read_events(&mut Vec::new());
        if self.logs_writes() {
            if let Err(e) = self.dirty.stop(Consumer::Access) {
                tracing::warn!(error = %e, "cannot stop the access tracker's dirty log");
            }
        }
        phase.state = to;
    }

    fn unregister(&self) {
        for (addr, len) in self.tracker.regions() {
            if let Err(e) = self.uffd.unregister(addr, len) {
                tracing::warn!(error = %e, "cannot unregister guest RAM from access tracking");
            }
        }
    }

    /// Gives tracking up after an error; the VM runs on.
    fn fail(&self, phase: &mut Phase, why: String) {
        tracing::warn!(error = %why, "access tracking stopped; the VM runs on without it");
        self.end(phase, TrackingState::Failed);
        phase.error = Some(why);
    }

    /// Serves the pending faults; Err says why tracking must stop.
    fn serve(&self, events: &mut Vec<Event>, woke: Instant, tids: &[u32]) -> Result<(), String> {
        events.clear();
        self.uffd
            .read_events(events)
            .map_err(|e| format!("reading faults: {e}"))?;
        for ev in events.iter() {
            let Event::PageFault {
                addr,
                minor: true,
                tid,
                ..
            } = *ev
            else {
                continue; // only MINOR is registered; nothing else waits on us
            };
            // Record before the wake-up: the access belongs to this period.
            let Some(group) = self.tracker.record(addr) else {
                continue;
            };
            let page = addr & !(PAGE_SIZE - 1);
            continue_page(&self.uffd, page).map_err(|e| format!("resolving a fault: {e}"))?;
            // The rest of the group is recorded read: map it back too, so
            // the task that faulted does not fault again on its neighbours
            // (with sampled writes only one page per group is armed).
            if !self.arms_samples() {
                continue_group(&self.uffd, group)
                    .map_err(|e| format!("mapping a sampled group back: {e}"))?;
            }
            self.tracker
                .add_fault_cost(woke.elapsed().as_nanos() as u64);
            if tids.contains(&tid) {
                self.vcpu_faults.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Closes a period (with the writes KVM logged, if it logs them) and
    /// arms the next share.
    ///
    /// Where KVM's log is in manual-protect mode, writes are sampled like
    /// reads: only the share about to be armed is write-protected again,
    /// so a guest writing everywhere pays a logging fault on 1/share of
    /// its pages per period, not on all of them (a radix sort ran at a
    /// third of its speed with every page re-protected each period).
    fn period(&self) -> Result<(), String> {
        if self.arms_samples() {
            let dirty = if self.logs_writes() {
                let next = self.tracker.next_share_mask();
                self.dirty
                    .take_some(Consumer::Access, &next)
                    .map_err(|e| format!("reading the dirty log: {e}"))?
            } else {
                Vec::new() // the faults alone
            };
            self.tracker.end_period_sampled(&dirty);
            self.tracker
                .arm_sampled()
                .map_err(|e| format!("arming the next share: {e}"))?;
            return Ok(());
        }
        let dirty = self
            .dirty
            .take(Consumer::Access)
            .map_err(|e| format!("reading the dirty log: {e}"))?;
        self.tracker.end_period(Some(&dirty));
        self.tracker
            .arm()
            .map_err(|e| format!("arming the next share: {e}"))?;
        Ok(())
    }
}

/// Maps the faulting page back and wakes its thread first.
fn continue_page(uffd: &Userfaultfd, page: u64) -> Result<(), UffdError> {
    let mut tries = 0;
    loop {
        match uffd.continue_range(page, PAGE_SIZE) {
            // Another thread's fault on the page mapped it first.
            Ok(_) | Err(UffdError::AlreadyMapped { .. }) => return Ok(()),
            Err(UffdError::Ioctl { source, .. })
                if source.raw_os_error() == Some(libc::EAGAIN) && tries < 3 =>
            {
                tries += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Maps back every page of `(addr, bytes)` that is armed, in as few calls
/// as the group allows: a page still mapped (skipped by arm as just
/// written, or the one already continued) or not in the page cache (a
/// hole, allocated as usual when touched) is stepped over.
fn continue_group(uffd: &Userfaultfd, (addr, bytes): (u64, u64)) -> Result<(), UffdError> {
    let end = addr + bytes;
    let mut at = addr;
    while at < end {
        let mapped = uffd.continue_prefix(at, end - at)?;
        at += if mapped == 0 { PAGE_SIZE } else { mapped };
    }
    Ok(())
}

/// Unregisters guest RAM if the thread panics: a thread blocked on a
/// fault must never wait for it forever. (Every other way out has ended
/// tracking already, or leaves it to `stop`.)
struct Guard<'a>(&'a Shared);

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut phase = self.0.lock();
        if phase.state == TrackingState::Tracking {
            self.0
                .fail(&mut phase, "the tracking thread ended unexpectedly".into());
        }
    }
}

/// The tracking thread.
fn run(s: &Shared) {
    let _guard = Guard(s);
    let mut events = Vec::new();
    let mut next = Instant::now() + s.config.period;
    let mut tids = (s.vcpu_tids)();
    while !s.stop.load(Ordering::Acquire) {
        let wait = next
            .saturating_duration_since(Instant::now())
            .min(POLL_AT_MOST);
        let ready = s.uffd.poll(wait);
        let woke = Instant::now();
        let mut phase = s.lock();
        match phase.state {
            TrackingState::Tracking => {}
            TrackingState::Paused => {
                let _ = s.uffd.read_events(&mut events);
                events.clear();
                next = woke + s.config.period;
                continue;
            }
            TrackingState::Failed | TrackingState::Stopped => return,
        }
        let served = match ready {
            Ok(true) => s.serve(&mut events, woke, &tids),
            Ok(false) => Ok(()),
            Err(e) => Err(format!("waiting for faults: {e}")),
        };
        let done = served.and_then(|()| {
            if woke < next {
                return Ok(());
            }
            next += s.config.period;
            if next < woke {
                next = woke + s.config.period; // fell behind: no catch-up burst
            }
            tids = (s.vcpu_tids)();
            s.period()
        });
        if let Err(why) = done {
            s.fail(&mut phase, why);
            return;
        }
    }
}

/// A VM's tracking, if any: off, running, or why it could not start.
#[derive(Default)]
pub struct AccessSlot(Mutex<Slot>);

#[derive(Default)]
enum Slot {
    #[default]
    Off,
    On(Arc<AccessTracking>),
    Unavailable(String),
}

impl AccessSlot {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts tracking unless it runs already; a failure is logged and
    /// kept for status (the VM runs on without tracking).
    pub fn start(
        &self,
        memory: &Arc<GuestMemory>,
        dirty: Arc<DirtyLog>,
        config: AccessConfig,
        vcpu_tids: Box<dyn Fn() -> Vec<u32> + Send + Sync>,
    ) {
        let mut slot = self.lock();
        if matches!(*slot, Slot::On(_)) {
            return;
        }
        *slot = match AccessTracking::start(memory, dirty, config, vcpu_tids) {
            Ok(t) => Slot::On(Arc::new(t)),
            Err(e) => {
                tracing::warn!(error = %e, "access tracking unavailable; the VM runs without it");
                Slot::Unavailable(e.to_string())
            }
        };
    }

    fn tracking(&self) -> Option<Arc<AccessTracking>> {
        match &*self.lock() {
            Slot::On(t) => Some(t.clone()),
            _ => None,
        }
    }

    /// Steps tracking aside; true if it was tracking.
    pub fn pause(&self) -> bool {
        self.tracking().is_some_and(|t| t.pause())
    }

    /// Undoes [`pause`](Self::pause).
    pub fn resume(&self) {
        if let Some(t) = self.tracking() {
            t.resume();
        }
    }

    /// Ends tracking (the VM stops); histories stay readable.
    pub fn stop(&self) {
        if let Some(t) = self.tracking() {
            t.stop();
        }
    }

    /// The histories, if tracking ever ran.
    pub fn snapshot(&self) -> Option<AccessSnapshot> {
        self.tracking().map(|t| t.snapshot())
    }

    /// Where tracking stands and what it cost; None when it is off.
    pub fn status(&self) -> Option<AccessStatus> {
        match &*self.lock() {
            Slot::Off => None,
            Slot::On(t) => Some(t.status()),
            Slot::Unavailable(why) => Some(AccessStatus {
                state: TrackingState::Failed,
                error: Some(why.clone()),
                period_ms: 0,
                writes: WriteSource::default(),
                vcpu_faults: 0,
                stats: AccessStats::default(),
            }),
        }
    }
}
