//! Paul Hsieh's SuperFastHash (u32), written from the published description.
//!
//! The dedup chunk cache is indexed by it. Input is read as little-endian
//! 16-bit words; the 1- and 3-byte tails add their last byte sign-extended, as
//! the reference reads it through a `signed char` (dedup chunks are 256 bytes,
//! so they never have a tail).

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
    // Final avalanche.
    h ^= h << 3;
    h = h.wrapping_add(h >> 5);
    h ^= h << 4;
    h = h.wrapping_add(h >> 17);
    h ^= h << 25;
    h = h.wrapping_add(h >> 6);
    h
}
