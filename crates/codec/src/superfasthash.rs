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
