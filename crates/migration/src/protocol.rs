//! ferry migration wire protocol, version 1 (full text: docs/protocol.md).
//!
//! Every message is one frame:
//!
//! ```text
//! +--------+--------+--------+--------+--------+
//! | magic  | kind   | flags  | len    | crc32c |   16-byte header, little-endian
//! | u32    | u16    | u16    | u32    | u32    |   crc32c covers the body
//! +--------+--------+--------+--------+--------+
//! | body: len bytes (postcard, or raw pages)   |   len <= MAX_BODY
//! +--------------------------------------------+
//! ```
//!
//! A session is one control connection plus N bulk connections, each opened
//! by the source with a `Hello` naming its role:
//!
//! ```text
//! source                                         destination
//!  ctl  Hello{versions 1..=1, Control, streams}  ──▶
//!                                                ◀──  HelloAck{version 1}  (or Abort: version/shape)
//!  ctl  Layout{regions, vcpus}                   ──▶   (checked against the waiting VM)
//!  bulk Hello{Bulk} ... ; Pages / ZeroRanges     ──▶   written into guest memory
//!  ctl  RoundDone{round, frames per stream}      ──▶   (waits for that many frames per stream)
//!  ...  dirty rounds ..., then the source pauses the VM, sends the last dirty pages
//!  ctl  State{vm state}                          ──▶
//!  ctl  Verify{page hashes}                      ──▶   (optional) compared with its own
//!  ctl  Complete                                 ──▶   restores state, starts vCPUs
//!                                                ◀──  Started   (source releases the VM)
//!  either side: Abort{reason} at any point; the source then resumes its VM.
//! ```

use std::io::{self, Read, Write};

use crate::ranges::GpaPages;

/// Frame magic "FRYM".
pub const MAGIC: u32 = 0x4d59_5246;
/// Oldest protocol version this build speaks.
pub const VERSION_MIN: u16 = 1;
/// Newest protocol version this build speaks.
pub const VERSION_MAX: u16 = 8;
/// The first version with postcopy (PostcopyPlan, PageRequest, Finished).
pub const VERSION_POSTCOPY: u16 = 3;
/// The first version where a postcopy survives a broken link (Resume
/// connections, PostcopyResume).
pub const VERSION_RESUME: u16 = 4;
/// The first version where the VM's clients move with it (ClientsPlan,
/// ClientsAnswer, Clients; Started reports restore and verify times).
pub const VERSION_CLIENTS: u16 = 5;
/// The first version where the destination sends its timeline back
/// (TimelineAsk, Timeline).
pub const VERSION_TIMELINE: u16 = 6;
/// The first version with memory servers (Role::Store and the Store*
/// messages; see memserver).
pub const VERSION_STORE: u16 = 7;
/// The first version with split migration (SplitPlan to the main host,
/// StoreFetch on memory servers).
pub const VERSION_SPLIT: u16 = 8;
/// Bytes of frame header.
pub const HEADER: usize = 16;
/// Largest frame body accepted from a peer.
pub const MAX_BODY: usize = 32 << 20;
/// Guest page size, the unit of transfer (as a buffer length).
pub const PAGE: usize = crate::ranges::PAGE as usize;
/// Most pages in one Pages frame.
pub const MAX_BATCH: usize = 1024;

/// Message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    /// Opens a connection: versions, role.
    Hello = 1,
    /// Accepts a Hello: chosen version.
    HelloAck = 2,
    /// Guest memory layout and vCPU count.
    Layout = 3,
    /// A batch of pages: count, addresses, contents.
    Pages = 4,
    /// Ranges of zero pages.
    ZeroRanges = 5,
    /// End of a round: how many frames each bulk stream carried in it.
    RoundDone = 6,
    /// VM state (vCPUs, devices).
    State = 7,
    /// Per-page hashes for end-to-end verification.
    Verify = 8,
    /// Everything sent: restore and run.
    Complete = 9,
    /// The destination runs the VM.
    Started = 10,
    /// Give up; the reason is in the body.
    Abort = 11,
    /// Receipt of a round (destination to source).
    RoundAck = 12,
    /// v2, first frame of a compressed bulk stream: its codec caches.
    Codec = 13,
    /// v2: a batch of pages in ferry-codec's encoding.
    Encoded = 14,
    /// v3, source to destination before Complete: the VM will start before
    /// these pages arrive (one or more frames, the last one marked).
    PostcopyPlan = 15,
    /// v3, destination to source on the demand connection: pages a vCPU
    /// waits for.
    PageRequest = 16,
    /// v3, destination to source: every page arrived (and verified); the
    /// source may let go. Body: the destination's fault report.
    Finished = 17,
    /// v4, destination to source on a Resume connection: the pages still
    /// missing after a broken link (one or more frames, the last one marked).
    PostcopyResume = 18,
    /// v5, source to destination right after Layout: whether the VM's
    /// clients can move with it (its own address and service port), or None.
    ClientsPlan = 19,
    /// v5, destination to source: it takes the clients over, or why not.
    ClientsAnswer = 20,
    /// v5, source to destination just before Complete when the clients
    /// move: their connections, checkpointed (opaque to the engine).
    Clients = 21,
    /// v6, source to destination after the clients plan: how long to go on
    /// sampling after the VM started there (or every page arrived) before
    /// sending the timeline back (ms, u32).
    TimelineAsk = 22,
    /// v6, destination to source last, after Started (precopy) or Finished
    /// (postcopy) and the tail: the destination's timeline, zstd-compressed
    /// JSON lines (empty when it kept none).
    Timeline = 23,
    /// v7, memory server: opens (or joins) a VM's store.
    StoreOpen = 24,
    /// v7, memory server: pages held and room left.
    StoreAck = 25,
    /// v7, memory server: answer with StoreAck once everything sent before
    /// has landed.
    StoreSync = 26,
    /// v7, memory server: forget these runs.
    StoreDrop = 27,
    /// v7, memory server: what do you hold for this VM?
    StoreList = 28,
    /// v7, memory server: runs held (one or more frames, the last marked).
    StoreHeld = 29,
    /// v7, memory server: free this VM's store.
    StoreClose = 30,
    /// v8, memory server: send the held pages of these runs, run by run
    /// (each run in frames of at most MAX_BATCH pages, held ones only, so
    /// the first run's answer comes first), forgetting them if asked.
    StoreFetch = 31,
    /// v8, source to the main host after Layout: split migration's plan
    /// (chunk size, memory servers, where each chunk lives, the budget).
    SplitPlan = 32,
    /// v8, a split VM's main host to the gathering destination: pull these
    /// runs from these memory servers before any page from the main host.
    GatherPlan = 33,
    /// v8, the gathering destination: everything on the servers landed.
    GatherReady = 34,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => HelloAck,
            3 => Layout,
            4 => Pages,
            5 => ZeroRanges,
            6 => RoundDone,
            7 => State,
            8 => Verify,
            9 => Complete,
            10 => Started,
            11 => Abort,
            12 => RoundAck,
            13 => Codec,
            14 => Encoded,
            15 => PostcopyPlan,
            16 => PageRequest,
            17 => Finished,
            18 => PostcopyResume,
            19 => ClientsPlan,
            20 => ClientsAnswer,
            21 => Clients,
            22 => TimelineAsk,
            23 => Timeline,
            24 => StoreOpen,
            25 => StoreAck,
            26 => StoreSync,
            27 => StoreDrop,
            28 => StoreList,
            29 => StoreHeld,
            30 => StoreClose,
            31 => StoreFetch,
            32 => SplitPlan,
            33 => GatherPlan,
            34 => GatherReady,
            _ => return None,
        })
    }
}

/// Why a frame or message was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// Socket error.
    #[error("migration connection failed: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the connection.
    #[error("the peer closed the migration connection")]
    Closed,
    /// The stream ended inside a frame.
    #[error("migration stream truncated inside a frame")]
    Truncated,
    /// Not a ferry migration stream.
    #[error("not a ferry migration stream (magic {0:#x}): is the peer a ferry destination?")]
    BadMagic(u32),
    /// Unknown message kind.
    #[error("unknown message kind {0}")]
    BadKind(u16),
    /// Body too large.
    #[error("frame body of {0} bytes exceeds the {MAX_BODY}-byte limit")]
    TooLarge(u32),
    /// Checksum mismatch.
    #[error("frame checksum mismatch (kind {kind:?}, {len} bytes): corrupt stream")]
    Checksum {
        /// Kind of the corrupt frame.
        kind: Kind,
        /// Its length.
        len: u32,
    },
    /// The body does not decode.
    #[error("malformed {kind:?} message: {reason}")]
    Malformed {
        /// Kind.
        kind: Kind,
        /// What is wrong.
        reason: String,
    },
    /// No common version.
    #[error("peer speaks protocol versions {min}..={max}, this ferry speaks {VERSION_MIN}..={VERSION_MAX}")]
    Version {
        /// Peer's oldest.
        min: u16,
        /// Peer's newest.
        max: u16,
    },
    /// A message that does not belong here.
    #[error("unexpected {got:?} message while waiting for {want}")]
    Unexpected {
        /// What came.
        got: Kind,
        /// What was expected.
        want: &'static str,
    },
    /// The peer gave up.
    #[error("the peer aborted the migration: {0}")]
    Aborted(String),
}

/// Role of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Role {
    /// The control connection.
    Control,
    /// Bulk page stream number n.
    Bulk(u16),
    /// Demand pages: faults and their answers, never behind bulk data.
    Demand,
    /// Descriptor passing (same host, Unix socket).
    Fds,
    /// v4: the control connection again, after a link broke during
    /// postcopy (same session id).
    Resume,
    /// v7: a connection to a memory server.
    Store,
}

impl Role {
    /// The connection's name in timelines and metrics (a resumed control
    /// connection counts as the control connection).
    pub fn link_name(self) -> String {
        match self {
            Role::Control | Role::Resume => "control".into(),
            Role::Bulk(i) => format!("bulk{i}"),
            Role::Demand => "demand".into(),
            Role::Fds => "fds".into(),
            Role::Store => "store".into(),
        }
    }
}

/// Opens a connection.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hello {
    /// Oldest version the sender speaks.
    pub version_min: u16,
    /// Newest version the sender speaks.
    pub version_max: u16,
    /// This connection's role.
    pub role: Role,
    /// Session id chosen by the source (ties bulk connections to the control one).
    pub session: u64,
    /// Bulk streams that will follow (control only).
    pub streams: u16,
}

/// Guest memory layout and shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    /// (guest physical address, bytes) per region.
    pub regions: Vec<(u64, u64)>,
    /// vCPUs.
    pub vcpus: u32,
}

/// End of a round.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RoundDone {
    /// Round number (0 = full copy).
    pub round: u32,
    /// Frames each bulk stream sent in this round.
    pub frames: Vec<u64>,
}

/// Part of the postcopy plan: pages the source still has to send after the
/// switch (everything else the destination holds already, or is zero).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PostcopyPlan {
    /// Runs of pending pages (this frame's share).
    pub pending: Vec<GpaPages>,
    /// True on the plan's last frame.
    pub last: bool,
    /// Pages sent on each side of a requested page.
    pub prefetch: u32,
    /// The source will send page hashes at the end: record what lands.
    pub verify: bool,
    /// The guest's count of absorbed async page faults at the pause, if the
    /// VM keeps one (the destination reports the phase's share).
    pub guest_apf_base: Option<u64>,
}

/// Part of the destination's answer to a Resume: pages it still lacks (the
/// source sends exactly these again; its memory has not changed since the
/// switch, so nothing can be stale).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PostcopyResume {
    /// Runs of missing pages (this frame's share).
    pub missing: Vec<GpaPages>,
    /// True on the last frame.
    pub last: bool,
}

/// Most runs in one PostcopyPlan or PostcopyResume frame (well under MAX_BODY).
pub const PLAN_RUNS_PER_FRAME: usize = 1 << 20;

/// `runs` cut into the shares of a message sent as several frames
/// (PostcopyPlan, PostcopyResume), each with "is it the last": always at
/// least one share, empty when there are no runs.
pub fn run_frames(runs: &[GpaPages]) -> impl Iterator<Item = (&[GpaPages], bool)> {
    let n = runs.len().div_ceil(PLAN_RUNS_PER_FRAME).max(1);
    (0..n).map(move |i| {
        let from = (i * PLAN_RUNS_PER_FRAME).min(runs.len());
        let to = ((i + 1) * PLAN_RUNS_PER_FRAME).min(runs.len());
        (&runs[from..to], i == n - 1)
    })
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Kind.
    pub kind: Kind,
    /// Body.
    pub body: Vec<u8>,
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, kind: Kind, body: &[u8]) -> io::Result<()> {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&(kind as u16).to_le_bytes());
    h[8..12].copy_from_slice(&(body.len() as u32).to_le_bytes());
    h[12..16].copy_from_slice(&crate::checksum::crc32c(body).to_le_bytes());
    w.write_all(&h)?;
    w.write_all(body)
}

/// Writes one frame whose body is the concatenation of `parts`, without
/// concatenating them in memory (Pages: count, addresses, page data).
pub fn write_frame_parts(w: &mut impl Write, kind: Kind, parts: &[&[u8]]) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let crc = parts
        .iter()
        .fold(0u32, |c, p| crate::checksum::append(c, p));
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&(kind as u16).to_le_bytes());
    h[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    w.write_all(&h)?;
    for p in parts {
        w.write_all(p)?;
    }
    Ok(())
}

/// Writes a Pages frame whose page data's crc32c the caller already knows
/// (computed page by page while each page was hot in cache).
pub fn write_pages_frame(
    w: &mut impl Write,
    count: &[u8],
    addrs: &[u8],
    data: &[u8],
    data_crc: u32,
) -> io::Result<()> {
    let head = crate::checksum::append(crate::checksum::crc32c(count), addrs);
    let crc = crate::checksum::combine(head, data_crc, data.len());
    let len = count.len() + addrs.len() + data.len();
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&(Kind::Pages as u16).to_le_bytes());
    h[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    w.write_all(&h)?;
    w.write_all(count)?;
    w.write_all(addrs)?;
    w.write_all(data)
}

/// Writes a ZeroRanges frame of runs; returns its wire bytes.
pub fn write_zero_ranges(w: &mut impl Write, ranges: &[GpaPages]) -> Result<u64, ProtocolError> {
    let body = postcard::to_stdvec(ranges).map_err(|e| ProtocolError::Malformed {
        kind: Kind::ZeroRanges,
        reason: e.to_string(),
    })?;
    write_frame(w, Kind::ZeroRanges, &body)?;
    Ok((HEADER + body.len()) as u64)
}

/// Writes known-zero holes as ZeroRanges frames (4096 runs each); returns
/// (frames, wire bytes).
pub fn write_holes(w: &mut impl Write, holes: &[GpaPages]) -> Result<(u64, u64), ProtocolError> {
    let (mut frames, mut bytes) = (0, 0);
    for chunk in holes.chunks(4096) {
        bytes += write_zero_ranges(w, chunk)?;
        frames += 1;
    }
    Ok((frames, bytes))
}

/// Writes a message with a postcard body.
pub fn send<T: serde::Serialize>(
    w: &mut impl Write,
    kind: Kind,
    msg: &T,
) -> Result<(), ProtocolError> {
    let body = postcard::to_stdvec(msg).map_err(|e| ProtocolError::Malformed {
        kind,
        reason: e.to_string(),
    })?;
    write_frame(w, kind, &body)?;
    Ok(())
}

/// Reads one frame, checking magic, kind, length limit and checksum.
pub fn read_frame(r: &mut impl Read) -> Result<Frame, ProtocolError> {
    let mut body = Vec::new();
    let kind = read_frame_into(r, &mut body)?;
    Ok(Frame { kind, body })
}

/// A frame header, checked (magic, kind, length limit) but not its body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Kind.
    pub kind: Kind,
    /// Body length in bytes (at most [`MAX_BODY`]).
    pub len: u32,
    /// crc32c of the body.
    pub crc: u32,
}

/// Reads and checks one frame header. A clean end of stream before the
/// first byte is `Closed`; in the middle, `Truncated`.
pub fn read_header(r: &mut impl Read) -> Result<Header, ProtocolError> {
    let mut h = [0u8; HEADER];
    let mut got = 0;
    while got < HEADER {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Err(ProtocolError::Closed),
            Ok(0) => return Err(ProtocolError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if magic != MAGIC {
        return Err(ProtocolError::BadMagic(magic));
    }
    let raw_kind = u16::from_le_bytes([h[4], h[5]]);
    let kind = Kind::from_u16(raw_kind).ok_or(ProtocolError::BadKind(raw_kind))?;
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if len as usize > MAX_BODY {
        return Err(ProtocolError::TooLarge(len));
    }
    let crc = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
    Ok(Header { kind, len, crc })
}

/// Maps a short read to `Truncated`.
pub fn eof_is_truncated(e: io::Error) -> ProtocolError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => ProtocolError::Truncated,
        _ => ProtocolError::Io(e),
    }
}

/// Like [`read_frame`], reusing `body`'s allocation (bulk streams read
/// thousands of 4 MiB frames: a fresh buffer each time costs page faults).
pub fn read_frame_into(r: &mut impl Read, body: &mut Vec<u8>) -> Result<Kind, ProtocolError> {
    let h = read_header(r)?;
    read_body_into(r, &h, body)?;
    Ok(h.kind)
}

/// Reads the body that `h` announced and checks its checksum (an Abort
/// frame becomes the `Aborted` error).
pub fn read_body_into(
    r: &mut impl Read,
    h: &Header,
    body: &mut Vec<u8>,
) -> Result<(), ProtocolError> {
    body.resize(h.len as usize, 0);
    r.read_exact(body).map_err(eof_is_truncated)?;
    if crate::checksum::crc32c(body) != h.crc {
        return Err(ProtocolError::Checksum {
            kind: h.kind,
            len: h.len,
        });
    }
    if h.kind == Kind::Abort {
        return Err(ProtocolError::Aborted(
            String::from_utf8_lossy(body).into_owned(),
        ));
    }
    Ok(())
}

/// Decodes a postcard body of the expected kind.
pub fn decode<T: serde::de::DeserializeOwned>(f: &Frame, want: Kind) -> Result<T, ProtocolError> {
    if f.kind != want {
        return Err(ProtocolError::Unexpected {
            got: f.kind,
            want: kind_name(want),
        });
    }
    postcard::from_bytes(&f.body).map_err(|e| ProtocolError::Malformed {
        kind: f.kind,
        reason: e.to_string(),
    })
}

/// Reads the next frame and decodes it as `want`.
pub fn recv<T: serde::de::DeserializeOwned>(
    r: &mut impl Read,
    want: Kind,
) -> Result<T, ProtocolError> {
    decode(&read_frame(r)?, want)
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Hello => "Hello",
        Kind::HelloAck => "HelloAck",
        Kind::Layout => "Layout",
        Kind::Pages => "Pages",
        Kind::ZeroRanges => "ZeroRanges",
        Kind::RoundDone => "RoundDone",
        Kind::State => "State",
        Kind::Verify => "Verify",
        Kind::Complete => "Complete",
        Kind::Started => "Started",
        Kind::Abort => "Abort",
        Kind::RoundAck => "RoundAck",
        Kind::Codec => "Codec",
        Kind::Encoded => "Encoded",
        Kind::PostcopyPlan => "PostcopyPlan",
        Kind::PageRequest => "PageRequest",
        Kind::Finished => "Finished",
        Kind::PostcopyResume => "PostcopyResume",
        Kind::ClientsPlan => "ClientsPlan",
        Kind::ClientsAnswer => "ClientsAnswer",
        Kind::Clients => "Clients",
        Kind::TimelineAsk => "TimelineAsk",
        Kind::Timeline => "Timeline",
        Kind::StoreOpen => "StoreOpen",
        Kind::StoreAck => "StoreAck",
        Kind::StoreSync => "StoreSync",
        Kind::StoreDrop => "StoreDrop",
        Kind::StoreList => "StoreList",
        Kind::StoreHeld => "StoreHeld",
        Kind::StoreClose => "StoreClose",
        Kind::StoreFetch => "StoreFetch",
        Kind::SplitPlan => "SplitPlan",
        Kind::GatherPlan => "GatherPlan",
        Kind::GatherReady => "GatherReady",
    }
}

/// Picks the version both sides speak, or says why there is none.
pub fn negotiate(h: &Hello) -> Result<u16, ProtocolError> {
    let v = h.version_max.min(VERSION_MAX);
    if v < h.version_min.max(VERSION_MIN) {
        return Err(ProtocolError::Version {
            min: h.version_min,
            max: h.version_max,
        });
    }
    Ok(v)
}

/// Encodes a Pages body: `count:u32 | count x gpa:u64 | count x 4096 bytes`.
pub fn encode_pages(gpas: &[u64], data: &[u8]) -> Vec<u8> {
    debug_assert_eq!(data.len(), gpas.len() * PAGE);
    let mut b = Vec::with_capacity(4 + gpas.len() * (8 + PAGE));
    b.extend_from_slice(&(gpas.len() as u32).to_le_bytes());
    for g in gpas {
        b.extend_from_slice(&g.to_le_bytes());
    }
    b.extend_from_slice(data);
    b
}

/// Splits a Pages body into (addresses, page data), checking its shape.
pub fn decode_pages(body: &[u8]) -> Result<(Vec<u64>, &[u8]), ProtocolError> {
    let bad = |reason: String| ProtocolError::Malformed {
        kind: Kind::Pages,
        reason,
    };
    if body.len() < 4 {
        return Err(bad("shorter than its count".into()));
    }
    let n = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    if n > MAX_BATCH || body.len() != 4 + n * (8 + PAGE) {
        return Err(bad(format!("{n} pages do not match {} bytes", body.len())));
    }
    let gpas = body[4..4 + 8 * n]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    Ok((gpas, &body[4 + 8 * n..]))
}

/// Hash of one page for end-to-end verification.
pub fn page_hash(page: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pages_frame_with_a_precomputed_data_crc_reads_back() {
        let data: Vec<u8> = (0..2 * PAGE).map(|i| (i * 7) as u8).collect();
        let addrs = [0x1000u64.to_le_bytes(), 0x5000u64.to_le_bytes()].concat();
        let crc = data.chunks(PAGE).fold(0, crate::checksum::append);
        let mut buf = Vec::new();
        write_pages_frame(&mut buf, &2u32.to_le_bytes(), &addrs, &data, crc).unwrap();
        let f = read_frame(&mut &buf[..]).unwrap();
        assert_eq!(f.body, encode_pages(&[0x1000, 0x5000], &data));
    }

    #[test]
    fn a_frame_written_in_parts_reads_back_whole() {
        let mut a = Vec::new();
        write_frame_parts(&mut a, Kind::Pages, &[b"ab", b"", b"cde"]).unwrap();
        let mut b = Vec::new();
        write_frame(&mut b, Kind::Pages, b"abcde").unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn frames_round_trip() {
        let mut buf = Vec::new();
        let hello = Hello {
            version_min: 1,
            version_max: 1,
            role: Role::Bulk(2),
            session: 9,
            streams: 0,
        };
        send(&mut buf, Kind::Hello, &hello).unwrap();
        let gpas = [0x1000u64, 0x5000];
        let data = vec![7u8; 2 * PAGE];
        write_frame(&mut buf, Kind::Pages, &encode_pages(&gpas, &data)).unwrap();
        let mut r = &buf[..];
        assert_eq!(recv::<Hello>(&mut r, Kind::Hello).unwrap(), hello);
        let f = read_frame(&mut r).unwrap();
        let (g, d) = decode_pages(&f.body).unwrap();
        assert_eq!((g.as_slice(), d), (&gpas[..], &data[..]));
        assert!(matches!(read_frame(&mut r), Err(ProtocolError::Closed)));
    }

    #[test]
    fn corrupt_truncated_and_foreign_streams_are_refused() {
        let mut buf = Vec::new();
        send(
            &mut buf,
            Kind::Layout,
            &Layout {
                regions: vec![(0, 4096)],
                vcpus: 1,
            },
        )
        .unwrap();
        let mut flipped = buf.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(
            read_frame(&mut &flipped[..]),
            Err(ProtocolError::Checksum { .. })
        ));
        assert!(matches!(
            read_frame(&mut &buf[..buf.len() - 1]),
            Err(ProtocolError::Truncated)
        ));
        assert!(matches!(
            read_frame(&mut &buf[..5]),
            Err(ProtocolError::Truncated)
        ));
        assert!(matches!(
            read_frame(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]),
            Err(ProtocolError::BadMagic(_))
        ));
        let mut big = buf.clone();
        big[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            read_frame(&mut &big[..]),
            Err(ProtocolError::TooLarge(_))
        ));
        let mut kind = buf.clone();
        kind[4] = 99;
        assert!(matches!(
            read_frame(&mut &kind[..]),
            Err(ProtocolError::BadKind(99))
        ));
        let mut r = &buf[..];
        assert!(matches!(
            recv::<Hello>(&mut r, Kind::Hello),
            Err(ProtocolError::Unexpected { .. })
        ));
        assert!(decode_pages(&[1, 0, 0, 0, 1]).is_err());
        assert!(decode_pages(&[0xff, 0xff, 0, 0]).is_err());
        let mut a = Vec::new();
        write_frame(&mut a, Kind::Abort, b"disk full").unwrap();
        assert!(
            matches!(read_frame(&mut &a[..]), Err(ProtocolError::Aborted(m)) if m == "disk full")
        );
    }

    #[test]
    fn runs_go_out_in_marked_frames() {
        let runs: Vec<GpaPages> = (0..PLAN_RUNS_PER_FRAME as u64 + 1)
            .map(|i| GpaPages::new(i * 8192, 1))
            .collect();
        let shares: Vec<(usize, bool)> = run_frames(&runs).map(|(r, l)| (r.len(), l)).collect();
        assert_eq!(shares, [(PLAN_RUNS_PER_FRAME, false), (1, true)]);
        let shares: Vec<(usize, bool)> =
            run_frames(&runs[..3]).map(|(r, l)| (r.len(), l)).collect();
        assert_eq!(shares, [(3, true)]);
        assert_eq!(
            run_frames(&[])
                .map(|(r, l)| (r.len(), l))
                .collect::<Vec<_>>(),
            [(0, true)]
        );
    }

    #[test]
    fn versions_are_negotiated() {
        let h = |min, max| Hello {
            version_min: min,
            version_max: max,
            role: Role::Control,
            session: 0,
            streams: 1,
        };
        assert_eq!(negotiate(&h(1, 9)).unwrap(), VERSION_MAX);
        assert_eq!(negotiate(&h(1, 1)).unwrap(), 1);
        assert_eq!(negotiate(&h(2, 2)).unwrap(), 2);
        assert_eq!(negotiate(&h(2, 3)).unwrap(), 3);
        assert_eq!(negotiate(&h(3, 4)).unwrap(), VERSION_RESUME);
        assert!(matches!(
            negotiate(&h(VERSION_MAX + 1, VERSION_MAX + 2)),
            Err(ProtocolError::Version { .. })
        ));
    }
}
