//! SharedPages frames: pages sent as references to content the
//! destination's host holds, written by the source's sender and landed by
//! the destination's bulk streams through the sink like any other page.

use std::io::Write;
use std::sync::Mutex;

use super::SiblingIndex;
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::protocol::{self, Kind, ProtocolError, MAX_BATCH, PAGE};
use crate::ranges::GpaPages;
use crate::sink::PageSink;

/// Runs of at least this many referenced pages are populated in one call.
const POPULATE_MIN_PAGES: usize = 8;

/// One page sent by reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct SharedRef {
    /// Where it lands.
    pub(crate) gpa: u64,
    /// Its key in the destination's offer.
    pub(crate) key: u64,
    /// Its identity ([`super::page_id`]).
    pub(crate) id: [u8; 16],
}

/// Writes one SharedPages frame of `refs` (nothing if there are none);
/// returns its wire bytes.
pub(crate) fn write_refs(w: &mut impl Write, refs: &[SharedRef]) -> Result<u64, ProtocolError> {
    if refs.is_empty() {
        return Ok(0);
    }
    let body = postcard::to_stdvec(refs).map_err(|e| ProtocolError::Malformed {
        kind: Kind::SharedPages,
        reason: e.to_string(),
    })?;
    protocol::write_frame(w, Kind::SharedPages, &body)?;
    Ok((protocol::HEADER + body.len()) as u64)
}

/// Lands a SharedPages body: each page its reference resolves to lands
/// through `sink`; one that does not resolve (the other VM changed it, or
/// no such key) goes to `missed`, for the source to send again. Returns
/// the pages landed. A frame without an offer behind it, of more than a
/// batch, or naming a page outside guest RAM fails the migration.
pub(crate) fn land_refs(
    regions: &[RegionView],
    sink: &dyn PageSink,
    body: &[u8],
    index: Option<&SiblingIndex>,
    missed: &Mutex<Vec<u64>>,
) -> Result<(u64, u64), MigrationError> {
    let bad = |reason: String| ProtocolError::Malformed {
        kind: Kind::SharedPages,
        reason,
    };
    let Some(index) = index else {
        return Err(ProtocolError::Unexpected {
            got: Kind::SharedPages,
            want: "pages (this side offered none to refer to)",
        }
        .into());
    };
    // The longest a batch of references encodes to, checked before it is
    // decoded: a count, and per reference two varints and 16 bytes.
    if body.len() > 5 + MAX_BATCH * (10 + 10 + 16) {
        return Err(bad(format!("{} bytes of references in one frame", body.len())).into());
    }
    let refs: Vec<SharedRef> = postcard::from_bytes(body).map_err(|e| bad(e.to_string()))?;
    if refs.len() > MAX_BATCH {
        return Err(bad(format!("{} references in one frame", refs.len())).into());
    }
    // A round names a page once: more misses than the VM has pages is not
    // an honest source.
    let pages: u64 = regions.iter().map(RegionView::pages).sum();
    // Runs of consecutive pages are allocated in one call first, where the
    // sink writes plain memory: fresh guest memory faults page by page on
    // a copy's first touch, which cost more than the rest of a reference.
    let mut i = 0;
    while i < refs.len() {
        let mut n = 1;
        while i + n < refs.len()
            && refs[i + n].gpa == refs[i].gpa.wrapping_add(n as u64 * PAGE as u64)
        {
            n += 1;
        }
        let run = GpaPages::new(refs[i].gpa, n as u64);
        if n >= POPULATE_MIN_PAGES {
            if let Some(stretch) = sink.in_place(run) {
                stretch.populate();
            }
        }
        i += n;
    }
    let mut page = [0u8; PAGE];
    let (mut landed, mut misses) = (0, 0);
    for r in refs {
        let run = GpaPages::new(r.gpa, 1);
        crate::sink::host_of(regions, run)?;
        if index.resolve(r.key, &r.id, &mut page) {
            sink.write(run, &page)?;
            landed += 1;
        } else {
            misses += 1;
            let mut missed = missed.lock().unwrap_or_else(|e| e.into_inner());
            if missed.len() as u64 >= pages {
                return Err(bad("more references missed than the VM has pages".into()).into());
            }
            missed.push(r.gpa);
        }
    }
    Ok((landed, misses))
}
