//! The destination's side of postcopy, as the session's phases: take the
//! plan, accept the demand connection, and at the start put all guest RAM
//! under userfaultfd (MISSING) with the pending pages discarded. Then, while
//! the VM runs: a fault thread turns faults on pending pages into requests,
//! fills untouched memory with zeros itself, and wakes faults whose page is
//! here; a demand thread lands the answers; the bulk streams land the push
//! through the same sink (first copy wins). The phase ends when every
//! pending page landed, the hashes match (with verification) and the
//! source sent Complete; the range is then unregistered.
//!
//! A broken link pauses the phase instead of ending it: the VM runs on,
//! vCPUs touching a missing page wait, and the source may connect again as
//! the same session (`Role::Resume`) within the reconnect timeout. It is
//! told which pages are still missing, opens new demand and bulk
//! connections, and the faults still waiting are asked for again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_memory::{Event, Features, RegisterMode, UffdError, Userfaultfd};

use super::faults::{Action, Tracker};
use super::pages::PageIndex;
use crate::memory::RegionView;
use crate::protocol::{self, Frame, Kind, PostcopyPlan, ProtocolError, Role};
use crate::ranges::{GpaPages, OffsetBytes, PAGE};
use crate::receiver::Received;
use crate::session::DestinationPhases;
use crate::sink::{LandPolicy, SwitchSink, UffdSink};
use crate::stats::IncomingStats;
use crate::transport::{Closer, Conn, ConnReader, ConnWriter, Listener};
use crate::vm::IncomingVm;
use crate::MigrationError;

/// A destination's phases: precopy's (none) until a plan arrives, then
/// postcopy's.
pub(crate) struct Incoming<'a> {
    vm: &'a dyn IncomingVm,
    listener: &'a Listener,
    session: u64,
    timeout: Duration,
    /// How long a paused phase waits for the source to come back.
    reconnect_timeout: Duration,
    sink: &'a SwitchSink<'a>,
    plan: Vec<GpaPages>,
    planned: bool,
    verify: bool,
    guest_apf_base: Option<u64>,
    demand: Option<Conn>,
    live: Option<Live>,
    /// Pauses on a broken link, and their time.
    pauses: u32,
    paused: Duration,
    /// Live figures for watchers.
    tel: Arc<crate::telemetry::Telemetry>,
}

/// The running postcopy phase.
struct Live {
    shared: Arc<Shared>,
    fault_thread: Option<JoinHandle<()>>,
    link: Link,
}

/// One connection epoch of the phase: the demand connection's landing
/// thread and, after a resume, the bulk streams' (the first epoch's bulk
/// streams belong to the session).
#[derive(Default)]
struct Link {
    socks: Vec<Closer>,
    threads: Vec<JoinHandle<()>>,
    /// The resumed bulk streams' frame counts and failures.
    rx: Option<Arc<Received>>,
}

impl Link {
    /// Shuts the connections and waits for their threads.
    fn cut(&mut self) {
        if let Some(rx) = &self.rx {
            rx.stop();
        }
        for s in &self.socks {
            s.shutdown();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// What the phase's threads (fault, demand) share with the control thread.
struct Shared {
    uffd: Arc<Userfaultfd>,
    regions: Vec<RegionView>,
    sink: Arc<UffdSink>,
    tracker: Arc<Tracker>,
    stop: AtomicBool,
    /// The first failure of a phase thread (the real cause of most others).
    failure: Mutex<Option<MigrationError>>,
    /// Pages received on the demand connection.
    demand_pages: AtomicU64,
    /// Where page requests go: the demand connection, none while paused.
    requests: Mutex<Option<ConnWriter>>,
}

impl<'a> Incoming<'a> {
    pub(crate) fn new(
        vm: &'a dyn IncomingVm,
        listener: &'a Listener,
        session: u64,
        timeout: Duration,
        reconnect_timeout: Duration,
        sink: &'a SwitchSink<'a>,
    ) -> Self {
        Incoming {
            vm,
            listener,
            session,
            timeout,
            reconnect_timeout,
            sink,
            plan: Vec::new(),
            planned: false,
            verify: false,
            guest_apf_base: None,
            demand: None,
            live: None,
            pauses: 0,
            paused: Duration::ZERO,
            tel: vm.telemetry().unwrap_or_default(),
        }
    }

    /// Ends the phase's threads and releases the memory from userfaultfd
    /// (a fault still waiting is retried as a normal one).
    fn stop(&mut self) {
        if let Some(live) = self.live.as_mut() {
            live.shared.stop.store(true, Ordering::Release);
            for r in &live.shared.regions {
                let _ = live.shared.uffd.unregister(r.host_start(), r.size());
            }
            live.link.cut();
            if let Some(t) = live.fault_thread.take() {
                let _ = t.join();
            }
        }
    }

    fn failure(&self) -> Option<MigrationError> {
        self.live.as_ref().and_then(|l| l.shared.take_failure())
    }

    /// Accepts this session's demand connection.
    fn accept_demand(&self) -> Result<Conn, MigrationError> {
        let (mut c, h) = self.listener.accept_hello(self.timeout)?;
        c.count_into(self.tel.link(&h.role.link_name()));
        if h.role != Role::Demand || h.session != self.session {
            return Err(ProtocolError::Unexpected {
                got: Kind::Hello,
                want: "the demand connection of this session",
            }
            .into());
        }
        Ok(c)
    }

    /// Waits until every pending page has landed.
    fn wait_landed(&self, live: &Live) -> Result<(), MigrationError> {
        let deadline = Instant::now() + self.timeout;
        while live.shared.tracker.missing() > 0 {
            if let Some(e) = self.failure() {
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Err(ProtocolError::Io(std::io::ErrorKind::TimedOut.into()).into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// The fault report, once every page is here (the guest's counters
    /// read true then).
    fn report(&self, live: &Live) -> crate::stats::FaultReport {
        let vcpus: Vec<u32> = self.vm.vcpu_tids();
        let own = |tid: u32| std::path::Path::new(&format!("/proc/self/task/{tid}")).exists();
        let absorbed = self
            .guest_apf_base
            .zip(self.vm.guest_apf_count())
            .map(|(base, now)| now.saturating_sub(base));
        let mut report = live.shared.tracker.report(&vcpus, &own, absorbed);
        let s = live.shared.sink.stats();
        report.supplied_pages = s.copied + s.zero_filled;
        report.kept_pages = s.kept;
        report.demand_pages = live.shared.demand_pages.load(Ordering::Relaxed);
        report
    }

    fn lost(&self, e: MigrationError) -> MigrationError {
        let Some(live) = &self.live else { return e };
        let missing = live.shared.tracker.missing();
        if missing == 0 {
            return e;
        }
        let first = live
            .shared
            .tracker
            .missing_runs()
            .first()
            .map_or(0, |r| r.gpa);
        MigrationError::PagesLost {
            reason: e.to_string(),
            missing,
            first,
        }
    }
}

impl DestinationPhases for Incoming<'_> {
    fn on_message(&mut self, f: &Frame, _ctl: &mut Conn) -> Result<(), MigrationError> {
        if f.kind != Kind::PostcopyPlan || self.planned {
            return Err(ProtocolError::Unexpected {
                got: f.kind,
                want: "RoundDone, State, Verify, PostcopyPlan or Complete",
            }
            .into());
        }
        let part: PostcopyPlan = protocol::decode(f, Kind::PostcopyPlan)?;
        let regions = self.vm.regions();
        for run in &part.pending {
            let inside = run
                .pages
                .checked_mul(PAGE)
                .is_some_and(|b| regions.iter().any(|r| r.contains_range(run.gpa, b)));
            if !inside || !run.gpa.is_multiple_of(PAGE) {
                return Err(ProtocolError::Malformed {
                    kind: Kind::PostcopyPlan,
                    reason: format!("{} pages at {:#x} are not in guest RAM", run.pages, run.gpa),
                }
                .into());
            }
        }
        self.plan.extend(part.pending);
        self.verify = part.verify;
        self.guest_apf_base = part.guest_apf_base;
        if part.last {
            self.planned = true;
            self.demand = Some(self.accept_demand()?);
            tracing::info!(
                pending = crate::ranges::total_pages(&self.plan),
                "postcopy planned"
            );
        }
        Ok(())
    }

    fn before_start(&mut self, rounds: u32) -> Result<(), MigrationError> {
        if !self.planned {
            return Ok(());
        }
        let vm = self.vm;
        let regions = vm.regions();
        // What this VM holds and the source will not send must be final:
        // pending pages go (they come again), and without a single precopy
        // round so does anything the VMM wrote here.
        let mut discard = self.plan.clone();
        if rounds == 0 {
            for (i, r) in regions.iter().enumerate() {
                discard.extend(
                    vm.data_ranges(i)
                        .iter()
                        .map(|d| GpaPages::new(r.gpa() + d.offset, d.bytes / PAGE)),
                );
            }
        }
        for run in discard.iter().filter(|r| r.pages > 0) {
            vm.discard(*run)
                .map_err(MigrationError::vm("discard pending pages"))?;
        }
        let hashes = self
            .verify
            .then(|| crate::session::hashes(&regions, |i| vm.data_ranges(i)));
        let uffd = Arc::new(
            Userfaultfd::new(Features {
                missing_shmem: true,
                thread_id: true,
                ..Default::default()
            })
            .map_err(|e| MigrationError::Unsupported(format!("postcopy needs userfaultfd: {e}")))?,
        );
        for r in &regions {
            uffd.register(
                r.host_start(),
                r.size(),
                RegisterMode {
                    missing: true,
                    ..Default::default()
                },
            )
            .map_err(|e| {
                MigrationError::Unsupported(format!("postcopy needs userfaultfd on guest RAM: {e}"))
            })?;
        }
        let index = PageIndex::new(&regions);
        let tracker = Arc::new(Tracker::new(index, &self.plan, hashes));
        // Every page but the pending ones counts as present for the sink.
        let present = present_ranges(&regions, &self.plan);
        let sink = Arc::new(
            UffdSink::new(
                uffd.clone(),
                regions.clone(),
                &present,
                LandPolicy::KeepFirst,
            )
            .with_observer(tracker.clone()),
        );
        self.sink.switch(sink.clone());
        let demand = self.demand.take().ok_or(ProtocolError::Closed)?;
        let shared = Arc::new(Shared {
            uffd,
            regions,
            sink,
            tracker,
            stop: AtomicBool::new(false),
            failure: Mutex::new(None),
            demand_pages: AtomicU64::new(0),
            requests: Mutex::new(None),
        });
        let sh = shared.clone();
        let fault_thread = spawn("postcopy-faults", move || {
            if let Err(e) = sh.serve_faults() {
                sh.fail(e);
            }
        })?;
        let link = shared.connect(demand, Vec::new())?;
        self.live = Some(Live {
            shared,
            fault_thread: Some(fault_thread),
            link,
        });
        Ok(())
    }

    fn after_start(
        &mut self,
        ctl: &mut Conn,
        rx: &Received,
        stats: &mut IncomingStats,
    ) -> Result<bool, MigrationError> {
        if self.live.is_none() {
            return Ok(false);
        }
        self.tel.set_phase(crate::telemetry::LivePhase::Postcopy);
        let result = self.run_phase(ctl, rx, stats);
        stats.postcopy_pauses = self.pauses;
        stats.postcopy_paused_s = self.paused.as_secs_f64();
        self.stop();
        result.map(|_| true).map_err(|e| self.lost(e))
    }
}

impl Incoming<'_> {
    /// Waits for the next control message for as long as pages keep
    /// landing (the push takes as long as memory takes to cross the link);
    /// a source that sends nothing for the session timeout is gone.
    fn wait_for_source(&self, ctl: &Conn, rx: &Received) -> Result<(), MigrationError> {
        let live = self.live.as_ref().ok_or(ProtocolError::Closed)?;
        let rx = live.link.rx.as_deref().unwrap_or(rx);
        let (mut missing, mut since) = (live.shared.tracker.missing(), Instant::now());
        loop {
            if ctl.wait_readable(Duration::from_millis(100)) {
                return Ok(());
            }
            if let Some(e) = self.failure().or_else(|| rx.take_failure()) {
                return Err(e);
            }
            let now = live.shared.tracker.missing();
            if now != missing {
                (missing, since) = (now, Instant::now());
            } else if since.elapsed() >= self.timeout {
                // A silent link counts as a broken one.
                return Err(ProtocolError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the source sent nothing for {:.0} s",
                        self.timeout.as_secs_f64()
                    ),
                ))
                .into());
            }
        }
    }

    /// The phase: serve the source until it says Complete; on a broken
    /// link, pause and wait for it to resume.
    fn run_phase(
        &mut self,
        ctl: &mut Conn,
        rx: &Received,
        stats: &mut IncomingStats,
    ) -> Result<(), MigrationError> {
        loop {
            match self.serve(ctl, rx, stats) {
                Err(e) if e.is_link_break() => {
                    let t = Instant::now();
                    let missing = self.live.as_ref().map_or(0, |l| l.shared.tracker.missing());
                    tracing::warn!(
                        error = %e,
                        missing,
                        wait_s = self.reconnect_timeout.as_secs_f64(),
                        "postcopy paused: the link to the source broke; the VM runs on, vCPUs touching a missing page wait for the source to reconnect"
                    );
                    self.tel.event("link_broken", e.to_string());
                    self.tel.set_phase(crate::telemetry::LivePhase::Paused);
                    ctl.shutdown();
                    rx.cut();
                    if let Some(live) = self.live.as_mut() {
                        // Sockets first: a fault thread blocked writing a
                        // request holds the writer until its socket is shut.
                        live.link.cut();
                        live.shared.requests_to(None);
                        // Failures of the cut connections are this pause.
                        let _ = live.shared.take_failure();
                    }
                    *ctl = match self.await_resume(&e) {
                        Ok(c) => c,
                        Err(gone) => {
                            self.end_without_source(gone, stats)?;
                            self.pauses += 1;
                            self.paused += t.elapsed();
                            return Ok(());
                        }
                    };
                    ctl.count_into(self.tel.link(&protocol::Role::Control.link_name()));
                    self.tel.set_phase(crate::telemetry::LivePhase::Postcopy);
                    self.pauses += 1;
                    self.paused += t.elapsed();
                    tracing::info!(paused_s = t.elapsed().as_secs_f64(), "postcopy resumed");
                }
                r => return r,
            }
        }
    }

    /// The source did not come back (`gone`). With every page here the VM
    /// needs nothing more from it: the phase ends well, with this side's
    /// report, and only the source's last word is lost. Else `gone`.
    fn end_without_source(
        &mut self,
        gone: MigrationError,
        stats: &mut IncomingStats,
    ) -> Result<(), MigrationError> {
        let Some(live) = self
            .live
            .as_ref()
            .filter(|l| l.shared.tracker.missing() == 0)
        else {
            return Err(gone);
        };
        let verified = if stats.verified_pages > 0 {
            "verified"
        } else {
            "not verified"
        };
        tracing::warn!(
            error = %gone,
            verified,
            "postcopy: the source did not come back, but every page had arrived; the VM runs on"
        );
        self.tel.event(
            "finished",
            format!("every page arrived ({verified}); the source's last word is lost: {gone}"),
        );
        stats.postcopy = Some(self.report(live));
        Ok(())
    }

    /// Waits for this session's source to connect again (Role::Resume),
    /// tells it the pages still missing, and takes its new demand and bulk
    /// connections. Gives up after the reconnect timeout.
    fn await_resume(&mut self, why: &MigrationError) -> Result<Conn, MigrationError> {
        let deadline = Instant::now() + self.reconnect_timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(MigrationError::Unsupported(format!(
                    "the link to the source broke ({why}) and the source did not come back within {:.0} s",
                    self.reconnect_timeout.as_secs_f64()
                )));
            }
            let (mut c, h) = match self.listener.accept_hello(left) {
                Ok(got) => got,
                Err(MigrationError::Listen { source, .. })
                    if source.kind() != std::io::ErrorKind::TimedOut =>
                {
                    return Err(MigrationError::Listen {
                        addr: self.listener.endpoint().to_string(),
                        source,
                    })
                }
                Err(_) => continue,
            };
            if h.role != Role::Resume || h.session != self.session {
                c.abort("this destination runs a migrated VM and waits only for its own source to resume");
                continue;
            }
            match self.resume_with(&mut c, &h) {
                Ok(()) => return Ok(c),
                Err(e) => {
                    tracing::warn!(error = %e, "a resume attempt failed; waiting for another");
                    if !e.is_link_break() {
                        c.abort(&e.to_string());
                    }
                }
            }
        }
    }

    /// The resume handshake on `c`: version, the missing pages, the new
    /// connections; then the waiting faults are asked for again.
    fn resume_with(&mut self, c: &mut Conn, h: &protocol::Hello) -> Result<(), MigrationError> {
        let version = protocol::negotiate(h)?;
        if version < protocol::VERSION_RESUME {
            return Err(MigrationError::Unsupported(format!(
                "resuming needs protocol v{}, the source speaks v{version}",
                protocol::VERSION_RESUME
            )));
        }
        c.send(Kind::HelloAck, &version)?;
        let missing = self
            .live
            .as_ref()
            .ok_or(ProtocolError::Closed)?
            .shared
            .tracker
            .missing_runs();
        for (share, last) in protocol::run_frames(&missing) {
            let part = protocol::PostcopyResume {
                missing: share.to_vec(),
                last,
            };
            protocol::send(c.writer(), Kind::PostcopyResume, &part)?;
        }
        c.flush()?;
        // The source opens its demand connection, then the bulk streams.
        let demand = self.accept_demand()?;
        let bulk = crate::session::destination::accept_bulk(
            self.listener,
            self.timeout,
            self.session,
            h.streams,
            &self.tel,
        )?;
        let live = self.live.as_mut().ok_or(ProtocolError::Closed)?;
        live.link = live.shared.connect(demand, bulk)?;
        let again = live.shared.tracker.waiting_pages();
        tracing::info!(
            missing = live.shared.tracker.missing(),
            asked_again = again.len(),
            "postcopy resuming"
        );
        live.shared.request(&again);
        Ok(())
    }

    /// One connection epoch of the phase, until Complete or a failure.
    fn serve(
        &mut self,
        ctl: &mut Conn,
        rx: &Received,
        stats: &mut IncomingStats,
    ) -> Result<(), MigrationError> {
        let t0 = Instant::now();
        loop {
            self.wait_for_source(ctl, rx)?;
            let f = match protocol::read_frame(ctl.reader()) {
                Ok(f) => f,
                Err(e) => return Err(self.failure().unwrap_or(e.into())),
            };
            let live = self.live.as_ref().ok_or(ProtocolError::Closed)?;
            match f.kind {
                Kind::RoundDone => {
                    let rx = live.link.rx.as_deref().unwrap_or(rx);
                    let rd = crate::session::destination::round_done(&f, rx)?;
                    rx.barrier(&rd.frames, self.timeout)?;
                    self.wait_landed(live)?;
                    tracing::info!(
                        secs = t0.elapsed().as_secs_f64(),
                        "postcopy: every page arrived"
                    );
                    ctl.send(Kind::RoundAck, &rd.round)?;
                }
                Kind::Verify => {
                    let mine = live.shared.tracker.hashes().unwrap_or_default();
                    stats.verified_pages =
                        crate::session::compare_hashes(&live.shared.regions, &mine, &f.body)?;
                }
                Kind::Complete => {
                    if live.shared.tracker.missing() > 0 {
                        return Err(ProtocolError::Unexpected {
                            got: Kind::Complete,
                            want: "every pending page first",
                        }
                        .into());
                    }
                    let report = self.report(live);
                    ctl.send(Kind::Finished, &report)?;
                    tracing::info!(
                        faults = report.faults,
                        major = report.major,
                        p50_us = report.latency_us.p50,
                        "postcopy finished"
                    );
                    stats.postcopy = Some(report);
                    return Ok(());
                }
                Kind::Abort => {
                    return Err(
                        ProtocolError::Aborted(String::from_utf8_lossy(&f.body).into()).into(),
                    )
                }
                k => {
                    return Err(ProtocolError::Unexpected {
                        got: k,
                        want: "RoundDone, Verify or Complete after the switch",
                    }
                    .into())
                }
            }
        }
    }
}

impl Drop for Incoming<'_> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Per region, the ranges outside `pending` (present for the sink).
fn present_ranges(regions: &[RegionView], pending: &[GpaPages]) -> Vec<Vec<OffsetBytes>> {
    let mut sorted = pending.to_vec();
    sorted.sort_unstable();
    regions
        .iter()
        .map(|r| {
            let mut out = Vec::new();
            let mut at = 0u64;
            for run in sorted.iter().filter(|p| r.contains(p.gpa)) {
                let off = run.gpa - r.gpa();
                if off > at {
                    out.push(OffsetBytes::new(at, off - at));
                }
                at = at.max(off + run.bytes());
            }
            if at < r.size() {
                out.push(OffsetBytes::new(at, r.size() - at));
            }
            out
        })
        .collect()
}

impl Shared {
    /// Records a phase thread's failure (the first one wins), unless the
    /// phase is being stopped anyway.
    fn fail(&self, e: MigrationError) {
        if self.stop.load(Ordering::Acquire) {
            return;
        }
        tracing::warn!(error = %e, "a postcopy thread failed");
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(e);
    }

    fn take_failure(&self) -> Option<MigrationError> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Sends page requests on the current demand connection from now on
    /// (none: paused, requests wait in the tracker).
    fn requests_to(&self, w: Option<ConnWriter>) {
        *self.requests.lock().unwrap_or_else(|e| e.into_inner()) = w;
    }

    /// Asks the source for pages; a failed send drops the connection (the
    /// control thread pauses the phase) and the faults stay waiting.
    fn request(&self, gpas: &[u64]) {
        if gpas.is_empty() {
            return;
        }
        let mut w = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        let Some(writer) = w.as_mut() else { return };
        let sent = protocol::send(writer, Kind::PageRequest, &gpas)
            .and_then(|_| std::io::Write::flush(writer).map_err(ProtocolError::Io));
        if let Err(e) = sent {
            *w = None;
            drop(w);
            self.fail(e.into());
        }
    }

    /// Starts a connection epoch: requests go out on `demand`, its answers
    /// and (after a resume) the `bulk` streams land on threads of their own.
    fn connect(self: &Arc<Self>, demand: Conn, bulk: Vec<Conn>) -> Result<Link, MigrationError> {
        let mut link = Link::default();
        let _ = demand.set_read_timeout(None);
        link.socks.push(demand.closer().map_err(ProtocolError::Io)?);
        let (reader, writer) = demand.into_parts();
        let sh = self.clone();
        link.threads.push(spawn("postcopy-demand", move || {
            if let Err(e) = sh.land_demand(reader) {
                sh.fail(e);
            }
        })?);
        if !bulk.is_empty() {
            let rx = Arc::new(Received::new(bulk.len()));
            for (i, c) in bulk.into_iter().enumerate() {
                link.socks.push(c.closer().map_err(ProtocolError::Io)?);
                let (reader, _) = c.into_parts();
                let (sh, rx2) = (self.clone(), rx.clone());
                link.threads.push(spawn("postcopy-bulk", move || {
                    let sink: &dyn crate::sink::PageSink = sh.sink.as_ref();
                    if let Err(e) = crate::receiver::bulk_loop(&sh.regions, sink, reader, i, &rx2) {
                        rx2.fail(i, e);
                    }
                })?);
            }
            link.rx = Some(rx);
        }
        self.requests_to(Some(writer));
        Ok(link)
    }

    /// Lands the source's answers until the connection closes.
    fn land_demand(&self, mut r: ConnReader) -> Result<(), MigrationError> {
        crate::priority::fault_path();
        let (mut scratch, mut data) = (Vec::new(), Vec::new());
        loop {
            let h = match protocol::read_header(&mut r) {
                Err(ProtocolError::Closed) => return Ok(()),
                Err(e) => return Err(e.into()),
                Ok(h) => h,
            };
            if h.kind != Kind::Pages {
                return Err(ProtocolError::Unexpected {
                    got: h.kind,
                    want: "Pages on the demand connection",
                }
                .into());
            }
            let n = crate::pagein::read_pages(
                &mut r,
                &h,
                &self.regions,
                self.sink.as_ref(),
                &mut scratch,
                &mut data,
            )?;
            self.demand_pages.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The fault thread: turns faults into requests, zero fills and wakes.
    fn serve_faults(&self) -> Result<(), MigrationError> {
        crate::priority::fault_path();
        let mut events = Vec::new();
        let mut ask: Vec<u64> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            if !self
                .uffd
                .poll(Duration::from_millis(50))
                .map_err(uffd_err)?
            {
                continue;
            }
            events.clear();
            self.uffd.read_events(&mut events).map_err(uffd_err)?;
            ask.clear();
            for ev in &events {
                let Event::PageFault { addr, tid, .. } = *ev else {
                    continue;
                };
                let Some(gpa) = self.regions.iter().find_map(|r| r.gpa_of_host(addr)) else {
                    continue;
                };
                let gpa = gpa & !(PAGE - 1);
                let Some(n) = self.tracker.index().page_of(gpa) else {
                    continue;
                };
                let page = GpaPages::new(gpa, 1);
                if !self.tracker.planned(n) {
                    // Never had data at the source: zeros, here and now.
                    self.sink.placer().zero_missing(page)?;
                    self.tracker.zero_fault(tid);
                    continue;
                }
                match self.tracker.fault(n, tid, self.sink.is_present(gpa)) {
                    Action::Request => ask.push(gpa),
                    Action::Wait => {}
                    Action::Wake => self.sink.placer().wake(page),
                }
            }
            self.request(&ask);
        }
        Ok(())
    }
}

/// Starts a named thread of the phase.
fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, MigrationError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| MigrationError::Unsupported(format!("cannot start a thread: {e}")))
}

fn uffd_err(e: UffdError) -> MigrationError {
    MigrationError::Sink(e.into())
}
