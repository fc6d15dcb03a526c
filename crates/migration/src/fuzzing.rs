//! Doors for ferry's fuzz targets (`fuzz/` at the repository root,
//! docs/fuzzing.md): the crate-private code that reads a peer's bytes,
//! reachable from outside so a target runs exactly what the engine runs.
//! Each function here only calls that code; none decodes anything itself.
//! Not an API: hidden from the docs, and nothing in ferry calls it.

use std::sync::atomic::Ordering;
use std::time::Instant;

use ferry_codec::StreamDecoder;

use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::postcopy::source::SourcePages;
use crate::protocol::{Frame, RoundDone};
use crate::ranges::GpaPages;
use crate::receiver::Received;
use crate::sink::PageSink;
use crate::transport::{Conn, ConnReader};

pub use crate::checksum::{combine, crc32c};
pub use crate::encoded::{parse_encoded, write_encoded, CodecSetup, MAX_CACHE_BYTES, MAX_SHARDS};
pub use crate::pagein::read_pages;
pub use crate::ranges::total_pages;
pub use crate::shared::SiblingIndex;
pub use crate::split::{ChunkMap, GatherPlan, SplitPlan};
pub use crate::telemetry::{pack_lines, unpack_lines, MAX_TIMELINE_BYTES};

/// Pages a destination's bulk stream landed: (pages, zero pages).
pub type Landed = (u64, u64);

/// The destination's bulk stream receiver (`receiver::bulk_loop`): reads
/// frames from `r` until it closes and lands them in `sink`. A failure of
/// the stream's decode thread (compressed streams) is returned too.
pub fn bulk_stream(
    regions: &[RegionView],
    sink: &dyn PageSink,
    r: ConnReader,
) -> Result<Landed, MigrationError> {
    let rx = Received::new(1);
    crate::receiver::bulk_loop(regions, sink, r, 0, &rx)?;
    if let Some(e) = rx.take_failure() {
        return Err(e);
    }
    Ok((
        rx.pages.load(Ordering::Relaxed),
        rx.zero_pages.load(Ordering::Relaxed),
    ))
}

/// A ZeroRanges body landed as a bulk stream lands it; returns the zero
/// pages.
pub fn zero_ranges(
    regions: &[RegionView],
    sink: &dyn PageSink,
    body: &[u8],
) -> Result<u64, MigrationError> {
    let rx = Received::new(1);
    crate::receiver::zero_ranges(regions, sink, body, &rx)?;
    Ok(rx.zero_pages.load(Ordering::Relaxed))
}

/// Encoded bodies decoded and landed by a compressed stream's decode stage
/// (`receiver::decode_loop`), one decoder per shard; returns the pages.
pub fn encoded(
    regions: &[RegionView],
    sink: &dyn PageSink,
    decoders: Vec<StreamDecoder>,
    bodies: Vec<Vec<u8>>,
) -> Result<u64, MigrationError> {
    let rx = Received::new(1);
    let (tx, bodies_rx) = std::sync::mpsc::channel();
    for b in bodies {
        let _ = tx.send(b);
    }
    drop(tx);
    let (back, _back_rx) = std::sync::mpsc::channel();
    crate::receiver::decode_loop(regions, sink, bodies_rx, back, decoders, 0, &rx)?;
    Ok(rx.pages.load(Ordering::Relaxed))
}

/// A RoundDone as the destination's control loop checks it, for a session
/// of `streams` bulk streams.
pub fn round_done(f: &Frame, streams: usize) -> Result<RoundDone, MigrationError> {
    crate::session::destination::round_done(f, &Received::new(streams))
}

/// A Verify body compared with this side's page hashes `mine`, as the
/// destination's control loop does; returns the pages compared.
pub fn verify(regions: &[RegionView], mine: &[u64], body: &[u8]) -> Result<u64, MigrationError> {
    crate::session::compare_hashes(regions, mine, body)
}

/// A VerifyDigests frame held against the hashes of `regions`' pages as
/// they landed (here: as they are), as a v12 destination's control loop
/// does; the pages covered, or why not.
pub fn verify_digests(regions: &[RegionView], f: &Frame) -> Result<u64, MigrationError> {
    let landed = crate::verify::PageHashes::new(regions);
    for r in regions {
        let pages = crate::ranges::GpaPages::new(r.gpa(), r.pages());
        let mut data = vec![0u8; r.size() as usize];
        r.read(r.gpa(), &mut data);
        landed.set_pages(pages, &data);
    }
    landed.check_digests(f)
}

/// What a postcopy source's demand thread did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    /// Requests answered.
    pub requests: u64,
    /// Pages sent in answer (each requested page and its prefetch).
    pub pages: u64,
}

/// A postcopy source's demand thread (`SourcePages::serve_demand`) over
/// `conn`: `pending` pages of `regions` not sent yet, `prefetch` neighbours
/// sent with each requested page. The caller must read what it answers.
pub fn serve_demand(
    regions: Vec<RegionView>,
    pending: &[GpaPages],
    prefetch: u32,
    conn: &mut Conn,
) -> Result<Demand, MigrationError> {
    let src = SourcePages::new(regions, pending, prefetch, None, Instant::now());
    src.serve_demand(conn)?;
    Ok(Demand {
        requests: src.requests.load(Ordering::Relaxed),
        pages: src.demand_pages.load(Ordering::Relaxed),
    })
}

/// A postcopy standby's intake (`standby::intake`): a source's Hello, plan,
/// pages and hashes read from `c` and checked, answered with StandbyHeld;
/// the pages held, or why they were refused. Never stands by nor resumes
/// anything.
pub fn standby_intake(c: &mut Conn, hello: &crate::protocol::Hello) -> Result<u64, MigrationError> {
    let room = crate::standby::Room::new(u64::MAX);
    crate::standby::intake(c, hello, &room).map(|i| i.pages)
}

/// A SharedPages body landed as a bulk stream lands it, against `index`
/// (the host's other VMs' pages): returns the pages landed and the pages
/// it missed (runs, as the source is told).
pub fn shared_pages(
    regions: &[RegionView],
    sink: &dyn PageSink,
    body: &[u8],
    index: &crate::shared::SiblingIndex,
) -> Result<(u64, Vec<GpaPages>), MigrationError> {
    let rx = Received::new(1);
    let (landed, _) = crate::shared::land_refs(regions, sink, body, Some(index), &rx.missed)?;
    Ok((landed, rx.take_missed()))
}
