//! Fallbacks, ratios, cache behaviour and batch semantics.

mod common;

use common::{make_page, Kind, Rng};
use ferry_codec::{
    dedup::{ChunkCache, NO_SLOT},
    xbzrle::PageCache,
    CacheSizes, CodecError, EncodedBatch, Method, PageCodec, StreamDecoder, StreamEncoder, CHUNK,
    PAGE,
};

const ALL: [Method; 7] = [
    Method::None,
    Method::Rle,
    Method::Xbzrle,
    Method::Dedup,
    Method::Lz4,
    Method::Zstd(1),
    Method::Zstd(19),
];

/// Encodes one batch with a fresh encoder, checks the round trip, returns the batch.
fn encode_fresh(method: Method, pages: &[u64], data: &[u8]) -> EncodedBatch {
    let mut enc = StreamEncoder::new(CacheSizes::default());
    let mut dec = StreamDecoder::new(CacheSizes::default());
    let mut out = EncodedBatch::default();
    enc.encode(method, pages, data, &mut out).unwrap();
    let mut back = vec![0u8; data.len()];
    dec.decode_batch(method, pages, &out, &mut back).unwrap();
    assert!(back == data);
    out
}

#[test]
fn random_pages_go_raw() {
    let mut data = vec![0u8; 8 * PAGE];
    Rng(1).fill(&mut data);
    let pages: Vec<u64> = (0..8).collect();
    for method in ALL {
        let out = encode_fresh(method, &pages, &data);
        assert!(
            out.codecs.iter().all(|&c| c == PageCodec::Raw),
            "{method}: {:?}",
            out.codecs
        );
        assert!(out.lens.iter().all(|&l| l == PAGE as u32));
        assert_eq!(out.payload, data);
    }
}

#[test]
fn zero_pages_go_zero() {
    let data = vec![0u8; 4 * PAGE];
    for method in ALL {
        let out = encode_fresh(method, &[0, 1, 2, 3], &data);
        assert_eq!(out.codecs, vec![PageCodec::Zero; 4], "{method}");
        assert_eq!(out.lens, vec![0; 4]);
        assert!(out.payload.is_empty());
    }
}

#[test]
fn constant_pages_shrink_with_rle() {
    let data: Vec<u8> = (1..=8u8)
        .flat_map(|v| vec![v.wrapping_mul(37); PAGE])
        .collect();
    let pages: Vec<u64> = (0..8).collect();
    let out = encode_fresh(Method::Rle, &pages, &data);
    assert_eq!(out.codecs, vec![PageCodec::Rle; 8]);
    // 32 header bytes + 16 chunks of (value, 00, FE).
    assert_eq!(out.lens, vec![80; 8]);
    let ratio = data.len() as f64 / out.payload.len() as f64;
    assert!(ratio > 50.0, "ratio {ratio}");
    // Text and small integers still shrink through lz4/zstd.
    let text = make_page(Kind::Text, 3, None);
    for method in [Method::Lz4, Method::Zstd(3)] {
        let out = encode_fresh(method, &[0], &text);
        assert!(out.lens[0] < PAGE as u32 / 2, "{method}: {}", out.lens[0]);
    }
}

#[test]
fn xbzrle_hit_after_small_change_is_small() {
    let mut enc = StreamEncoder::new(CacheSizes::default());
    let mut dec = StreamDecoder::new(CacheSizes::default());
    let mut out = EncodedBatch::default();
    let mut back = vec![0u8; PAGE];
    let mut page = vec![0u8; PAGE];
    Rng(9).fill(&mut page);
    enc.encode(Method::Xbzrle, &[42], &page, &mut out).unwrap();
    assert_eq!(out.codecs, vec![PageCodec::Raw]);
    dec.decode_batch(Method::Xbzrle, &[42], &out, &mut back)
        .unwrap();
    for at in [5, 1000, 4095] {
        page[at] ^= 0x40;
    }
    enc.encode(Method::Xbzrle, &[42], &page, &mut out).unwrap();
    assert_eq!(out.codecs, vec![PageCodec::Xbzrle]);
    // 32 header bytes, 13 unchanged chunks of 2 bytes, 3 chunks of at most 5 bytes.
    assert!(out.lens[0] <= 32 + 13 * 2 + 3 * 5, "{}", out.lens[0]);
    dec.decode_batch(Method::Xbzrle, &[42], &out, &mut back)
        .unwrap();
    assert!(back == page);
}

#[test]
fn page_cache_lru_in_one_set() {
    // 8 KiB: two entries, one set.
    let mut cache = PageCache::new(8192).unwrap();
    assert_eq!(cache.sets(), 1);
    let (a, b, c) = ([1u8; PAGE], [2u8; PAGE], [3u8; PAGE]);
    cache.touch(10, &a);
    cache.touch(20, &b);
    assert_eq!(cache.lookup(10), Some(&a));
    assert_eq!(cache.lookup(20), Some(&b));
    // 10 is LRU; re-touching it makes 20 LRU, so 30 evicts 20.
    cache.touch(10, &c);
    assert_eq!(cache.lookup(10), Some(&c));
    cache.touch(30, &a);
    assert_eq!(cache.lookup(20), None);
    assert_eq!(cache.way_of(10), Some(0));
    assert_eq!(cache.way_of(30), Some(1));
    // Now 10 is LRU: 40 evicts it.
    cache.touch(40, &b);
    assert_eq!(cache.lookup(10), None);
    assert_eq!(cache.way_of(40), Some(0));
    // Smaller than two pages still makes one set of two ways.
    assert_eq!(PageCache::new(0).unwrap().sets(), 1);
    assert_eq!(PageCache::new(3 * 4096).unwrap().sets(), 1);
    assert_eq!(PageCache::new(64 << 20).unwrap().sets(), 8192);
}

#[test]
fn a_found_chunk_whose_set_was_replaced_in_the_batch_is_touched_in_full() {
    // One set of two ways; A and C share a hash (a collision), B does not.
    let (a, b, c) = ([1u8; CHUNK], [2u8; CHUNK], [3u8; CHUNK]);
    let mut fast = ChunkCache::new(512).unwrap();
    assert_eq!(fast.sets(), 1);
    fast.touch(7, &a);
    fast.touch(9, &b);
    let mut full = fast.clone();
    // The batch's lookup finds A in way 0, then an earlier touch of the
    // batch puts C (same hash, other bytes) there in A's place.
    fast.begin_batch();
    let found = fast.lookup(7, &a).unwrap();
    assert_eq!(found, 0);
    fast.touch(7, &c);
    full.touch(7, &c);
    // The hint is stale: A must be inserted again (evicting B), exactly as a
    // touch without a hint does; taking the slot on its hash alone would
    // leave C there as if it were A.
    fast.touch_found(7, &a, found);
    full.touch(7, &a);
    for cache in [&fast, &full] {
        assert_eq!(cache.lookup(7, &c), Some(0));
        assert_eq!(cache.lookup(7, &a), Some(1));
        assert_eq!(cache.lookup(9, &b), None);
    }
    // In a new batch with no replacement the hint is taken: B evicts the
    // set's LRU way, which the hinted touch of A made C's.
    fast.begin_batch();
    let found = fast.lookup(7, &a).unwrap();
    fast.touch_found(7, &a, found);
    fast.touch(9, &b);
    assert_eq!(fast.lookup(7, &a), Some(1));
    assert_eq!(fast.lookup(7, &c), None);
    assert_eq!(fast.lookup(9, &b), Some(0));
    // A hint of no slot is a plain touch.
    fast.touch_found(5, &c, NO_SLOT);
    assert_eq!(fast.lookup(5, &c), Some(1));
}

#[test]
fn xbzrle_eviction_through_the_stream() {
    let sizes = CacheSizes {
        xbzrle_bytes: 8192,
        dedup_bytes: 0,
    };
    let mut enc = StreamEncoder::new(sizes);
    let mut dec = StreamDecoder::new(sizes);
    let mut out = EncodedBatch::default();
    let page = |v: u8| make_page(Kind::Sparse, u64::from(v), None);
    let mut run = |indices: &[u64], data: Vec<u8>| {
        enc.encode(Method::Xbzrle, indices, &data, &mut out)
            .unwrap();
        let mut back = vec![0u8; data.len()];
        dec.decode_batch(Method::Xbzrle, indices, &out, &mut back)
            .unwrap();
        assert!(back == data);
        out.codecs.clone()
    };
    use PageCodec::{Rle, Xbzrle};
    assert_eq!(run(&[1, 2], [page(1), page(2)].concat()), [Rle, Rle]);
    assert_eq!(run(&[1], page(1)), [Xbzrle]); // 2 is LRU now
    assert_eq!(run(&[3], page(3)), [Rle]); // evicts 2
    assert_eq!(run(&[2, 1], [page(2), page(1)].concat()), [Rle, Xbzrle]);
}

#[test]
fn lookups_see_the_cache_before_the_batch() {
    // The same page twice in one batch: neither copy hits (pre-batch state);
    // the next batch hits against the last copy.
    let mut enc = StreamEncoder::new(CacheSizes::default());
    let mut dec = StreamDecoder::new(CacheSizes::default());
    let mut out = EncodedBatch::default();
    let p1 = make_page(Kind::Sparse, 1, None);
    let p2 = make_page(Kind::Modified, 2, Some(&p1));
    let data = [p1.clone(), p2.clone()].concat();
    let mut back = vec![0u8; data.len()];
    enc.encode(Method::Xbzrle, &[7, 7], &data, &mut out)
        .unwrap();
    assert_eq!(out.codecs, [PageCodec::Rle, PageCodec::Rle]);
    dec.decode_batch(Method::Xbzrle, &[7, 7], &out, &mut back)
        .unwrap();
    assert!(back == data);
    enc.encode(Method::Xbzrle, &[7], &p2, &mut out).unwrap();
    assert_eq!(out.codecs, [PageCodec::Xbzrle]);
    assert_eq!(out.lens, [64], "identical to the last copy: 16 x (00 FF)");
    dec.decode_batch(Method::Xbzrle, &[7], &out, &mut back[..PAGE])
        .unwrap();
    assert!(back[..PAGE] == p2[..]);

    // Dedup: two copies of a page in one fresh batch do not reference each other,
    // the next batch references all 16 chunks (even though the page went Raw).
    let mut r = vec![0u8; PAGE];
    Rng(5).fill(&mut r);
    let data = [r.clone(), r.clone()].concat();
    let out = {
        let mut enc = StreamEncoder::new(CacheSizes::default());
        let mut out = EncodedBatch::default();
        enc.encode(Method::Dedup, &[1, 2], &data, &mut out).unwrap();
        assert_eq!(out.codecs, [PageCodec::Raw, PageCodec::Raw]);
        enc.encode(Method::Dedup, &[3], &r, &mut out).unwrap();
        out
    };
    assert_eq!(out.codecs, [PageCodec::Dedup]);
    assert_eq!(out.lens, [32 + 16 * 4]);
}

#[test]
fn encoder_errors() {
    let mut enc = StreamEncoder::new(CacheSizes::default());
    let mut out = EncodedBatch::default();
    let r = enc.encode(Method::Rle, &[0, 1], &[0; PAGE], &mut out);
    assert!(matches!(
        r,
        Err(CodecError::DataLength {
            expected: 8192,
            actual: 4096
        })
    ));
    for level in [0, 20, -5] {
        let r = enc.encode(Method::Zstd(level), &[0], &[1; PAGE], &mut out);
        assert!(matches!(r, Err(CodecError::BadZstdLevel(l)) if l == level));
    }
    let pages: Vec<u64> = (0..1025).collect();
    let r = enc.encode(Method::None, &pages, &vec![0; 1025 * PAGE], &mut out);
    assert!(matches!(r, Err(CodecError::BatchTooLarge(1025))));
    // Cache sizes that cannot be allocated are errors, not aborts.
    let huge = CacheSizes {
        xbzrle_bytes: u64::MAX,
        dedup_bytes: u64::MAX,
    };
    let mut enc = StreamEncoder::new(huge);
    let r = enc.encode(Method::Xbzrle, &[0], &[1; PAGE], &mut out);
    assert!(
        matches!(r, Err(CodecError::CacheSize { what: "xbzrle", .. })),
        "{r:?}"
    );
    let r = enc.encode(Method::Dedup, &[0], &[1; PAGE], &mut out);
    assert!(
        matches!(r, Err(CodecError::CacheSize { what: "dedup", .. })),
        "{r:?}"
    );
    // Batches of the maximum size work; an empty batch too.
    let mut enc = StreamEncoder::new(CacheSizes::default());
    let pages: Vec<u64> = (0..1024).collect();
    enc.encode(Method::Rle, &pages, &vec![3; 1024 * PAGE], &mut out)
        .unwrap();
    assert_eq!(out.len(), 1024);
    enc.encode(Method::Rle, &[], &[], &mut out).unwrap();
    assert!(out.is_empty());
}
