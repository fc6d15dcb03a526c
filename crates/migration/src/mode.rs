//! The mode trait on each side: what a migration mode adds to the shared
//! session and data paths. The entry points pick one object from the
//! options (source) or from the plan message that arrives (destination),
//! and the loops below never ask which mode they run: precopy's round loop
//! asks its [`Rounds`](crate::precopy::Rounds) hooks, and a mode that ends
//! the rounds early (hybrid) takes the migration over from there.
//!
//! | mode | source | destination |
//! |---|---|---|
//! | precopy | `precopy.rs` (the round loop every copy mode shares) | session defaults |
//! | hybrid | `hybrid.rs` (the rounds; if they do not converge, its switch to postcopy) | `postcopy/destination/` once a PostcopyPlan arrives |
//! | postcopy | `postcopy/mod.rs` (its own run: pause, switch, serve) | `postcopy/destination/` |
//! | split | `split/source.rs` (rounds routed per chunk) | `split/destination.rs` once a SplitPlan arrives |
//! | gather | `split/gather.rs` (servers pulled first, then rounds) | `split/destination.rs` once a GatherPlan arrives |

use crate::compress::Backend;
use crate::error::MigrationError;
use crate::paused::Outcome;
use crate::session::SourceSession;
use crate::stats::Progress;

/// A migration mode on the source: it runs the migration over a session
/// that is not open yet. Every copy mode gets this from precopy's round
/// loop through its [`Rounds`](crate::precopy::Rounds) hooks; postcopy has
/// a run of its own.
pub(crate) trait SourceMode {
    /// Migrates; on failure the session's safety rule decides what the VM
    /// is left as.
    fn run(
        &mut self,
        s: &mut SourceSession,
        backend: &Backend,
        progress: &dyn Fn(&Progress),
    ) -> Result<Outcome, MigrationError>;
}
