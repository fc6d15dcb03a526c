//! The per-chunk decoders under rle and xbzrle: zero-run decoding of one
//! 256-byte chunk (`zrle::decode`), rle's delta on top of it
//! (`rle::decode_chunk`) and xbzrle's XOR against the cached chunk
//! (`xbzrle::decode_chunk`), on any bytes.
//!
//! Checks: a decoded chunk re-encodes (when its encoding is short enough
//! not to go verbatim) to bytes that decode to the same chunk; rle and
//! xbzrle accept exactly what zrle accepts, and undo their own encoders.
#![no_main]

use ferry_codec::{rle, xbzrle, zrle, CHUNK};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_fuzz::init();
    let Some((&seed, src)) = data.split_first() else {
        return;
    };
    let mut out = [0u8; CHUNK];
    let plain = zrle::decode(src, &mut out);
    if plain.is_ok() {
        let mut enc = [0u8; CHUNK];
        if let Some(n) = zrle::encode(&out, &mut enc) {
            let mut back = [0u8; CHUNK];
            zrle::decode(&enc[..n], &mut back).expect("an encoding decodes");
            assert_eq!(back, out, "zrle round trip");
            assert!(n <= src.len(), "the canonical encoding is the shortest");
        }
    }
    let mut r = [0u8; CHUNK];
    assert_eq!(rle::decode_chunk(src, &mut r).is_ok(), plain.is_ok());
    if plain.is_ok() {
        let mut enc = [0u8; CHUNK];
        if let Some(n) = rle::encode_chunk(&r, &mut enc) {
            let mut back = [0u8; CHUNK];
            rle::decode_chunk(&enc[..n], &mut back).expect("an encoding decodes");
            assert_eq!(back, r, "rle round trip");
        }
    }
    let old: [u8; CHUNK] = std::array::from_fn(|i| (i as u8).wrapping_mul(seed));
    let mut x = [0u8; CHUNK];
    assert_eq!(
        xbzrle::decode_chunk(src, &old, &mut x).is_ok(),
        plain.is_ok()
    );
    if plain.is_ok() {
        let mut enc = [0u8; CHUNK];
        if let Some(n) = xbzrle::encode_chunk(&x, &old, &mut enc) {
            let mut back = [0u8; CHUNK];
            xbzrle::decode_chunk(&enc[..n], &old, &mut back).expect("an encoding decodes");
            assert_eq!(back, x, "xbzrle round trip");
        }
    }
});
