//! The chunked page layout shared by rle, xbzrle and dedup: 16 little-endian
//! u16 chunk headers, then the 16 chunk payloads in order.
//!
//! Headers: `HDR_OVERFLOW` (0x8000) = chunk verbatim, 256 bytes; 1..=255 = a
//! zero-run encoded payload of that many bytes (rle, xbzrle); `HDR_DEDUP_REF`
//! (0x4004) = a 4-byte little-endian chunk-cache reference (dedup). Every other
//! value is invalid.

use crate::error::{ChunkError, CodecError};
use crate::page::{chunks, chunks_mut};
use crate::sizes::{CHUNK, CHUNKS_PER_PAGE, PAGE};

/// Bytes of chunk headers at the start of a chunked page.
pub const CHUNK_HEADERS: usize = 2 * CHUNKS_PER_PAGE;
/// Header bit 15: the chunk is stored verbatim (the header is exactly this value).
pub const HDR_OVERFLOW: u16 = 0x8000;
/// Header of a dedup reference: bit 14 plus the payload length 4.
pub const HDR_DEDUP_REF: u16 = 0x4000 | 4;
/// Header bits holding the length of a zero-run encoded payload (1..=255).
pub const HDR_LEN_MASK: u16 = 0x00ff;

/// How the per-chunk coder stored one chunk.
pub(crate) enum ChunkOut {
    /// The first n bytes of the scratch buffer.
    Encoded(usize),
    /// The chunk itself.
    Verbatim,
    /// A chunk-cache reference.
    Ref(u32),
}

/// Appends the chunked form of `page` to `out`. Returns false, with `out` as it
/// was, when that form would not be smaller than a page (the page goes Raw).
pub(crate) fn encode_page(
    page: &[u8; PAGE],
    out: &mut Vec<u8>,
    mut code: impl FnMut(usize, &[u8; CHUNK], &mut [u8; CHUNK]) -> ChunkOut,
) -> bool {
    let start = out.len();
    out.extend_from_slice(&[0; CHUNK_HEADERS]);
    let mut headers = [0u16; CHUNKS_PER_PAGE];
    let mut scratch = [0u8; CHUNK];
    for (i, (chunk, header)) in chunks(page).zip(&mut headers).enumerate() {
        *header = match code(i, chunk, &mut scratch) {
            ChunkOut::Encoded(n) => {
                let n = n.min(CHUNK - 1);
                out.extend_from_slice(&scratch[..n]);
                n as u16
            }
            ChunkOut::Verbatim => {
                out.extend_from_slice(chunk);
                HDR_OVERFLOW
            }
            ChunkOut::Ref(index) => {
                out.extend_from_slice(&index.to_le_bytes());
                HDR_DEDUP_REF
            }
        };
        // Give up as soon as the page can no longer beat Raw.
        if out.len() - start >= PAGE {
            out.truncate(start);
            return false;
        }
    }
    for (slot, header) in out[start..start + CHUNK_HEADERS]
        .chunks_exact_mut(2)
        .zip(headers)
    {
        slot.copy_from_slice(&header.to_le_bytes());
    }
    true
}

/// Payload bytes a chunk header announces, `None` for an invalid header.
fn payload_len(header: u16) -> Option<usize> {
    match header {
        HDR_OVERFLOW => Some(CHUNK),
        HDR_DEDUP_REF => Some(4),
        1..=HDR_LEN_MASK => Some(usize::from(header)),
        _ => None,
    }
}

/// The chunk-cache references of a dedup page payload, read ahead of
/// decoding so their cache lines can be fetched together. Stops at the first
/// header or length that does not parse; [`decode_page`] reports it.
pub(crate) fn dedup_refs(src: &[u8]) -> impl Iterator<Item = u32> + '_ {
    let (heads, body) = src.split_at_checked(CHUNK_HEADERS).unwrap_or_default();
    let mut at = 0;
    heads
        .chunks_exact(2)
        .map_while(move |head| {
            let header = u16::from_le_bytes([head[0], head[1]]);
            let start = at;
            at += payload_len(header)?;
            Some((header, body.get(start..at)?))
        })
        .filter_map(|(header, payload)| match (header, payload) {
            (HDR_DEDUP_REF, &[a, b, c, d]) => Some(u32::from_le_bytes([a, b, c, d])),
            _ => None,
        })
}

/// Decodes a chunked page payload into `out`. Verbatim chunks are copied here;
/// every other chunk goes to `decode(chunk, header, payload, out)`, which
/// rejects headers its method does not use. The headers must account for the
/// payload exactly.
pub(crate) fn decode_page(
    page: usize,
    src: &[u8],
    out: &mut [u8; PAGE],
    mut decode: impl FnMut(usize, u16, &[u8], &mut [u8; CHUNK]) -> Result<(), CodecError>,
) -> Result<(), CodecError> {
    let length_error = |expected| CodecError::ChunkedLength {
        page,
        expected,
        actual: src.len(),
    };
    let (heads, mut rest) = src
        .split_at_checked(CHUNK_HEADERS)
        .ok_or_else(|| length_error(CHUNK_HEADERS))?;
    let mut expected = CHUNK_HEADERS;
    for (chunk, (head, dst)) in heads.chunks_exact(2).zip(chunks_mut(out)).enumerate() {
        let header = u16::from_le_bytes([head[0], head[1]]);
        let len = payload_len(header).ok_or(CodecError::Chunk {
            page,
            chunk,
            source: ChunkError::BadHeader(header),
        })?;
        expected += len;
        let (body, tail) = rest
            .split_at_checked(len)
            .ok_or_else(|| length_error(expected))?;
        rest = tail;
        if header == HDR_OVERFLOW {
            dst.copy_from_slice(body);
        } else {
            decode(chunk, header, body, dst)?;
        }
    }
    if !rest.is_empty() {
        return Err(length_error(expected));
    }
    Ok(())
}
