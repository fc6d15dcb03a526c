//! Hostile input to the decoder: errors, never panics, and caches untouched.

mod common;

use common::{make_page, Kind, Rng};
use ferry_codec::{
    rle, xbzrle, zrle, CacheSizes, CodecError, EncodedBatch, Method, PageCodec, StreamDecoder,
    StreamEncoder, CHUNK, HDR_DEDUP_REF, HDR_OVERFLOW, PAGE,
};
use proptest::prelude::*;

const ALL: [Method; 6] = [
    Method::None,
    Method::Rle,
    Method::Xbzrle,
    Method::Dedup,
    Method::Lz4,
    Method::Zstd(3),
];

fn small() -> CacheSizes {
    CacheSizes {
        xbzrle_bytes: 4 * 4096,
        dedup_bytes: 4096,
    }
}

/// An encoder/decoder pair that has seen one batch of mixed pages (so caches
/// hold entries), and the next batch encoded with `method`.
fn primed(method: Method) -> (StreamDecoder, Vec<u64>, EncodedBatch, Vec<u8>) {
    let mut enc = StreamEncoder::new(small());
    let mut dec = StreamDecoder::new(small());
    let pages: Vec<u64> = (0..6).collect();
    let kinds = [
        Kind::Random,
        Kind::Zero,
        Kind::Text,
        Kind::Constant,
        Kind::Sparse,
        Kind::SmallInts,
    ];
    let first: Vec<u8> = kinds
        .iter()
        .enumerate()
        .flat_map(|(i, &k)| make_page(k, i as u64, None))
        .collect();
    let mut batch = EncodedBatch::default();
    let mut out = vec![0u8; first.len()];
    enc.encode(method, &pages, &first, &mut batch).unwrap();
    dec.decode_batch(method, &pages, &batch, &mut out).unwrap();
    let second: Vec<u8> = first
        .chunks(PAGE)
        .enumerate()
        .flat_map(|(i, p)| make_page(Kind::Modified, 100 + i as u64, Some(p)))
        .collect();
    enc.encode(method, &pages, &second, &mut batch).unwrap();
    (dec, pages, batch, second)
}

fn codec_of(id: u8) -> PageCodec {
    PageCodec::try_from(id % 7).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random metadata and payloads: Ok or Err, never a panic.
    #[test]
    fn random_batches(
        m in 0..ALL.len(),
        meta in prop::collection::vec((0u64..8, any::<u8>(), prop_oneof![0u32..64, Just(32u32), Just(4096u32), 0u32..5000]), 0..6),
        payload_seed in any::<u64>(),
        extra in 0usize..3,
        structured in any::<bool>(),
    ) {
        let method = ALL[m];
        let (mut dec, _, _, _) = primed(method);
        let pages: Vec<u64> = meta.iter().map(|x| x.0).collect();
        let codecs: Vec<PageCodec> = meta.iter().map(|x| codec_of(x.1)).collect();
        let lens: Vec<u32> = meta.iter().map(|x| x.2).collect();
        let total = lens.iter().map(|&l| l as usize).sum::<usize>() + extra;
        let mut payload = vec![0u8; total];
        let mut rng = Rng(payload_seed);
        rng.fill(&mut payload);
        if structured {
            // Plausible chunk headers, so decoding gets past the header check.
            for b in payload.chunks_mut(2).take(16) {
                let h = match rng.below(4) { 0 => HDR_OVERFLOW, 1 => HDR_DEDUP_REF, _ => rng.below(256) as u16 };
                b.copy_from_slice(&h.to_le_bytes()[..b.len()]);
            }
        }
        let mut out = vec![0u8; pages.len() * PAGE];
        let _ = dec.decode(method, &pages, &codecs, &lens, &payload, &mut out);
    }

    /// A valid batch with bytes, codecs or lengths corrupted: Ok or Err, never a panic.
    #[test]
    fn corrupted_batches(m in 0..ALL.len(), edits in prop::collection::vec((0u8..4, any::<u64>(), any::<u8>()), 1..4)) {
        let method = ALL[m];
        let (mut dec, pages, mut batch, _) = primed(method);
        for (what, at, value) in edits {
            match what {
                0 if !batch.payload.is_empty() => {
                    // Prefer the bytes of coded (non-Raw) pages, where the parsing is.
                    let mut ranges = Vec::new();
                    let mut start = 0;
                    for (&c, &l) in batch.codecs.iter().zip(&batch.lens) {
                        if c != PageCodec::Raw && l > 0 {
                            ranges.push(start..start + l as usize);
                        }
                        start += l as usize;
                    }
                    let i = if ranges.is_empty() {
                        (at % batch.payload.len() as u64) as usize
                    } else {
                        let r = &ranges[(at % ranges.len() as u64) as usize];
                        r.start + ((at >> 32) % r.len() as u64) as usize
                    };
                    // Earlier edits may have shortened the payload.
                    let i = i % batch.payload.len();
                    batch.payload[i] ^= value | 1;
                }
                1 => {
                    let i = (at % batch.codecs.len() as u64) as usize;
                    batch.codecs[i] = codec_of(value);
                }
                2 => {
                    let i = (at % batch.lens.len() as u64) as usize;
                    batch.lens[i] = batch.lens[i].wrapping_add(u32::from(value) % 5).wrapping_sub(2);
                }
                _ => {
                    let cut = (at % (batch.payload.len() as u64 + 1)) as usize;
                    batch.payload.truncate(cut);
                }
            }
        }
        let mut out = vec![0u8; pages.len() * PAGE];
        let _ = dec.decode_batch(method, &pages, &batch, &mut out);
    }
}

/// Bytes with many zeros and small values, the alphabet of zero-run encodings.
fn zrle_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![Just(0u8), 0u8..4, 250u8..=255, any::<u8>()],
        0..max,
    )
}

/// One chunk of a structured page: (kind, bytes); see `structured_pages`.
fn chunk_strategy() -> impl Strategy<Value = (u8, Vec<u8>, u16, u32)> {
    (
        0u8..4,
        zrle_bytes(256),
        any::<u16>(),
        prop_oneof![0u32..48, any::<u32>()],
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// The per-chunk decoders on arbitrary input: Ok or Err, and Ok means 256 bytes
    /// that encode back to something that decodes the same.
    #[test]
    fn chunk_decoders(src in zrle_bytes(320), old in any::<u64>()) {
        let mut out = [0u8; CHUNK];
        if zrle::decode(&src, &mut out).is_ok() {
            let mut again = [0u8; CHUNK];
            if let Some(n) = zrle::encode(&out, &mut again) {
                let mut back = [0u8; CHUNK];
                zrle::decode(&again[..n], &mut back).unwrap();
                prop_assert_eq!(back, out);
            }
        }
        let _ = rle::decode_chunk(&src, &mut out);
        let mut prev = [0u8; CHUNK];
        Rng(old).fill(&mut prev);
        let _ = xbzrle::decode_chunk(&src, &prev, &mut out);
    }

    /// Chunked pages whose headers and lengths are consistent but whose chunks
    /// are arbitrary: Ok or Err, never a panic.
    #[test]
    fn structured_pages(m in 0usize..3, index in 0u64..8, chunks in prop::collection::vec(chunk_strategy(), 16)) {
        let (method, codec) = [
            (Method::Rle, PageCodec::Rle),
            (Method::Xbzrle, PageCodec::Xbzrle),
            (Method::Dedup, PageCodec::Dedup),
        ][m];
        let (mut dec, _, _, _) = primed(method);
        let mut heads = Vec::new();
        let mut body = Vec::new();
        for (kind, bytes, header, reference) in chunks {
            match kind {
                0 => {
                    heads.push(HDR_OVERFLOW);
                    body.extend(bytes.iter().copied().chain(std::iter::repeat(0)).take(CHUNK));
                }
                1 => {
                    let n = bytes.len().clamp(1, 255);
                    heads.push(n as u16);
                    body.extend(bytes.iter().copied().chain(std::iter::repeat(0)).take(n));
                }
                2 => {
                    heads.push(HDR_DEDUP_REF);
                    body.extend(reference.to_le_bytes());
                }
                _ => {
                    heads.push(header);
                    body.extend(bytes.iter().copied().take(usize::from(header & 0xff)));
                }
            }
        }
        let mut payload: Vec<u8> = heads.iter().flat_map(|h| h.to_le_bytes()).collect();
        payload.extend(body);
        let mut out = vec![0u8; PAGE];
        let _ = dec.decode(method, &[index], &[codec], &[payload.len() as u32], &payload, &mut out);
    }
}

#[track_caller]
fn expect_err(method: Method, batch: &EncodedBatch, check: impl Fn(&CodecError) -> bool) {
    let (mut dec, pages, _, _) = primed(method);
    let mut out = vec![0u8; pages.len() * PAGE];
    match dec.decode_batch(method, &pages, batch, &mut out) {
        Err(e) => assert!(check(&e), "unexpected error {e}"),
        Ok(()) => panic!("hostile batch decoded"),
    }
}

#[test]
fn specific_errors() {
    for method in ALL {
        let (_, _, good, _) = primed(method);
        // Truncated payload: lengths no longer add up.
        let mut b = good.clone();
        b.payload.pop();
        expect_err(method, &b, |e| {
            matches!(e, CodecError::PayloadLength { .. })
        });
        // One length changed.
        let mut b = good.clone();
        b.lens[0] += 1;
        expect_err(method, &b, |e| {
            matches!(e, CodecError::PayloadLength { .. })
        });
        // Missing metadata.
        let mut b = good.clone();
        b.codecs.pop();
        expect_err(method, &b, |e| matches!(e, CodecError::MetaLength { .. }));
        // A codec the method never produces.
        let mut b = good.clone();
        b.codecs[0] = if method == Method::Lz4 {
            PageCodec::Zstd
        } else {
            PageCodec::Lz4
        };
        expect_err(method, &b, |e| {
            matches!(e, CodecError::CodecNotAllowed { .. })
        });
    }
    assert!(matches!(
        PageCodec::try_from(7),
        Err(CodecError::BadCodecId(7))
    ));
    assert!(matches!(
        PageCodec::try_from(0xff),
        Err(CodecError::BadCodecId(0xff))
    ));
}

fn one_page(codec: PageCodec, payload: Vec<u8>) -> EncodedBatch {
    // Six pages like `primed`: page 0 carries the test payload, the rest are Zero.
    let mut codecs = vec![PageCodec::Zero; 6];
    codecs[0] = codec;
    let mut lens = vec![0; 6];
    lens[0] = payload.len() as u32;
    EncodedBatch {
        codecs,
        lens,
        payload,
    }
}

fn headers(hs: &[u16]) -> Vec<u8> {
    hs.iter().flat_map(|h| h.to_le_bytes()).collect()
}

#[test]
fn page_level_errors() {
    let page_len = |e: &CodecError| matches!(e, CodecError::PageLength { .. });
    expect_err(
        Method::None,
        &one_page(PageCodec::Raw, vec![1; 4095]),
        page_len,
    );
    expect_err(Method::None, &one_page(PageCodec::Zero, vec![0]), page_len);

    // Dedup reference past the end of the cache (4 KiB: 16 entries).
    let mut p = headers(&[HDR_DEDUP_REF; 16]);
    for _ in 0..16 {
        p.extend(1000u32.to_le_bytes());
    }
    expect_err(Method::Dedup, &one_page(PageCodec::Dedup, p), |e| {
        matches!(e, CodecError::DedupIndex { index: 1000, .. })
    });
    // A fresh decoder has only empty ways.
    let mut p = headers(&[HDR_DEDUP_REF; 16]);
    for _ in 0..16 {
        p.extend(0u32.to_le_bytes());
    }
    let mut dec = StreamDecoder::new(small());
    let mut out = vec![0u8; PAGE];
    let r = dec.decode(
        Method::Dedup,
        &[0],
        &[PageCodec::Dedup],
        &[p.len() as u32],
        &p,
        &mut out,
    );
    assert!(
        matches!(r, Err(CodecError::DedupIndex { index: 0, .. })),
        "{r:?}"
    );

    // Rle header kinds the method does not use, and unknown header bits.
    let mut p = headers(&[HDR_DEDUP_REF; 16]);
    p.extend([0; 64]);
    expect_err(Method::Rle, &one_page(PageCodec::Rle, p), |e| {
        matches!(e, CodecError::Chunk { chunk: 0, .. })
    });
    let mut p = headers(&[0x2002; 16]);
    p.extend([0x00, 0xff].repeat(16));
    expect_err(Method::Rle, &one_page(PageCodec::Rle, p), |e| {
        matches!(e, CodecError::Chunk { .. })
    });
    // Headers that describe more or fewer bytes than the page has.
    let mut p = headers(&[2; 16]);
    p.extend([0x00, 0xff].repeat(15));
    expect_err(Method::Rle, &one_page(PageCodec::Rle, p.clone()), |e| {
        matches!(e, CodecError::ChunkedLength { .. })
    });
    p.extend([0x00, 0xff, 0x00]);
    expect_err(Method::Rle, &one_page(PageCodec::Rle, p), |e| {
        matches!(e, CodecError::ChunkedLength { .. })
    });
    expect_err(Method::Rle, &one_page(PageCodec::Rle, vec![2, 0]), |e| {
        matches!(e, CodecError::ChunkedLength { .. })
    });
    // A chunk that expands short.
    let mut p = headers(&[2; 16]);
    p.extend([0x00, 0xff].repeat(15));
    p.extend([0x00, 0xfe]);
    expect_err(Method::Rle, &one_page(PageCodec::Rle, p), |e| {
        matches!(e, CodecError::Chunk { chunk: 15, .. })
    });

    // Xbzrle for a page index the cache does not hold.
    let mut p = headers(&[2; 16]);
    p.extend([0x00, 0xff].repeat(16));
    let mut dec = StreamDecoder::new(small());
    let r = dec.decode(
        Method::Xbzrle,
        &[77],
        &[PageCodec::Xbzrle],
        &[p.len() as u32],
        &p,
        &mut out,
    );
    assert!(
        matches!(r, Err(CodecError::XbzrleMiss { index: 77, .. })),
        "{r:?}"
    );

    // Garbage compressed pages.
    expect_err(
        Method::Lz4,
        &one_page(PageCodec::Lz4, vec![0xff; 40]),
        |e| matches!(e, CodecError::Lz4 { .. }),
    );
    expect_err(
        Method::Zstd(3),
        &one_page(PageCodec::Zstd, vec![0x28, 0xb5, 0x2f, 0xfd, 1, 2, 3]),
        |e| matches!(e, CodecError::Zstd { .. }),
    );
    // A valid lz4 block of the wrong size.
    let short = lz4_flex::block::compress(&[7u8; 100]);
    expect_err(Method::Lz4, &one_page(PageCodec::Lz4, short), |e| {
        matches!(e, CodecError::Lz4 { .. })
    });
    let big = zstd::bulk::compress(&[7u8; 8192], 3).unwrap();
    expect_err(Method::Zstd(3), &one_page(PageCodec::Zstd, big), |e| {
        matches!(e, CodecError::Zstd { .. })
    });
}

#[test]
fn batch_shape_errors() {
    let mut dec = StreamDecoder::new(small());
    let mut out = vec![0u8; PAGE - 1];
    let r = dec.decode(Method::None, &[0], &[PageCodec::Zero], &[0], &[], &mut out);
    assert!(matches!(r, Err(CodecError::DataLength { .. })));
    let pages: Vec<u64> = (0..1025).collect();
    let mut out = vec![0u8; pages.len() * PAGE];
    let codecs = vec![PageCodec::Zero; 1025];
    let lens = vec![0; 1025];
    let r = dec.decode(Method::None, &pages, &codecs, &lens, &[], &mut out);
    assert!(matches!(r, Err(CodecError::BatchTooLarge(1025))));
}

/// A rejected batch leaves the caches as they were: the next good batch decodes.
#[test]
fn failed_decode_leaves_caches_alone() {
    for method in [Method::Xbzrle, Method::Dedup] {
        let (mut dec, pages, good, data) = primed(method);
        let mut bad = good.clone();
        // Corrupt the last page so that earlier pages decode first.
        let last = bad.payload.len() - 1;
        bad.payload[last] ^= 0xff;
        bad.lens[5] += 1;
        bad.payload.push(0);
        let mut out = vec![0u8; data.len()];
        assert!(dec.decode_batch(method, &pages, &bad, &mut out).is_err());
        dec.decode_batch(method, &pages, &good, &mut out).unwrap();
        assert!(out == data);
    }
}
