//! Where a migration stands on each side, as types whose transitions are
//! checked, and the one rule for what a failure leaves behind.
//!
//! Source (after QEMU's "the source must not be changed or destroyed by an
//! outgoing migration"):
//!
//! ```text
//!  Connecting ──▶ Copying ──▶ Paused ──▶ Completing ──▶ Done        precopy, split, gather
//!       │                       ▲            │
//!       └───────────────────────┘            └──▶ Switched ──▶ Done  postcopy, hybrid
//!                                                 (resumed sessions start here)
//! ```
//!
//! - Connecting, Copying, Paused: the VM is the source's. A failure stops
//!   dirty tracking and the throttle, resumes the VM if it was paused, tells
//!   the peer to abort: the VM runs on here with nothing lost.
//! - Completing: Complete went out. Only the peer's Abort proves it did not
//!   start the VM; any other failure leaves the outcome unknown, and the VM
//!   stays paused here (never two running copies).
//! - Switched: the VM runs at the destination and may lack pages only this
//!   side holds: it stays paused here with all its memory, whatever fails.
//! - Done: the destination has the VM; nothing here may run it again.
//!
//! Downtime is defined here once: from the source's pause to the
//! destination's Started.
//!
//! Destination: `Waiting ──▶ Receiving ──▶ Restoring ──▶ Started ──▶ Done`.
//! Until Started the VM never ran here, and a failure only tells the source
//! why; from Started on the VM runs here.

use std::time::{Duration, Instant};

use crate::error::MigrationError;
use crate::telemetry::LivePhase;

/// The source's phases (see the module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SourcePhase {
    /// Connecting and agreeing; nothing done to the VM yet.
    Connecting,
    /// Dirty tracking on, memory copied while the VM runs here.
    Copying,
    /// The VM is paused here; Complete has not gone out.
    Paused,
    /// Complete went out; waiting for Started.
    Completing,
    /// The VM runs at the destination; this side still holds pages it may
    /// lack (postcopy).
    Switched,
    /// The destination has the whole VM.
    Done,
}

impl SourcePhase {
    /// True if the source may go from `self` to `next`.
    pub(crate) fn may_enter(self, next: SourcePhase) -> bool {
        use SourcePhase::*;
        matches!(
            (self, next),
            (Connecting, Copying)
                | (Connecting, Paused)
                | (Copying, Paused)
                | (Paused, Completing)
                | (Completing, Done)
                | (Completing, Switched)
                | (Switched, Done)
        )
    }

    /// The phase watchers see (timeline, metrics, `ferry status`).
    pub(crate) fn live(self) -> LivePhase {
        match self {
            SourcePhase::Connecting | SourcePhase::Copying => LivePhase::Running,
            SourcePhase::Paused | SourcePhase::Completing => LivePhase::Switching,
            SourcePhase::Switched => LivePhase::Postcopy,
            SourcePhase::Done => LivePhase::Succeeded,
        }
    }

    /// Its name in events and logs.
    pub(crate) fn name(self) -> &'static str {
        match self {
            SourcePhase::Connecting => "connecting",
            SourcePhase::Copying => "copying",
            SourcePhase::Paused => "paused",
            SourcePhase::Completing => "completing",
            SourcePhase::Switched => "switched",
            SourcePhase::Done => "done",
        }
    }
}

/// A transition the code asked for that the rule does not allow: a bug in
/// a mode, reported instead of acted on.
#[derive(Debug, thiserror::Error)]
#[error("the source cannot go from {from:?} to {to:?}")]
pub(crate) struct BadTransition {
    pub(crate) from: SourcePhase,
    pub(crate) to: SourcePhase,
}

/// What a failure leaves the VM as, here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Left {
    /// It runs here again, as before the migration.
    RunsHere,
    /// Paused here; the destination may run it (in doubt): the operator
    /// resumes it here only if the destination did not start it.
    PausedInDoubt,
    /// Paused here for good: it runs at the destination, which may still
    /// need pages from here.
    PausedSwitched,
    /// Paused here, waiting for `ferry migrate --resume` (postcopy whose
    /// link broke): no Abort, the destination waits for this session.
    PausedResumable,
    /// Paused here for good: the switch failed after Complete, and the
    /// registry says the destination took the VM (it runs there).
    Handed,
}

/// What the source does on a failure: the safety rule as data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cleanup {
    /// What the VM is left as.
    pub(crate) left: Left,
    /// Give the vCPUs their full time back.
    pub(crate) unthrottle: bool,
    /// Stop dirty tracking (if it is on).
    pub(crate) stop_dirty_log: bool,
    /// Resume the vCPUs here.
    pub(crate) resume: bool,
    /// Tell the destination to abort.
    pub(crate) abort_peer: bool,
}

impl Cleanup {
    /// The phase watchers see after this failure.
    pub(crate) fn live(self) -> LivePhase {
        match self.left {
            Left::PausedResumable => LivePhase::Paused,
            _ => LivePhase::Failed,
        }
    }
}

/// The source's state: its phase, the resources it holds on the VM, and
/// the clock of the switch.
#[derive(Debug)]
pub(crate) struct SourceState {
    phase: SourcePhase,
    /// Dirty tracking is on (started by the session, stopped by it).
    pub(crate) dirty_log: bool,
    paused_at: Option<Instant>,
    started_at: Option<Instant>,
    lap_mark: Option<Instant>,
}

impl SourceState {
    /// A new migration: nothing done yet.
    pub(crate) fn new() -> Self {
        SourceState {
            phase: SourcePhase::Connecting,
            dirty_log: false,
            paused_at: None,
            started_at: None,
            lap_mark: None,
        }
    }

    /// A postcopy resumed after its link broke: the VM runs at the
    /// destination and is paused here.
    pub(crate) fn resumed() -> Self {
        SourceState {
            phase: SourcePhase::Switched,
            ..SourceState::new()
        }
    }

    /// The phase now.
    pub(crate) fn phase(&self) -> SourcePhase {
        self.phase
    }

    /// Moves to `next` if the rule allows it. Entering Paused starts the
    /// downtime clock, leaving Completing stops it.
    pub(crate) fn enter(&mut self, next: SourcePhase) -> Result<(), BadTransition> {
        if !self.phase.may_enter(next) {
            return Err(BadTransition {
                from: self.phase,
                to: next,
            });
        }
        let now = Instant::now();
        match next {
            SourcePhase::Paused => {
                self.paused_at = Some(now);
                self.lap_mark = Some(now);
            }
            SourcePhase::Done | SourcePhase::Switched if self.phase == SourcePhase::Completing => {
                self.started_at = Some(now);
            }
            _ => {}
        }
        self.phase = next;
        Ok(())
    }

    /// The pause was asked for at `at` (before the vCPUs were parked and
    /// Paused entered): the downtime and its first part count from there.
    pub(crate) fn pause_asked_at(&mut self, at: Instant) {
        if self.phase == SourcePhase::Paused {
            self.paused_at = Some(at);
            self.lap_mark = Some(at);
        }
    }

    /// When the VM was paused here (None before).
    pub(crate) fn paused_at(&self) -> Option<Instant> {
        self.paused_at
    }

    /// The downtime: from the pause here to the destination's Started
    /// (None until both happened).
    pub(crate) fn downtime(&self) -> Option<Duration> {
        Some(self.started_at?.saturating_duration_since(self.paused_at?))
    }

    /// Milliseconds since the pause or the previous lap: the parts of the
    /// downtime, taken in order (0 before the pause).
    pub(crate) fn lap_ms(&mut self) -> f64 {
        let Some(mark) = self.lap_mark else {
            return 0.0;
        };
        let now = Instant::now();
        self.lap_mark = Some(now);
        now.saturating_duration_since(mark).as_secs_f64() * 1e3
    }

    /// What a postcopy that paused (its link lost for good, not a failure)
    /// leaves behind: the destination waits for this session to come back,
    /// so no Abort, and the VM stays paused here with its memory.
    pub(crate) fn on_pause(&self) -> Cleanup {
        Cleanup {
            left: Left::PausedResumable,
            unthrottle: false,
            stop_dirty_log: false,
            resume: false,
            abort_peer: false,
        }
    }

    /// A fenced source whose switch failed after Complete took its VM back
    /// in the registry: it runs here again, as before the migration, and the
    /// destination is told.
    pub(crate) fn on_taken_back(&self) -> Cleanup {
        Cleanup {
            left: Left::RunsHere,
            unthrottle: true,
            stop_dirty_log: true,
            resume: true,
            abort_peer: true,
        }
    }

    /// A fenced source whose switch failed after Complete finds the
    /// destination holding the VM: it stays paused here for good, and the
    /// destination (which runs it) is not told to abort.
    pub(crate) fn on_handed(&self) -> Cleanup {
        Cleanup {
            left: Left::Handed,
            unthrottle: false,
            stop_dirty_log: true,
            resume: false,
            abort_peer: false,
        }
    }

    /// What a failure with `e` in the current phase must leave behind.
    pub(crate) fn on_failure(&self, e: &MigrationError) -> Cleanup {
        let keep = |left| Cleanup {
            left,
            unthrottle: false,
            stop_dirty_log: true,
            resume: false,
            abort_peer: false,
        };
        match self.phase {
            SourcePhase::Switched => Cleanup {
                abort_peer: true,
                ..keep(Left::PausedSwitched)
            },
            SourcePhase::Done => keep(Left::PausedSwitched),
            SourcePhase::Completing if !e.is_peer_abort() => keep(Left::PausedInDoubt),
            _ if matches!(e, MigrationError::InDoubt(_)) => keep(Left::PausedInDoubt),
            SourcePhase::Connecting
            | SourcePhase::Copying
            | SourcePhase::Paused
            | SourcePhase::Completing => Cleanup {
                left: Left::RunsHere,
                unthrottle: true,
                stop_dirty_log: true,
                resume: self.paused_at.is_some(),
                abort_peer: true,
            },
        }
    }
}

/// The destination's phases (see the module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DestPhase {
    /// Agreeing on version and layout.
    Waiting,
    /// Pages, rounds, state and hashes arrive.
    Receiving,
    /// Complete arrived: restoring the state (unless it was restored as it
    /// arrived, from v15) and the clients, and starting the vCPUs.
    Restoring,
    /// The VM runs here (Started went out); a mode may still receive pages.
    Started,
    /// Every page arrived.
    Done,
}

impl DestPhase {
    /// True if the destination may go from `self` to `next`.
    pub(crate) fn may_enter(self, next: DestPhase) -> bool {
        use DestPhase::*;
        matches!(
            (self, next),
            (Waiting, Receiving) | (Receiving, Restoring) | (Restoring, Started) | (Started, Done)
        )
    }

    /// True once the VM has run here: a failure can no longer leave it
    /// "never started".
    pub(crate) fn vm_started(self) -> bool {
        matches!(self, DestPhase::Started | DestPhase::Done)
    }

    /// The phase watchers see.
    pub(crate) fn live(self) -> LivePhase {
        match self {
            DestPhase::Waiting => LivePhase::Pending,
            DestPhase::Receiving => LivePhase::Running,
            DestPhase::Restoring | DestPhase::Started => LivePhase::Switching,
            DestPhase::Done => LivePhase::Succeeded,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::ProtocolError;

    const ALL: [SourcePhase; 6] = [
        SourcePhase::Connecting,
        SourcePhase::Copying,
        SourcePhase::Paused,
        SourcePhase::Completing,
        SourcePhase::Switched,
        SourcePhase::Done,
    ];

    fn at(path: &[SourcePhase]) -> SourceState {
        let mut s = SourceState::new();
        for &p in path {
            s.enter(p).unwrap();
        }
        s
    }

    fn plain() -> MigrationError {
        ProtocolError::Closed.into()
    }

    fn abort() -> MigrationError {
        ProtocolError::Aborted("no room".into()).into()
    }

    #[test]
    fn the_downtime_counts_from_the_pause_request_parking_included() {
        use SourcePhase::*;
        let asked = Instant::now();
        std::thread::sleep(Duration::from_millis(20)); // the vCPUs park
        let mut s = at(&[Copying, Paused]);
        s.pause_asked_at(asked);
        assert!(
            s.lap_ms() >= 20.0,
            "the first part (pause) holds the parking"
        );
        s.enter(Completing).unwrap();
        s.enter(Done).unwrap();
        assert!(s.downtime().unwrap() >= Duration::from_millis(20));
        // Only while paused: a stray call later moves nothing.
        let before = s.downtime();
        s.pause_asked_at(Instant::now());
        assert_eq!(s.downtime(), before);
    }

    #[test]
    fn the_source_allows_exactly_the_drawn_transitions() {
        use SourcePhase::*;
        let allowed = [
            (Connecting, Copying),
            (Connecting, Paused),
            (Copying, Paused),
            (Paused, Completing),
            (Completing, Done),
            (Completing, Switched),
            (Switched, Done),
        ];
        for from in ALL {
            for to in ALL {
                assert_eq!(
                    from.may_enter(to),
                    allowed.contains(&(from, to)),
                    "{from:?} -> {to:?}"
                );
            }
        }
        let mut s = at(&[Copying]);
        let e = s.enter(Completing).unwrap_err();
        assert_eq!((e.from, e.to), (Copying, Completing));
        assert_eq!(s.phase(), Copying, "a refused transition changes nothing");
    }

    #[test]
    fn every_source_phase_has_a_live_phase_and_a_name() {
        use SourcePhase::*;
        let live: Vec<_> = ALL.iter().map(|p| p.live()).collect();
        assert_eq!(
            live,
            [
                LivePhase::Running,
                LivePhase::Running,
                LivePhase::Switching,
                LivePhase::Switching,
                LivePhase::Postcopy,
                LivePhase::Succeeded
            ]
        );
        let names: std::collections::HashSet<_> = ALL.iter().map(|p| p.name()).collect();
        assert_eq!(names.len(), ALL.len());
        assert_eq!(Switched.name(), "switched");
    }

    #[test]
    fn before_the_pause_a_failure_leaves_the_vm_running_here() {
        use SourcePhase::*;
        for path in [&[][..], &[Copying]] {
            let c = at(path).on_failure(&plain());
            assert_eq!(c.left, Left::RunsHere, "{path:?}");
            assert!(c.unthrottle && c.stop_dirty_log && c.abort_peer);
            assert!(!c.resume, "never paused: nothing to resume");
            assert_eq!(c.live(), LivePhase::Failed);
        }
    }

    #[test]
    fn paused_before_complete_a_failure_resumes_the_vm_here() {
        use SourcePhase::*;
        for path in [&[Copying, Paused][..], &[Paused]] {
            for e in [plain(), abort()] {
                let c = at(path).on_failure(&e);
                assert_eq!(c.left, Left::RunsHere);
                assert!(c.resume && c.abort_peer && c.unthrottle && c.stop_dirty_log);
            }
        }
    }

    #[test]
    fn after_complete_only_the_peers_abort_resumes_the_vm() {
        use SourcePhase::*;
        let s = at(&[Copying, Paused, Completing]);
        let c = s.on_failure(&plain());
        assert_eq!(c.left, Left::PausedInDoubt);
        assert!(!c.resume && !c.abort_peer && c.stop_dirty_log);
        let c = s.on_failure(&MigrationError::InDoubt("garbage".into()));
        assert_eq!(c.left, Left::PausedInDoubt);
        let c = s.on_failure(&abort());
        assert_eq!(c.left, Left::RunsHere, "an Abort proves it did not start");
        assert!(c.resume && c.abort_peer);
    }

    #[test]
    fn after_the_switch_the_vm_stays_paused_here_whatever_fails() {
        use SourcePhase::*;
        for s in [at(&[Paused, Completing, Switched]), SourceState::resumed()] {
            for e in [plain(), abort(), MigrationError::InDoubt("x".into())] {
                let c = s.on_failure(&e);
                assert_eq!(c.left, Left::PausedSwitched);
                assert!(!c.resume && !c.unthrottle && c.abort_peer && c.stop_dirty_log);
            }
        }
        let c = at(&[Paused, Completing, Done]).on_failure(&plain());
        assert_eq!(c.left, Left::PausedSwitched);
        assert!(!c.resume && !c.abort_peer, "done: nothing to tell");
    }

    #[test]
    fn a_paused_postcopy_waits_for_resume_without_an_abort() {
        let c = SourceState::resumed().on_pause();
        assert_eq!(c.left, Left::PausedResumable);
        assert!(!c.resume && !c.abort_peer && !c.stop_dirty_log);
        assert_eq!(c.live(), LivePhase::Paused);
    }

    #[test]
    fn downtime_runs_from_the_pause_to_started_and_laps_split_it() {
        use SourcePhase::*;
        let mut s = at(&[Copying]);
        assert_eq!(s.lap_ms(), 0.0, "no lap before the pause");
        s.enter(Paused).unwrap();
        assert!(s.downtime().is_none());
        std::thread::sleep(Duration::from_millis(20));
        let first = s.lap_ms();
        assert!(first >= 19.0, "{first}");
        s.enter(Completing).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        s.enter(Done).unwrap();
        let second = s.lap_ms();
        let d = s.downtime().unwrap().as_secs_f64() * 1e3;
        assert!(
            d >= 30.0 && d >= first + second - 1.0,
            "{d} {first} {second}"
        );
        assert!(d <= first + second + 1.0, "laps add up to the downtime");
        // A resumed session never paused in this process: no downtime of
        // its own.
        assert!(SourceState::resumed().downtime().is_none());
    }

    #[test]
    fn the_destination_goes_through_its_phases_in_order_only() {
        use DestPhase::*;
        let all = [Waiting, Receiving, Restoring, Started, Done];
        for (i, from) in all.iter().enumerate() {
            for (j, to) in all.iter().enumerate() {
                assert_eq!(from.may_enter(*to), j == i + 1, "{from:?} -> {to:?}");
            }
        }
        let started: Vec<_> = all.iter().map(|p| p.vm_started()).collect();
        assert_eq!(started, [false, false, false, true, true]);
        assert_eq!(Waiting.live(), LivePhase::Pending);
        assert_eq!(Done.live(), LivePhase::Succeeded);
    }
}
