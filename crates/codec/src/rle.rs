//! GM-RLE for one chunk: byte deltas within the chunk, then zero-run encoding.
//!
//! `d[0] = b[0]`, `d[i] = b[i] - b[i-1]` (wrapping); decoding expands the runs
//! and takes the prefix sum. Constant and slowly varying chunks become long zero
//! runs.

use crate::error::ChunkError;
use crate::sizes::CHUNK;
use crate::zrle;

/// Byte deltas of a chunk: `d[0] = b[0]`, `d[i] = b[i].wrapping_sub(b[i-1])`.
pub fn delta(src: &[u8; CHUNK], out: &mut [u8; CHUNK]) {
    out[0] = src[0];
    for ((d, &b), &prev) in out[1..].iter_mut().zip(&src[1..]).zip(&src[..CHUNK - 1]) {
        *d = b.wrapping_sub(prev);
    }
}

/// Undoes [`delta`] in place (wrapping prefix sum).
pub fn undelta(buf: &mut [u8; CHUNK]) {
    let mut acc = 0u8;
    for b in buf.iter_mut() {
        acc = acc.wrapping_add(*b);
        *b = acc;
    }
}

/// Encodes one chunk into `out`, returning the length, or `None` when the chunk
/// overflows (its encoding would be 256 bytes or more; it goes verbatim).
pub fn encode_chunk(src: &[u8; CHUNK], out: &mut [u8; CHUNK]) -> Option<usize> {
    let mut d = [0u8; CHUNK];
    delta(src, &mut d);
    zrle::encode(&d, out)
}

/// Decodes one chunk payload (not a verbatim one) into `out`.
pub fn decode_chunk(src: &[u8], out: &mut [u8; CHUNK]) -> Result<(), ChunkError> {
    zrle::decode(src, out)?;
    undelta(out);
    Ok(())
}
