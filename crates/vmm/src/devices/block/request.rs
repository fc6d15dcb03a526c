//! One virtio-blk request, parsed from its descriptor chain and checked
//! against guest memory and the disk before any I/O starts.
//!
//! Layout (virtio 1.x, 5.2.6; any split of the bytes across descriptors
//! is accepted, as the spec's VERSION_1 requires): device-readable bytes
//! first, a 16-byte header (`type: u32, reserved: u32, sector: u64`), then
//! the data of a write (or the segments of a discard / write-zeroes); then
//! device-writable bytes, the data a read fills, and last one status byte.
//!
//! Everything in a chain is the guest's and so untrusted: a chain that is
//! cut short (a bad `next` index, a loop caught by the queue-size bound,
//! an unreadable descriptor), readable bytes after writable ones, an
//! address outside RAM, a length that is not whole sectors or runs past
//! the disk's end, more data than [`MAX_DATA`] or more pieces than
//! [`MAX_SEGS`] all give a [`BadRequest`]: the guest gets an I/O error
//! status if the chain has a status byte to write, and the device carries
//! on either way.

use virtio_queue::desc::split::Descriptor;
use vm_memory::{GuestAddress, GuestMemoryBackend};

use super::backend::HostSeg;
use super::memory::Mem;
use super::spec::SECTOR;

/// Request types (virtio_blk.h).
pub mod kind {
    /// Read.
    pub const IN: u32 = 0;
    /// Write.
    pub const OUT: u32 = 1;
    /// Flush.
    pub const FLUSH: u32 = 4;
    /// The device's id string.
    pub const GET_ID: u32 = 8;
    /// Discard sectors.
    pub const DISCARD: u32 = 11;
    /// Zero sectors.
    pub const WRITE_ZEROES: u32 = 13;
}

/// Status bytes.
pub mod status {
    /// Done.
    pub const OK: u8 = 0;
    /// I/O error (or a malformed request).
    pub const IOERR: u8 = 1;
    /// A request type the device does not do.
    pub const UNSUPP: u8 = 2;
}

/// Largest data of one read or write (advertised as size_max × seg_max).
pub const MAX_DATA: u64 = 1 << 20;
/// Most pieces of data in one request (advertised as seg_max).
pub const MAX_SEGS: usize = 128;
/// Bytes of the id a GET_ID returns.
pub const ID_BYTES: usize = 20;
/// Most descriptors in one chain, whatever the queue size.
pub const MAX_DESCS: usize = MAX_SEGS + 4;
/// Bytes of one discard / write-zeroes segment.
const DZ_SEG: u64 = 16;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Read `len` bytes at `sector` into the data.
    Read,
    /// Write the data at `sector`.
    Write,
    /// Make completed writes durable.
    Flush,
    /// Write the device id into the data.
    GetId,
    /// Discard (`zero: false`) or zero a range.
    Zero {
        /// Write-zeroes (true) or discard (false).
        zero: bool,
        /// First sector.
        sector: u64,
        /// Sectors.
        sectors: u64,
    },
    /// A type the device does not know.
    Unsupported(u32),
}

/// A request ready for the backend.
#[derive(Debug)]
pub struct Request {
    /// What to do.
    pub op: Op,
    /// First sector (reads and writes).
    pub sector: u64,
    /// Guest memory of the data (reads and writes, GET_ID).
    pub data: Vec<HostSeg>,
    /// Bytes of data.
    pub len: u64,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain is not a request the device will do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    /// The chain ended early: a `next` out of the table, a loop, an
    /// unreadable descriptor or more than [`MAX_DESCS`] of them.
    #[error("descriptor chain broken (bad next index, loop, or too long)")]
    BrokenChain,
    /// No writable byte at the end for the status.
    #[error("no status byte")]
    NoStatus,
    /// A device-readable descriptor after a writable one.
    #[error("readable descriptor after a writable one")]
    Layout,
    /// Fewer than 16 readable bytes.
    #[error("header shorter than 16 bytes")]
    ShortHeader,
    /// A buffer outside guest RAM (or across two RAM ranges).
    #[error("buffer at {0:#x} is outside guest RAM")]
    OutsideRam(u64),
    /// Data that is not whole sectors.
    #[error("data of {0} bytes is not whole sectors")]
    Unaligned(u64),
    /// Sectors past the disk's end.
    #[error("sectors {first}..{end} run past the disk's {capacity} sectors")]
    PastEnd {
        /// First sector.
        first: u64,
        /// One past the last.
        end: u64,
        /// Sectors on the disk.
        capacity: u64,
    },
    /// More data or pieces than the device takes at once.
    #[error("request too large ({0} bytes)")]
    TooLarge(u64),
    /// The wrong direction or size of data for the type.
    #[error("data of the wrong direction or size for the request type")]
    BadData,
}

/// A failed parse: why, and where its status byte goes if it has one.
#[derive(Debug)]
pub struct Refused {
    /// Why.
    pub why: BadRequest,
    /// The status byte, if the chain has one to write.
    pub status: Option<GuestAddress>,
}

/// (guest address, length) of one piece of a byte stream.
type Piece = (u64, u64);

/// Takes `n` bytes off the front of `pieces`.
fn take_front(pieces: &mut Vec<Piece>, mut n: u64) -> Vec<Piece> {
    let mut out = Vec::new();
    while n > 0 && !pieces.is_empty() {
        let (a, l) = pieces[0];
        if l <= n {
            out.push((a, l));
            pieces.remove(0);
            n -= l;
        } else {
            out.push((a, n));
            pieces[0] = (a + n, l - n);
            n = 0;
        }
    }
    out
}

fn host(mem: &Mem, (addr, len): Piece) -> Result<HostSeg, BadRequest> {
    let slice = GuestMemoryBackend::get_slice(mem, GuestAddress(addr), len as usize)
        .map_err(|_| BadRequest::OutsideRam(addr))?;
    Ok(HostSeg {
        ptr: slice.ptr_guard_mut().as_ptr(),
        len: len as usize,
    })
}

fn read_bytes(mem: &Mem, pieces: &[Piece], out: &mut [u8]) -> Result<(), BadRequest> {
    let mut at = 0;
    for &(a, l) in pieces {
        let s = host(mem, (a, l))?;
        // SAFETY: `s` is `l` bytes of live guest RAM (checked by `host`);
        // the guest may change them meanwhile, which only changes what we
        // read: bytes are copied once and then checked.
        unsafe { std::ptr::copy_nonoverlapping(s.ptr, out[at..].as_mut_ptr(), l as usize) };
        at += l as usize;
    }
    Ok(())
}

/// Parses one chain (its descriptors in order) for a disk of `capacity`
/// sectors.
pub fn parse(
    chain: impl IntoIterator<Item = Descriptor>,
    mem: &Mem,
    capacity: u64,
) -> Result<Request, Refused> {
    let mut readable: Vec<Piece> = Vec::new();
    let mut writable: Vec<Piece> = Vec::new();
    let mut count = 0usize;
    let mut cut = false;
    let mut layout_bad = false;
    for d in chain {
        count += 1;
        if count > MAX_DESCS {
            cut = true;
            break;
        }
        if d.is_write_only() {
            if d.len() > 0 {
                writable.push((d.addr().0, u64::from(d.len())));
            }
        } else {
            if !writable.is_empty() {
                layout_bad = true;
            }
            if d.len() > 0 {
                readable.push((d.addr().0, u64::from(d.len())));
            }
        }
        // The iterator stops early on a bad descriptor: a last one that
        // still points on means the chain was cut.
        cut = d.has_next();
    }
    // The status byte: the last writable byte.
    let status = writable.last().map(|&(a, l)| GuestAddress(a + l - 1));
    let status = match status {
        Some(s) if host(mem, (s.0, 1)).is_ok() => Some(s),
        Some(_) => None,
        None => None,
    };
    let refuse = |why| Refused { why, status };
    if cut || count == 0 {
        return Err(refuse(BadRequest::BrokenChain));
    }
    let Some(status_addr) = status else {
        return Err(refuse(if writable.is_empty() {
            BadRequest::NoStatus
        } else {
            BadRequest::OutsideRam(writable.last().map_or(0, |w| w.0))
        }));
    };
    if layout_bad {
        return Err(refuse(BadRequest::Layout));
    }
    if let Some(last) = writable.last_mut() {
        last.1 -= 1;
        if last.1 == 0 {
            writable.pop();
        }
    }
    let mut header = [0u8; 16];
    let readable_len: u64 = readable.iter().map(|p| p.1).sum();
    if readable_len < 16 {
        return Err(refuse(BadRequest::ShortHeader));
    }
    let head = take_front(&mut readable, 16);
    read_bytes(mem, &head, &mut header).map_err(refuse)?;
    let ty = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
    let out_len: u64 = readable.iter().map(|p| p.1).sum();
    let in_len: u64 = writable.iter().map(|p| p.1).sum();
    let segs = |pieces: &[Piece]| -> Result<Vec<HostSeg>, BadRequest> {
        if pieces.len() > MAX_SEGS {
            return Err(BadRequest::TooLarge(pieces.iter().map(|p| p.1).sum()));
        }
        pieces.iter().map(|p| host(mem, *p)).collect()
    };
    let rw = |len: u64, pieces: &[Piece]| -> Result<Vec<HostSeg>, BadRequest> {
        if len > MAX_DATA {
            return Err(BadRequest::TooLarge(len));
        }
        if !len.is_multiple_of(SECTOR) {
            return Err(BadRequest::Unaligned(len));
        }
        let end = sector.checked_add(len / SECTOR);
        match end {
            Some(end) if end <= capacity => {}
            _ => {
                return Err(BadRequest::PastEnd {
                    first: sector,
                    end: end.unwrap_or(u64::MAX),
                    capacity,
                })
            }
        }
        segs(pieces)
    };
    let (op, data, len) = match ty {
        kind::IN => {
            if out_len != 0 {
                return Err(refuse(BadRequest::BadData));
            }
            (Op::Read, rw(in_len, &writable).map_err(refuse)?, in_len)
        }
        kind::OUT => {
            if in_len != 0 {
                return Err(refuse(BadRequest::BadData));
            }
            (Op::Write, rw(out_len, &readable).map_err(refuse)?, out_len)
        }
        kind::FLUSH => (Op::Flush, Vec::new(), 0),
        kind::GET_ID => {
            if in_len < ID_BYTES as u64 {
                return Err(refuse(BadRequest::BadData));
            }
            let mut w = writable.clone();
            let id = take_front(&mut w, ID_BYTES as u64);
            (Op::GetId, segs(&id).map_err(refuse)?, ID_BYTES as u64)
        }
        kind::DISCARD | kind::WRITE_ZEROES => {
            // One segment per request (max_*_seg = 1 in the config).
            if out_len != DZ_SEG || in_len != 0 {
                return Err(refuse(BadRequest::BadData));
            }
            let mut seg = [0u8; 16];
            read_bytes(mem, &readable, &mut seg).map_err(refuse)?;
            let first = u64::from_le_bytes(seg[0..8].try_into().unwrap_or_default());
            let n = u64::from(u32::from_le_bytes(
                seg[8..12].try_into().unwrap_or_default(),
            ));
            let end = first.checked_add(n).filter(|e| *e <= capacity);
            if end.is_none() {
                return Err(refuse(BadRequest::PastEnd {
                    first,
                    end: first.saturating_add(n),
                    capacity,
                }));
            }
            let zero = ty == kind::WRITE_ZEROES;
            (
                Op::Zero {
                    zero,
                    sector: first,
                    sectors: n,
                },
                Vec::new(),
                0,
            )
        }
        other => (Op::Unsupported(other), Vec::new(), 0),
    };
    Ok(Request {
        op,
        sector,
        data,
        len,
        status: status_addr,
    })
}
