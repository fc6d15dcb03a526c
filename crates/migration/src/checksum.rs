//! The frame checksum: CRC-32C (Castagnoli), as docs/protocol.md specifies.
//!
//! Every byte of page data is checksummed once on each side, so this runs
//! over the whole of a migration's traffic. crc-fast folds with carry-less
//! multiplies (VPCLMULQDQ where the CPU has it): about twice the speed of the
//! SSE4.2 `crc32` instruction on these machines, with the same result.

use crc_fast::{CrcAlgorithm, Digest};

/// CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    append(0, data)
}

/// CRC-32C of the bytes `crc` covered followed by `data`.
pub fn append(crc: u32, data: &[u8]) -> u32 {
    // The digest's running state is the finished CRC with the final xor undone.
    let mut d = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(data);
    d.finalize() as u32
}

/// CRC-32C of A followed by B, from `a` = crc32c(A), `b` = crc32c(B) and
/// B's length: `a` times x^(8 * b_len) modulo the polynomial, plus `b`.
/// About 0.4 µs for a page (the crc-fast crate's combine took 9.4 µs here,
/// which a one-page postcopy answer paid in full).
pub fn combine(a: u32, b: u32, b_len: usize) -> u32 {
    mul_mod(x_pow_8n(b_len as u64), a) ^ b
}

/// CRC-32C's polynomial, bit-reflected: bit 31 is x^0, bit 0 is x^31.
const POLY: u32 = 0x82F6_3B78;

/// `a * b` modulo [`POLY`], both reflected.
const fn mul_mod(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 1u32 << 31;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        // b times x: a right shift in the reflected form, reduced.
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        bit >>= 1;
    }
    product
}

/// x^(2^k) modulo [`POLY`] for k = 0..64 (x^1 is bit 30 reflected).
const X_POW_2K: [u32; 64] = {
    let mut t = [0u32; 64];
    let mut p = 1u32 << 30;
    let mut k = 0;
    while k < 64 {
        t[k] = p;
        p = mul_mod(p, p);
        k += 1;
    }
    t
};

/// x^(8 * n) modulo [`POLY`]: the factor that moves a CRC past n bytes.
fn x_pow_8n(n: u64) -> u32 {
    // x^(8n) = product of x^(2^k) over the set bits k of 8n.
    let mut bits = n << 3;
    let mut p = 1u32 << 31; // x^0
    let mut k = 0;
    while bits != 0 {
        if bits & 1 != 0 {
            p = mul_mod(X_POW_2K[k], p);
        }
        bits >>= 1;
        k += 1;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        // The CRC-32C check value and RFC 3720's test patterns.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let inc: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&inc), 0x46dd_794e);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn append_and_combine_agree_with_one_pass() {
        let data: Vec<u8> = (0u32..20_000)
            .map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[3])
            .collect();
        let whole = crc32c(&data);
        for cut in [0, 1, 7, 64, 4095, 4096, 12_345, 20_000] {
            let (a, b) = data.split_at(cut);
            assert_eq!(append(crc32c(a), b), whole, "append at {cut}");
            assert_eq!(
                combine(crc32c(a), crc32c(b), b.len()),
                whole,
                "combine at {cut}"
            );
        }
        let by_pages = data.chunks(4096).fold(0, append);
        assert_eq!(by_pages, whole);
    }

    #[test]
    fn combine_holds_past_a_whole_batch() {
        // A frame's head, then 1024 pages of data (a full precopy batch).
        let head: Vec<u8> = (0u8..=255).cycle().take(8196).collect();
        let data: Vec<u8> = (0u32..(1024 * 4096))
            .map(|i| i.wrapping_mul(40_503).to_le_bytes()[2])
            .collect();
        let mut all = head.clone();
        all.extend_from_slice(&data);
        assert_eq!(
            combine(crc32c(&head), crc32c(&data), data.len()),
            crc32c(&all)
        );
        assert_eq!(combine(0x1234_5678, 0, 0), 0x1234_5678, "nothing appended");
    }
}
