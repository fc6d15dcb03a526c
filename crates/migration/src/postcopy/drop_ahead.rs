//! A hybrid's source, once it has chosen to switch, names the pages the
//! guest dirtied since they were sent, and the destination drops them
//! while the VM still runs here (DropAhead, v17). Each drop is a hole
//! punched in guest memory (~4 µs a run on these machines); a kv guest
//! left ~25,000 scattered runs, and the destination's part of the pause was
//! 26 of its 29 ms. Now the pause drops only what was dirtied during the
//! last of these steps.
//!
//! Safe because every round's pages have landed when this starts (the
//! round barrier) and no page is sent between it and the pause: a dropped
//! page stays a hole until postcopy fills it. Every dropped page is in the
//! plan, as every page dirtied since it was sent is.

use crate::dirty::dirty_runs;
use crate::error::MigrationError;
use crate::protocol::{self, DropAhead, Kind, ProtocolError};
use crate::ranges::{subtract_runs, total_pages, union_runs, GpaPages};
use crate::session::SourceSession;

/// At most this many steps: each drops what the guest dirtied during the
/// one before.
const STEPS: usize = 3;
/// Fewer new pages than this are left to the pause (a step costs a round
/// trip and a dirty-log harvest).
const MIN_PAGES: u64 = 256;

/// Has the destination drop `pending` and what the guest dirties while it
/// does; adds what was dirtied to `pending` (all of it stays the plan).
/// Returns the pages dropped.
pub(crate) fn drop_ahead(
    s: &mut SourceSession,
    pending: &mut Vec<GpaPages>,
) -> Result<u64, MigrationError> {
    let mut dropped: Vec<GpaPages> = Vec::new();
    let mut batch = pending.clone();
    for _ in 0..STEPS {
        let pages = total_pages(&batch);
        if pages < MIN_PAGES {
            break;
        }
        for (share, last) in protocol::run_frames(&batch) {
            let part = DropAhead {
                runs: share.to_vec(),
                last,
            };
            protocol::send(s.ctl()?.writer(), Kind::DropAhead, &part)?;
        }
        s.ctl()?.flush()?;
        let answered: u64 = s.ctl()?.recv(Kind::DroppedAhead)?;
        if answered != pages {
            return Err(ProtocolError::Malformed {
                kind: Kind::DroppedAhead,
                reason: format!("{answered} pages dropped, {pages} asked"),
            }
            .into());
        }
        dropped = union_runs(dropped.into_iter().chain(batch));
        let bitmaps = s.take_dirty()?;
        let (dirtied, _) = dirty_runs(s.regions(), &bitmaps);
        batch = subtract_runs(&dirtied, &dropped);
        *pending = union_runs(pending.drain(..).chain(dirtied));
    }
    let pages = total_pages(&dropped);
    tracing::info!(
        pages,
        "the destination dropped dirtied pages ahead of the pause"
    );
    s.tel().event("dropped_ahead", pages.to_string());
    Ok(pages)
}
