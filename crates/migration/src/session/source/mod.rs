//! The source's session, in rooms: this file holds what the session is
//! (its connections, phase and figures, private to it) and the few things
//! every mode asks of it; [`link`] connects, agrees on the capabilities and
//! the layout, opens the bulk streams and reconnects a paused postcopy;
//! [`clients`] decides whether the VM's clients move and sends them;
//! [`rounds`] holds the dirty log and the round barriers; [`finish`]
//! pauses, sends state, hashes and Complete, and concludes: it applies the
//! state's safety rule to a failure (the VM runs on here, or stays paused
//! in doubt or after the switch).
//!
//! Its phase is a [`SourceState`] (`state.rs`): every change goes through
//! [`SourceSession::enter`], which checks it, tells the watchers and logs it.

use std::time::Instant;

use super::state::{SourcePhase, SourceState};
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::options::MigrateOptions;
use crate::paused::Resumable;
use crate::protocol::Caps;
use crate::ranges::GpaPages;
use crate::stats::{thread_cpu_secs, CpuMeter};
use crate::telemetry::{LivePhase, Telemetry};
use crate::transport::{Conn, Endpoint};
use crate::vm::MigratableVm;

/// One outgoing migration's connections and what it has done to the VM.
pub(crate) struct SourceSession<'a> {
    vm: &'a dyn MigratableVm,
    opts: &'a MigrateOptions,
    to: &'a Endpoint,
    regions: Vec<RegionView>,
    ctl: Option<Conn>,
    bulk: Vec<Conn>,
    /// What the agreed protocol version lets this session use.
    caps: Caps,
    id: u64,
    /// Where the migration stands, and what it holds on the VM.
    state: SourceState,
    /// The clients move with the VM (the destination said so).
    clients_move: bool,
    /// What became of the clients, once known.
    clients: Option<crate::stats::ClientsOutcome>,
    /// Checkpointing and sending the clients took this long (ms).
    clients_ms: f64,
    /// The clients' connections went out already (v15: early in the pause).
    clients_sent: bool,
    /// CPU seconds of the data threads.
    cpu: CpuMeter,
    ctl_cpu0: f64,
    t_start: Instant,
    /// Live figures for watchers (the VM's, or a private one).
    tel: std::sync::Arc<Telemetry>,
    /// The last round's ack, not read yet ([`SourceSession::last_round_done`]).
    unacked: Option<u32>,
    /// A verified precopy with a v12 peer: every page's hash as it was
    /// sent (`crate::verify`).
    sent_hashes: Option<std::sync::Arc<crate::verify::PageHashes>>,
    /// Memory the destination had populated ahead and gave back at the
    /// opening, because this migration may switch (v13 SwitchReady).
    released_ahead: u64,
    /// What the destination's host already holds (v14), for the sender.
    shared: Option<std::sync::Arc<crate::shared::Offer>>,
    /// This thread at real time from the pause to Started
    /// (crate::priority): it carries the downtime.
    urgent: Option<crate::priority::Urgent>,
    /// Pages sent by reference that the destination could not resolve,
    /// from the last round barrier: they go again in the next round.
    missed: Vec<GpaPages>,
}

/// A fresh session id: random, so a stranger cannot guess it (it ties a
/// session's connections together and names a split VM's stores); the
/// clock and pid only if the kernel's random source fails.
fn session_id() -> u64 {
    crate::random::u64().unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id())
    })
}

mod clients;
mod finish;
mod link;
mod rounds;
#[cfg(test)]
mod tests;

impl<'a> SourceSession<'a> {
    /// A session for migrating `vm` to `to` (nothing is sent yet).
    pub(crate) fn new(
        vm: &'a dyn MigratableVm,
        to: &'a Endpoint,
        opts: &'a MigrateOptions,
    ) -> Self {
        let t_start = Instant::now();
        SourceSession {
            vm,
            opts,
            to,
            regions: vm.regions(),
            ctl: None,
            bulk: Vec::new(),
            caps: Caps::default(),
            id: session_id(),
            state: SourceState::new(),
            clients_move: false,
            clients: None,
            clients_ms: 0.0,
            clients_sent: false,
            cpu: CpuMeter::default(),
            sent_hashes: None,
            released_ahead: 0,
            shared: None,
            urgent: None,
            missed: Vec::new(),
            unacked: None,
            ctl_cpu0: thread_cpu_secs(),
            t_start,
            tel: vm.telemetry().unwrap_or_default(),
        }
    }

    /// A session that comes back as `r` after its postcopy paused (the VM
    /// paused here and running there; nothing is connected yet).
    pub(crate) fn resuming(
        vm: &'a dyn MigratableVm,
        to: &'a Endpoint,
        opts: &'a MigrateOptions,
        r: Resumable,
    ) -> Self {
        let mut s = SourceSession::new(vm, to, opts);
        s.id = r.id;
        s.caps = Caps::of(r.version);
        s.t_start = r.t_start;
        s.state = SourceState::resumed();
        s
    }

    /// What it takes to come back as this session later.
    pub(crate) fn resumable(&self) -> Resumable {
        Resumable {
            id: self.id,
            version: self.caps.version(),
            t_start: self.t_start,
        }
    }

    /// The VM being moved.
    pub(crate) fn vm(&self) -> &'a dyn MigratableVm {
        self.vm
    }

    /// How it is moved.
    pub(crate) fn opts(&self) -> &'a MigrateOptions {
        self.opts
    }

    /// The VM's memory, region by region.
    pub(crate) fn regions(&self) -> &[RegionView] {
        &self.regions
    }

    /// Live figures for watchers.
    pub(crate) fn tel(&self) -> &std::sync::Arc<Telemetry> {
        &self.tel
    }

    /// When the migration started (a resumed one keeps the first start).
    pub(crate) fn started_at(&self) -> Instant {
        self.t_start
    }

    /// Bulk streams open.
    pub(crate) fn streams(&self) -> usize {
        self.bulk.len()
    }

    /// The bulk streams.
    pub(crate) fn bulk(&self) -> &[Conn] {
        &self.bulk
    }

    /// The bulk streams, handed to a mode's sender for good (postcopy's
    /// push).
    pub(crate) fn take_bulk(&mut self) -> Vec<Conn> {
        std::mem::take(&mut self.bulk)
    }

    /// What a round's sender uses at once: the memory, the bulk streams,
    /// and the meter its threads add their CPU time to.
    pub(crate) fn sending_parts(&mut self) -> (&[RegionView], &mut Vec<Conn>, &CpuMeter) {
        (&self.regions, &mut self.bulk, &self.cpu)
    }

    /// Every page's hash as sent, for a verified precopy (v12).
    pub(crate) fn sent_hashes(&self) -> Option<&std::sync::Arc<crate::verify::PageHashes>> {
        self.sent_hashes.as_ref()
    }

    /// What the destination's host already holds (v14).
    pub(crate) fn shared(&self) -> Option<&std::sync::Arc<crate::shared::Offer>> {
        self.shared.as_ref()
    }

    /// What the agreed protocol version lets this session use.
    pub(crate) fn caps(&self) -> Caps {
        self.caps
    }

    /// The session id (every connection of the session carries it).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// When the migration started, in seconds since the Unix epoch (a
    /// resumed session keeps the original start).
    pub(crate) fn start_unix_s(&self) -> f64 {
        crate::telemetry::unix_now() - self.t_start.elapsed().as_secs_f64()
    }

    /// The destination.
    pub(crate) fn to(&self) -> &Endpoint {
        self.to
    }

    /// The one place the source changes phase: checked against the rule,
    /// shown to watchers (timeline, metrics), logged.
    pub(crate) fn enter(&mut self, next: SourcePhase) -> Result<(), MigrationError> {
        self.state
            .enter(next)
            .map_err(|e| MigrationError::Internal(e.to_string()))?;
        self.tel.set_phase(next.live());
        tracing::info!(phase = next.name(), "source phase");
        Ok(())
    }

    /// Postcopy's link broke (`true`) or is back: watchers see it paused.
    pub(crate) fn link_broken(&self, broken: bool) {
        self.tel.set_phase(if broken {
            LivePhase::Paused
        } else {
            self.state.phase().live()
        });
    }

    /// Back to normal priority before long work in the pause (hashing all
    /// of memory), which must not hold a core at real time.
    pub(crate) fn relax(&mut self) {
        self.urgent = None;
    }

    /// When the VM was paused here.
    pub(crate) fn paused_at(&self) -> Option<Instant> {
        self.state.paused_at()
    }

    /// Milliseconds since the pause or the previous lap: the downtime's
    /// parts, in order.
    pub(crate) fn lap_ms(&mut self) -> f64 {
        self.state.lap_ms()
    }

    /// The downtime (pause here to Started there), in milliseconds; 0
    /// before Started.
    pub(crate) fn downtime_ms(&self) -> f64 {
        self.state.downtime().map_or(0.0, |d| d.as_secs_f64() * 1e3)
    }

    /// Host CPU seconds this side used: data threads and this thread.
    pub(crate) fn cpu_secs(&self) -> f64 {
        self.cpu.secs() + thread_cpu_secs() - self.ctl_cpu0
    }
}
