//! The source's side of split migration: a precopy whose pages are routed
//! by chunk. [`Router::open`] ranks the chunks, places them, opens a store
//! on every memory server and sends the plan to the main host; each round
//! then goes to the main host's bulk streams (precopy's sender) and, at the
//! same time, straight to the servers, one thread per server, ending with
//! a StoreSync on each (the servers' round barrier).

use std::time::Instant;

use crate::batch::{Fill, PageBatch};
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::memserver::{StoreClient, StoreError, StoreOpen, StoreSecret};
use crate::precopy::{Rounds, SendRound};
use crate::protocol::{self, Kind};
use crate::ranges::GpaPages;
use crate::session::SourceSession;
use crate::stats::{MigrationStats, RoundStats, SplitServerStats, SplitStats};

use super::{chunk_scores, place, ChunkMap, SplitPlan, ON_MAIN};

/// Routes a precopy's pages to the main host and the memory servers.
pub(crate) struct Router {
    map: ChunkMap,
    places: Vec<u16>,
    /// Per chunk not on the main host: 1 + the server of its second copy, or 0.
    mirrors: Vec<u16>,
    stores: Vec<StoreClient>,
    stats: SplitStats,
    /// Complete went out: the main host may run the VM on these stores.
    committed: bool,
}

impl Router {
    /// Ranks and places the chunks, opens the stores and sends the plan.
    pub(crate) fn open(s: &mut SourceSession) -> Result<Self, MigrationError> {
        // v9: the plan carries the stores' secrets, and memory servers
        // serve v9 clients only.
        if !s.caps().trust() {
            return Err(MigrationError::Unsupported(format!(
                "the main host speaks protocol v{}; split needs v{} (a newer ferry there)",
                s.caps().version(),
                protocol::VERSION_TRUST
            )));
        }
        let sp = &s.opts().split;
        let map = ChunkMap::new(s.regions(), sp.chunk_pages);
        let history = s.vm().access_history();
        let scores = chunk_scores(&map, history.as_ref(), sp.rank);
        let vm = s.vm();
        let (data, _) = crate::dirty::first_round(s.regions(), |i| vm.data_ranges(i));
        let data_pages = map.pages_per_chunk(&data);
        let budget = sp.main_budget / (map.chunk_pages() * crate::ranges::PAGE);
        let placed = place(&scores, &data_pages, budget, sp.subs.len(), sp.replicas);
        let places = placed.places.clone();
        // Where second copies go: the mirror of every chunk not on the main host.
        let mirrors: Vec<u16> = (0..map.chunks())
            .map(|c| {
                if places[c] == ON_MAIN {
                    ON_MAIN
                } else {
                    placed.mirrors[c]
                }
            })
            .collect();
        // The session id is random (session/source/mod.rs): a stranger cannot
        // guess the VM's id on the servers, and without its store's secret
        // (one per server, made here, handed to the main host in the plan)
        // could do nothing with it anyway.
        let vm_id = format!("{:016x}", s.id());
        let secrets = StoreSecret::random_each(sp.subs.len()).map_err(StoreError::Random)?;
        let layout: Vec<(u64, u64)> = s.regions().iter().map(|r| (r.gpa(), r.size())).collect();
        let mine = |i: usize, c: usize| places[c] == i as u16 + 1 || mirrors[c] == i as u16 + 1;
        let opened = super::open_stores(&sp.subs, s.opts().timeout(), |i| StoreOpen {
            vm: vm_id.clone(),
            regions: layout.clone(),
            reserve_pages: (0..map.chunks())
                .filter(|&c| mine(i, c))
                .map(|c| data_pages[c])
                .sum(),
            secret: secrets[i].clone(),
        });
        let mut stores = Vec::new();
        let mut servers = Vec::new();
        let mut failed = None;
        for (i, (to, r)) in sp.subs.iter().zip(opened).enumerate() {
            match r {
                Ok((client, ack)) => {
                    let chunks = (0..map.chunks()).filter(|&c| mine(i, c)).count() as u64;
                    tracing::info!(%to, chunks, free = ack.free_pages, "memory server store open");
                    stores.push(client);
                    servers.push(SplitServerStats {
                        addr: to.to_string(),
                        chunks,
                        ..Default::default()
                    });
                }
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        if let Some(e) = failed {
            // Nothing stays on the servers that did open.
            for store in stores {
                let _ = store.close();
            }
            return Err(e);
        }
        let main_chunks = places.iter().filter(|&&p| p == ON_MAIN).count() as u64;
        let plan = SplitPlan {
            vm: vm_id.clone(),
            chunk_pages: sp.chunk_pages,
            servers: sp.subs.clone(),
            places: places.clone(),
            homes: placed.homes,
            mirrors: placed.mirrors,
            budget_chunks: budget,
            rank: sp.rank,
            secrets,
        };
        s.ctl()?.send(Kind::SplitPlan, &plan)?;
        s.tel().event(
            "split_plan",
            format!(
                "{main_chunks} of {} chunks on the main host, the rest on {} servers ({} copies)",
                map.chunks(),
                sp.subs.len(),
                sp.replicas
            ),
        );
        let stats = SplitStats {
            vm: vm_id,
            chunk_pages: sp.chunk_pages,
            chunks: map.chunks() as u64,
            main_chunks,
            budget_chunks: budget,
            rank: sp.rank.to_string(),
            history_periods: history.map_or(0, |h| h.periods),
            servers,
        };
        Ok(Router {
            map,
            places,
            mirrors,
            stores,
            stats,
            committed: false,
        })
    }

    /// Sends one round: `main(runs, holes)` sends the main host's share on
    /// this thread while each server's share goes out on its own thread;
    /// returns main's result with the servers' pages and bytes added, once
    /// every server has everything.
    pub(crate) fn round(
        &mut self,
        regions: &[RegionView],
        runs: &[GpaPages],
        holes: &[GpaPages],
        main: impl FnOnce(&[GpaPages], &[GpaPages]) -> Result<(RoundStats, Vec<u64>), MigrationError>,
    ) -> Result<(RoundStats, Vec<u64>), MigrationError> {
        let t0 = Instant::now();
        let places = self.stores.len() + 1;
        let mut routed = vec![Vec::new(); places];
        self.map.route(runs, &self.places, &mut routed);
        // Second copies: the same pages again, to each chunk's mirror.
        let mut copies = vec![Vec::new(); places];
        self.map.route(runs, &self.mirrors, &mut copies);
        for (k, extra) in copies.into_iter().enumerate().skip(1) {
            routed[k].extend(extra);
            routed[k].sort_unstable();
        }
        let mut main_holes = vec![Vec::new(); places];
        self.map.route(holes, &self.places, &mut main_holes);
        let mine = std::mem::take(&mut routed[0]);
        let (result, shares) = std::thread::scope(|sc| {
            let threads: Vec<_> = self
                .stores
                .iter_mut()
                .zip(routed.iter().skip(1))
                .map(|(store, share)| sc.spawn(move || put_share(store, regions, share)))
                .collect();
            let result = main(&mine, &main_holes[0]);
            let shares: Vec<_> = threads
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or_else(|_| {
                        Err(MigrationError::Unsupported(
                            "a memory server thread panicked".into(),
                        ))
                    })
                })
                .collect();
            (result, shares)
        });
        let (mut rs, frames) = result?;
        for (share, server) in shares.into_iter().zip(&mut self.stats.servers) {
            let (pages, zero, bytes) = share?;
            server.pages += pages;
            server.bytes += bytes;
            rs.pages += pages;
            rs.zero_pages += zero;
            rs.bytes += bytes;
        }
        rs.secs = t0.elapsed().as_secs_f64();
        rs.throughput = rs.bytes as f64 / rs.secs.max(1e-6);
        Ok((rs, frames))
    }

    /// Complete is about to go out: from here the main host may run the VM
    /// on these stores, so a failure must not free them.
    pub(crate) fn commit(&mut self) {
        self.committed = true;
    }

    /// What the split did.
    pub(crate) fn stats(&self) -> SplitStats {
        self.stats.clone()
    }
}

impl Drop for Router {
    /// A migration that failed before Complete leaves nothing on the
    /// servers (the VM runs on here).
    fn drop(&mut self) {
        if !self.committed {
            for store in self.stores.drain(..) {
                let _ = store.close();
            }
        }
    }
}

/// Puts one server's share of a round: pages with data go out in frames
/// of up to 1024 pages, pages that became zero are dropped there (absent
/// means zero); then waits until the server has them all. Returns (pages,
/// zero pages, bytes).
fn put_share(
    store: &mut StoreClient,
    regions: &[RegionView],
    runs: &[GpaPages],
) -> Result<(u64, u64, u64), MigrationError> {
    let mut batch = PageBatch::default();
    let mut zero: Vec<GpaPages> = Vec::new();
    let (mut pages, mut zeros, mut bytes) = (0u64, 0u64, 0u64);
    let mut gpas = runs.iter().flat_map(|r| r.page_addrs());
    loop {
        let more = batch.fill_upto(regions, &mut gpas, Fill::RAW, protocol::MAX_BATCH);
        pages += batch.pages();
        zeros += batch.zero_pages();
        bytes += store.put_batch(&batch)?;
        for r in batch.zeros() {
            match zero.last_mut() {
                Some(last) if last.end() == r.gpa => last.pages += r.pages,
                _ => zero.push(*r),
            }
        }
        if !more {
            break;
        }
    }
    if !zero.is_empty() {
        store.drop_runs(&zero)?;
    }
    store.sync()?;
    Ok((pages, zeros, bytes))
}

/// The split mode on the source: precopy's rounds with every page routed
/// to where its chunk lives (the main host, or a memory server).
#[derive(Default)]
pub(crate) struct Split {
    router: Option<Router>,
}

impl Rounds for Split {
    fn begin(&mut self, s: &mut SourceSession) -> Result<(), MigrationError> {
        self.router = Some(Router::open(s)?);
        Ok(())
    }

    fn send_round(
        &mut self,
        regions: &[RegionView],
        runs: &[GpaPages],
        holes: &[GpaPages],
        send: &mut SendRound<'_>,
    ) -> Result<(RoundStats, Vec<u64>), MigrationError> {
        match self.router.as_mut() {
            Some(r) => r.round(regions, runs, holes, |r, h| send(r, h)),
            None => send(runs, holes),
        }
    }

    fn commit(&mut self, stats: &mut MigrationStats) {
        if let Some(r) = self.router.as_mut() {
            r.commit();
            stats.split = Some(r.stats());
        }
    }
}
