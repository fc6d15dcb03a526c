//! The destination's session: waits for a source, agrees on a version,
//! checks the layout, accepts the bulk streams by their role, and runs the
//! control loop (round barriers, state, verification, Complete) until the
//! VM starts. The incoming stream is treated as hostile: every frame is
//! checked, and the VM starts only after Complete. A failure before that
//! leaves the VM never started, and the source is told why.

use std::time::{Duration, Instant};

use super::DestPhase;
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::priority::{Urgent, PAUSE_PRIORITY};
use crate::protocol::{self, Frame, Hello, Kind, ProtocolError, Role, RoundDone};
use crate::receiver::Received;
use crate::sink::{PageSink, SwitchSink};
use crate::stats::{thread_cpu_secs, DestinationStats, StartedReport, StartedReportV1};
use crate::telemetry::{LivePhase, Telemetry};
use crate::transport::{Conn, Listener};
use crate::verify::{HashingSink, PageHashes};
use crate::vm::{ClientsAnswer, ClientsPlan, DestinationVm};

/// What a destination mode is made with: the VM, the listener the
/// session's other connections arrive on, the session's id and timeouts,
/// and the sink pages land through.
#[derive(Clone, Copy)]
pub(crate) struct DestinationContext<'a> {
    pub(crate) vm: &'a dyn DestinationVm,
    pub(crate) listener: &'a Listener,
    pub(crate) session: u64,
    /// Bounds each step once the source is connected.
    pub(crate) timeout: Duration,
    /// How long a paused postcopy waits for its source to come back.
    pub(crate) reconnect_timeout: Duration,
    pub(crate) sink: &'a SwitchSink<'a>,
}

/// What a mode adds to the destination's control loop. The defaults are a
/// precopy destination's: no messages of its own, nothing to do around the
/// start.
pub(crate) trait DestinationMode {
    /// A control message the session does not handle itself (a mode's own
    /// phase), with the control connection to answer on; the default
    /// refuses it.
    fn on_message(&mut self, f: &Frame, _ctl: &mut Conn) -> Result<(), MigrationError> {
        Err(ProtocolError::Unexpected {
            got: f.kind,
            want: "RoundDone, State, Verify or Complete",
        }
        .into())
    }
    /// Per-page hashes of this side's memory to verify against the
    /// source's, where the mode knows better than reading memory (split:
    /// some pages live on memory servers); None: read memory.
    fn hashes(&mut self, _regions: &[RegionView]) -> Result<Option<Vec<u64>>, MigrationError> {
        Ok(None)
    }
    /// After the state is restored, just before the vCPUs start (postcopy
    /// registers the missing pages with userfaultfd here); `rounds` precopy
    /// rounds were applied.
    fn before_start(&mut self, _rounds: u32) -> Result<(), MigrationError> {
        Ok(())
    }
    /// After Started went out, while the bulk streams still run (postcopy's
    /// phase); true if the mode had such a phase.
    fn after_start(
        &mut self,
        _ctl: &mut Conn,
        _rx: &Received,
        _stats: &mut DestinationStats,
    ) -> Result<bool, MigrationError> {
        Ok(false)
    }
}

/// One incoming migration's control connection and what it agreed on.
pub(crate) struct DestSession<'a> {
    listener: &'a Listener,
    timeout: Duration,
    ctl: Conn,
    hello: Hello,
    /// What the agreed protocol version lets this session use.
    pub(crate) caps: crate::protocol::Caps,
    /// Where this side stands (checked transitions, `state.rs`).
    phase: DestPhase,
    /// This side agreed to take the VM's clients over.
    clients_agreed: bool,
    /// Live figures for watchers (the VM's, or a private one).
    tel: std::sync::Arc<Telemetry>,
    /// The source wants this side's timeline, this long after the end (v6).
    timeline_tail: Option<Duration>,
    /// The source asked for every page to be hashed as it lands (v12).
    hash_landed: bool,
    /// This host's other VMs' pages, offered to the source (v14).
    shared: Option<std::sync::Arc<crate::shared::SiblingIndex>>,
    /// The ownership claim the source holds (v18), taken over at Complete.
    owner_claim: Option<Vec<u8>>,
}

impl<'a> DestSession<'a> {
    /// Waits (as long as it takes) for a source, and admits the first
    /// whose control connection agrees on a version, presents the token
    /// the listener demands (v9) and sends this VM's layout, each opening
    /// on its own thread within the admission limit (`admission.rs`).
    /// Anyone else is told why with an Abort and the wait goes on: a
    /// stranger, a stalling or a mistaken peer never ends it nor holds up
    /// the real source. The VM is untouched so far.
    pub(crate) fn accept(
        listener: &'a Listener,
        timeout: Duration,
        vm: &dyn DestinationVm,
    ) -> Result<Self, MigrationError> {
        let mine = super::layout_of(&vm.regions(), vm.vcpus());
        let won = super::admission::first_source(listener, &mine)?;
        won.conn
            .set_timeouts(Some(timeout))
            .map_err(ProtocolError::Io)?;
        let who = won
            .conn
            .peer()
            .map(|p| p.name().to_string())
            .unwrap_or_else(|| "a peer".into());
        tracing::info!(peer = %who, "incoming migration admitted");
        Ok(DestSession {
            listener,
            timeout,
            ctl: won.conn,
            hello: won.hello,
            caps: crate::protocol::Caps::of(won.version),
            phase: DestPhase::Waiting,
            clients_agreed: false,
            tel: Telemetry::new(),
            timeline_tail: None,
            hash_landed: false,
            shared: None,
            owner_claim: None,
        })
    }

    /// The one place this side changes phase: checked, shown to watchers.
    fn enter(&mut self, next: DestPhase) -> Result<(), MigrationError> {
        if !self.phase.may_enter(next) {
            return Err(MigrationError::Internal(format!(
                "the destination cannot go from {:?} to {next:?}",
                self.phase
            )));
        }
        self.phase = next;
        self.tel.set_phase(next.live());
        tracing::debug!(phase = ?next, "destination phase");
        Ok(())
    }

    /// The session id the source chose (its other connections carry it).
    pub(crate) fn session_id(&self) -> u64 {
        self.hello.session
    }

    /// Answers the source's clients plan (v5) and timeline ask (v6); the
    /// version, token and layout were agreed when it was admitted.
    pub(crate) fn handshake(&mut self, vm: &dyn DestinationVm) -> Result<(), MigrationError> {
        let regions = vm.regions();
        if let Some(t) = vm.telemetry() {
            self.tel = t;
        }
        self.ctl
            .count_into(self.tel.link(&Role::Control.link_name()));
        if self.caps.clients() {
            let plan: Option<ClientsPlan> = self.ctl.recv(Kind::ClientsPlan)?;
            if let Some(plan) = plan {
                let answer = match vm.prepare_clients(&plan) {
                    Ok(()) => ClientsAnswer::Move,
                    Err(why) => ClientsAnswer::Stay(why),
                };
                tracing::info!(?plan, ?answer, "clients plan");
                self.clients_agreed = answer == ClientsAnswer::Move;
                self.ctl.send(Kind::ClientsAnswer, &answer)?;
            }
        }
        if self.caps.timeline() {
            let tail: u32 = self.ctl.recv(Kind::TimelineAsk)?;
            // A source may ask for a long tail; this side bounds it.
            self.timeline_tail = Some(Duration::from_millis(u64::from(tail.min(60_000))));
        }
        if self.caps.landed_hashes() {
            self.hash_landed = self.ctl.recv(Kind::HashAsk)?;
        }
        if self.caps.switch_ahead() {
            let ahead: bool = self.ctl.recv(Kind::SwitchAhead)?;
            if ahead {
                // No page has landed yet: nothing given back here is data.
                let released = vm
                    .release_prealloc()
                    .map_err(MigrationError::vm("give back memory populated ahead"))?;
                self.tel.event("released", format!("{released} bytes"));
                self.ctl.send(Kind::SwitchReady, &released)?;
            }
        }
        if self.caps.shared_pages() {
            let ask: bool = self.ctl.recv(Kind::ShareAsk)?;
            if ask {
                self.offer_shared(vm)?;
            }
        }
        if self.caps.answers_follow() {
            let token: Option<[u8; 16]> = self.ctl.recv(Kind::AnswersAsk)?;
            if let Some(token) = token {
                let held = !self.clients_agreed && vm.hold_answers(token);
                self.ctl.send(Kind::AnswersHeld, &held)?;
            }
        }
        self.owner_claim = if self.caps.owner() {
            self.ctl.recv(Kind::Owner)?
        } else {
            None
        };
        super::owner::check_claim(self.owner_claim.as_deref(), vm.fence().is_some(), self.caps)?;
        if let (Some(fence), Some(claim)) = (vm.fence(), self.owner_claim.as_deref()) {
            fence.expect(claim).map_err(MigrationError::Fence)?;
        }
        self.tel
            .set_total_bytes(regions.iter().map(|r| r.size()).sum());
        self.enter(DestPhase::Receiving)?;
        self.tel.event("open", format!("v{}", self.caps.version()));
        tracing::info!(
            version = self.caps.version(),
            "incoming migration session open"
        );
        Ok(())
    }

    /// Takes the VM from the source's claim before its first instruction
    /// here, if this VMM fences its VM (it waits while the registry does not
    /// answer: the VM runs nowhere meanwhile, and that is the safe side).
    pub(crate) fn take_ownership(&mut self, vm: &dyn DestinationVm) -> Result<(), MigrationError> {
        let (Some(fence), Some(claim)) = (vm.fence(), self.owner_claim.as_deref()) else {
            return Ok(());
        };
        let t = Instant::now();
        let held = fence.take_over(claim).map_err(MigrationError::Fence)?;
        self.tel.event(
            "owner",
            format!("{held} ({:.1} ms)", t.elapsed().as_secs_f64() * 1e3),
        );
        tracing::info!(%held, "took the VM's ownership");
        Ok(())
    }

    /// Answers a ShareAsk: the keys of the pages this host's other VMs
    /// hold, under a seed drawn for this migration (none when this VM does
    /// not share).
    fn offer_shared(&mut self, vm: &dyn DestinationVm) -> Result<(), MigrationError> {
        let Some(siblings) = vm.sibling_memory() else {
            return Ok(crate::shared::send_offer(&mut self.ctl, 0, &[])?);
        };
        let t = Instant::now();
        let seed = crate::random::u64().map_err(ProtocolError::Io)?;
        let index = crate::shared::SiblingIndex::build(siblings, seed);
        let keys = index.keys();
        crate::shared::send_offer(&mut self.ctl, seed, &keys)?;
        tracing::info!(
            pages = keys.len(),
            ms = t.elapsed().as_millis() as u64,
            "offered the pages this host's other VMs hold"
        );
        self.tel
            .event("shared_offer", format!("{} pages", keys.len()));
        self.shared = Some(std::sync::Arc::new(index));
        Ok(())
    }

    /// Accepts the bulk streams the source announced, each by its role.
    fn accept_bulk(&self) -> Result<Vec<Conn>, MigrationError> {
        accept_bulk(
            self.listener,
            self.timeout,
            self.hello.session,
            self.hello.streams,
            &self.tel,
        )
    }

    /// Receives the migration into `vm` through `sink`: bulk streams on
    /// their own threads, the control loop here, with `mode`'s phases.
    pub(crate) fn run(
        &mut self,
        vm: &dyn DestinationVm,
        sink: &dyn PageSink,
        mode: &mut dyn DestinationMode,
    ) -> Result<DestinationStats, MigrationError> {
        let ctl_cpu0 = thread_cpu_secs();
        let bulk = self.accept_bulk()?;
        let regions = vm.regions();
        // The receiver holds the index alone, and lets go of it when the
        // copy rounds end.
        let rx = Received::new(bulk.len()).sharing(self.shared.take());
        let mut stats = DestinationStats::default();
        // A verified precopy: every page is hashed as it lands.
        let landed = self.hash_landed.then(|| PageHashes::new(&regions));
        let hashing = landed.as_ref().map(|hashes| HashingSink {
            inner: sink,
            hashes,
        });
        let sink: &dyn PageSink = match &hashing {
            Some(h) => h,
            None => sink,
        };
        std::thread::scope(|s| -> Result<(), MigrationError> {
            for (i, c) in bulk.into_iter().enumerate() {
                if let Ok(closer) = c.closer() {
                    rx.hold(closer);
                }
                let (reader, _) = c.into_parts();
                let (rx, regions) = (&rx, &regions);
                s.spawn(move || {
                    if let Err(e) = crate::receiver::bulk_loop(regions, sink, reader, i, rx) {
                        rx.fail(i, e);
                    }
                });
            }
            let r = self.control_loop(
                vm,
                &regions,
                &rx,
                mode,
                landed.as_ref(),
                ctl_cpu0,
                &mut stats,
            );
            if r.is_err() {
                // Bulk threads may wait on a source that waits for us: cut
                // their streams so the Abort goes out now, not at a timeout.
                rx.cut();
            } else {
                rx.stop();
            }
            // A bulk stream that failed (corrupt frame, bad address) is the
            // real cause even when the control connection saw something else.
            match (r, rx.take_failure()) {
                (Err(_), Some(bulk)) => Err(bulk),
                (r, _) => r,
            }
        })?;
        stats.pages = rx.pages.load(std::sync::atomic::Ordering::Relaxed);
        stats.shared_pages = rx.shared_landed.load(std::sync::atomic::Ordering::Relaxed);
        stats.shared_missed = rx.shared_missed.load(std::sync::atomic::Ordering::Relaxed);
        stats.zero_pages = rx.zero_pages.load(std::sync::atomic::Ordering::Relaxed);
        Ok(stats)
    }

    #[allow(clippy::too_many_arguments)]
    fn control_loop(
        &mut self,
        vm: &dyn DestinationVm,
        regions: &[RegionView],
        rx: &Received,
        mode: &mut dyn DestinationMode,
        landed: Option<&PageHashes>,
        ctl_cpu0: f64,
        stats: &mut DestinationStats,
    ) -> Result<(), MigrationError> {
        let mut state: Option<Vec<u8>> = None;
        // From v15: the state, and the clients that move, were restored
        // as they arrived.
        let mut restored = false;
        let mut clients_restored = false;
        let mut clients: Option<Vec<u8>> = None;
        // From the pause's first frame to Started this thread carries the
        // downtime: real time (crate::priority), so the readers a move wakes
        // and the vCPUs it starts do not take its core. Raised from the
        // start: the pause's first frame must wake it at once, and at
        // normal priority on a busy host that wake-up waits a time slice
        // (5-10 ms with 16 busy vCPUs on 2 cores). Until then it only
        // sleeps on the control connection and the round barriers, and
        // answers each round with a frame, which starves nothing.
        let mut urgent: Option<Urgent> = Some(Urgent::enter(PAUSE_PRIORITY));
        loop {
            let tel = self.tel.clone();
            await_control(&mut self.ctl, || {
                // Bytes in on every connection, and what the streams applied.
                let bytes: u64 = tel.snapshot().links.iter().map(|l| l.2).sum();
                bytes + rx.progress()
            })?;
            let f = protocol::read_frame(self.ctl.reader())?;
            match f.kind {
                Kind::RoundDone => {
                    let rd = round_done(&f, rx)?;
                    // Every bulk stream has applied its share of the round.
                    rx.barrier(&rd.frames, self.timeout)?;
                    stats.rounds = rd.round + 1;
                    tracing::debug!(round = rd.round, "round applied");
                    self.tel.event("round_applied", rd.round.to_string());
                    let missed = rx.take_missed();
                    for (runs, _) in protocol::run_frames(&missed).filter(|(r, _)| !r.is_empty()) {
                        self.ctl.send(Kind::SharedMissed, &runs)?;
                    }
                    self.ctl.send(Kind::RoundAck, &rd.round)?;
                }
                Kind::State => {
                    urgent.get_or_insert_with(|| Urgent::enter(PAUSE_PRIORITY));
                    // No reference comes after: the last round was applied
                    // (or, from v15, is the last round, which sends none).
                    rx.stop_sharing();
                    if self.caps.early_state() {
                        // Restored now, while the rest arrives: the state
                        // touches no guest memory, and restoring it again
                        // (a second State) replaces it whole.
                        let t = Instant::now();
                        vm.restore_state(&f.body)
                            .map_err(MigrationError::vm("restore state"))?;
                        restored = true;
                        tracing::debug!(
                            ms = t.elapsed().as_secs_f64() * 1e3,
                            "state restored ahead of Complete"
                        );
                    } else {
                        state = Some(f.body);
                    }
                }
                Kind::Clients if self.clients_agreed => {
                    if clients_restored {
                        return Err(ProtocolError::Unexpected {
                            got: Kind::Clients,
                            want: "Complete (the clients came already)",
                        }
                        .into());
                    }
                    if self.caps.early_state() {
                        // Restored now, parked: they go live only as the
                        // VM starts, so the last round may still land.
                        let t = Instant::now();
                        let note = vm
                            .restore_clients(&f.body)
                            .map_err(MigrationError::vm("restore the clients"))?;
                        stats.clients = Some(note);
                        clients_restored = true;
                        tracing::debug!(
                            ms = t.elapsed().as_secs_f64() * 1e3,
                            "clients restored ahead of Complete"
                        );
                    } else {
                        clients = Some(f.body);
                    }
                }
                Kind::Verify => {
                    // Hashing all of memory must not hold a core at real time.
                    drop(urgent.take());
                    let t = Instant::now();
                    let mine = match mode.hashes(regions)? {
                        Some(h) => h,
                        None => super::hashes(regions, |i| vm.data_ranges(i)),
                    };
                    stats.verified_pages = super::compare_hashes(regions, &mine, &f.body)?;
                    stats.verify_ms = t.elapsed().as_secs_f64() * 1e3;
                }
                Kind::VerifyDigests => {
                    let t = Instant::now();
                    let Some(landed) = landed else {
                        return Err(ProtocolError::Unexpected {
                            got: Kind::VerifyDigests,
                            want: "Verify (no hashes were asked for as pages landed)",
                        }
                        .into());
                    };
                    stats.verified_pages = landed.check_digests(&f)?;
                    stats.verify_ms = t.elapsed().as_secs_f64() * 1e3;
                }
                Kind::Complete => {
                    urgent.get_or_insert_with(|| Urgent::enter(PAUSE_PRIORITY));
                    let t = Instant::now();
                    self.enter(DestPhase::Restoring)?;
                    if !restored {
                        let state = state.take().ok_or(ProtocolError::Unexpected {
                            got: Kind::Complete,
                            want: "State before Complete",
                        })?;
                        vm.restore_state(&state)
                            .map_err(MigrationError::vm("restore state"))?;
                    }
                    let state_ms = t.elapsed().as_secs_f64() * 1e3;
                    match clients.take() {
                        Some(c) => {
                            let note = vm
                                .restore_clients(&c)
                                .map_err(MigrationError::vm("restore the clients"))?;
                            stats.clients = Some(note);
                        }
                        None if self.clients_agreed && !clients_restored => {
                            return Err(ProtocolError::Unexpected {
                                got: Kind::Complete,
                                want: "the Clients this side agreed to take",
                            }
                            .into())
                        }
                        None => {}
                    }
                    let clients_ms = t.elapsed().as_secs_f64() * 1e3 - state_ms;
                    mode.before_start(stats.rounds)?;
                    self.take_ownership(vm)?;
                    vm.start().map_err(MigrationError::vm("start"))?;
                    self.enter(DestPhase::Started)?;
                    stats.restore_ms = t.elapsed().as_secs_f64() * 1e3;
                    tracing::debug!(
                        state_ms,
                        clients_ms,
                        total_ms = stats.restore_ms,
                        "restored and started"
                    );
                    let report = StartedReport {
                        service: vm.service_addr(),
                        cpu_s: rx.cpu.secs() + thread_cpu_secs() - ctl_cpu0,
                        restore_ms: stats.restore_ms,
                        verify_ms: stats.verify_ms,
                        clients: stats.clients.clone(),
                    };
                    if self.caps.clients() {
                        self.ctl.send(Kind::Started, &report)?;
                    } else {
                        let v1 = StartedReportV1 {
                            service: report.service,
                            cpu_s: report.cpu_s,
                        };
                        self.ctl.send(Kind::Started, &v1)?;
                    }
                    drop(urgent.take()); // postcopy's after_start runs on
                    tracing::info!(restore_ms = stats.restore_ms, "VM started here");
                    self.tel
                        .event("started", format!("restore {:.1} ms", stats.restore_ms));
                    if mode.after_start(&mut self.ctl, rx, stats)? {
                        self.tel.event("finished", "every page arrived");
                    }
                    self.enter(DestPhase::Done)?;
                    return Ok(());
                }
                _ => mode.on_message(&f, &mut self.ctl)?,
            }
        }
    }

    /// After a migration that succeeded, if the source asked (v6): goes on
    /// sampling for the tail it asked for, then sends this side's timeline.
    /// The VM runs here whatever happens to it: a failure is only logged.
    pub(crate) fn send_timeline(&mut self, vm: &dyn DestinationVm) {
        let Some(tail) = self.timeline_tail else {
            return;
        };
        tracing::debug!(tail_ms = tail.as_millis() as u64, "timeline tail");
        std::thread::sleep(tail);
        let mut body = crate::telemetry::pack_lines(&vm.timeline());
        if body.len() > protocol::MAX_BODY {
            tracing::warn!(bytes = body.len(), "timeline too large to send back");
            body.clear();
        }
        match self.ctl.send_frame(Kind::Timeline, &body) {
            Ok(()) => tracing::debug!(bytes = body.len(), "timeline sent back"),
            Err(e) => tracing::warn!(error = %e, "could not send the timeline back"),
        }
    }

    /// Tells the source why this side gives up (unless it gave up first)
    /// and closes gracefully, so the reason is not lost to a reset.
    pub(crate) fn conclude<T>(
        mut self,
        result: Result<T, MigrationError>,
    ) -> Result<T, MigrationError> {
        if let Err(e) = &result {
            self.tel.event("failed", e.to_string());
            self.tel.set_phase(LivePhase::Failed);
            if self.phase.vm_started() {
                tracing::error!(error = %e, "incoming migration failed after the VM started here");
            } else {
                tracing::warn!(error = %e, "incoming migration failed; no VM was started");
            }
            if !e.is_peer_abort() {
                self.ctl.abort(&e.to_string());
                self.ctl.drain(Duration::from_secs(1));
            }
        }
        result
    }
}

/// Accepts `streams` bulk connections of `session` (clamped to 1-64),
/// each by its role (and counted in `tel` under it), within `timeout` of
/// the last one. Other connections are left to whoever asks for them (a
/// stray is dropped by the listener after a while).
pub(crate) fn accept_bulk(
    listener: &Listener,
    timeout: Duration,
    session: u64,
    streams: u16,
    tel: &Telemetry,
) -> Result<Vec<Conn>, MigrationError> {
    let n = streams.clamp(1, 64) as usize;
    let mut slots: Vec<Option<Conn>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (mut c, h) = listener.accept_matching(timeout, |h| match h.role {
            Role::Bulk(i) => {
                h.session == session && (i as usize) < n && slots[i as usize].is_none()
            }
            _ => false,
        })?;
        let Role::Bulk(i) = h.role else {
            unreachable!("accept_matching took only bulk streams")
        };
        c.count_into(tel.link(&h.role.link_name()));
        slots[i as usize] = Some(c);
    }
    slots
        .into_iter()
        .map(|c| c.ok_or(ProtocolError::Closed.into()))
        .collect()
}

/// Waits until the control connection's next frame starts. A round on a
/// slow link may take longer than the step timeout, and the source says
/// nothing on the control connection until it ends: silence there is a
/// failure only once `progress` (bytes in on the other connections) stood
/// still too, for a whole timeout (the connection's read timeout).
/// Nothing is read past the frame's first bytes, so a timeout here leaves
/// the stream as it was.
fn await_control(ctl: &mut Conn, progress: impl Fn() -> u64) -> Result<(), MigrationError> {
    use std::io::BufRead;
    let mut seen = progress();
    loop {
        match ctl.reader().fill_buf() {
            // Bytes, or the end (read_frame says which).
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let now = progress();
                if now == seen {
                    return Err(ProtocolError::Io(e).into());
                }
                seen = now;
            }
            Err(e) => return Err(ProtocolError::Io(e).into()),
        }
    }
}

/// Decodes a RoundDone and checks that it counts frames for every bulk stream.
pub(crate) fn round_done(f: &Frame, rx: &Received) -> Result<RoundDone, MigrationError> {
    let rd: RoundDone = protocol::decode(f, Kind::RoundDone)?;
    if rd.frames.len() != rx.streams() {
        return Err(ProtocolError::Malformed {
            kind: Kind::RoundDone,
            reason: "wrong stream count".into(),
        }
        .into());
    }
    Ok(rd)
}
