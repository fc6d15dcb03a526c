//! The end of a migration: the pause, state and hashes, Complete and
//! Started (or a postcopy's Finished), the destination's timeline, and the
//! safety rule applied to whatever happened.

use std::time::{Duration, Instant};

use super::rounds::check_ack;
use super::SourceSession;
use crate::error::MigrationError;
use crate::paused::Outcome;
use crate::protocol::{self, Caps, Kind, ProtocolError, HEADER};
use crate::session::state::{Cleanup, Left, SourcePhase};
use crate::stats::StartedReport;
use crate::vm::TakeBackAnswer;

/// How long the paused source polls for the destination's answers to
/// Complete before it blocks in read(2), when it could not take real time.
const SPIN_FOR_STARTED: Duration = Duration::from_millis(5);

impl SourceSession<'_> {
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
        let hashes = crate::session::hashes(&self.regions, |i| vm.data_ranges(i));
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
        if let Some(f) = self.vm.fence() {
            f.completing();
        }
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
        if let Some(f) = self.vm.fence() {
            f.handed();
        }
        tracing::info!(service = ?report.service, "destination started the VM");
        self.tel.event("started", "the VM runs at the destination");
        Ok(report)
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
                    Left::PausedSwitched | Left::PausedResumable | Left::Handed => {
                        tracing::error!(error = %e, "postcopy broke after the switch; the VM stays paused here with all its memory")
                    }
                }
                c
            }
        };
        let c = self.fenced(c, &mut result);
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

    /// With an owner fence, a source that sent Complete resumes only if the
    /// registry says the destination never took the VM (a peer's Abort is
    /// not enough: it could come from a destination that took it and then
    /// failed); the registry also settles what was in doubt.
    fn fenced(&mut self, c: Cleanup, result: &mut Result<Outcome, MigrationError>) -> Cleanup {
        let Some(fence) = self.vm.fence() else {
            return c;
        };
        let after_complete = self.state.phase() == SourcePhase::Completing;
        if !after_complete || !(c.resume || c.left == Left::PausedInDoubt) {
            return c;
        }
        let error = match &*result {
            Err(e) => e.to_string(),
            Ok(_) => return c,
        };
        match fence.take_back() {
            TakeBackAnswer::Back(why) => {
                tracing::warn!(%why, "the destination never took the VM: it runs here again");
                self.tel.event("owner", format!("taken back: {why}"));
                self.state.on_taken_back()
            }
            TakeBackAnswer::Gone(holder) => {
                tracing::warn!(%holder, "the switch failed but the destination holds the VM");
                self.tel
                    .event("owner", format!("held by the destination: {holder}"));
                *result = Err(MigrationError::HandedOver { error, holder });
                self.state.on_handed()
            }
            TakeBackAnswer::Unknown(why) => {
                self.tel.event("owner", format!("in doubt: {why}"));
                *result = Err(MigrationError::InDoubt(format!(
                    "{error}; and the registry did not answer ({why}): this VMM resumes the VM by \
                     itself if the registry says the destination never took it"
                )));
                Cleanup {
                    left: Left::PausedInDoubt,
                    resume: false,
                    abort_peer: false,
                    ..c
                }
            }
        }
    }
}
