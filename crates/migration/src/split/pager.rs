//! Remote paging on a split VM's main host, for as long as the VM runs
//! here. All guest RAM is under one userfaultfd (MISSING and WP, and MINOR
//! where the kernel allows all three), served by one thread, which is the
//! only writer of the location map, so faults, page-ins and page-outs are
//! ordered by construction:
//! - a MISSING fault on a chunk held here is a page never written: every
//!   hole of the chunk gets a zero page at once;
//! - a MISSING fault on a remote chunk pages it in: the server sends the
//!   faulting page first (the vCPU is woken at once), then the rest of the
//!   chunk, and forgets it; what it did not hold becomes zero pages;
//! - after a page-in over budget, the coldest chunk held here is paged
//!   out: write-protected (writers wait), read through the memfd (never the
//!   guest mapping, where this thread could fault on itself), its non-zero
//!   pages sent to its home server (and mirror), synced, punched out of
//!   the memfd, unprotected; the writers then fault MISSING and page it
//!   back in;
//! - access sampling (with MINOR): every period a share of the chunks held
//!   here loses its page table entries; the first access to one raises a
//!   MINOR fault, which marks the chunk referenced and maps it back. The
//!   ranking (clock: last use; aging: 8-bit history) picks the page-out
//!   victim;
//! - clock also arms on demand, as a two-handed clock: while the main host
//!   pages out, a front hand keeps a lead of chunks armed, and the victim
//!   is the chunk armed longest ago that no access has touched since (the
//!   back hand), so a chunk in use is never taken for cold merely because
//!   no period sampled it. Arming costs one MINOR fault per chunk in use,
//!   paid only while paging out.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_memory::{Event, Features, RegisterMode, UffdError, Userfaultfd};

use crate::memory::RegionView;
use crate::memserver::StoreClient;
use crate::options::Rank;
use crate::ranges::{GpaPages, PAGE};
use crate::MigrationError;

use super::{ChunkMap, SplitPlan, ON_MAIN};

/// How often the pager samples accesses and ages its chunks.
const PERIOD: Duration = Duration::from_secs(1);
/// Most chunks armed for sampling per period (a MINOR fault costs a vCPU
/// 30-90 µs here, so the share stays small).
const ARM_MAX: usize = 64;
/// Chunks the clock keeps armed ahead of page-out: this share of the
/// budget, within the bounds below.
const CLOCK_LEAD_SHARE: u64 = 8;
const CLOCK_LEAD_MIN: usize = 4;
const CLOCK_LEAD_MAX: usize = 256;
/// How long an armed chunk must go untouched before the clock takes it
/// for cold (a chunk in use is touched within a few milliseconds).
const CLOCK_MIN_EXPOSURE: Duration = Duration::from_millis(10);
/// How far one quick refault moves the clock's choice.
const LOOP_LEARN: f64 = 0.1;
/// Chunks the idle loop keeps free below the budget (so a page-in seldom
/// waits for a page-out): this share of the budget, within the bounds.
const RESERVE_SHARE: u64 = 32;
const RESERVE_MIN: u64 = 1;
const RESERVE_MAX: u64 = 16;
/// Page-in latencies kept for the percentiles.
const LATENCY_SAMPLES: usize = 1 << 16;

/// What remote paging did so far (the VMM's status shows it).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PagerStats {
    /// Pages per chunk.
    pub chunk_pages: u64,
    /// Chunks in all.
    pub chunks: u64,
    /// Chunks the main host may hold.
    pub budget_chunks: u64,
    /// Chunks held here now.
    pub resident_chunks: u64,
    /// Chunks paged in (faults on a remote chunk).
    pub page_ins: u64,
    /// Pages those brought (held ones; the rest of a chunk is zero).
    pub pages_in: u64,
    /// Chunks paged out.
    pub page_outs: u64,
    /// Pages those sent.
    pub pages_out: u64,
    /// Page-outs of a chunk the clock had armed and seen untouched since
    /// (the others fell back to the least recently seen chunk).
    pub cold_victims: u64,
    /// Of those, the ones taken as the idle chunk used last, because the
    /// chunk idle longest kept coming straight back (a loop).
    pub loop_victims: u64,
    /// Zero pages mapped into chunks held here (never-written pages of a
    /// chunk filled at its first fault, or the pages a page-in did not bring).
    pub zero_fills: u64,
    /// MINOR faults taken by access sampling.
    pub sampled_faults: u64,
    /// False when the kernel refused MINOR with MISSING+WP: page-out then
    /// ranks chunks by their faults only.
    pub sampling: bool,
    /// Fault to wake of a page-in, µs: median, 99th percentile, most.
    pub page_in_p50_us: f64,
    /// As above, 99th percentile.
    pub page_in_p99_us: f64,
    /// As above, the most.
    pub page_in_max_us: f64,
    /// Memory servers lost while paging (their chunks are served from
    /// their second copies, where there are any).
    pub lost_servers: Vec<String>,
    /// Why paging stopped (a chunk with no copy left), if it did.
    pub failure: Option<String>,
}

/// Counters the pager thread updates and anyone may read.
#[derive(Default)]
struct Counters {
    resident: AtomicU64,
    page_ins: AtomicU64,
    pages_in: AtomicU64,
    page_outs: AtomicU64,
    pages_out: AtomicU64,
    cold_victims: AtomicU64,
    loop_victims: AtomicU64,
    zero_fills: AtomicU64,
    sampled: AtomicU64,
}

type FailureHook = Box<dyn Fn(&str) + Send>;

struct Shared {
    stop: AtomicBool,
    counters: Counters,
    latency_us: Mutex<Vec<f64>>,
    failure: Mutex<Option<String>>,
    lost: Mutex<Vec<String>>,
    /// Told once when paging fails (the VMM stops the VM).
    on_failure: Mutex<Option<FailureHook>>,
    /// The location map, per chunk: [`ON_MAIN`] or 1 + server index.
    places: Mutex<Vec<u16>>,
    /// A gather reads the servers: no page-outs, and page-ins leave the
    /// servers' copies in place.
    gathering: AtomicBool,
    /// Held for the whole of a page-out: a gather's snapshot waits for
    /// one in flight (its chunk would be a hole here and not yet there).
    paging_out: Mutex<()>,
}

impl Shared {
    /// The location map, held (a panicked holder left it whole: every
    /// write is one element).
    fn places_held(&self) -> std::sync::MutexGuard<'_, Vec<u16>> {
        self.places.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the location map.
    fn places(&self) -> Vec<u16> {
        self.places_held().clone()
    }
}

/// Remote paging for one VM; dropping it stops the thread, releases the
/// memory from userfaultfd and frees the VM's stores on the servers (the
/// VM must not run on without it).
pub struct RemotePager {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    map: ChunkMap,
    budget: u64,
    sampling: bool,
    /// The VM's id on the servers, and the servers.
    vm: String,
    servers: Vec<crate::transport::Endpoint>,
}

/// Where a split VM's memory is when a gather begins.
#[derive(Clone, Debug)]
pub struct GatherSnapshot {
    /// The VM's id on the servers.
    pub vm: String,
    /// Pages per chunk.
    pub chunk_pages: u32,
    /// The memory servers.
    pub servers: Vec<crate::transport::Endpoint>,
    /// Per chunk: [`ON_MAIN`] or 1 + the server holding it.
    pub places: Vec<u16>,
    /// The pager's counters once paging-out had stopped (a page-out
    /// under way when the gather began is counted here).
    pub at_start: PagerStats,
}

impl RemotePager {
    /// Puts `regions` under userfaultfd with every chunk the plan places
    /// elsewhere punched out, and starts serving faults. `stores` are open
    /// on the plan's servers, in its order.
    pub fn start(
        regions: Vec<RegionView>,
        fds: Vec<std::os::fd::OwnedFd>,
        plan: &SplitPlan,
        stores: Vec<StoreClient>,
    ) -> Result<Self, MigrationError> {
        let map = ChunkMap::new(&regions, plan.chunk_pages);
        plan.check(&map).map_err(MigrationError::Mismatch)?;
        if fds.len() != regions.len() {
            return Err(MigrationError::Mismatch(format!(
                "{} memory files for {} regions",
                fds.len(),
                regions.len()
            )));
        }
        let files: Vec<std::fs::File> = fds.into_iter().map(std::fs::File::from).collect();
        let fail = |what: &str, e: UffdError| {
            MigrationError::Unsupported(format!("split paging needs userfaultfd {what}: {e}"))
        };
        let uffd = Userfaultfd::new(Features {
            missing_shmem: true,
            minor_shmem: true,
            wp_shmem: true,
            ..Default::default()
        })
        .or_else(|_| {
            Userfaultfd::new(Features {
                missing_shmem: true,
                wp_shmem: true,
                ..Default::default()
            })
        })
        .map_err(|e| fail("(MISSING and WP on shared memory)", e))?;
        // Remote chunks must read as missing here.
        for (c, &p) in plan.places.iter().enumerate() {
            if p != ON_MAIN {
                let run = map.run(c);
                let host = host_of(&regions, run.gpa).ok_or_else(|| bad_gpa(run.gpa))?;
                // SAFETY: the run lies inside a region of this VM's shared
                // guest mapping (host_of checked), and its pages live on a
                // memory server.
                unsafe { ferry_memory::mapping::remove_range(host, run.bytes()) }
                    .map_err(|e| MigrationError::vm("punch remote chunks")(e.to_string()))?;
            }
        }
        let all = RegisterMode {
            missing: true,
            wp: true,
            minor: true,
        };
        let mut sampling = true;
        for r in &regions {
            let got = uffd.register(r.host_start(), r.size(), all).or_else(|_| {
                sampling = false;
                uffd.register(
                    r.host_start(),
                    r.size(),
                    RegisterMode {
                        minor: false,
                        ..all
                    },
                )
            });
            let ioctls = got.map_err(|e| fail("registration", e))?;
            if !(ioctls.copy() && ioctls.zeropage() && ioctls.write_protect()) {
                return Err(MigrationError::Unsupported(
                    "this kernel lacks UFFDIO_COPY, ZEROPAGE or WRITEPROTECT on guest memory"
                        .into(),
                ));
            }
        }
        let resident = plan.places.iter().filter(|&&p| p == ON_MAIN).count() as u64;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            counters: Counters::default(),
            latency_us: Mutex::new(Vec::new()),
            failure: Mutex::new(None),
            lost: Mutex::new(Vec::new()),
            on_failure: Mutex::new(None),
            places: Mutex::new(plan.places.clone()),
            gathering: AtomicBool::new(false),
            paging_out: Mutex::new(()),
        });
        shared.counters.resident.store(resident, Ordering::Relaxed);
        let n = map.chunks();
        let worker = Worker {
            uffd,
            regions,
            files,
            map: map.clone(),
            homes: plan.homes.clone(),
            mirrors: plan.mirrors.clone(),
            servers: plan.servers.iter().map(|s| s.to_string()).collect(),
            budget: plan.budget_chunks,
            rank: plan.rank,
            stores,
            dead: vec![false; plan.servers.len()],
            last_use: vec![0; n],
            events: 0,
            aging: vec![0x80; n],
            referenced: vec![false; n],
            armed_at: vec![None; n],
            hand: 0,
            pressed: false,
            evicted: vec![None; n],
            loop_weight: 0.0,
            armed: Vec::new(),
            cursor: 0,
            sampling,
            shared: shared.clone(),
            parked: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("ferry-pager".into())
            .spawn(move || worker.run())
            .map_err(|e| MigrationError::Unsupported(format!("cannot start the pager: {e}")))?;
        tracing::info!(
            chunks = n,
            resident,
            budget = plan.budget_chunks,
            sampling,
            "remote paging started"
        );
        Ok(RemotePager {
            shared,
            thread: Some(thread),
            map,
            budget: plan.budget_chunks,
            sampling,
            vm: plan.vm.clone(),
            servers: plan.servers.clone(),
        })
    }

    /// What paging did so far.
    pub fn stats(&self) -> PagerStats {
        let c = &self.shared.counters;
        let mut lat = self
            .shared
            .latency_us
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        lat.sort_by(f64::total_cmp);
        let pct = |q: f64| {
            lat.get(((lat.len() as f64 - 1.0) * q).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        PagerStats {
            chunk_pages: self.map.chunk_pages(),
            chunks: self.map.chunks() as u64,
            budget_chunks: self.budget,
            resident_chunks: c.resident.load(Ordering::Relaxed),
            page_ins: c.page_ins.load(Ordering::Relaxed),
            pages_in: c.pages_in.load(Ordering::Relaxed),
            page_outs: c.page_outs.load(Ordering::Relaxed),
            pages_out: c.pages_out.load(Ordering::Relaxed),
            cold_victims: c.cold_victims.load(Ordering::Relaxed),
            loop_victims: c.loop_victims.load(Ordering::Relaxed),
            zero_fills: c.zero_fills.load(Ordering::Relaxed),
            sampled_faults: c.sampled.load(Ordering::Relaxed),
            sampling: self.sampling,
            page_in_p50_us: pct(0.5),
            page_in_p99_us: pct(0.99),
            page_in_max_us: lat.last().copied().unwrap_or(0.0),
            lost_servers: self
                .shared
                .lost
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            failure: self.failure(),
        }
    }

    /// Calls `hook` once when paging fails for good (a page out of reach):
    /// at once if it already has. It runs on the pager's thread and must
    /// not wait for the VM's vCPUs (they may wait for the pager).
    pub fn on_failure(&self, hook: impl Fn(&str) + Send + 'static) {
        let failure = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(why) = failure.as_ref() {
            hook(why);
        }
        *self
            .shared
            .on_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Box::new(hook));
    }

    /// A gather begins: from now on nothing is paged out and page-ins
    /// leave the servers' copies in place, so what the servers hold stays
    /// what the snapshot says (a chunk paged in meanwhile has the same
    /// bytes on both sides until the guest writes it, which the dirty log
    /// sees).
    pub fn begin_gather(&self) -> GatherSnapshot {
        self.shared.gathering.store(true, Ordering::SeqCst);
        let _no_page_out = self
            .shared
            .paging_out
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        GatherSnapshot {
            vm: self.vm.clone(),
            chunk_pages: self.map.chunk_pages() as u32,
            servers: self.servers.clone(),
            places: self.places(),
            at_start: self.stats(),
        }
    }

    /// The gather failed: the VM stays split here, paging as before.
    pub fn end_gather(&self) {
        self.shared.gathering.store(false, Ordering::SeqCst);
    }

    /// Why paging stopped, if it did.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A copy of the location map: per chunk, [`ON_MAIN`] or 1 + server.
    pub fn places(&self) -> Vec<u16> {
        self.shared.places()
    }
}

impl Drop for RemotePager {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn host_of(regions: &[RegionView], gpa: u64) -> Option<u64> {
    crate::memory::region_of(regions, gpa)
        .and_then(|(_, r)| r.host_range(gpa, PAGE))
        .map(|p| p as u64)
}

fn bad_gpa(gpa: u64) -> MigrationError {
    MigrationError::Mismatch(format!("guest address {gpa:#x} is outside the VM's memory"))
}

/// The pager thread's own state.
struct Worker {
    uffd: Userfaultfd,
    regions: Vec<RegionView>,
    /// The memfd behind each region: page-out reads through it, never
    /// through the mapping (a page there may fault on this very thread).
    files: Vec<std::fs::File>,
    map: ChunkMap,
    homes: Vec<u16>,
    mirrors: Vec<u16>,
    servers: Vec<String>,
    budget: u64,
    rank: Rank,
    stores: Vec<StoreClient>,
    /// Servers that failed: their chunks cannot come back.
    dead: Vec<bool>,
    /// Per chunk: when it was last seen used (a count of paging events,
    /// so chunks used within one period still have an order).
    last_use: Vec<u64>,
    /// The paging event count.
    events: u64,
    /// Per chunk: aging history (top bit = the latest period).
    aging: Vec<u8>,
    /// Per chunk: referenced since it was armed.
    referenced: Vec<bool>,
    /// Per chunk held here: when it was armed and not touched since.
    armed_at: Vec<Option<Instant>>,
    /// The clock's front hand.
    hand: usize,
    /// Per chunk paged out: the page-out count then, and whether the
    /// clock took it as the one used last.
    evicted: Vec<Option<(u64, bool)>>,
    /// How much quick refaults favour taking the idle chunk used last over
    /// the one used longest ago (above one half: the former).
    loop_weight: f64,
    /// A page-in found the budget full: from then on the idle loop pages
    /// out ahead (not before: a VM that never pages keeps its chunks).
    pressed: bool,
    /// Chunks armed this period.
    armed: Vec<usize>,
    /// Where the next arming starts.
    cursor: usize,
    sampling: bool,
    shared: Arc<Shared>,
    /// Faults on chunks of a dead server: never woken (the VM stops).
    parked: Vec<u64>,
}

impl Worker {
    fn run(mut self) {
        let mut events = Vec::new();
        let mut next_period = Instant::now() + PERIOD;
        while !self.shared.stop.load(Ordering::Acquire) {
            if Instant::now() >= next_period {
                self.period();
                next_period = Instant::now() + PERIOD;
            }
            // Page-out down to the low watermark runs only while no fault
            // waits: a fault never queues behind it for more than one chunk.
            let idle_work = self.below_watermark_needed();
            let wait = if idle_work {
                Duration::ZERO
            } else {
                Duration::from_millis(20)
            };
            match self.uffd.poll(wait) {
                Ok(true) => {}
                Ok(false) => {
                    if idle_work {
                        if let Err(e) = self.evict_one(None) {
                            self.fail(e.to_string());
                        }
                    }
                    continue;
                }
                Err(e) => {
                    self.fail(format!("reading userfaultfd: {e}"));
                    break;
                }
            }
            events.clear();
            if let Err(e) = self.uffd.read_events(&mut events) {
                self.fail(format!("reading userfaultfd: {e}"));
                break;
            }
            for ev in &events {
                if let Event::PageFault {
                    addr, wp, minor, ..
                } = *ev
                {
                    if let Err(e) = self.fault(addr, wp, minor) {
                        self.fail(e.to_string());
                    }
                }
            }
        }
        for r in &self.regions {
            let _ = self.uffd.unregister(r.host_start(), r.size());
        }
        // The VM is gone from here: what the servers hold for it is garbage.
        for store in self.stores.drain(..) {
            let _ = store.close();
        }
    }

    fn fail(&self, why: String) {
        let sh = &self.shared;
        let mut f = sh.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_some() {
            return;
        }
        tracing::error!(%why, "remote paging failed");
        if let Some(hook) = sh
            .on_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            hook(&why);
        }
        *f = Some(why);
    }

    fn place(&self, c: usize) -> u16 {
        self.shared.places_held()[c]
    }

    fn set_place(&self, c: usize, p: u16) {
        self.shared.places_held()[c] = p;
    }

    fn fault(&mut self, addr: u64, wp: bool, minor: bool) -> Result<(), MigrationError> {
        let page = addr & !(PAGE - 1);
        let Some(gpa) = self.regions.iter().find_map(|r| r.gpa_of_host(page)) else {
            return Ok(());
        };
        let Some(c) = self.map.chunk_of(gpa) else {
            return Ok(());
        };
        if wp {
            // A write that waited on a page-out, which has finished: the
            // page is gone now, and the retry faults MISSING.
            let _ = self.uffd.wake(page, PAGE);
            return Ok(());
        }
        self.events += 1;
        self.last_use[c] = self.events;
        self.referenced[c] = true;
        self.armed_at[c] = None;
        if minor {
            self.shared.counters.sampled.fetch_add(1, Ordering::Relaxed);
            return self.map_back(c, page);
        }
        let place = self.place(c);
        if place == ON_MAIN {
            // Never-written pages of a chunk held here: all of them at
            // once (a guest filling fresh memory faults once per chunk,
            // not once per page; the budget counts whole chunks anyway).
            self.fill_holes(c)?;
            let _ = self.uffd.wake(page, PAGE);
            return Ok(());
        }
        let t = Instant::now();
        for server in self.copies(c) {
            if self.dead[server] {
                continue;
            }
            match self.page_in(c, gpa, server, t) {
                Ok(()) if self.shared.gathering.load(Ordering::SeqCst) => return Ok(()),
                Ok(()) => {
                    // The other copy is stale from now on.
                    for other in self.copies(c) {
                        if other != server && !self.dead[other] {
                            let run = [self.map.run(c)];
                            let store = &mut self.stores[other];
                            if let Err(e) = store.drop_runs(&run).and_then(|_| store.flush()) {
                                self.lose(other, &e.to_string());
                            }
                        }
                    }
                    self.learn_refault(c);
                    return self.keep_budget(c);
                }
                Err(e) => self.lose(server, &e.to_string()),
            }
        }
        self.parked.push(gpa);
        let names: Vec<&str> = self
            .copies(c)
            .into_iter()
            .map(|s| self.servers[s].as_str())
            .collect();
        Err(MigrationError::Unsupported(format!(
            "page {gpa:#x} is out of reach: memory server {} failed and the VM cannot run on without it",
            names.join(" and ")
        )))
    }

    /// The servers holding chunk `c` when it is not here (home first).
    fn copies(&self, c: usize) -> Vec<usize> {
        [self.homes[c], self.mirrors[c]]
            .into_iter()
            .filter(|&s| s != ON_MAIN)
            .map(|s| usize::from(s) - 1)
            .collect()
    }

    /// A memory server failed: paging goes on with the other copies.
    fn lose(&mut self, server: usize, why: &str) {
        if !std::mem::replace(&mut self.dead[server], true) {
            tracing::error!(server = %self.servers[server], %why, "memory server lost");
            let mut lost = self.shared.lost.lock().unwrap_or_else(|e| e.into_inner());
            lost.push(self.servers[server].clone());
        }
    }

    /// Maps zero pages over every hole of chunk `c` (waking whoever waits
    /// on one).
    fn fill_holes(&self, c: usize) -> Result<(), MigrationError> {
        let (host, resident) = self.residency(c)?;
        let holes: Vec<bool> = resident.iter().map(|&r| !r).collect();
        let mut filled = 0;
        for (i, n) in runs_of(&holes) {
            let at = host + i as u64 * PAGE;
            match self.uffd.zeropage(at, n as u64 * PAGE) {
                Ok(_) => filled += n as u64,
                Err(UffdError::AlreadyMapped { .. }) => {
                    for p in 0..n as u64 {
                        if self.uffd.zeropage(at + p * PAGE, PAGE).is_ok() {
                            filled += 1;
                        }
                    }
                }
                Err(e) => return Err(uffd_err("zero page", e)),
            }
        }
        self.shared
            .counters
            .zero_fills
            .fetch_add(filled, Ordering::Relaxed);
        Ok(())
    }

    /// Chunk `c`'s first host address, and which of its pages are in the
    /// memfd (asked with mincore: nothing is touched).
    fn residency(&self, c: usize) -> Result<(u64, Vec<bool>), MigrationError> {
        let run = self.map.run(c);
        let host = host_of(&self.regions, run.gpa).ok_or_else(|| bad_gpa(run.gpa))?;
        // SAFETY: the chunk lies inside this VM's guest mapping (host_of).
        let resident = unsafe { ferry_memory::mapping::resident_pages(host, run.bytes()) }
            .map_err(|e| MigrationError::vm("mincore")(e.to_string()))?;
        Ok((host, resident))
    }

    /// A sampled chunk was touched: maps all its resident pages back at
    /// once (sampling dropped their page table entries), so the chunk costs
    /// one MINOR fault per period, not one per page; then wakes the fault.
    fn map_back(&mut self, c: usize, page: u64) -> Result<(), MigrationError> {
        let (host, resident) = self.residency(c)?;
        for (i, n) in runs_of(&resident) {
            let at = host + i as u64 * PAGE;
            if let Err(UffdError::AlreadyMapped { .. }) =
                self.uffd.continue_range(at, n as u64 * PAGE)
            {
                // Some are mapped already: one by one.
                for p in 0..n as u64 {
                    let _ = self.uffd.continue_range(at + p * PAGE, PAGE);
                }
            }
        }
        let _ = self.uffd.wake(page, PAGE);
        Ok(())
    }

    /// Brings chunk `c` from `server`: the page at `gpa` first (its vCPU
    /// is woken as soon as it is in), then the rest; the server forgets it.
    fn page_in(
        &mut self,
        c: usize,
        gpa: u64,
        server: usize,
        t: Instant,
    ) -> Result<(), MigrationError> {
        let run = self.map.run(c);
        let runs: Vec<GpaPages> = [
            GpaPages::new(gpa, 1),
            GpaPages::new(gpa + PAGE, (run.end() - gpa) / PAGE - 1),
            GpaPages::new(run.gpa, (gpa - run.gpa) / PAGE),
        ]
        .into_iter()
        .filter(|r| r.pages > 0)
        .collect();
        let (uffd, regions, shared) = (&self.uffd, &self.regions, &self.shared);
        let mut pages = 0u64;
        let drop = !shared.gathering.load(Ordering::SeqCst);
        self.stores[server].fetch_runs(&runs, drop, |i, gpas, data| {
            // One copy per run of consecutive pages (a chunk is one run in
            // one region): a page at a time costs an ioctl each.
            let mut j = 0;
            while j < gpas.len() {
                let mut n = 1;
                while j + n < gpas.len() && gpas[j + n] == gpas[j] + n as u64 * PAGE {
                    n += 1;
                }
                let host = host_of(regions, gpas[j]).ok_or_else(|| bad_gpa(gpas[j]))?;
                let last = host_of(regions, gpas[j + n - 1]);
                let bytes = &data[j * PAGE as usize..][..n * PAGE as usize];
                let whole = last == Some(host + (n as u64 - 1) * PAGE);
                match whole.then(|| uffd.copy(host, bytes, i == 0)) {
                    Some(Ok(_)) => pages += n as u64,
                    Some(Err(e)) if !matches!(e, UffdError::AlreadyMapped { .. }) => {
                        return Err(uffd_err("copy", e))
                    }
                    // Some page is mapped already, or the run spans two
                    // regions: a page at a time.
                    _ => {
                        for (k, &g) in gpas[j..j + n].iter().enumerate() {
                            let host = host_of(regions, g).ok_or_else(|| bad_gpa(g))?;
                            let page = &bytes[k * PAGE as usize..][..PAGE as usize];
                            match uffd.copy(host, page, i == 0) {
                                Ok(_) | Err(UffdError::AlreadyMapped { .. }) => pages += 1,
                                Err(e) => return Err(uffd_err("copy", e)),
                            }
                        }
                    }
                }
                j += n;
            }
            if i == 0 {
                if gpas.is_empty() {
                    // A zero page: the server held nothing for it.
                    let host = host_of(regions, gpa).ok_or_else(|| bad_gpa(gpa))?;
                    match uffd.zeropage(host, PAGE) {
                        Ok(_) | Err(UffdError::AlreadyMapped { .. }) => {}
                        Err(e) => return Err(uffd_err("zero page", e)),
                    }
                }
                let mut lat = shared.latency_us.lock().unwrap_or_else(|e| e.into_inner());
                if lat.len() < LATENCY_SAMPLES {
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            Ok(())
        })?;
        // The pages the server did not hold are zero pages.
        self.fill_holes(c)?;
        // A vCPU that faulted on a page of the chunk while it came in
        // waits for a wake (the copies did not wake): give it now, not
        // after the page-out that may follow.
        let host = host_of(regions, run.gpa).ok_or_else(|| bad_gpa(run.gpa))?;
        let _ = self.uffd.wake(host, run.bytes());
        self.set_place(c, ON_MAIN);
        self.aging[c] |= 0x80;
        let k = &self.shared.counters;
        k.resident.fetch_add(1, Ordering::Relaxed);
        k.page_ins.fetch_add(1, Ordering::Relaxed);
        k.pages_in.fetch_add(pages, Ordering::Relaxed);
        Ok(())
    }

    /// Pages out the coldest chunks until the main host is within budget
    /// (never `keep`, just paged in): the hard limit, paid by the fault
    /// that crossed it. The idle loop keeps a reserve below it, so this
    /// seldom has work.
    fn keep_budget(&mut self, keep: usize) -> Result<(), MigrationError> {
        // (A gather pages nothing out: checked each time round, since
        // one may begin between two page-outs.)
        while !self.shared.gathering.load(Ordering::SeqCst)
            && self.shared.counters.resident.load(Ordering::Relaxed) > self.budget
        {
            if !self.evict_one(Some(keep))? {
                return Ok(());
            }
            // Paging has begun: the idle loop keeps a reserve from now on.
            self.pressed = true;
        }
        Ok(())
    }

    /// True when the main host holds more than its low watermark (the
    /// budget less a reserve for the next page-ins) and may page out.
    fn below_watermark_needed(&self) -> bool {
        let reserve = (self.budget / RESERVE_SHARE).clamp(RESERVE_MIN, RESERVE_MAX);
        self.pressed
            && !self.shared.gathering.load(Ordering::SeqCst)
            && self.budget > reserve
            && self.shared.counters.resident.load(Ordering::Relaxed) > self.budget - reserve
            && self.failure_free()
    }

    fn failure_free(&self) -> bool {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
            && !self.dead.iter().all(|&d| d)
    }

    /// Pages out the coldest chunk held here other than `keep`; false when
    /// there is none to page out.
    fn evict_one(&mut self, keep: Option<usize>) -> Result<bool, MigrationError> {
        let clock = self.rank == Rank::Clock && self.sampling;
        let keep = keep.unwrap_or(usize::MAX);
        let places = self.shared.places();
        let held = |c: &usize| places[*c] == ON_MAIN && *c != keep;
        let cold = if clock {
            self.clock_victim(&places, keep)
        } else {
            None
        };
        let victim = cold.map(|(c, _)| c).or_else(|| {
            (0..places.len())
                .filter(held)
                .min_by_key(|&c| match self.rank {
                    Rank::Clock => (0u8, self.last_use[c]),
                    Rank::Aging => (self.aging[c], self.last_use[c]),
                })
        });
        let Some(victim) = victim else {
            return Ok(false);
        };
        let live: Vec<usize> = self
            .copies(victim)
            .into_iter()
            .filter(|&s| !self.dead[s])
            .collect();
        if live.is_empty() {
            // Not fatal: the VM runs on, over budget.
            tracing::warn!("every memory server of a chunk to page out was lost; the main host stays over budget");
            return Ok(false);
        }
        self.page_out(victim, &live)?;
        let outs = self.shared.counters.page_outs.load(Ordering::Relaxed);
        self.evicted[victim] = Some((outs, cold.is_some_and(|(_, last)| last)));
        if let Some((_, last)) = cold {
            let k = &self.shared.counters;
            k.cold_victims.fetch_add(1, Ordering::Relaxed);
            k.loop_victims.fetch_add(u64::from(last), Ordering::Relaxed);
        }
        if clock {
            self.clock_arm(&places, keep, victim);
        }
        Ok(true)
    }

    /// The back hand: among the chunks held here that were armed and have
    /// gone untouched for long enough, the one used longest ago, or, while
    /// that choice keeps coming straight back (a loop over more than the
    /// budget, where the chunk idle longest is the one needed next), the
    /// one used last. Returns it and whether it was the latter.
    fn clock_victim(&self, places: &[u16], keep: usize) -> Option<(usize, bool)> {
        let now = Instant::now();
        let idle = (0..places.len())
            .filter(|&c| places[c] == ON_MAIN && c != keep)
            .filter(|&c| {
                self.armed_at[c].is_some_and(|t| now.duration_since(t) >= CLOCK_MIN_EXPOSURE)
            });
        let loop_mode = self.loop_weight > 0.5;
        if loop_mode {
            idle.max_by_key(|&c| self.last_use[c]).map(|c| (c, true))
        } else {
            idle.min_by_key(|&c| self.last_use[c]).map(|c| (c, false))
        }
    }

    /// Chunk `c` came back: if it was paged out only a lead of page-outs
    /// ago, the choice that took it was wrong, and the other one gains.
    fn learn_refault(&mut self, c: usize) {
        let outs = self.shared.counters.page_outs.load(Ordering::Relaxed);
        let Some((at, by_last_use)) = self.evicted[c] else {
            return;
        };
        if outs.saturating_sub(at) > self.clock_lead() as u64 {
            return;
        }
        if by_last_use {
            self.loop_weight *= 1.0 - LOOP_LEARN;
        } else {
            self.loop_weight += (1.0 - self.loop_weight) * LOOP_LEARN;
        }
    }

    fn clock_lead(&self) -> usize {
        ((self.budget / CLOCK_LEAD_SHARE) as usize).clamp(CLOCK_LEAD_MIN, CLOCK_LEAD_MAX)
    }

    /// The front hand: arms chunks held here (drops their page table
    /// entries: the next access raises a MINOR fault, which disarms) until
    /// the lead is armed again.
    fn clock_arm(&mut self, places: &[u16], keep: usize, gone: usize) {
        let lead = self.clock_lead();
        let held = |c: usize| places[c] == ON_MAIN && c != keep && c != gone;
        let mut armed = (0..places.len())
            .filter(|&c| held(c) && self.armed_at[c].is_some())
            .count();
        let now = Instant::now();
        let n = places.len();
        let mut seen = 0;
        while armed < lead && seen < n {
            let c = self.hand;
            self.hand = (self.hand + 1) % n;
            seen += 1;
            if !held(c) || self.armed_at[c].is_some() {
                continue;
            }
            if self.drop_ptes(c) {
                self.armed_at[c] = Some(now);
                armed += 1;
            }
        }
    }

    /// Drops chunk `c`'s page table entries (the memfd keeps its pages):
    /// its next access raises a MINOR fault.
    fn drop_ptes(&self, c: usize) -> bool {
        let run = self.map.run(c);
        let Some(host) = host_of(&self.regions, run.gpa) else {
            return false;
        };
        // SAFETY: the chunk lies inside this VM's shared guest mapping;
        // only page table entries go, the memfd keeps the pages.
        unsafe { ferry_memory::mapping::drop_ptes(host, run.bytes()) }.is_ok()
    }

    /// Moves chunk `c` to `servers` (its home, and its mirror): write-
    /// protect, read, send, sync, punch, unprotect (writers blocked
    /// meanwhile fault MISSING next). A server that fails is lost; the
    /// chunk moves if one copy landed.
    fn page_out(&mut self, c: usize, servers: &[usize]) -> Result<(), MigrationError> {
        let shared = self.shared.clone();
        let _out = shared.paging_out.lock().unwrap_or_else(|e| e.into_inner());
        if shared.gathering.load(Ordering::SeqCst) {
            return Ok(());
        }
        let run = self.map.run(c);
        let host = host_of(&self.regions, run.gpa).ok_or_else(|| bad_gpa(run.gpa))?;
        let len = run.bytes();
        let (ri, view) = crate::memory::region_of(&self.regions, run.gpa)
            .map(|(i, r)| (i, *r))
            .ok_or_else(|| bad_gpa(run.gpa))?;
        self.uffd
            .write_protect(host, len, true)
            .map_err(|e| uffd_err("write-protect", e))?;
        let result = (|| -> Result<u64, MigrationError> {
            // Read through the memfd: a hole reads as zeros there, and
            // nothing this thread does can raise a fault it would have to
            // serve itself. Writers wait on the protection meanwhile.
            let mut bytes = vec![0u8; len as usize];
            std::os::unix::fs::FileExt::read_exact_at(
                &self.files[ri],
                &mut bytes,
                run.gpa - view.gpa(),
            )
            .map_err(|e| MigrationError::vm("read a chunk to page out")(e.to_string()))?;
            let (mut gpas, mut data) = (Vec::new(), Vec::new());
            for (i, page) in bytes.chunks_exact(PAGE as usize).enumerate() {
                if !crate::memory::is_zero(page) {
                    gpas.push(run.gpa + i as u64 * PAGE);
                    data.extend_from_slice(page);
                }
            }
            let mut landed = 0;
            for &server in servers {
                let store = &mut self.stores[server];
                match store.put(&gpas, &data).and_then(|_| store.sync()) {
                    Ok(_) => landed += 1,
                    Err(e) => self.lose(server, &e.to_string()),
                }
            }
            if landed == 0 {
                let names: Vec<String> = servers
                    .iter()
                    .map(|&i| self.servers[i].to_string())
                    .collect();
                return Err(MigrationError::Unsupported(format!(
                    "every memory server of a chunk failed while paging it out ({})",
                    names.join(", ")
                )));
            }
            // SAFETY: as above; the chunk's data is on its server now.
            unsafe { ferry_memory::mapping::remove_range(host, len) }
                .map_err(|e| MigrationError::vm("punch a paged-out chunk")(e.to_string()))?;
            Ok(gpas.len() as u64)
        })();
        self.uffd
            .write_protect(host, len, false)
            .map_err(|e| uffd_err("unprotect", e))?;
        let _ = self.uffd.wake(host, len);
        let pages = result?;
        self.set_place(c, self.homes[c]);
        self.armed_at[c] = None;
        let k = &self.shared.counters;
        k.resident.fetch_sub(1, Ordering::Relaxed);
        k.page_outs.fetch_add(1, Ordering::Relaxed);
        k.pages_out.fetch_add(pages, Ordering::Relaxed);
        Ok(())
    }

    /// Ends a sampling period: ages the chunks armed in it and arms the
    /// next share of the chunks held here.
    fn period(&mut self) {
        for &c in &self.armed {
            self.aging[c] = (self.aging[c] >> 1) | if self.referenced[c] { 0x80 } else { 0 };
        }
        self.armed.clear();
        if !self.sampling {
            return;
        }
        let places = self.shared.places();
        let n = places.len();
        let want =
            (self.shared.counters.resident.load(Ordering::Relaxed) as usize / 4).clamp(1, ARM_MAX);
        let mut seen = 0;
        while self.armed.len() < want && seen < n {
            let c = self.cursor;
            self.cursor = (self.cursor + 1) % n;
            seen += 1;
            if places[c] != ON_MAIN {
                continue;
            }
            if self.drop_ptes(c) {
                self.referenced[c] = false;
                self.armed_at[c].get_or_insert(Instant::now());
                self.armed.push(c);
            }
        }
    }
}

/// Runs of `true` in `v` as (start, length).
fn runs_of(v: &[bool]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < v.len() {
        if v[i] {
            let s = i;
            while i < v.len() && v[i] {
                i += 1;
            }
            out.push((s, i - s));
        } else {
            i += 1;
        }
    }
    out
}

fn uffd_err(what: &str, e: UffdError) -> MigrationError {
    MigrationError::Unsupported(format!("remote paging: {what}: {e}"))
}
