//! Gather, the source's side: a split VM's main host moves it whole to a
//! destination with room for all of it. The pager stops paging out and
//! leaves the servers' copies in place ([`RemotePager::begin_gather`]),
//! the dirty log starts, and the destination is told to pull every chunk
//! the servers hold (GatherPlan; all servers at once) before anything
//! else lands; then a precopy sends what the main host holds (its holes
//! only for its own chunks: a remote chunk's hole here is not a zero page
//! there). A chunk paged in meanwhile has the servers' bytes until the
//! guest writes it, which the dirty log sends again; the main host's pages
//! always land after the pulled ones. If the gather fails the VM stays
//! split here and paging goes on as before.

use std::sync::Arc;

use crate::error::MigrationError;
use crate::memserver::StoreOpen;
use crate::precopy::Rounds;
use crate::protocol::{self, Kind};
use crate::ranges::GpaPages;
use crate::session::SourceSession;
use crate::stats::{GatherStats, MigrationStats};

use super::{ChunkMap, GatherPlan, GatherSnapshot, RemotePager, ON_MAIN};

/// A gather in progress on the main host.
pub(crate) struct Gather {
    pager: Arc<RemotePager>,
    snap: GatherSnapshot,
    map: ChunkMap,
    stats: GatherStats,
    committed: bool,
    t_plan: std::time::Instant,
}

impl Gather {
    /// Freezes paging-out, starts the dirty log, and tells the destination
    /// to pull the servers' chunks.
    pub(crate) fn open(s: &mut SourceSession) -> Result<Self, MigrationError> {
        // v9: the plan carries the stores' secrets.
        if !s.caps().trust() {
            return Err(MigrationError::Unsupported(format!(
                "the destination speaks protocol v{}; gather needs v{}",
                s.caps().version(),
                protocol::VERSION_TRUST
            )));
        }
        let pager = s.vm().pager().ok_or_else(|| {
            MigrationError::Unsupported(
                "this VM is not split (no memory server holds its pages): migrate it with --mode precopy"
                    .into(),
            )
        })?;
        let snap = pager.begin_gather();
        let map = ChunkMap::new(s.regions(), snap.chunk_pages);
        let mut g = Gather {
            pager,
            stats: GatherStats {
                servers: snap.servers.iter().map(|e| e.to_string()).collect(),
                remote_chunks: snap.places.iter().filter(|&&p| p != ON_MAIN).count() as u64,
                ..Default::default()
            },
            snap,
            map,
            committed: false,
            t_plan: std::time::Instant::now(),
        };
        // Writes from here on are sent again by the main host.
        s.start_dirty_log()?;
        // Per server, the runs it holds (place 0, the main host's, left out).
        let mut pulls = g
            .map
            .runs_by_place(&g.snap.places, g.snap.servers.len() + 1);
        pulls.remove(0);
        let plan = GatherPlan {
            vm: g.snap.vm.clone(),
            servers: g.snap.servers.clone(),
            pulls,
            secrets: g.snap.secrets.clone(),
        };
        s.ctl()?.send(Kind::GatherPlan, &plan)?;
        g.t_plan = std::time::Instant::now();
        Ok(g)
    }

    /// Waits until the destination pulled the servers' part (it reads the
    /// plan only once the bulk streams are open).
    pub(crate) fn wait_pulled(&mut self, s: &mut SourceSession) -> Result<(), MigrationError> {
        let g = self;
        g.stats.pulled_pages = s.ctl()?.recv(Kind::GatherReady)?;
        g.stats.pull_secs = g.t_plan.elapsed().as_secs_f64();
        s.tel().event(
            "gather_pulled",
            format!(
                "{} pages from {} memory servers",
                g.stats.pulled_pages,
                g.snap.servers.len()
            ),
        );
        Ok(())
    }

    /// The known-zero runs the main host may send: those in its own
    /// chunks (a chunk on a server is a hole here).
    pub(crate) fn main_holes(&self, holes: &[GpaPages]) -> Vec<GpaPages> {
        let mut out = vec![Vec::new(); self.snap.servers.len() + 1];
        self.map.route(holes, &self.snap.places, &mut out);
        out.swap_remove(0)
    }

    /// Per-page hashes of the whole VM: the main host's chunks from
    /// memory, the servers' from the servers.
    pub(crate) fn hashes(&self, s: &SourceSession) -> Result<Vec<u64>, MigrationError> {
        // Which chunks are here, asked before memory is read: one paged in
        // meanwhile is hashed from its server (the same bytes: the VM is
        // paused), never from a hole read before it arrived.
        let now = self.pager.places();
        let vm = s.vm();
        let mut out = crate::session::hashes(s.regions(), |i| vm.data_ranges(i));
        let open = |i: usize| StoreOpen {
            vm: self.snap.vm.clone(),
            regions: s.regions().iter().map(|r| (r.gpa(), r.size())).collect(),
            reserve_pages: 0,
            secret: self.snap.secrets[i].clone(),
        };
        let mut stores = super::open_stores(&self.snap.servers, s.opts().timeout(), open)
            .into_iter()
            .map(|r| r.map(|(c, _)| c))
            .collect::<Result<Vec<_>, _>>()?;
        // A chunk paged in since the snapshot: its bytes here are the
        // newest (the servers' copy may predate a write).
        let places: Vec<u16> = (0..self.map.chunks())
            .map(|c| {
                if now[c] == ON_MAIN {
                    ON_MAIN
                } else {
                    self.snap.places[c]
                }
            })
            .collect();
        super::hash_remote(&self.map, &places, &mut stores, &mut out)?;
        Ok(out)
    }

    /// Complete is about to go out.
    pub(crate) fn commit(&mut self) {
        self.committed = true;
    }

    /// What the gather did.
    pub(crate) fn stats(&self) -> GatherStats {
        let (now, then) = (self.pager.stats(), &self.snap.at_start);
        GatherStats {
            page_ins: now.page_ins - then.page_ins,
            page_outs: now.page_outs - then.page_outs,
            ..self.stats.clone()
        }
    }
}

impl Drop for Gather {
    /// A gather that failed before Complete leaves the VM split here.
    fn drop(&mut self) {
        if !self.committed {
            self.pager.end_gather();
        }
    }
}

/// The gather mode on the source: the destination pulls the memory
/// servers' part first, then precopy's rounds send what the main host
/// holds (its holes only for its own chunks).
#[derive(Default)]
pub(crate) struct GatherMode {
    gather: Option<Gather>,
}

impl Rounds for GatherMode {
    fn begin(&mut self, s: &mut SourceSession) -> Result<(), MigrationError> {
        self.gather = Some(Gather::open(s)?);
        Ok(())
    }

    fn streams_open(&mut self, s: &mut SourceSession) -> Result<(), MigrationError> {
        match self.gather.as_mut() {
            Some(g) => g.wait_pulled(s),
            None => Ok(()),
        }
    }

    fn holes(&self, holes: Vec<GpaPages>) -> Vec<GpaPages> {
        match &self.gather {
            Some(g) => g.main_holes(&holes),
            None => holes,
        }
    }

    fn hashes(&self, s: &SourceSession) -> Option<Result<Vec<u64>, MigrationError>> {
        self.gather.as_ref().map(|g| g.hashes(s))
    }

    fn commit(&mut self, stats: &mut MigrationStats) {
        if let Some(g) = self.gather.as_mut() {
            g.commit();
            stats.gather = Some(g.stats());
        }
    }
}
