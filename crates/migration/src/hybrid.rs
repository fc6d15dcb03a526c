//! Hybrid: precopy's rounds while they converge; once they have run for
//! `--postcopy-after` without converging, the rounds hand over and
//! postcopy takes over from the paused VM (`postcopy::switch`), so the
//! migration ends in bounded time however fast the guest dirties memory.

use std::time::Instant;

use crate::error::MigrationError;
use crate::options::PostcopyAfter;
use crate::paused::Outcome;
use crate::postcopy;
use crate::precopy::{HandOver, Rounds};
use crate::session::SourceSession;
use crate::stats::Progress;

/// The hybrid mode on the source.
pub(crate) struct Hybrid;

impl Rounds for Hybrid {
    fn begin(&mut self, s: &mut SourceSession) -> Result<(), MigrationError> {
        postcopy::require(s)
    }

    /// Its rounds go to the destination's memory, which commits nothing
    /// else at Complete (until it switches: then postcopy sends).
    fn sends_in_place(&self) -> bool {
        true
    }

    fn commits_nothing_at_complete(&self) -> bool {
        true
    }

    fn hand_over_due(&self, s: &SourceSession, rounds_done: u32, dirty: u64) -> Option<String> {
        let after = s.opts().postcopy_after;
        let why = postcopy_due(after, rounds_done, s.started_at()).then(|| match after {
            PostcopyAfter::Rounds(n) => format!("{n} dirty rounds"),
            PostcopyAfter::Secs(x) => format!("{x} s"),
            PostcopyAfter::Either(n, _) if rounds_done > n => format!("{n} dirty rounds"),
            PostcopyAfter::Either(_, x) => format!("its {x} s deadline"),
        })?;
        Some(format!(
            "not converged after {why} ({dirty} pages dirty): switched to postcopy"
        ))
    }

    /// The switch: drop ahead what the destination can, pause, and let
    /// postcopy send the rest.
    fn hand_over(
        &mut self,
        s: &mut SourceSession,
        mut h: HandOver,
        progress: &dyn Fn(&Progress),
    ) -> Result<Outcome, MigrationError> {
        // The pages dirtied since they were sent are dropped ahead of the
        // pause, where the destination can (v17).
        let dropped_ahead = if s.caps().drop_ahead() {
            postcopy::drop_ahead(s, &mut h.runs)?
        } else {
            0
        };
        let round = h.round;
        // (The dirty log goes off once the VM runs there: postcopy::switch.)
        let (pending, mut stats) = h.pause(s)?;
        let paused = postcopy::switch(s, &mut stats, pending, round, progress)?;
        if let Some(p) = stats.postcopy.as_mut() {
            p.dropped_ahead_pages = dropped_ahead;
        }
        Ok(postcopy::outcome(stats, paused))
    }
}

/// True when hybrid has waited long enough for precopy to converge.
fn postcopy_due(after: PostcopyAfter, rounds_done: u32, t_start: Instant) -> bool {
    match after {
        // Round 0 is the full copy; `n` dirty rounds follow it.
        PostcopyAfter::Rounds(n) => rounds_done > n,
        PostcopyAfter::Secs(x) => t_start.elapsed().as_secs_f64() >= x,
        PostcopyAfter::Either(n, x) => {
            postcopy_due(PostcopyAfter::Rounds(n), rounds_done, t_start)
                || postcopy_due(PostcopyAfter::Secs(x), rounds_done, t_start)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn hybrid_switches_after_n_dirty_rounds_or_after_its_time() {
        let now = Instant::now();
        // Round 0 is the full copy: 3 dirty rounds means 4 rounds done.
        assert!(!postcopy_due(PostcopyAfter::Rounds(3), 3, now));
        assert!(postcopy_due(PostcopyAfter::Rounds(3), 4, now));
        assert!(!postcopy_due(PostcopyAfter::Secs(60.0), 100, now));
        let long_ago = now - Duration::from_secs(3);
        assert!(postcopy_due(PostcopyAfter::Secs(2.5), 1, long_ago));
        // Whichever comes first.
        let either = PostcopyAfter::Either(3, 2.5);
        assert!(!postcopy_due(either, 1, now));
        assert!(postcopy_due(either, 4, now));
        assert!(postcopy_due(either, 1, long_ago));
        assert_eq!("3|2.5s".parse::<PostcopyAfter>(), Ok(either));
        assert_eq!(either.to_string(), "3|2.5s");
        assert!("3|4".parse::<PostcopyAfter>().is_err());
    }
}
