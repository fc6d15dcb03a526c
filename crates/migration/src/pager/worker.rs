//! The pager thread: one loop that owns the userfaultfd's events and is the
//! only writer of the location map, so faults, page-ins and page-outs are
//! ordered by construction. It waits on the userfaultfd, sends each fault
//! to what serves it (a hole of a chunk held here, a remote chunk, a
//! sampled chunk), ends a sampling period every [`PERIOD`], and pages out
//! ahead down to the low watermark while no fault waits.
//!
//! The work itself is in the sibling modules: [`super::page_in`],
//! [`super::page_out`], [`super::sampling`] and [`super::clock`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_memory::{Event, Userfaultfd};

use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::memserver::StoreClient;
use crate::options::Rank;
use crate::ranges::{GpaPages, PAGE};
use crate::sink::UffdPlacer;

use super::chunks::{ChunkMap, ON_MAIN};
use super::clock::Clock;
use super::Shared;

/// How often the pager samples accesses and ages its chunks.
pub(super) const PERIOD: Duration = Duration::from_secs(1);

/// How long paging waits for a memory server whose connection broke to
/// answer again before it counts as lost (a link down for a while, a
/// server stopped and continued): the VM's faults on its chunks wait
/// meanwhile, as they would on a slow link.
pub(super) const RECOVER_WINDOW: Duration = Duration::from_secs(30);

/// The same when another server holds a copy of what was asked: the VM
/// goes on from that copy, not waiting long on this one.
pub(super) const MIRRORED_WINDOW: Duration = Duration::from_secs(3);

/// The pager thread's own state.
pub(super) struct Worker {
    /// Fault handling: registration, write-protect, polling, events.
    pub(super) uffd: Arc<Userfaultfd>,
    /// Landing: every page put into guest memory, every map-back and wake.
    pub(super) placer: UffdPlacer,
    pub(super) regions: Vec<RegionView>,
    /// The memfd behind each region: page-out reads through it, never
    /// through the mapping (a page there may fault on this very thread).
    pub(super) files: Vec<std::fs::File>,
    pub(super) map: ChunkMap,
    pub(super) homes: Vec<u16>,
    pub(super) mirrors: Vec<u16>,
    pub(super) servers: Vec<String>,
    pub(super) budget: u64,
    pub(super) rank: Rank,
    pub(super) stores: Vec<StoreClient>,
    /// Servers that failed: their chunks cannot come back.
    pub(super) dead: Vec<bool>,
    /// Per chunk: when it was last seen used (a count of paging events,
    /// so chunks used within one period still have an order).
    pub(super) last_use: Vec<u64>,
    /// The paging event count.
    pub(super) events: u64,
    /// Per chunk: aging history (top bit = the latest period).
    pub(super) aging: Vec<u8>,
    /// Per chunk: referenced since it was armed.
    pub(super) referenced: Vec<bool>,
    /// The clock: which chunks are armed, and its learned victim choice.
    pub(super) clock: Clock,
    /// A page-in found the budget full: from then on the idle loop pages
    /// out ahead (not before: a VM that never pages keeps its chunks).
    pub(super) pressed: bool,
    /// Chunks armed this period.
    pub(super) armed: Vec<usize>,
    /// Where the next arming starts.
    pub(super) cursor: usize,
    pub(super) sampling: bool,
    pub(super) shared: Arc<Shared>,
    /// Faults on chunks of a dead server: never woken (the VM stops).
    pub(super) parked: Vec<u64>,
    /// Per chunk: held here unchanged since its page-in, its servers still
    /// holding the same bytes, so paging it out is a drop ([`super::clean`]).
    pub(super) clean: Vec<bool>,
    /// Per chunk held here: it was paged in, and its servers kept the copy
    /// it came from, which may be old now (a page-out makes it current).
    pub(super) kept: Vec<bool>,
    /// Page-ins by a read land write-protected, clean (off once the kernel
    /// refused to map a page back write-protected).
    pub(super) track_clean: bool,
    /// Page-out's read buffer, one chunk, reused.
    pub(super) chunk_buf: Vec<u8>,
}

impl Worker {
    pub(super) fn run(mut self) {
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
                    addr,
                    wp,
                    minor,
                    write,
                    ..
                } = *ev
                {
                    if let Err(e) = self.fault(addr, wp, minor, write) {
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

    pub(super) fn fail(&self, why: String) {
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

    pub(super) fn set_place(&self, c: usize, p: u16) {
        self.shared.places_held()[c] = p;
    }

    fn fault(
        &mut self,
        addr: u64,
        wp: bool,
        minor: bool,
        write: bool,
    ) -> Result<(), MigrationError> {
        let page = addr & !(PAGE - 1);
        let Some(gpa) = self.regions.iter().find_map(|r| r.gpa_of_host(page)) else {
            return Ok(());
        };
        let Some(c) = self.map.chunk_of(gpa) else {
            return Ok(());
        };
        if wp {
            if self.clean[c] && self.place(c) == ON_MAIN {
                // The first write to a chunk paged in by a read: it
                // differs from its servers' copies from now on.
                return self.mark_dirty(c);
            }
            // A write that waited on a page-out, which has finished: the
            // page is gone now, and the retry faults MISSING.
            self.placer.wake(GpaPages::new(gpa, 1));
            return Ok(());
        }
        self.events += 1;
        self.last_use[c] = self.events;
        self.referenced[c] = true;
        self.clock.disarm(c);
        if minor {
            self.shared.counters.sampled.fetch_add(1, Ordering::Relaxed);
            if write && self.clean[c] {
                // Mapped back for a write: dirty now, not one fault later.
                self.mark_dirty(c)?;
            }
            return self.map_back(c, gpa);
        }
        let place = self.place(c);
        if place == ON_MAIN {
            if self.clean[c] {
                // (A clean chunk has no holes; zero pages landing
                // unprotected would make it dirty unseen.)
                self.mark_dirty(c)?;
            }
            // Never-written pages of a chunk held here: all of them at
            // once (a guest filling fresh memory faults once per chunk,
            // not once per page; the budget counts whole chunks anyway).
            self.fill_holes(c)?;
            self.placer.wake(GpaPages::new(gpa, 1));
            return Ok(());
        }
        let t = Instant::now();
        for server in self.copies(c) {
            if self.dead[server] {
                continue;
            }
            let mut got = self.page_in(c, gpa, server, t, write);
            if let Err(e) = &got {
                // Its connection broke: once it answers again, the same
                // page-in again (pages placed before the break count as
                // brought: nothing lands twice).
                let mirrored = self.copies(c).iter().any(|&s| s != server && !self.dead[s]);
                if !self.recover(server, e, mirrored) {
                    continue;
                }
                got = self.page_in(c, gpa, server, t, write);
            }
            match got {
                Ok(()) if self.shared.gathering.load(Ordering::SeqCst) => return Ok(()),
                Ok(()) => {
                    // (Both copies stay: the next page-out sends to both,
                    // or, clean, needs neither.)
                    let outs = self.shared.counters.page_outs.load(Ordering::Relaxed);
                    self.clock.learn_refault(c, outs);
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
    pub(super) fn copies(&self, c: usize) -> Vec<usize> {
        [self.homes[c], self.mirrors[c]]
            .into_iter()
            .filter(|&s| s != ON_MAIN)
            .map(|s| usize::from(s) - 1)
            .collect()
    }

    /// A request to `server` failed with `e`: opens its connection again
    /// (its store and the pages it holds outlive a connection) until it
    /// answers, within [`RECOVER_WINDOW`], or [`MIRRORED_WINDOW`] when
    /// another live server holds what was asked (`mirrored`: the VM need
    /// not wait on this one). True if it answers again; else the server
    /// is lost. A server that refuses the connection (nothing listens
    /// there: it died) or that answered with an error is lost at once.
    pub(super) fn recover(&mut self, server: usize, e: &MigrationError, mirrored: bool) -> bool {
        if !e.is_link_break() {
            self.lose(server, &e.to_string());
            return false;
        }
        let window = if mirrored {
            MIRRORED_WINDOW
        } else {
            RECOVER_WINDOW
        };
        let deadline = Instant::now() + window;
        let mut pause = Duration::from_millis(100);
        tracing::warn!(server = %self.servers[server], error = %e, "memory server connection broke: reconnecting");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.shared.stop.load(Ordering::Acquire) {
                self.lose(
                    server,
                    &format!("{e}; no answer again within {}s", window.as_secs()),
                );
                return false;
            }
            match self.stores[server].reopen(left) {
                Ok(()) => {
                    self.shared
                        .counters
                        .reconnects
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::info!(server = %self.servers[server], "memory server answers again");
                    return true;
                }
                Err(MigrationError::Connect { source, .. })
                    if source.kind() == std::io::ErrorKind::ConnectionRefused =>
                {
                    self.lose(
                        server,
                        &format!("{e}; then it refused a new connection: {source}"),
                    );
                    return false;
                }
                Err(_) => {
                    std::thread::sleep(
                        pause.min(deadline.saturating_duration_since(Instant::now())),
                    );
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// A memory server failed: paging goes on with the other copies.
    pub(super) fn lose(&mut self, server: usize, why: &str) {
        if !std::mem::replace(&mut self.dead[server], true) {
            tracing::error!(server = %self.servers[server], %why, "memory server lost");
            let mut lost = self.shared.lost.lock().unwrap_or_else(|e| e.into_inner());
            lost.push(self.servers[server].clone());
        }
    }
}
