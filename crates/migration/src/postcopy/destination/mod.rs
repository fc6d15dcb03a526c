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
//!
//! This file holds [`PostcopyDestination`] (the session's hooks: plan, start, the
//! phase after the start) and what the phase's threads share. The rest,
//! one job a file: [`arm`] puts guest RAM under userfaultfd at the start,
//! [`control`] answers the source's control messages within one connection
//! epoch, [`epoch`] starts an epoch's connections and resumes after a
//! broken link, [`fault_thread`] turns faults into page requests.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ferry_memory::Userfaultfd;

use super::fault_account::Tracker;
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::protocol::{self, DropAhead, Frame, Kind, PostcopyPlan, ProtocolError, Role};
use crate::ranges::{intersect_runs, subtract_runs, total_pages, union_runs, GpaPages, PAGE};
use crate::receiver::Received;
use crate::session::{DestinationContext, DestinationMode};
use crate::sink::UffdSink;
use crate::stats::DestinationStats;
use crate::transport::{Conn, ConnWriter};

mod arm;
mod control;
mod epoch;
mod fault_thread;

use epoch::Link;

/// Postcopy's destination, made when a PostcopyPlan arrives.
pub(crate) struct PostcopyDestination<'a> {
    /// The VM, the listener, the session, its timeouts and the sink.
    cx: DestinationContext<'a>,
    plan: Vec<GpaPages>,
    planned: bool,
    /// Pages dropped ahead of the pause (DropAhead, v17), merged; the
    /// pause drops only the plan's other pages.
    dropped: Vec<GpaPages>,
    /// The DropAhead being received (its runs so far, in order).
    dropping: Vec<GpaPages>,
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

impl<'a> PostcopyDestination<'a> {
    pub(crate) fn new(cx: DestinationContext<'a>) -> Self {
        PostcopyDestination {
            cx,
            plan: Vec::new(),
            planned: false,
            dropped: Vec::new(),
            dropping: Vec::new(),
            verify: false,
            guest_apf_base: None,
            demand: None,
            live: None,
            pauses: 0,
            paused: Duration::ZERO,
            tel: cx.vm.telemetry().unwrap_or_default(),
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
        let session = self.cx.session;
        let (mut c, h) = self.cx.listener.accept_matching(self.cx.timeout, |h| {
            h.role == Role::Demand && h.session == session
        })?;
        c.count_into(self.tel.link(&h.role.link_name()));
        Ok(c)
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

/// Checks one PostcopyPlan frame's runs against the VM's memory and the
/// plan so far (whose last run is `prev`): each run inside one region and
/// page aligned (checked arithmetic), and every run after the one before
/// it, not overlapping it. A source sends its pending pages merged and in
/// address order; a plan that repeats or goes back is refused, so plans
/// cannot grow past the VM's memory. A DropAhead's runs obey the same.
fn check_plan_part<'a>(
    kind: Kind,
    regions: &[RegionView],
    mut prev: Option<&'a GpaPages>,
    runs: &'a [GpaPages],
) -> Result<(), ProtocolError> {
    let bad = |reason: String| ProtocolError::Malformed { kind, reason };
    for run in runs {
        let inside = run
            .pages
            .checked_mul(PAGE)
            .is_some_and(|b| regions.iter().any(|r| r.contains_range(run.gpa, b)));
        if !inside || !run.gpa.is_multiple_of(PAGE) {
            return Err(bad(format!(
                "{} pages at {:#x} are not in guest RAM",
                run.pages, run.gpa
            )));
        }
        if run.pages == 0 {
            continue;
        }
        if let Some(p) = prev {
            if run.gpa < p.end() {
                return Err(bad(format!(
                    "{} pages at {:#x} come after {} pages at {:#x}: a plan's runs must be in address order and must not repeat",
                    run.pages, run.gpa, p.pages, p.gpa
                )));
            }
        }
        prev = Some(run);
    }
    Ok(())
}

impl DestinationMode for PostcopyDestination<'_> {
    fn on_message(&mut self, f: &Frame, ctl: &mut Conn) -> Result<(), MigrationError> {
        match f.kind {
            Kind::DropAhead if !self.planned => return self.drop_ahead(f, ctl),
            Kind::PostcopyPlan if !self.planned => {}
            _ => {
                return Err(ProtocolError::Unexpected {
                    got: f.kind,
                    want: "RoundDone, State, Verify, DropAhead, PostcopyPlan or Complete",
                }
                .into())
            }
        }
        let part: PostcopyPlan = protocol::decode(f, Kind::PostcopyPlan)?;
        check_plan_part(
            Kind::PostcopyPlan,
            &self.cx.vm.regions(),
            self.plan.last(),
            &part.pending,
        )?;
        // Checked: sorted, disjoint, inside guest RAM, so the whole plan
        // never names more pages (nor runs) than the VM has, however many
        // frames a source sends without `last`.
        self.plan
            .extend(part.pending.into_iter().filter(|r| r.pages > 0));
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
        let vm = self.cx.vm;
        let regions = vm.regions();
        // What this VM holds and the source will not send must be final:
        // pending pages go (they come again), and without a single precopy
        // round so does anything the VMM wrote here. Pages dropped ahead
        // are gone already, unless a device wrote one since.
        let mut discard = subtract_runs(&self.plan, &self.dropped);
        if !self.dropped.is_empty() {
            let written = union_runs(vm.device_written_ranges().iter().map(|r| r.pages()));
            let rewritten = intersect_runs(&self.dropped, &written);
            discard = union_runs(discard.into_iter().chain(rewritten));
        }
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
        let arm::Armed {
            uffd,
            tracker,
            sink,
        } = arm::arm(&regions, &self.plan, hashes)?;
        self.cx.sink.switch(sink.clone());
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
        stats: &mut DestinationStats,
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

impl PostcopyDestination<'_> {
    /// One frame of a DropAhead (v17): the source is about to pause and
    /// switch; these pages were dirtied since they were sent (and every
    /// round's pages have landed: the source sends this after a round's
    /// barrier). Dropped now, while the VM still runs there, they need no
    /// drop in the pause. Answers the last frame with the pages dropped.
    fn drop_ahead(&mut self, f: &Frame, ctl: &mut Conn) -> Result<(), MigrationError> {
        let part: DropAhead = protocol::decode(f, Kind::DropAhead)?;
        check_plan_part(
            Kind::DropAhead,
            &self.cx.vm.regions(),
            self.dropping.last(),
            &part.runs,
        )?;
        for run in part.runs.iter().filter(|r| r.pages > 0) {
            self.cx
                .vm
                .discard(*run)
                .map_err(MigrationError::vm("drop pages ahead of the pause"))?;
        }
        // Checked: sorted, disjoint and inside guest RAM, so never more
        // runs than the VM has pages.
        self.dropping
            .extend(part.runs.into_iter().filter(|r| r.pages > 0));
        if part.last {
            let batch = std::mem::take(&mut self.dropping);
            let pages = total_pages(&batch);
            self.dropped = union_runs(self.dropped.drain(..).chain(batch));
            ctl.send(Kind::DroppedAhead, &pages)?;
        }
        Ok(())
    }
}

impl Drop for PostcopyDestination<'_> {
    fn drop(&mut self) {
        self.stop();
    }
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
}

/// Starts a named thread of the phase.
fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, MigrationError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| MigrationError::Unsupported(format!("cannot start a thread: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_must_go_forward_inside_guest_ram() {
        // SAFETY: only the views' addresses are used.
        let regions = [
            unsafe { RegionView::new(0, 16 * PAGE, std::ptr::null_mut()) },
            unsafe { RegionView::new(1 << 32, 16 * PAGE, std::ptr::null_mut()) },
        ];
        let p = GpaPages::new;
        let ok = [p(0, 2), p(2 * PAGE, 1), p(1 << 32, 16)];
        assert!(check_plan_part(Kind::PostcopyPlan, &regions, None, &ok).is_ok());
        assert!(
            check_plan_part(Kind::PostcopyPlan, &regions, Some(&p(0, 1)), &[p(PAGE, 1)]).is_ok()
        );
        for (prev, runs) in [
            (None, vec![p(0, 2), p(PAGE, 1)]),     // overlaps
            (None, vec![p(4 * PAGE, 1), p(0, 1)]), // goes back
            (Some(p(0, 16)), vec![p(0, 16)]),      // repeats the last frame
            (None, vec![p(0, (1 << 52) + 1)]),     // wraps
            (None, vec![p(15 * PAGE, 2)]),         // crosses the region's end
            (None, vec![p(1, 1)]),                 // not aligned
        ] {
            for kind in [Kind::PostcopyPlan, Kind::DropAhead] {
                let e = check_plan_part(kind, &regions, prev.as_ref(), &runs);
                assert!(
                    matches!(e, Err(ProtocolError::Malformed { kind: k, .. }) if k == kind),
                    "{kind:?} {prev:?} {runs:?}"
                );
            }
        }
    }
}
