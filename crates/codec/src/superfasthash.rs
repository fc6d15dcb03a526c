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
pub fn hash_chunks(page: &[u8; CHUNKS_PER_PAGE * CHUNK]) -> [u32; CHUNKS_PER_PAGE] {
    // Every chunk has the same length and no tail.
    let mut h = [CHUNK as u32; CHUNKS_PER_PAGE];
    for quad in 0..CHUNK / 4 {
        // Gathered first, so the arithmetic below runs on whole vectors of lanes.
        let words: [u32; CHUNKS_PER_PAGE] = std::array::from_fn(|lane| {
            let at = lane * CHUNK + quad * 4;
            u32::from_le_bytes([page[at], page[at + 1], page[at + 2], page[at + 3]])
        });
        for (h, word) in h.iter_mut().zip(words) {
            *h = h.wrapping_add(word & 0xffff);
            let tmp = ((word >> 16) << 11) ^ *h;
            *h = (*h << 16) ^ tmp;
            *h = h.wrapping_add(*h >> 11);
        }
    }
    h.map(avalanche)
}

/// The final mixing of every hash.
fn avalanche(mut h: u32) -> u32 {
    h ^= h << 3;
    h = h.wrapping_add(h >> 5);
    h ^= h << 4;
    h = h.wrapping_add(h >> 17);
    h ^= h << 25;
    h = h.wrapping_add(h >> 6);
    h
}
