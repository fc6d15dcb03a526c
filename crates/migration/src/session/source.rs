//! The source's session: connects, agrees on a version and the layout,
//! opens the bulk streams, and at the end sends state, hashes and Complete.
//!
//! Its phase is a [`SourceState`] (`state.rs`): every change goes through
//! [`SourceSession::enter`], which checks it, tells the watchers and logs it;
//! [`SourceSession::conclude`] applies the state's safety rule to a failure
//! (the VM runs on here, or stays paused in doubt or after the switch).

use std::time::{Duration, Instant};

use super::state::{Left, SourcePhase, SourceState};
use crate::encoded::CodecSetup;
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::options::MigrateOptions;
use crate::paused::{Outcome, Resumable};
use crate::protocol::{self, Caps, Hello, Kind, ProtocolError, Role, RoundDone, HEADER};
use crate::ranges::GpaPages;
use crate::stats::{thread_cpu_secs, CpuMeter, StartedReport};
use crate::telemetry::{LivePhase, Telemetry};
use crate::transport::{Conn, Endpoint};
use crate::vm::{ClientsAnswer, MigratableVm};

/// How long the paused source polls for the destination's answers to
/// Complete before it blocks in read(2), when it could not take real time.
const SPIN_FOR_STARTED: Duration = Duration::from_millis(5);

/// One outgoing migration's connections and what it has done to the VM.
pub(crate) struct SourceSession<'a> {
    pub(crate) vm: &'a dyn MigratableVm,
    pub(crate) opts: &'a MigrateOptions,
    to: &'a Endpoint,
    pub(crate) regions: Vec<RegionView>,
    ctl: Option<Conn>,
    pub(crate) bulk: Vec<Conn>,
    /// What the agreed protocol version lets this session use.
    caps: Caps,
    id: u64,
    /// Where the migration stands, and what it holds on the VM.
    state: SourceState,
    /// The clients move with the VM (the destination said so).
    clients_move: bool,
    /// What became of the clients, once known.
    pub(crate) clients: Option<crate::stats::ClientsOutcome>,
    /// Checkpointing and sending the clients took this long (ms).
    pub(crate) clients_ms: f64,
    /// The clients' connections went out already (v15: early in the pause).
    clients_sent: bool,
    /// CPU seconds of the data threads.
    pub(crate) cpu: CpuMeter,
    ctl_cpu0: f64,
    pub(crate) t_start: Instant,
    /// Live figures for watchers (the VM's, or a private one).
    pub(crate) tel: std::sync::Arc<Telemetry>,
    /// The last round's ack, not read yet ([`SourceSession::last_round_done`]).
    unacked: Option<u32>,
    /// A verified precopy with a v12 peer: every page's hash as it was
    /// sent (`crate::verify`).
    pub(crate) sent_hashes: Option<std::sync::Arc<crate::verify::PageHashes>>,
    /// Memory the destination had populated ahead and gave back at the
    /// opening, because this migration may switch (v13 SwitchReady).
    released_ahead: u64,
    /// What the destination's host already holds (v14), for the sender.
    pub(crate) shared: Option<std::sync::Arc<crate::shared::Offer>>,
    /// This thread at real time from the pause to Started
    /// (crate::priority): it carries the downtime.
    urgent: Option<crate::priority::Urgent>,
    /// Pages sent by reference that the destination could not resolve,
    /// from the last round barrier: they go again in the next round.
    missed: Vec<GpaPages>,
}

/// Checks that an ack is for `round`.
fn check_ack(ack: u32, round: u32) -> Result<(), MigrationError> {
    if ack != round {
        return Err(ProtocolError::Malformed {
            kind: Kind::RoundAck,
            reason: format!("ack for round {ack}, expected {round}"),
        }
        .into());
    }
    Ok(())
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

    /// Closes every connection (a broken link: the threads blocked on them
    /// end, and the peer sees them go).
    pub(crate) fn drop_links(&mut self) {
        for c in self.ctl.iter().chain(self.bulk.iter()) {
            c.shutdown();
        }
        self.ctl = None;
        self.bulk.clear();
    }

    /// After a broken link in postcopy: connects again as this session
    /// (retrying until `within` ran out) and returns the pages the
    /// destination still lacks, with the new demand connection; the bulk
    /// streams are open again. A destination that refuses (it gave up, or
    /// has no such session) ends the attempt at once.
    pub(crate) fn reconnect(
        &mut self,
        within: Duration,
    ) -> Result<(Vec<crate::ranges::GpaPages>, Conn), MigrationError> {
        let deadline = Instant::now() + within;
        loop {
            match self.reconnect_once() {
                Ok(r) => return Ok(r),
                Err(e) if e.is_peer_abort() || !e.is_link_break() => return Err(e),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(e) => {
                    tracing::debug!(error = %e, "reconnect failed; retrying");
                    self.drop_links();
                    std::thread::sleep(Duration::from_millis(250));
                }
            }
        }
    }

    fn reconnect_once(&mut self) -> Result<(Vec<crate::ranges::GpaPages>, Conn), MigrationError> {
        let hello = self.hello(Role::Resume);
        let ctl = self.ctl.insert(self.metered(
            Conn::open(self.to, self.opts.timeout(), &hello)?,
            Role::Resume,
        ));
        ctl.flush()?;
        let version: u16 = ctl.recv(Kind::HelloAck)?;
        if !Caps::of(version).resume() {
            return Err(MigrationError::Unsupported(format!(
                "the destination resumed with protocol v{version}; resuming needs v{}",
                protocol::VERSION_RESUME
            )));
        }
        let mut missing = Vec::new();
        loop {
            let part: protocol::PostcopyResume = ctl.recv(Kind::PostcopyResume)?;
            missing.extend(part.missing);
            if part.last {
                break;
            }
        }
        let mut demand = self.open_role(Role::Demand)?;
        demand.flush()?;
        self.open_bulk(None)?;
        Ok((missing, demand))
    }

    fn hello(&self, role: Role) -> Hello {
        Hello {
            version_min: protocol::VERSION_MIN,
            version_max: protocol::VERSION_MAX,
            role,
            session: self.id,
            streams: self.opts.streams.max(1),
        }
    }

    /// The control connection.
    pub(crate) fn ctl(&mut self) -> Result<&mut Conn, MigrationError> {
        self.ctl.as_mut().ok_or(ProtocolError::Closed.into())
    }

    /// Connects, agrees on a version and checks the layout.
    pub(crate) fn open(&mut self) -> Result<(), MigrationError> {
        let hello = self.hello(Role::Control);
        let ctl = self.ctl.insert(self.metered(
            Conn::open(self.to, self.opts.timeout(), &hello)?,
            Role::Control,
        ));
        ctl.flush()?;
        self.caps = Caps::of(ctl.recv(Kind::HelloAck)?);
        if self.caps.trust() {
            let token = self.opts.token.clone();
            self.ctl()?.send(Kind::Token, &token)?;
        }
        let layout = super::layout_of(&self.regions, self.vm.vcpus());
        self.ctl()?.send(Kind::Layout, &layout)?;
        self.plan_clients()?;
        if self.caps.timeline() {
            let tail = self.opts.timeline_tail_ms;
            self.ctl()?.send(Kind::TimelineAsk, &tail)?;
        }
        if self.caps.landed_hashes() {
            // Only a precopy compares hashes taken as pages go and land;
            // the other modes hash memory when they verify.
            let hash = self.opts.verify && self.opts.mode == crate::options::Mode::Precopy;
            self.ctl()?.send(Kind::HashAsk, &hash)?;
            if hash {
                let table = crate::verify::PageHashes::new(&self.regions);
                self.sent_hashes = Some(std::sync::Arc::new(table));
            }
        }
        if self.caps.switch_ahead() {
            use crate::options::Mode;
            // These modes need the pages still to come missing at the
            // destination when they switch; it makes them so now, while the
            // guest still runs here, instead of in the pause.
            let ahead = matches!(self.opts.mode, Mode::Postcopy | Mode::Hybrid | Mode::Split);
            self.ctl()?.send(Kind::SwitchAhead, &ahead)?;
            if ahead {
                self.released_ahead = self.ctl()?.recv(Kind::SwitchReady)?;
                tracing::info!(
                    bytes = self.released_ahead,
                    "destination gave back memory populated ahead"
                );
            }
        }
        if self.caps.shared_pages() {
            use crate::options::Mode;
            // Only the copy rounds send references (a miss goes again in
            // the next round); postcopy and split pages have no next round.
            let ask = matches!(self.opts.mode, Mode::Precopy | Mode::Hybrid);
            self.ctl()?.send(Kind::ShareAsk, &ask)?;
            if ask {
                let offer = crate::shared::recv_offer(self.ctl()?)?;
                tracing::info!(
                    keys = offer.len(),
                    "the destination's host offers pages it holds"
                );
                self.shared = Some(std::sync::Arc::new(offer));
            }
        }
        if self.caps.answers_follow() {
            self.ask_answers_held()?;
        }
        let total: u64 = self.regions.iter().map(|r| r.size()).sum();
        self.tel.set_total_bytes(total);
        self.tel.set_phase(self.state.phase().live());
        self.tel
            .event("open", format!("{} v{}", self.to, self.caps.version()));
        tracing::info!(to = %self.to, version = self.caps.version(), "migration session open");
        Ok(())
    }

    /// Asks the destination whether the VM's clients can move with it
    /// (v5), and tells the VM the answer.
    fn plan_clients(&mut self) -> Result<(), MigrationError> {
        let plan = self.vm.clients_plan();
        let answer = if self.caps.clients() {
            self.ctl()?.send(Kind::ClientsPlan, &plan)?;
            if plan.is_none() {
                return Ok(());
            }
            self.ctl()?.recv::<ClientsAnswer>(Kind::ClientsAnswer)?
        } else if plan.is_some() {
            ClientsAnswer::Stay(format!(
                "the destination speaks protocol v{}; moving clients needs v{}",
                self.caps.version(),
                protocol::VERSION_CLIENTS
            ))
        } else {
            return Ok(());
        };
        tracing::info!(?answer, "clients");
        self.clients_move = answer == ClientsAnswer::Move;
        self.clients = Some(crate::stats::ClientsOutcome {
            moved: self.clients_move,
            connections: 0,
            detail: match &answer {
                ClientsAnswer::Move => String::new(),
                ClientsAnswer::Stay(why) => why.clone(),
            },
        });
        self.vm.clients_decided(&answer);
        Ok(())
    }

    /// Clients that stay here (forwarded) may have requests in the ring at
    /// the pause (v16): asks the destination to hold their answers under a
    /// fresh token, and tells the VM when it does, so its pause need not
    /// wait for the guest to answer them here.
    fn ask_answers_held(&mut self) -> Result<(), MigrationError> {
        let token = if self.clients_move || !self.vm.answers_may_follow() {
            None
        } else {
            let mut t = [0u8; 16];
            crate::random::fill(&mut t)
                .map_err(|e| MigrationError::Internal(format!("no random token: {e}")))?;
            Some(t)
        };
        self.ctl()?.send(Kind::AnswersAsk, &token)?;
        let Some(token) = token else {
            return Ok(());
        };
        let held: bool = self.ctl()?.recv(Kind::AnswersHeld)?;
        tracing::info!(held, "answers to requests in flight at the pause");
        if held {
            self.vm.answers_follow(token);
        }
        Ok(())
    }

    /// Counts `c`'s bytes as the connection of `role`.
    fn metered(&self, mut c: Conn, role: Role) -> Conn {
        c.count_into(self.tel.link(&role.link_name()));
        c
    }

    /// Opens one more connection of this session in `role`.
    pub(crate) fn open_role(&self, role: Role) -> Result<Conn, MigrationError> {
        let c = Conn::open(self.to, self.opts.timeout(), &self.hello(role))?;
        Ok(self.metered(c, role))
    }

    /// Opens the bulk streams; with `codec`, each announces its codec caches.
    pub(crate) fn open_bulk(&mut self, codec: Option<&CodecSetup>) -> Result<(), MigrationError> {
        for i in 0..self.opts.streams.max(1) {
            let mut c = self.open_role(Role::Bulk(i))?;
            if let Some(setup) = codec {
                protocol::send(c.writer(), Kind::Codec, setup)?;
            }
            c.flush()?;
            self.bulk.push(c);
        }
        Ok(())
    }

    /// Starts dirty tracking (stopped again by [`SourceSession::conclude`]);
    /// once on, a second call keeps what it tracked.
    /// Starts dirty tracking and enters Copying (stopped again by
    /// [`SourceSession::conclude`]); once on, a second call keeps what it
    /// tracked.
    pub(crate) fn start_dirty_log(&mut self) -> Result<(), MigrationError> {
        if self.state.dirty_log {
            return Ok(());
        }
        let t = std::time::Instant::now();
        self.vm
            .start_dirty_log()
            .map_err(MigrationError::vm("start dirty log"))?;
        // Usually about a millisecond. A few moves on a host whose memory
        // had just been churned waited 2-11 s between opening and round 0
        // (session 52, not explained): if this is where, say so.
        let took = t.elapsed();
        if took > std::time::Duration::from_secs(1) {
            tracing::warn!(
                ms = took.as_millis() as u64,
                "starting the dirty log took over a second"
            );
        } else {
            tracing::debug!(ms = took.as_secs_f64() * 1e3, "dirty log started");
        }
        self.state.dirty_log = true;
        self.enter(SourcePhase::Copying)
    }

    /// Stops dirty tracking (nothing to do where it is off).
    pub(crate) fn stop_dirty_log(&mut self) -> Result<(), MigrationError> {
        if !self.state.dirty_log {
            return Ok(());
        }
        self.state.dirty_log = false;
        self.vm
            .stop_dirty_log()
            .map_err(MigrationError::vm("stop dirty log"))
    }

    /// Pauses the vCPUs (resumed by [`SourceSession::conclude`] on failure)
    /// and starts the downtime clock.
    pub(crate) fn pause(&mut self) -> Result<(), MigrationError> {
        // The guest stops at the first kick: the downtime counts from here,
        // parking the vCPUs included.
        let asked = Instant::now();
        // Raised before the pause: the VM raises its kicked vCPUs too (until
        // each parks), and waits for them awake, yielding to them. At
        // normal priority on a busy host this thread's own turn would come
        // a time slice late.
        self.urgent = Some(crate::priority::Urgent::enter(
            crate::priority::PAUSE_PRIORITY,
        ));
        self.vm.pause().map_err(MigrationError::vm("pause"))?;
        self.enter(SourcePhase::Paused)?;
        self.state.pause_asked_at(asked);
        Ok(())
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

    /// Ends a round on the control connection and waits until the
    /// destination has applied it (so a later copy of a page can never be
    /// overtaken by an earlier one).
    pub(crate) fn barrier(&mut self, round: u32, frames: Vec<u64>) -> Result<(), MigrationError> {
        self.ctl()?
            .send(Kind::RoundDone, &RoundDone { round, frames })?;
        loop {
            let f = protocol::read_frame(self.ctl()?.reader())?;
            if f.kind == Kind::SharedMissed && self.shared.is_some() {
                let runs: Vec<GpaPages> = protocol::decode(&f, Kind::SharedMissed)?;
                // Only pages of this VM go again (a stranger's list is not
                // trusted to stay inside it).
                let inside = |r: &GpaPages| {
                    r.pages > 0 && crate::memory::range_inside(&self.regions, r.gpa, r.pages)
                };
                if !runs.iter().all(inside) {
                    return Err(ProtocolError::Malformed {
                        kind: Kind::SharedMissed,
                        reason: "a missed page outside guest RAM".into(),
                    }
                    .into());
                }
                // Held until the next round: never more than the VM's pages.
                let guest: u64 = self.regions.iter().map(RegionView::pages).sum();
                let held =
                    crate::ranges::total_pages(&self.missed) + crate::ranges::total_pages(&runs);
                if held > guest {
                    return Err(ProtocolError::Malformed {
                        kind: Kind::SharedMissed,
                        reason: "more pages missed than the VM has".into(),
                    }
                    .into());
                }
                self.missed.extend(runs);
                continue;
            }
            return check_ack(protocol::decode(&f, Kind::RoundAck)?, round);
        }
    }

    /// Pages sent by reference that the destination missed since the last
    /// call: they go again.
    pub(crate) fn take_missed(&mut self) -> Vec<GpaPages> {
        std::mem::take(&mut self.missed)
    }

    /// Ends the last round without waiting for its ack: the destination
    /// applies a round before it reads what follows, and starts the VM
    /// only after, so State and Complete may go out at once (a round trip
    /// less in the pause). [`SourceSession::complete`] reads the ack.
    pub(crate) fn last_round_done(
        &mut self,
        round: u32,
        frames: Vec<u64>,
    ) -> Result<(), MigrationError> {
        self.ctl()?
            .send(Kind::RoundDone, &RoundDone { round, frames })?;
        self.unacked = Some(round);
        Ok(())
    }

    /// Checkpoints the clients' connections and sends them (Clients).
    fn send_clients(&mut self) -> Result<(), MigrationError> {
        let clients = self
            .vm
            .save_clients()
            .map_err(MigrationError::vm("checkpoint the clients"))?;
        protocol::write_frame(self.ctl()?.writer(), Kind::Clients, &clients)
            .map_err(ProtocolError::Io)?;
        self.clients_sent = true;
        Ok(())
    }

    /// From v15, in the pause right after State: the clients that move go
    /// now, so the destination restores their connections (parked) while
    /// the last round arrives instead of after Complete. Their time off
    /// this host is no longer: the restore there overlaps the round.
    /// Returns whether they went (the downtime's clients part is then the
    /// caller's lap).
    pub(crate) fn send_clients_early(&mut self) -> Result<bool, MigrationError> {
        if !self.clients_move || !self.caps.early_state() {
            return Ok(false);
        }
        self.send_clients()?;
        Ok(true)
    }

    /// Sends the VM's state; returns its size in bytes.
    pub(crate) fn send_state(&mut self) -> Result<u64, MigrationError> {
        let state = self
            .vm
            .save_state()
            .map_err(MigrationError::vm("save state"))?;
        protocol::write_frame(self.ctl()?.writer(), Kind::State, &state)
            .map_err(ProtocolError::Io)?;
        Ok(state.len() as u64)
    }

    /// Sends per-page hashes of all memory; returns (pages, wire bytes).
    pub(crate) fn send_verify(&mut self) -> Result<(u64, u64), MigrationError> {
        let vm = self.vm;
        let hashes = super::hashes(&self.regions, |i| vm.data_ranges(i));
        let body: Vec<u8> = hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
        protocol::write_frame(self.ctl()?.writer(), Kind::Verify, &body)
            .map_err(ProtocolError::Io)?;
        Ok((hashes.len() as u64, (HEADER + body.len()) as u64))
    }

    /// Sends per-page hashes computed earlier; returns the wire bytes.
    pub(crate) fn send_hashes(&mut self, hashes: &[u64]) -> Result<u64, MigrationError> {
        let body: Vec<u8> = hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
        self.ctl()?.send_frame(Kind::Verify, &body)?;
        Ok((HEADER + body.len()) as u64)
    }

    /// Ends a postcopy: Complete, and the destination's Finished with its
    /// fault report (every page arrived there).
    pub(crate) fn finish(&mut self) -> Result<crate::stats::FaultReport, MigrationError> {
        let ctl = self.ctl()?;
        ctl.send_frame(Kind::Complete, &[])?;
        let report = ctl.recv(Kind::Finished)?;
        self.enter(SourcePhase::Done)?;
        Ok(report)
    }

    /// After a migration that succeeded: waits for the destination's
    /// timeline (it samples for the tail after the switch first) and hands
    /// it to the VM. Never fails the migration: a missing timeline is only
    /// an event in this side's.
    pub(crate) fn collect_timeline(&mut self) {
        // The migration is over: the destination's bulk threads end when
        // their streams close, and only then does it sample its tail.
        for c in &self.bulk {
            c.shutdown();
        }
        self.bulk.clear();
        if !self.caps.timeline() {
            self.tel.event(
                "timeline",
                format!(
                    "the destination speaks protocol v{}: it sends no timeline",
                    self.caps.version()
                ),
            );
            return;
        }
        let wait =
            Duration::from_millis(u64::from(self.opts.timeline_tail_ms)) + Duration::from_secs(5);
        let got = (|| -> Result<Vec<u8>, ProtocolError> {
            let ctl = self.ctl.as_mut().ok_or(ProtocolError::Closed)?;
            ctl.set_read_timeout(Some(wait))
                .map_err(ProtocolError::Io)?;
            let f = protocol::read_frame(ctl.reader())?;
            if f.kind != Kind::Timeline {
                return Err(ProtocolError::Unexpected {
                    got: f.kind,
                    want: "Timeline",
                });
            }
            crate::telemetry::unpack_lines(&f.body).map_err(|reason| ProtocolError::Malformed {
                kind: Kind::Timeline,
                reason,
            })
        })();
        match got {
            Ok(lines) => self.vm.peer_timeline(lines),
            Err(e) => self
                .tel
                .event("timeline", format!("no timeline from the destination: {e}")),
        }
    }

    /// Sends Complete and waits for Started, then enters `then` (Done, or
    /// Switched for postcopy). From Complete on the destination may start
    /// the VM at any moment: an Abort means it did not; anything else but
    /// Started leaves the outcome unknown, and resuming here could run the
    /// VM twice (the state's rule).
    pub(crate) fn complete(&mut self, then: SourcePhase) -> Result<StartedReport, MigrationError> {
        if self.clients_move && !self.clients_sent {
            // Last, so the clients are off this host for the shortest time
            // (a v15 precopy sent them earlier: send_clients_early).
            let t = Instant::now();
            self.send_clients()?;
            self.clients_ms = t.elapsed().as_secs_f64() * 1e3;
        }
        let version = self.caps.version();
        self.enter(SourcePhase::Completing)?;
        let unacked = self.unacked.take();
        self.ctl()?.send_frame(Kind::Complete, &[])?;
        // Still at real time: it sleeps in read, and a real-time thread
        // is woken at once even on a busy host. At normal priority it polls
        // instead (Conn::spin_until_readable: a sleeping thread wakes
        // 50-200 µs late here), but on a busy host each yield gave the core
        // away for a time slice (the wait took 5-10 ms beside 7 busy VMs).
        // Polling at real time was worse on both counts: on one host it
        // keeps the core from the destination's normal threads that the
        // answer waits for (idle 4 GiB 2.0 ms against 1.0; beside 7 busy
        // VMs 1.7 ms against 0.7; bench/results/downtime-busy.md).
        let spin = match &self.urgent {
            Some(u) if u.raised() => Duration::ZERO,
            _ => SPIN_FOR_STARTED,
        };
        let ctl = self.ctl()?;
        ctl.spin_until_readable(spin);
        if let Some(round) = unacked {
            // The last round's ack comes first; the destination applied it
            // before it could start the VM.
            match protocol::read_frame(ctl.reader()) {
                Ok(f) if f.kind == Kind::RoundAck => {
                    check_ack(protocol::decode(&f, Kind::RoundAck)?, round)?
                }
                Err(e @ ProtocolError::Aborted(_)) => return Err(e.into()),
                Ok(f) => {
                    return Err(MigrationError::InDoubt(format!(
                        "the destination answered the last round with {:?}",
                        f.kind
                    )))
                }
                Err(e) => return Err(MigrationError::InDoubt(e.to_string())),
            }
        }
        ctl.spin_until_readable(spin);
        let frame = protocol::read_frame(ctl.reader());
        // The downtime ends with Started: back to normal priority.
        self.relax();
        let frame = match frame {
            Ok(f) if f.kind == Kind::Started => f,
            Err(e @ ProtocolError::Aborted(_)) => return Err(e.into()),
            Ok(f) => {
                return Err(MigrationError::InDoubt(format!(
                    "the destination answered Complete with {:?}",
                    f.kind
                )))
            }
            Err(e) => return Err(MigrationError::InDoubt(e.to_string())),
        };
        let report: StartedReport = if Caps::of(version).clients() {
            protocol::decode(&frame, Kind::Started)?
        } else {
            let v1: crate::stats::StartedReportV1 = protocol::decode(&frame, Kind::Started)?;
            StartedReport {
                service: v1.service,
                cpu_s: v1.cpu_s,
                ..Default::default()
            }
        };
        if let (Some(c), Some(note)) = (self.clients.as_mut(), &report.clients) {
            c.detail = note.clone();
        }
        self.enter(then)?;
        tracing::info!(service = ?report.service, "destination started the VM");
        self.tel.event("started", "the VM runs at the destination");
        Ok(report)
    }

    /// Records in `stats` what the switch cost and brought: `ms` ran from
    /// the end of the previous downtime part until Started, of which the
    /// clients' checkpoint was this side's and the rest the destination's.
    pub(crate) fn note_started(
        &self,
        stats: &mut crate::stats::MigrationStats,
        report: &StartedReport,
        ms: f64,
    ) {
        let parts = &mut stats.downtime_parts;
        if self.clients_ms > 0.0 {
            // Checkpointed in complete(), inside this lap.
            parts.clients = self.clients_ms;
        }
        parts.destination = ms - self.clients_ms;
        // The destination starts hashing as the Verify frame arrives,
        // while this side is still finishing its own part: only what falls
        // in the destination's part counts there (the parts add up to the
        // downtime, and this one lies inside its part).
        parts.destination_verify = report.verify_ms.min(parts.destination);
        stats.clients = self.clients.clone();
        stats.destination_service = report.service.clone();
        stats.destination_released_bytes = self.released_ahead;
        stats.shared_offered = self.shared.as_ref().map_or(0, |o| o.len() as u64);
    }

    /// Host CPU seconds this side used: data threads and this thread.
    pub(crate) fn cpu_secs(&self) -> f64 {
        self.cpu.secs() + thread_cpu_secs() - self.ctl_cpu0
    }

    /// Applies the safety rule to a mode's result: on failure the VM runs
    /// here again (or stays paused when in doubt or switched) and the peer
    /// is told; a paused postcopy waits for its resume.
    pub(crate) fn conclude(
        mut self,
        mut result: Result<Outcome, MigrationError>,
    ) -> Result<Outcome, MigrationError> {
        // Whatever is left to do here (resume, abort, stop the dirty log)
        // is no pause's: at normal priority.
        self.relax();
        // A broken or refused connection often means the destination refused
        // the session and closed: its Abort, if it sent one, says why better
        // than "connection reset" (a bulk connect can race its exit).
        let broken = matches!(
            &result,
            Err(
                MigrationError::Protocol(ProtocolError::Io(_) | ProtocolError::Closed)
                    | MigrationError::Connect { .. }
                    | MigrationError::Stream { .. }
            )
        );
        if let (true, Some(ctl)) = (broken, self.ctl.as_mut()) {
            let _ = ctl.set_read_timeout(Some(Duration::from_millis(500)));
            loop {
                match protocol::read_frame(ctl.reader()) {
                    Ok(_) => continue,
                    Err(e @ ProtocolError::Aborted(_)) => {
                        result = Err(e.into());
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
        let c = match &result {
            Ok(Outcome::Done(_)) => return result,
            Ok(Outcome::Paused(p)) => {
                tracing::error!(reason = %p.reason, "postcopy paused");
                self.state.on_pause()
            }
            Err(e) => {
                let c = self.state.on_failure(e);
                self.tel.event("failed", e.to_string());
                match c.left {
                    Left::RunsHere => {
                        tracing::warn!(error = %e, "migration failed; the VM runs on here")
                    }
                    Left::PausedInDoubt => {
                        tracing::warn!(error = %e, "migration in doubt; the VM stays paused")
                    }
                    Left::PausedSwitched | Left::PausedResumable => {
                        tracing::error!(error = %e, "postcopy broke after the switch; the VM stays paused here with all its memory")
                    }
                }
                c
            }
        };
        self.tel.set_phase(c.live());
        if c.unthrottle {
            let _ = self.vm.throttle(0);
        }
        if c.stop_dirty_log && self.state.dirty_log {
            let _ = self.vm.stop_dirty_log();
        }
        if c.resume {
            let _ = self.vm.resume();
        }
        if let (true, Some(ctl), Err(e)) = (c.abort_peer, self.ctl.as_mut(), &result) {
            ctl.abort(&e.to_string());
        }
        result
    }
}
