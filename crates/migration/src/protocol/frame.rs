//! The frame: the one envelope every message travels in, and the only code
//! that reads or writes its header.
//!
//! ```text
//! offset  0        4      6      8           12       16
//!         +--------+------+------+-----------+--------+------------------+
//!         | magic  | kind | flags| len       | crc32c | body             |
//!         | u32    | u16  | u16  | u32       | u32    | len bytes        |
//!         +--------+------+------+-----------+--------+------------------+
//!          "FRYM"   Kind   0 or   <= MAX_BODY CRC-32C   postcard, or raw
//!                        SEALED (32 MiB)    of body   (Pages)
//! ```
//!
//! All integers are little-endian. Reading checks, in order: magic, kind,
//! flags, length limit (the header alone, [`read_header`]), then the body's
//! checksum ([`read_body_into`]); an Abort frame comes back as the
//! `Aborted` error. One flag is defined, [`SEALED`]: a Pages frame with no
//! checksum (field 0), sent only over a link that seals every byte (TLS),
//! where a CRC would check nothing the record's AEAD tag does not; only
//! the bulk page path reads one, and only from such a link (pagein.rs). Bulk streams read the header first so that Pages land
//! straight in guest memory (pagein.rs) instead of a buffer.

use std::io::{self, Read, Write};

use super::{Kind, ProtocolError};

/// Frame magic "FRYM".
pub const MAGIC: u32 = 0x4d59_5246;
/// Bytes of frame header.
pub const HEADER: usize = 16;
/// Largest frame body accepted from a peer.
pub const MAX_BODY: usize = 32 << 20;
/// Frame flag: the body has no checksum (the field is 0) because the link
/// seals every byte (TLS records, each with its AEAD tag). Pages frames
/// only, from protocol v10 ([`VERSION_SEALED_PAGES`](super::VERSION_SEALED_PAGES)).
pub const SEALED: u16 = 1;

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Kind.
    pub kind: Kind,
    /// Body.
    pub body: Vec<u8>,
}

/// A frame header, checked (magic, kind, flags, length limit) but not its
/// body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Kind.
    pub kind: Kind,
    /// Body length in bytes (at most [`MAX_BODY`]).
    pub len: u32,
    /// crc32c of the body (0 when `sealed`).
    pub crc: u32,
    /// The body has no checksum: the link seals it ([`SEALED`]).
    pub sealed: bool,
}

/// The header of a frame of `kind` whose body is `len` bytes with crc32c
/// `crc` (flags 0).
fn encode_header(kind: Kind, len: usize, crc: u32) -> [u8; HEADER] {
    encode_header_flagged(kind, 0, len, crc)
}

fn encode_header_flagged(kind: Kind, flags: u16, len: usize, crc: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&(kind as u16).to_le_bytes());
    h[6..8].copy_from_slice(&flags.to_le_bytes());
    h[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, kind: Kind, body: &[u8]) -> io::Result<()> {
    w.write_all(&encode_header(
        kind,
        body.len(),
        crate::checksum::crc32c(body),
    ))?;
    w.write_all(body)
}

/// Writes one frame whose body is the concatenation of `parts`, without
/// concatenating them in memory (Pages: count, addresses, page data).
pub fn write_frame_parts(w: &mut impl Write, kind: Kind, parts: &[&[u8]]) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let crc = parts
        .iter()
        .fold(0u32, |c, p| crate::checksum::append(c, p));
    w.write_all(&encode_header(kind, len, crc))?;
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
    w.write_all(&encode_header(Kind::Pages, len, crc))?;
    w.write_all(count)?;
    w.write_all(addrs)?;
    w.write_all(data)
}

/// Writes a [`SEALED`] Pages frame: no checksum, for a link that seals
/// every byte (TLS); the reader refuses one from any other link.
pub fn write_sealed_pages_frame(
    w: &mut impl Write,
    count: &[u8],
    addrs: &[u8],
    data: &[u8],
) -> io::Result<()> {
    let len = count.len() + addrs.len() + data.len();
    w.write_all(&encode_header_flagged(Kind::Pages, SEALED, len, 0))?;
    w.write_all(count)?;
    w.write_all(addrs)?;
    w.write_all(data)
}

/// A writer that may overwrite what it is given to write, to spare a copy
/// (a TLS link seals the buffer in place); any other writes it as it is.
pub trait SpendingWrite: Write {
    /// Writes all of `data`; afterwards `data` may hold anything.
    fn write_all_spending(&mut self, data: &mut [u8]) -> io::Result<()> {
        self.write_all(data)
    }
}

impl SpendingWrite for Vec<u8> {}

/// [`write_sealed_pages_frame`] whose page data the writer may spend.
pub fn write_sealed_pages_frame_spending(
    w: &mut impl SpendingWrite,
    count: &[u8],
    addrs: &[u8],
    data: &mut [u8],
) -> io::Result<()> {
    let len = count.len() + addrs.len() + data.len();
    w.write_all(&encode_header_flagged(Kind::Pages, SEALED, len, 0))?;
    w.write_all(count)?;
    w.write_all(addrs)?;
    w.write_all_spending(data)
}

/// Reads one frame, checking magic, kind, length limit and checksum.
pub fn read_frame(r: &mut impl Read) -> Result<Frame, ProtocolError> {
    let mut body = Vec::new();
    let kind = read_frame_into(r, &mut body)?;
    Ok(Frame { kind, body })
}

/// Reads and checks one frame header (magic, kind, flags 0, length
/// limit). A clean end of stream before the
/// first byte is `Closed`; in the middle, `Truncated`. A TLS record where
/// a frame should start (a TLS peer's alert to this plaintext side) is
/// `SpeaksTls`.
pub fn read_header(r: &mut impl Read) -> Result<Header, ProtocolError> {
    let mut h = [0u8; HEADER];
    let mut got = 0;
    while got < HEADER {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Err(ProtocolError::Closed),
            Ok(0) if looks_like_tls(&h[..got]) => return Err(ProtocolError::SpeaksTls),
            Ok(0) => return Err(ProtocolError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if magic != MAGIC {
        if looks_like_tls(&h) {
            return Err(ProtocolError::SpeaksTls);
        }
        return Err(ProtocolError::BadMagic(magic));
    }
    let raw_kind = u16::from_le_bytes([h[4], h[5]]);
    let kind = Kind::from_u16(raw_kind).ok_or(ProtocolError::BadKind(raw_kind))?;
    // Any other flag, or SEALED on another kind or with a checksum, is from
    // a peer this build does not understand, or corrupt.
    let flags = u16::from_le_bytes([h[6], h[7]]);
    let crc = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
    let sealed = match flags {
        0 => false,
        SEALED if kind == Kind::Pages && crc == 0 => true,
        _ => return Err(ProtocolError::BadFlags { kind, flags }),
    };
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if len as usize > MAX_BODY {
        return Err(ProtocolError::TooLarge(len));
    }
    Ok(Header {
        kind,
        len,
        crc,
        sealed,
    })
}

/// True if `b` begins a TLS record: a handshake (22) or an alert (21),
/// record version 3.x. A frame starts with "FRYM", never with these.
fn looks_like_tls(b: &[u8]) -> bool {
    matches!(b, [0x15 | 0x16, 0x03, minor, ..] if *minor <= 0x04)
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

/// The first piece of a body read before more of it has arrived.
const BODY_STEP: usize = 64 << 10;

/// Reads the body that `h` announced and checks its checksum (an Abort
/// frame becomes the `Aborted` error; a sealed frame, which has none, is
/// refused: only the bulk page path takes one, knowing its link). The buffer grows with what
/// arrives, each piece at most as large as what came before it (64 KiB
/// first): a peer that announces 32 MiB and sends nothing costs 64 KiB,
/// not 32 MiB. A reused buffer that is large enough already is filled in
/// one read, as before.
pub fn read_body_into(
    r: &mut impl Read,
    h: &Header,
    body: &mut Vec<u8>,
) -> Result<(), ProtocolError> {
    if h.sealed {
        return Err(ProtocolError::Unsealed { kind: h.kind });
    }
    let len = h.len as usize;
    body.clear();
    while body.len() < len {
        let have = body.len();
        let step = (len - have).min(have.max(BODY_STEP).max(body.capacity() - have));
        body.resize(have + step, 0);
        r.read_exact(&mut body[have..]).map_err(eof_is_truncated)?;
    }
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

/// A sealed Pages frame of one page at 0x1000 filled with `byte` (tests).
#[cfg(test)]
pub(crate) fn one_sealed_page(byte: u8) -> Vec<u8> {
    let mut wire = Vec::new();
    let data = vec![byte; crate::protocol::PAGE];
    write_sealed_pages_frame(
        &mut wire,
        &1u32.to_le_bytes(),
        &0x1000u64.to_le_bytes(),
        &data,
    )
    .expect("a Vec takes any frame");
    wire
}

#[cfg(test)]
mod tests;
