//! Hand-checked byte vectors for the chunk codecs, the hash and the ids
//! (the same vectors are listed in docs/codecs.md).

use ferry_codec::{
    dedup::ChunkCache, rle, superfasthash, xbzrle, zrle, ChunkError, Method, PageCodec, CHUNK,
};

fn chunk_from(prefix: &[u8]) -> [u8; CHUNK] {
    let mut c = [0u8; CHUNK];
    c[..prefix.len()].copy_from_slice(prefix);
    c
}

fn enc(
    f: impl Fn(&[u8; CHUNK], &mut [u8; CHUNK]) -> Option<usize>,
    src: &[u8; CHUNK],
) -> Option<Vec<u8>> {
    let mut out = [0u8; CHUNK];
    f(src, &mut out).map(|n| out[..n].to_vec())
}

#[test]
fn zrle_vectors() {
    // All zero: one run of 256 -> 00 FF.
    assert_eq!(enc(zrle::encode, &[0; CHUNK]), Some(vec![0x00, 0xff]));
    // 05 then 255 zeros.
    assert_eq!(
        enc(zrle::encode, &chunk_from(&[5])),
        Some(vec![0x05, 0x00, 0xfe])
    );
    // 3 zeros, 07, 252 zeros.
    assert_eq!(
        enc(zrle::encode, &chunk_from(&[0, 0, 0, 7])),
        Some(vec![0x00, 0x02, 0x07, 0x00, 0xfb])
    );
    // 253 non-zero bytes + a run of 3: exactly 255 bytes, the longest encoding.
    let mut c = [0x11u8; CHUNK];
    c[253..].fill(0);
    let e = enc(zrle::encode, &c).unwrap();
    assert_eq!(e.len(), 255);
    assert_eq!(&e[253..], &[0x00, 0x02]);
    // 254 non-zero + a run of 2 would be 256 bytes: overflow.
    c[253] = 0x11;
    assert_eq!(enc(zrle::encode, &c), None);
    // Alternating 1,0: 384 bytes: overflow.
    let alt: [u8; CHUNK] = std::array::from_fn(|i| (i % 2 == 0) as u8);
    assert_eq!(enc(zrle::encode, &alt), None);
}

#[test]
fn zrle_decode_errors() {
    let mut out = [0u8; CHUNK];
    assert_eq!(zrle::decode(&[0x00], &mut out), Err(ChunkError::Truncated));
    assert_eq!(
        zrle::decode(&[0x00, 0xfe], &mut out),
        Err(ChunkError::Short(255))
    );
    assert_eq!(
        zrle::decode(&[0x00, 0xff, 0x01], &mut out),
        Err(ChunkError::Overrun)
    );
    assert_eq!(
        zrle::decode(&[0x01, 0x00, 0xff], &mut out),
        Err(ChunkError::Overrun)
    );
    assert_eq!(zrle::decode(&[], &mut out), Err(ChunkError::Short(0)));
    // Non-maximal runs decode (the encoder never writes them).
    assert_eq!(zrle::decode(&[0x00, 0x7f, 0x00, 0x7f], &mut out), Ok(()));
    assert_eq!(out, [0; CHUNK]);
}

#[test]
fn rle_vectors() {
    // The paper's "11113": deltas 1 0 0 0 2, then 0 - 3 = FD, then 250 zeros.
    let c = chunk_from(&[1, 1, 1, 1, 3]);
    let e = enc(rle::encode_chunk, &c).unwrap();
    assert_eq!(e, vec![0x01, 0x00, 0x02, 0x02, 0xfd, 0x00, 0xf9]);
    // Constant 0x07: 07 then 255 zero deltas.
    assert_eq!(
        enc(rle::encode_chunk, &[7; CHUNK]),
        Some(vec![0x07, 0x00, 0xfe])
    );
    // All zero.
    assert_eq!(enc(rle::encode_chunk, &[0; CHUNK]), Some(vec![0x00, 0xff]));
    // Ramp 0,1,2,..: deltas 0,1,1,..,1 -> 00 00 + 255 x 01 = 257 bytes: overflow.
    let ramp: [u8; CHUNK] = std::array::from_fn(|i| i as u8);
    assert_eq!(enc(rle::encode_chunk, &ramp), None);
    // Ramp with step 2 starting at 0xFE: wrapping deltas stay 2.
    let mut out = [0u8; CHUNK];
    let wrap: [u8; CHUNK] = std::array::from_fn(|i| 0xfe_u8.wrapping_add((2 * i) as u8));
    let mut d = [0u8; CHUNK];
    rle::delta(&wrap, &mut d);
    assert_eq!(&d[..3], &[0xfe, 0x02, 0x02]);
    // Decode reverses.
    rle::decode_chunk(&[0x01, 0x00, 0x02, 0x02, 0xfd, 0x00, 0xf9], &mut out).unwrap();
    assert_eq!(out, c);
}

#[test]
fn xbzrle_vectors() {
    let old = [0x33u8; CHUNK];
    // Unchanged chunk: XOR is all zero.
    assert_eq!(
        enc(|s, o| xbzrle::encode_chunk(s, &old, o), &old),
        Some(vec![0x00, 0xff])
    );
    // Byte 10 changed from 33 to 36: XOR 05 at offset 10.
    let mut new = old;
    new[10] = 0x36;
    let e = enc(|s, o| xbzrle::encode_chunk(s, &old, o), &new).unwrap();
    assert_eq!(e, vec![0x00, 0x09, 0x05, 0x00, 0xf4]);
    let mut out = [0u8; CHUNK];
    xbzrle::decode_chunk(&e, &old, &mut out).unwrap();
    assert_eq!(out, new);
}

#[test]
fn superfasthash_vectors() {
    // Computed by hand from the published algorithm for "a"
    // (1 + 97 = 0x62, tail and avalanche steps -> 0x115ea782), the others by an
    // independent transcription of the description (see docs/codecs.md).
    assert_eq!(superfasthash::hash(b""), 0);
    assert_eq!(superfasthash::hash(b"a"), 0x115e_a782);
    assert_eq!(superfasthash::hash(b"ab"), 0x516b_8b44);
    assert_eq!(superfasthash::hash(b"abc"), 0xd2be_198a);
    assert_eq!(superfasthash::hash(b"abcd"), 0xdad8_b8db);
    assert_eq!(superfasthash::hash(b"hello world"), 0xa68c_6882);
    // Tails read as signed char: 1 + (-1) = 0 and everything stays 0.
    assert_eq!(superfasthash::hash(b"\xff"), 0);
    assert_eq!(superfasthash::hash(b"\x80\x81\xfe"), 0x48cc_fc29);
    assert_eq!(superfasthash::hash(&[0u8; 256]), 0xbc3f_b0f0);
    let ramp: [u8; 256] = std::array::from_fn(|i| i as u8);
    assert_eq!(superfasthash::hash(&ramp), 0xe4ee_f917);
}

#[test]
fn a_pages_chunk_hashes_taken_side_by_side_are_each_chunks_hash() {
    // Side by side = one by one, on this CPU's code and on the code a CPU
    // without AVX2 runs; returns the hashes.
    let agree = |page: &[u8; ferry_codec::PAGE]| {
        let side_by_side = superfasthash::hash_chunks(page);
        for (i, chunk) in page.chunks_exact(CHUNK).enumerate() {
            assert_eq!(side_by_side[i], superfasthash::hash(chunk), "chunk {i}");
        }
        assert_eq!(superfasthash::hash_chunks_portable(page), side_by_side);
        side_by_side
    };
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut random_byte = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (state >> 56) as u8
    };
    // Chunks of every kind: zero, a ramp, bytes with the top bit set, random.
    let page: [u8; ferry_codec::PAGE] = std::array::from_fn(|i| match i / CHUNK % 4 {
        0 => 0,
        1 => i as u8,
        2 => 0x80 | (i / 7) as u8,
        _ => random_byte(),
    });
    assert_eq!(agree(&page)[0], 0xbc3f_b0f0);
    // And pages of random bytes (every word of every lane lands where the
    // vector code puts it).
    for _ in 0..64 {
        agree(&std::array::from_fn(|_| random_byte()));
    }
}

#[test]
fn chunk_cache_references() {
    // 4 KiB: 16 entries, 8 sets; the zero chunk hashes to 0xbc3fb0f0, set 0.
    let mut cache = ChunkCache::new(4096).unwrap();
    assert_eq!(cache.sets(), 8);
    let zero = [0u8; CHUNK];
    let h = superfasthash::hash(&zero);
    assert_eq!(cache.set_of(h), (0xbc3f_b0f0_u32 % 8) as usize);
    assert_eq!(cache.lookup(h, &zero), None);
    cache.touch(h, &zero);
    let set = cache.set_of(h) as u32;
    assert_eq!(cache.lookup(h, &zero), Some(set * 2));
    assert_eq!(cache.get(set * 2), Some(&zero));
    assert_eq!(cache.get(set * 2 + 1), None, "empty way");
    assert_eq!(cache.get(16), None, "out of range");
    // Same hash, other content: no hit.
    assert_eq!(cache.lookup(h, &[1; CHUNK]), None);
}

#[test]
fn ids_and_names() {
    for id in 0..=6u8 {
        assert_eq!(PageCodec::try_from(id).unwrap() as u8, id);
    }
    assert!(PageCodec::try_from(7).is_err());
    let cases = [
        ("none", Method::None, 0x00),
        ("rle", Method::Rle, 0x01),
        ("xbzrle", Method::Xbzrle, 0x02),
        ("dedup", Method::Dedup, 0x03),
        ("lz4", Method::Lz4, 0x04),
        ("zstd", Method::Zstd(3), 0x43),
        ("zstd:1", Method::Zstd(1), 0x41),
        ("zstd:19", Method::Zstd(19), 0x53),
    ];
    for (name, method, id) in cases {
        let parsed: Method = name.parse().unwrap();
        assert_eq!(parsed, method);
        assert_eq!(method.id(), id);
        assert_eq!(Method::from_id(id).unwrap(), method);
        assert_eq!(method.to_string().parse::<Method>().unwrap(), method);
    }
    assert_eq!(Method::Zstd(3).to_string(), "zstd:3");
    assert_eq!(Method::Zstd(7).name(), "zstd");
    for bad in [
        "", "zstd:0", "zstd:20", "zstd:-1", "zstd:", "zstd:x", "RLE", "lz5",
    ] {
        assert!(bad.parse::<Method>().is_err(), "{bad:?}");
    }
    for id in (5..=0x40).chain(0x54..=0xff) {
        assert!(Method::from_id(id).is_err(), "{id:#x}");
    }
}
