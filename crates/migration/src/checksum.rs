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
/// B's length.
pub fn combine(a: u32, b: u32, b_len: usize) -> u32 {
    crc_fast::checksum_combine(
        CrcAlgorithm::Crc32Iscsi,
        u64::from(a),
        u64::from(b),
        b_len as u64,
    ) as u32
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
}
