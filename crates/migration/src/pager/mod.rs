//! Remote paging on a split VM's main host, for as long as the VM runs
//! here. All guest RAM is under one userfaultfd (MISSING and WP, and MINOR
//! where the kernel allows all three), served by one thread, which is the
//! only writer of the location map, so faults, page-ins and page-outs are
//! ordered by construction:
//! - a MISSING fault on a chunk held here is a page never written: every
//!   hole of the chunk gets a zero page at once;
//! - a MISSING fault on a remote chunk pages it in: the server sends the
//!   faulting page first (the vCPU is woken at once), then the rest of the
//!   chunk, and keeps its copy (a dirty page-out overwrites it, a clean
//!   one sends nothing); what it did not hold becomes zero pages;
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
//!
//! - a chunk paged in by a read stays on its servers and lands
//!   write-protected: while it is only read, paging it out again is a
//!   drop, no transfer; its first write unprotects it and makes it dirty.
//!
//! Files: [`worker`] (the thread's fault loop), [`page_in`], [`page_out`],
//! [`clean`] (chunks unchanged since their page-in), [`clock`] (which
//! chunk to page out), [`sampling`] (MINOR-fault access
//! sampling and map-back), [`stats`] (the counters and [`PagerStats`]).
//! This file starts the pager and is what the rest of the VMM holds.
//! Every page the pager lands goes through the sink's [`UffdPlacer`]; the
//! pager's own userfaultfd calls are fault handling: registering,
//! write-protecting a chunk being paged out, polling and reading events.

mod chunks;
mod clean;
mod clock;
mod page_in;
mod page_out;
mod plan;
mod sampling;
mod stats;
mod worker;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use ferry_memory::{Features, RegisterMode, UffdError, Userfaultfd};

use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::memserver::StoreClient;
use crate::ranges::PAGE;
use crate::sink::{SinkError, UffdPlacer};

use clock::Clock;
use stats::{percentiles, Counters};
use worker::Worker;

pub use chunks::{ChunkMap, ON_MAIN};
pub use plan::SplitPlan;
pub use stats::PagerStats;

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
    /// The VM's id on the servers, the servers, and its store secret on
    /// each (a gather hands them on).
    vm: String,
    servers: Vec<crate::transport::Endpoint>,
    secrets: Vec<crate::memserver::StoreSecret>,
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
    /// Per server, the VM's store secret there.
    pub secrets: Vec<crate::memserver::StoreSecret>,
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
        let uffd = Arc::new(uffd);
        let worker = Worker {
            placer: UffdPlacer::new(uffd.clone(), regions.clone()),
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
            clock: Clock::new(n, plan.budget_chunks),
            pressed: false,
            armed: Vec::new(),
            cursor: 0,
            sampling,
            shared: shared.clone(),
            parked: Vec::new(),
            clean: vec![false; n],
            kept: vec![false; n],
            track_clean: true,
            chunk_buf: Vec::new(),
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
            secrets: plan.secrets.clone(),
        })
    }

    /// What paging did so far.
    pub fn stats(&self) -> PagerStats {
        let c = &self.shared.counters;
        let lat = self
            .shared
            .latency_us
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let (p50, p99, max) = percentiles(lat);
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
            clean_drops: c.clean_drops.load(Ordering::Relaxed),
            sampling: self.sampling,
            page_in_p50_us: p50,
            page_in_p99_us: p99,
            page_in_max_us: max,
            lost_servers: self
                .shared
                .lost
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            reconnects: c.reconnects.load(Ordering::Relaxed),
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
            secrets: self.secrets.clone(),
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

fn uffd_err(what: &str, e: UffdError) -> MigrationError {
    MigrationError::Unsupported(format!("remote paging: {what}: {e}"))
}

/// A placement that failed, worded as [`uffd_err`] words the userfaultfd
/// call under it (a kernel error reads the same as before the placer).
fn sink_err(what: &str, e: SinkError) -> MigrationError {
    MigrationError::Unsupported(format!("remote paging: {what}: {e}"))
}
