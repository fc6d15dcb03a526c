//! The main host's side of split migration, as the session's phases: take
//! the plan and open a store connection to every memory server it names
//! (before any page, so an unreachable server fails the migration while
//! the VM still runs at the source); verify remote chunks by fetching them
//! from their servers; at the start, hand the memory to the pager, which
//! the VM keeps for as long as it runs here.

use std::time::Duration;

use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::memserver::{StoreClient, StoreOpen};
use crate::protocol::{self, Frame, Kind};
use crate::session::{DestinationContext, DestinationMode};
use crate::sink::PageSink;
use crate::transport::Conn;
use crate::vm::DestinationVm;

use super::{ChunkMap, RemotePager, SplitPlan, ON_MAIN};

/// The main host's split phases.
pub(crate) struct SplitDestination<'a> {
    vm: &'a dyn DestinationVm,
    /// Where a gather's pulled pages land.
    sink: &'a dyn PageSink,
    timeout: Duration,
    plan: Option<SplitPlan>,
    stores: Vec<StoreClient>,
    pager: Option<RemotePager>,
}

impl<'a> SplitDestination<'a> {
    pub(crate) fn new(cx: DestinationContext<'a>) -> Self {
        SplitDestination {
            vm: cx.vm,
            sink: cx.sink,
            timeout: cx.timeout,
            plan: None,
            stores: Vec::new(),
            pager: None,
        }
    }

    /// True once a SplitPlan arrived.
    pub(crate) fn planned(&self) -> bool {
        self.plan.is_some()
    }

    /// Takes the plan: checks it against this VM and opens the stores.
    pub(crate) fn on_plan(&mut self, f: &Frame, ctl: &mut Conn) -> Result<(), MigrationError> {
        if self.vm.memory_fds().is_none() {
            return Err(MigrationError::Unsupported(
                "this VMM cannot page memory from memory servers (split)".into(),
            ));
        }
        let plan: SplitPlan = protocol::decode(f, Kind::SplitPlan)?;
        super::check_servers(Kind::SplitPlan, &plan.servers, !ctl.writer().is_tcp())?;
        let regions = self.vm.regions();
        plan.check(&ChunkMap::new(&regions, plan.chunk_pages))
            .map_err(MigrationError::Mismatch)?;
        // The plan checked: one secret per server.
        let open = |i: usize| StoreOpen {
            vm: plan.vm.clone(),
            regions: regions.iter().map(|r| (r.gpa(), r.size())).collect(),
            reserve_pages: 0,
            secret: plan.secrets[i].clone(),
        };
        for r in super::open_stores(&plan.servers, self.timeout, open) {
            let (client, _) = r.map_err(|e| {
                MigrationError::Unsupported(format!("the main host cannot reach a {e}"))
            })?;
            self.stores.push(client);
        }
        tracing::info!(
            chunks = plan.places.len(),
            on_main = plan.places.iter().filter(|&&p| p == ON_MAIN).count(),
            servers = plan.servers.len(),
            "split plan"
        );
        self.plan = Some(plan);
        Ok(())
    }

    /// A gather (this side takes a split VM back whole): pulls every run
    /// the plan names from its server, all servers at once, before the
    /// main host sends anything, then says GatherReady (pages pulled).
    pub(crate) fn on_gather(&mut self, f: &Frame, ctl: &mut Conn) -> Result<(), MigrationError> {
        let plan: super::GatherPlan = protocol::decode(f, Kind::GatherPlan)?;
        super::check_servers(Kind::GatherPlan, &plan.servers, !ctl.writer().is_tcp())?;
        if plan.pulls.len() != plan.servers.len() || plan.secrets.len() != plan.servers.len() {
            return Err(protocol::ProtocolError::Malformed {
                kind: Kind::GatherPlan,
                reason: "one list of runs and one store secret per server".into(),
            }
            .into());
        }
        let regions = self.vm.regions();
        let open = |i: usize| StoreOpen {
            vm: plan.vm.clone(),
            regions: regions.iter().map(|r| (r.gpa(), r.size())).collect(),
            reserve_pages: 0,
            secret: plan.secrets[i].clone(),
        };
        let (sink, timeout) = (self.sink, self.timeout);
        let pulled = std::thread::scope(|sc| {
            let threads: Vec<_> = plan
                .servers
                .iter()
                .zip(&plan.pulls)
                .enumerate()
                .map(|(i, (to, runs))| {
                    let open = open(i);
                    sc.spawn(move || -> Result<u64, MigrationError> {
                        let (mut store, _) =
                            StoreClient::open(to, timeout, &open).map_err(|e| {
                                MigrationError::Unsupported(format!("memory server {to}: {e}"))
                            })?;
                        // What a server does not hold is zero.
                        for r in runs {
                            sink.zero(*r)?;
                        }
                        let mut pages = 0;
                        store.fetch_runs(runs, false, |_, gpas, data| {
                            for (j, &g) in gpas.iter().enumerate() {
                                let page = &data[j * protocol::PAGE..][..protocol::PAGE];
                                sink.write(crate::ranges::GpaPages::new(g, 1), page)?;
                            }
                            pages += gpas.len() as u64;
                            Ok(())
                        })?;
                        Ok(pages)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or_else(|_| {
                        Err(MigrationError::Unsupported(
                            "a gather thread panicked".into(),
                        ))
                    })
                })
                .sum::<Result<u64, MigrationError>>()
        })?;
        tracing::info!(
            pulled,
            servers = plan.servers.len(),
            "gather: the servers' pages are here"
        );
        ctl.send(Kind::GatherReady, &pulled)?;
        Ok(())
    }

    /// Per-page hashes of the whole VM: chunks held here from memory,
    /// the others fetched from their servers (which keep them).
    pub(crate) fn hashes(&mut self, regions: &[RegionView]) -> Result<Vec<u64>, MigrationError> {
        let vm = self.vm;
        let mut out = crate::session::hashes(regions, |i| vm.data_ranges(i));
        let Some(plan) = &self.plan else {
            return Ok(out);
        };
        let map = ChunkMap::new(regions, plan.chunk_pages);
        super::hash_remote(&map, &plan.places, &mut self.stores, &mut out)?;
        Ok(out)
    }

    /// Puts the memory under the pager, just before the vCPUs start.
    pub(crate) fn before_start(&mut self) -> Result<(), MigrationError> {
        let Some(plan) = &self.plan else {
            return Ok(());
        };
        let stores = std::mem::take(&mut self.stores);
        let fds = self.vm.memory_fds().ok_or_else(|| {
            MigrationError::Unsupported("the VM's memory has no file to page out from".into())
        })?;
        self.pager = Some(RemotePager::start(self.vm.regions(), fds, plan, stores)?);
        Ok(())
    }

    /// The VM runs: it keeps the pager from now on.
    pub(crate) fn after_start(&mut self) -> Result<(), MigrationError> {
        if let Some(pager) = self.pager.take() {
            self.vm
                .adopt_pager(pager)
                .map_err(MigrationError::vm("keep the pager"))?;
        }
        Ok(())
    }
}

impl DestinationMode for SplitDestination<'_> {
    fn on_message(&mut self, f: &Frame, ctl: &mut Conn) -> Result<(), MigrationError> {
        match f.kind {
            Kind::SplitPlan => self.on_plan(f, ctl),
            Kind::GatherPlan => self.on_gather(f, ctl),
            _ => Err(protocol::ProtocolError::Unexpected {
                got: f.kind,
                want: "RoundDone, State, Verify or Complete after a split or gather plan",
            }
            .into()),
        }
    }

    fn hashes(&mut self, regions: &[RegionView]) -> Result<Option<Vec<u64>>, MigrationError> {
        if !self.planned() {
            return Ok(None);
        }
        SplitDestination::hashes(self, regions).map(Some)
    }

    fn before_start(&mut self, _rounds: u32) -> Result<(), MigrationError> {
        if !self.planned() {
            return Ok(());
        }
        SplitDestination::before_start(self)
    }

    fn after_start(
        &mut self,
        _ctl: &mut Conn,
        _rx: &crate::receiver::Received,
        _stats: &mut crate::stats::DestinationStats,
    ) -> Result<bool, MigrationError> {
        if self.planned() {
            SplitDestination::after_start(self)?;
        }
        Ok(false)
    }
}
