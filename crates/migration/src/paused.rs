//! How a source's migration ends when it does not fail: done, or paused.
//! A postcopy whose link broke and did not come back within the reconnect
//! timeout is not a failure: the VM runs at the destination and the source
//! keeps it paused with every page, until `ferry migrate --resume` continues
//! ([`crate::source::resume`]). What it keeps for that is here, as plain
//! data, so the entry points, the session and postcopy share it without
//! importing each other (and an error value never carries a session).

use std::time::Instant;

use crate::stats::MigrationStats;

/// What a migration that did not fail came to.
#[derive(Debug)]
// Made once per migration and taken apart at once: the size does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Outcome {
    /// The VM runs at the destination with all its memory; the caller
    /// releases it here.
    Done(MigrationStats),
    /// Postcopy paused: the VM runs at the destination, which still needs
    /// pages only this side holds; it stays paused here with all its
    /// memory until the migration is resumed.
    Paused(Box<PausedPostcopy>),
}

impl Outcome {
    /// The figures of a finished migration (None: paused).
    pub fn done(self) -> Option<MigrationStats> {
        match self {
            Outcome::Done(s) => Some(s),
            Outcome::Paused(_) => None,
        }
    }
}

/// What a source session that paused (postcopy, link lost) keeps to come
/// back as itself: the destination recognises its id.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Resumable {
    pub(crate) id: u64,
    pub(crate) version: u16,
    pub(crate) t_start: Instant,
}

/// A postcopy the link broke under, kept by the source's VMM until
/// [`crate::source::resume`] continues it: the VM is paused there with all its
/// memory (frozen since the switch, so whatever the destination still
/// lacks can be sent at any later time and is never stale).
#[derive(Debug)]
pub struct PausedPostcopy {
    /// The session to come back as.
    pub(crate) session: Resumable,
    /// Where the destination was.
    pub to: crate::transport::Endpoint,
    /// The migration's options (a resume uses them again).
    pub opts: crate::options::MigrateOptions,
    pub(crate) stats: MigrationStats,
    pub(crate) epoch: Epoch,
    /// Why it paused.
    pub reason: String,
}

/// Where a postcopy is, across pauses (postcopy's own bookkeeping, kept
/// here so a paused migration can carry it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Epoch {
    pub(crate) round: u32,
    /// The switch (postcopy time runs from here).
    pub(crate) t_post: Instant,
    /// Set while the link is broken.
    pub(crate) paused_since: Option<Instant>,
    /// The destination acknowledged that every pending page landed: what
    /// this side holds is no longer needed there.
    pub(crate) landed: bool,
}

impl std::fmt::Display for PausedPostcopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "postcopy paused: {}. The VM runs at the destination, which still needs pages only this side holds; the VM stays paused here with all its memory: resume the migration (ferry migrate --resume) once the destination is reachable, and do not resume the VM here", self.reason)
    }
}
