//! The mode trait on each side: what a migration mode adds to the shared
//! session and data paths. The entry points pick one object from the
//! options (source) or from the plan message that arrives (destination),
//! and the loops below never ask which mode they run.
//!
//! | mode | source | destination |
//! |---|---|---|
//! | precopy | `precopy.rs` (the round loop every copy mode shares) | session defaults |
//! | hybrid | `hybrid.rs` (the rounds, then postcopy if they do not converge) | `postcopy/destination/` once a PostcopyPlan arrives |
//! | postcopy | `postcopy/mod.rs` (its own run: pause, switch, serve) | `postcopy/destination/` |
//! | split | `split/source.rs` (rounds routed per chunk) | `split/destination.rs` once a SplitPlan arrives |
//! | gather | `split/gather.rs` (servers pulled first, then rounds) | `split/destination.rs` once a GatherPlan arrives |

use crate::compress::Backend;
use crate::memory::RegionView;
use crate::ranges::GpaPages;
use crate::session::SourceSession;
use crate::stats::{MigrationStats, Progress, RoundStats};
use crate::MigrationError;

/// Sends one round's pages to the destination over the bulk streams: runs,
/// then known-zero holes; returns the round's figures and each stream's
/// frame count (for the barrier).
pub(crate) type SendRound<'s> =
    dyn FnMut(&[GpaPages], &[GpaPages]) -> Result<(RoundStats, Vec<u64>), MigrationError> + 's;

/// A migration mode on the source. The defaults are plain precopy's.
pub(crate) trait SourceMode {
    /// Runs the migration over a session that is not open yet. Every copy
    /// mode runs precopy's rounds with its hooks below; postcopy has a run
    /// of its own.
    fn run(
        &mut self,
        s: &mut SourceSession,
        backend: &Backend,
        progress: &dyn Fn(&Progress),
    ) -> Result<MigrationStats, MigrationError> {
        crate::precopy::run(s, backend, progress, self)
    }

    /// Once the session is open, before the bulk streams (split places
    /// its chunks; hybrid checks the destination can do postcopy).
    fn begin(&mut self, _s: &mut SourceSession) -> Result<(), MigrationError> {
        Ok(())
    }

    /// Once the bulk streams are open, before round 0 (gather waits for
    /// the destination to pull the memory servers' part).
    fn streams_open(&mut self, _s: &mut SourceSession) -> Result<(), MigrationError> {
        Ok(())
    }

    /// Round 0's known-zero ranges, as this mode sends them (gather: only
    /// the main host's own).
    fn holes(&self, holes: Vec<GpaPages>) -> Vec<GpaPages> {
        holes
    }

    /// Sends a round; `send` takes pages to the destination (split sends
    /// each memory server its chunks beside it).
    fn send_round(
        &mut self,
        _regions: &[RegionView],
        runs: &[GpaPages],
        holes: &[GpaPages],
        send: &mut SendRound<'_>,
    ) -> Result<(RoundStats, Vec<u64>), MigrationError> {
        send(runs, holes)
    }

    /// After a dirty round that did not converge: why to switch to
    /// postcopy now (hybrid), or None to go on copying.
    fn switch_due(&self, _s: &SourceSession, _rounds_done: u32) -> Option<String> {
        None
    }

    /// The per-page hashes for Verify where this side's memory does not
    /// hold every page (gather); None: hash memory.
    fn hashes(&self, _s: &SourceSession) -> Option<Result<Vec<u64>, MigrationError>> {
        None
    }

    /// Complete is about to go out: keep what the destination will use
    /// and record the mode's figures.
    fn commit(&mut self, _stats: &mut MigrationStats) {}
}
