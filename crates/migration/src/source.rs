//! The source's entry point: one call migrates a VM away in the mode the
//! options name.

use crate::compress::Backend;
use crate::error::MigrationError;
use crate::mode::SourceMode;
use crate::options::{MigrateOptions, Mode};
use crate::paused::{Outcome, PausedPostcopy};
use crate::session::SourceSession;
use crate::stats::{MigrationStats, Progress};
use crate::transport::Endpoint;
use crate::vm::MigratableVm;

/// Migrates `vm` to the ferry destination at `to`, with the codecs of
/// `backend`. [`Outcome::Done`]: the VM runs at the destination and the
/// caller must release it here (it stays paused); [`Outcome::Paused`]: a
/// postcopy lost its link for good, the VM runs at the destination and stays
/// paused here until [`resume`]. On failure it runs here as before, except
/// after [`MigrationError::InDoubt`], [`MigrationError::PostcopyBroken`]
/// and [`MigrationError::VerifyAfterSwitch`], where it stays paused.
pub fn migrate(
    vm: &dyn MigratableVm,
    to: &Endpoint,
    opts: &MigrateOptions,
    backend: &Backend,
    progress: &dyn Fn(&Progress),
) -> Result<Outcome, MigrationError> {
    opts.check().map_err(MigrationError::Unsupported)?;
    tracing::info!(%to, mode = %opts.mode, streams = opts.streams, "migration starts");
    let mut session = SourceSession::new(vm, to, opts);
    let mut mode = source_mode(opts.mode);
    let result = mode.run(&mut session, backend, progress);
    conclude(session, result)
}

/// The mode object that runs a migration in `mode`.
fn source_mode(mode: Mode) -> Box<dyn SourceMode> {
    match mode {
        Mode::Precopy => Box::new(crate::precopy::Precopy),
        Mode::Hybrid => Box::new(crate::hybrid::Hybrid),
        Mode::Postcopy => Box::new(crate::postcopy::Postcopy),
        Mode::Split => Box::new(crate::split::source::Split::default()),
        Mode::Gather => Box::new(crate::split::gather::GatherMode::default()),
    }
}

/// Continues a postcopy that paused on a broken link
/// ([`Outcome::Paused`]): connects to the destination again
/// (at `to`, or where it was), which names the pages it still lacks, and
/// serves them until it has all. Fails the same way again if the
/// destination stays unreachable for the reconnect timeout.
pub fn resume(
    vm: &dyn MigratableVm,
    paused: PausedPostcopy,
    to: Option<Endpoint>,
    progress: &dyn Fn(&Progress),
) -> Result<Outcome, MigrationError> {
    let to = to.unwrap_or_else(|| paused.to.clone());
    let opts = paused.opts.clone();
    tracing::info!(%to, "postcopy resumes");
    let mut session = SourceSession::resuming(vm, &to, &opts, paused.session);
    let result = crate::postcopy::resume(&mut session, paused, progress);
    conclude(session, result)
}

/// Collects the destination's timeline of a migration that finished,
/// stamps it with its wall-clock start and applies the session's safety
/// rule.
fn conclude(
    mut session: SourceSession,
    result: Result<Outcome, MigrationError>,
) -> Result<Outcome, MigrationError> {
    if let Ok(Outcome::Done(_)) = &result {
        session.collect_timeline();
    }
    let start_unix_s = session.start_unix_s();
    session.conclude(result.map(|o| match o {
        Outcome::Done(stats) => Outcome::Done(MigrationStats {
            start_unix_s,
            ..stats
        }),
        paused => paused,
    }))
}
