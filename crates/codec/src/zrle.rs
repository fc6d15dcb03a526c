//! Zero-run encoding of one 256-byte chunk, the last stage of rle and xbzrle.
//!
//! A non-zero byte is copied; a run of k zero bytes (1..=256, always maximal)
//! becomes the two bytes `0x00, k-1`. An encoding of 256 bytes or more is not
//! produced: the caller stores the chunk verbatim instead.

use crate::error::ChunkError;
use crate::sizes::CHUNK;

/// Longest encoding [`encode`] produces; one byte more and the chunk overflows.
pub const MAX_ENCODED: usize = CHUNK - 1;

/// Encodes `src` into `out`, returning the length, or `None` when the encoding
/// would be [`CHUNK`] bytes or longer (the chunk overflows).
pub fn encode(src: &[u8; CHUNK], out: &mut [u8; CHUNK]) -> Option<usize> {
    let mut i = 0;
    let mut o = 0;
    while i < CHUNK {
        let b = src[i];
        if b != 0 {
            if o + 1 > MAX_ENCODED {
                return None;
            }
            out[o] = b;
            o += 1;
            i += 1;
        } else {
            let run = zero_run(src, i);
            if o + 2 > MAX_ENCODED {
                return None;
            }
            out[o] = 0;
            // run is 1..=CHUNK, so run - 1 fits a byte.
            out[o + 1] = (run - 1) as u8;
            o += 2;
            i += run;
        }
    }
    Some(o)
}

/// Length of the zero run starting at `start` (where src[start] == 0).
fn zero_run(src: &[u8; CHUNK], start: usize) -> usize {
    let mut i = start;
    // Eight bytes at a time: long runs (the common case in deltas) are cheap.
    while i + 8 <= CHUNK {
        let mut word = [0u8; 8];
        word.copy_from_slice(&src[i..i + 8]);
        let word = u64::from_le_bytes(word);
        if word != 0 {
            return i - start + (word.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < CHUNK && src[i] == 0 {
        i += 1;
    }
    i - start
}

/// Decodes a zero-run encoding into exactly 256 bytes.
///
/// Accepts any well-formed input, also non-maximal runs the encoder never writes;
/// fails when the input is truncated or does not expand to exactly 256 bytes.
pub fn decode(src: &[u8], out: &mut [u8; CHUNK]) -> Result<(), ChunkError> {
    let mut i = 0;
    let mut o = 0;
    while let Some(&b) = src.get(i) {
        if b != 0 {
            let slot = out.get_mut(o).ok_or(ChunkError::Overrun)?;
            *slot = b;
            o += 1;
            i += 1;
        } else {
            let run = usize::from(*src.get(i + 1).ok_or(ChunkError::Truncated)?) + 1;
            out.get_mut(o..o + run).ok_or(ChunkError::Overrun)?.fill(0);
            o += run;
            i += 2;
        }
    }
    if o != CHUNK {
        return Err(ChunkError::Short(o));
    }
    Ok(())
}
