//! Paul Hsieh's SuperFastHash (u32), written from the published description.
//!
//! The dedup chunk cache is indexed by it. Input is read as little-endian
//! 16-bit words; the 1- and 3-byte tails add their last byte sign-extended, as
//! the reference reads it through a `signed char` (dedup chunks are 256 bytes,
//! so they never have a tail).

use crate::sizes::{CHUNK, CHUNKS_PER_PAGE};

/// SuperFastHash of `data`; 0 for empty input.
pub fn hash(data: &[u8]) -> u32 {
    if data.is_empty() {
        return 0;
    }
    // The reference seeds with the length as an int; chunks are far below 2^32.
    let mut h = data.len() as u32;
    let mut quads = data.chunks_exact(4);
    for q in &mut quads {
        h = h.wrapping_add(u32::from(u16::from_le_bytes([q[0], q[1]])));
        let tmp = (u32::from(u16::from_le_bytes([q[2], q[3]])) << 11) ^ h;
        h = (h << 16) ^ tmp;
        h = h.wrapping_add(h >> 11);
    }
    let signed = |b: u8| b as i8 as i32 as u32;
    match *quads.remainder() {
        [a, b, c] => {
            h = h.wrapping_add(u32::from(u16::from_le_bytes([a, b])));
            h ^= h << 16;
            h ^= signed(c) << 18;
            h = h.wrapping_add(h >> 11);
        }
        [a, b] => {
            h = h.wrapping_add(u32::from(u16::from_le_bytes([a, b])));
            h ^= h << 11;
            h = h.wrapping_add(h >> 17);
        }
        [a] => {
            h = h.wrapping_add(signed(a));
            h ^= h << 10;
            h = h.wrapping_add(h >> 1);
        }
        _ => {}
    }
    avalanche(h)
}

/// The SuperFastHash of each 256-byte chunk of a page, as [`hash`] gives it.
///
/// Each hash is a chain of dependent steps; the 16 chains are walked side by
/// side so the CPU overlaps them (several times faster than one at a time).
/// On a CPU with AVX2 the same code runs compiled for it, 8 lanes to a
/// vector instead of SSE2's 4. (An explicit AVX2 version that loads 8 words
/// of a chunk at once and transposes them measured no faster: the loads of
/// the page itself dominate.)
pub fn hash_chunks(page: &[u8; CHUNKS_PER_PAGE * CHUNK]) -> [u32; CHUNKS_PER_PAGE] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above), the only
        // feature the function is compiled for.
        return unsafe { avx512::hash_chunks(page) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), the only feature
        // the function is compiled for.
        return unsafe { hash_chunks_avx2(page) };
    }
    hash_chunks_portable(page)
}

/// [`hash_chunks_portable`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hash_chunks_avx2(page: &[u8; CHUNKS_PER_PAGE * CHUNK]) -> [u32; CHUNKS_PER_PAGE] {
    hash_chunks_portable(page)
}

/// [`hash_chunks`] with AVX-512: the 16 chunks' hashes are the 16 lanes of
/// one vector. The compiler's version of the plain code gathers each step's
/// 16 words one by one (most of its time); here each chunk's next 16 words
/// are one load, and a 16x16 transpose of those rows gives the 16 steps'
/// vectors, four shuffles a row.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{CHUNK, CHUNKS_PER_PAGE};
    use std::arch::x86_64::*;

    /// Words of a chunk a block takes: one 64-byte load per chunk.
    const BLOCK_WORDS: usize = 16;

    #[target_feature(enable = "avx512f")]
    pub(super) fn hash_chunks(page: &[u8; CHUNKS_PER_PAGE * CHUNK]) -> [u32; CHUNKS_PER_PAGE] {
        let mut h = _mm512_set1_epi32(CHUNK as i32);
        let low = _mm512_set1_epi32(0xffff);
        for block in 0..CHUNK / (4 * BLOCK_WORDS) {
            let lines = page.as_chunks::<64>().0;
            let rows: [__m512i; CHUNKS_PER_PAGE] = std::array::from_fn(|chunk| {
                // 4 lines a chunk: chunk * 4 + block < 64 lines a page.
                let line = &lines[chunk * (CHUNK / 64) + block];
                // SAFETY: an unaligned load of the 64 bytes `line` borrows.
                unsafe { _mm512_loadu_si512(line.as_ptr().cast()) }
            });
            for word in transpose(rows) {
                // The step of `hash`, on every chunk at once.
                h = _mm512_add_epi32(h, _mm512_and_si512(word, low));
                let tmp =
                    _mm512_xor_si512(_mm512_slli_epi32::<11>(_mm512_srli_epi32::<16>(word)), h);
                h = _mm512_xor_si512(_mm512_slli_epi32::<16>(h), tmp);
                h = _mm512_add_epi32(h, _mm512_srli_epi32::<11>(h));
            }
        }
        let mut out = [0u32; CHUNKS_PER_PAGE];
        // SAFETY: an unaligned store of 64 bytes into `out`, which has them.
        unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), h) };
        for h in &mut out {
            *h = super::avalanche(*h);
        }
        out
    }

    /// Rows r (chunk r's 16 words) to columns: column c's lane r is row r's
    /// word c.
    #[target_feature(enable = "avx512f")]
    fn transpose(r: [__m512i; 16]) -> [__m512i; 16] {
        // Within each 128-bit lane L: 32-bit then 64-bit interleaves leave
        // u[4i+j] holding rows 4i..4i+3 of column 4L+j.
        let t: [__m512i; 16] = std::array::from_fn(|k| {
            let (a, b) = (r[k & !1], r[k | 1]);
            if k % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        let u: [__m512i; 16] = std::array::from_fn(|k| {
            let (i, j) = (k / 4, k % 4);
            let (a, b) = (t[4 * i + j / 2], t[4 * i + 2 + j / 2]);
            if j % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            }
        });
        // Then a 4x4 transpose of 128-bit lanes among u[j], u[4+j],
        // u[8+j], u[12+j]: column 4L+j gets lane L of each, in row order.
        let mut out = [_mm512_setzero_si512(); 16];
        for j in 0..4 {
            let a = _mm512_shuffle_i32x4::<0x44>(u[j], u[4 + j]);
            let b = _mm512_shuffle_i32x4::<0xee>(u[j], u[4 + j]);
            let c = _mm512_shuffle_i32x4::<0x44>(u[8 + j], u[12 + j]);
            let d = _mm512_shuffle_i32x4::<0xee>(u[8 + j], u[12 + j]);
            out[j] = _mm512_shuffle_i32x4::<0x88>(a, c);
            out[4 + j] = _mm512_shuffle_i32x4::<0xdd>(a, c);
            out[8 + j] = _mm512_shuffle_i32x4::<0x88>(b, d);
            out[12 + j] = _mm512_shuffle_i32x4::<0xdd>(b, d);
        }
        out
    }
}

/// [`hash_chunks`] as plain code the compiler vectorises for the CPU of its
/// caller (inlined into each): what runs without AVX2, public so that tests
/// compare the two.
#[doc(hidden)]
#[inline(always)]
pub fn hash_chunks_portable(page: &[u8; CHUNKS_PER_PAGE * CHUNK]) -> [u32; CHUNKS_PER_PAGE] {
    // Every chunk has the same length and no tail.
    let mut h = [CHUNK as u32; CHUNKS_PER_PAGE];
    for quad in 0..CHUNK / 4 {
        // Gathered first, so the arithmetic below runs on whole vectors of lanes.
        let mut words = [0u32; CHUNKS_PER_PAGE];
        for (lane, word) in words.iter_mut().enumerate() {
            let at = lane * CHUNK + quad * 4;
            *word = u32::from_le_bytes([page[at], page[at + 1], page[at + 2], page[at + 3]]);
        }
        for (h, word) in h.iter_mut().zip(words) {
            *h = h.wrapping_add(word & 0xffff);
            let tmp = ((word >> 16) << 11) ^ *h;
            *h = (*h << 16) ^ tmp;
            *h = h.wrapping_add(*h >> 11);
        }
    }
    let mut out = h;
    for h in &mut out {
        *h = avalanche(*h);
    }
    out
}

/// The final mixing of every hash.
#[inline(always)]
fn avalanche(mut h: u32) -> u32 {
    h ^= h << 3;
    h = h.wrapping_add(h >> 5);
    h ^= h << 4;
    h = h.wrapping_add(h >> 17);
    h ^= h << 25;
    h = h.wrapping_add(h >> 6);
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every version this CPU can run gives each chunk's own hash (the
    /// integration test checks only the one `hash_chunks` picks here).
    #[test]
    fn each_vector_version_gives_each_chunks_hash() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..64 {
            let page: [u8; CHUNKS_PER_PAGE * CHUNK] = std::array::from_fn(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Some rounds sparse, so zero and near-zero chunks occur too.
                if round % 4 == 0 && i % 97 != 0 {
                    0
                } else {
                    (x >> 32) as u8
                }
            });
            let one_by_one: Vec<u32> = page.chunks_exact(CHUNK).map(hash).collect();
            assert_eq!(hash_chunks_portable(&page).to_vec(), one_by_one);
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2.
                    assert_eq!(unsafe { hash_chunks_avx2(&page) }.to_vec(), one_by_one);
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F.
                    assert_eq!(unsafe { avx512::hash_chunks(&page) }.to_vec(), one_by_one);
                }
            }
        }
    }
}
