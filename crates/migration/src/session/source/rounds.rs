//! What the copy rounds ask of the session: the dirty log, and the barrier
//! that ends each round (so a later copy of a page is never overtaken by an
//! earlier one).

use super::SourceSession;
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::protocol::{self, Kind, ProtocolError, RoundDone};
use crate::ranges::GpaPages;
use crate::session::state::SourcePhase;

/// Checks that an ack is for `round`.
pub(super) fn check_ack(ack: u32, round: u32) -> Result<(), MigrationError> {
    if ack != round {
        return Err(ProtocolError::Malformed {
            kind: Kind::RoundAck,
            reason: format!("ack for round {ack}, expected {round}"),
        }
        .into());
    }
    Ok(())
}

impl SourceSession<'_> {
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

    /// The dirty log since its last read (which it clears).
    pub(crate) fn take_dirty(&self) -> Result<Vec<Vec<u64>>, MigrationError> {
        self.vm
            .take_dirty()
            .map_err(MigrationError::vm("read dirty log"))
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
}
