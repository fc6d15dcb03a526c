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
    // Most chunks that overflow are dense (random data, text): the length is
    // counted first with whole-chunk passes the compiler vectorises, so they
    // are refused without walking them byte by byte.
    if !fits(src) {
        return None;
    }
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

/// Length of the encoding of `src`: one byte per non-zero byte and two per
/// zero run (runs are maximal: a run of 256 is the whole chunk, so none is split).
pub fn encoded_len(src: &[u8; CHUNK]) -> usize {
    let non_zero = non_zero(src);
    if non_zero > MAX_ENCODED {
        return non_zero;
    }
    non_zero + 2 * runs(src)
}

/// Number of zero runs of `src`.
fn runs(src: &[u8; CHUNK]) -> usize {
    // Counted in u8 lanes so the compiler adds 16 bytes at a time; a chunk
    // has at most 128 runs (each but the first follows a non-zero byte), so
    // the count never wraps. A run starts at a zero byte that is first or follows a non-zero byte.
    let later_starts = src[1..]
        .iter()
        .zip(&src[..CHUNK - 1])
        .fold(0u8, |n, (&b, &prev)| {
            n.wrapping_add(u8::from(b == 0) & u8::from(prev != 0))
        });
    usize::from(later_starts) + usize::from(src[0] == 0)
}

/// Whether the encoding of `src` is at most [`MAX_ENCODED`] bytes.
fn fits(src: &[u8; CHUNK]) -> bool {
    // Runs lie between non-zero bytes, so there are at most non_zero + 1 of
    // them: a sparse chunk (the usual xbzrle delta) fits without counting runs.
    let non_zero = non_zero(src);
    non_zero + 2 * (non_zero + 1) <= MAX_ENCODED || non_zero + 2 * runs(src) <= MAX_ENCODED
}

/// Number of non-zero bytes of `src`.
fn non_zero(src: &[u8; CHUNK]) -> usize {
    // Counted in u8 lanes per half chunk (at most 128 each, so no count
    // wraps), which the compiler adds 16 bytes at a time.
    let (front, back) = src.split_at(CHUNK / 2);
    let count = |half: &[u8]| {
        half.iter()
            .fold(0u8, |n, &b| n.wrapping_add(u8::from(b != 0)))
    };
    usize::from(count(front)) + usize::from(count(back))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The encoding walked byte by byte with no length limit.
    fn walked_len(src: &[u8; CHUNK]) -> usize {
        let mut len = 0;
        let mut i = 0;
        while i < CHUNK {
            if src[i] == 0 {
                while i < CHUNK && src[i] == 0 {
                    i += 1;
                }
                len += 2;
            } else {
                len += 1;
                i += 1;
            }
        }
        len
    }

    #[test]
    fn the_counted_length_is_the_walked_length_and_decides_overflow() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut out = [0u8; CHUNK];
        let mut back = [0u8; CHUNK];
        let (mut fits, mut overflows) = (0, 0);
        // Densities from all zero to all non-zero, so lengths fall on both
        // sides of MAX_ENCODED and exactly on it.
        for round in 0..20_000u64 {
            let keep = round % 257;
            let mut src = [0u8; CHUNK];
            for b in src.iter_mut() {
                if next() % 256 < keep {
                    *b = (next() % 255 + 1) as u8;
                }
            }
            let len = walked_len(&src);
            if len <= MAX_ENCODED {
                assert_eq!(encoded_len(&src), len);
                assert_eq!(encode(&src, &mut out), Some(len));
                decode(&out[..len], &mut back).unwrap();
                assert_eq!(back, src);
                fits += 1;
            } else {
                assert!(encoded_len(&src) > MAX_ENCODED);
                assert_eq!(encode(&src, &mut out), None);
                overflows += 1;
            }
        }
        assert!(
            fits > 1000 && overflows > 1000,
            "{fits} fit, {overflows} overflow"
        );
    }
}
