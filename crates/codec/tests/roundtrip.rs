//! Round trips over sequences of batches, checked against an independent
//! reference encoder built from the public per-chunk functions and a naive
//! LRU model (the contract a GPU backend must meet byte for byte).

mod common;

use common::{make_page, KINDS};
use ferry_codec::{
    is_zero_page, rle, superfasthash, xbzrle, CacheSizes, EncodedBatch, Method, PageCodec,
    StreamDecoder, StreamEncoder, CHUNK, HDR_DEDUP_REF, HDR_OVERFLOW, PAGE,
};
use proptest::prelude::*;
use std::collections::HashMap;

/// A 2-way set: entries oldest first, each with the way it lives in.
#[derive(Clone, Default)]
struct ModelSet<T> {
    entries: Vec<(usize, T)>,
}

impl<T> ModelSet<T> {
    fn find(&self, hit: impl Fn(&T) -> bool) -> Option<(usize, &T)> {
        self.entries
            .iter()
            .find(|(_, t)| hit(t))
            .map(|(w, t)| (*w, t))
    }
    fn touch(&mut self, hit: impl Fn(&T) -> bool, value: T) {
        let way = if let Some(pos) = self.entries.iter().position(|(_, t)| hit(t)) {
            self.entries.remove(pos).0
        } else if self.entries.len() < 2 {
            self.entries.len()
        } else {
            self.entries.remove(0).0
        };
        self.entries.push((way, value));
    }
}

struct Model {
    xsets: Vec<ModelSet<(u64, Vec<u8>)>>,
    dsets: Vec<ModelSet<(u32, Vec<u8>)>>,
}

impl Model {
    fn new(sizes: CacheSizes) -> Self {
        let x = (sizes.xbzrle_bytes / 4096 / 2).max(1) as usize;
        let d = (sizes.dedup_bytes / 256 / 2).max(1) as usize;
        Model {
            xsets: vec![ModelSet::default(); x],
            dsets: vec![ModelSet::default(); d],
        }
    }
}

fn arr(c: &[u8]) -> &[u8; CHUNK] {
    c.try_into().unwrap()
}

/// Chunked page: 16 u16 headers + payloads; None when not below 4096 bytes.
fn chunked(parts: Vec<(u16, Vec<u8>)>) -> Option<Vec<u8>> {
    let mut out: Vec<u8> = parts.iter().flat_map(|(h, _)| h.to_le_bytes()).collect();
    for (_, p) in parts {
        out.extend(p);
    }
    (out.len() < PAGE).then_some(out)
}

fn zrle_part(r: Option<usize>, buf: &[u8; CHUNK], chunk: &[u8]) -> (u16, Vec<u8>) {
    match r {
        Some(n) => (n as u16, buf[..n].to_vec()),
        None => (HDR_OVERFLOW, chunk.to_vec()),
    }
}

fn rle_page(page: &[u8]) -> Option<Vec<u8>> {
    chunked(
        page.chunks(CHUNK)
            .map(|c| {
                let mut buf = [0u8; CHUNK];
                zrle_part(rle::encode_chunk(arr(c), &mut buf), &buf, c)
            })
            .collect(),
    )
}

fn reference_encode(model: &mut Model, method: Method, pages: &[u64], data: &[u8]) -> EncodedBatch {
    let mut out = EncodedBatch::default();
    let push = |out: &mut EncodedBatch, page: &[u8], coded: Option<(PageCodec, Vec<u8>)>| {
        let (codec, bytes) = if page.iter().all(|&b| b == 0) {
            (PageCodec::Zero, vec![])
        } else {
            coded.unwrap_or((PageCodec::Raw, page.to_vec()))
        };
        out.codecs.push(codec);
        out.lens.push(bytes.len() as u32);
        out.payload.extend(bytes);
    };
    let xsets = model.xsets.len() as u64;
    let dsets = model.dsets.len() as u32;
    for (&index, page) in pages.iter().zip(data.chunks(PAGE)) {
        let coded = match method {
            Method::None => None,
            Method::Rle => rle_page(page).map(|p| (PageCodec::Rle, p)),
            Method::Xbzrle => {
                let set = &model.xsets[(index % xsets) as usize];
                match set.find(|(tag, _)| *tag == index) {
                    Some((_, (_, old))) => chunked(
                        page.chunks(CHUNK)
                            .zip(old.chunks(CHUNK))
                            .map(|(c, o)| {
                                let mut buf = [0u8; CHUNK];
                                zrle_part(xbzrle::encode_chunk(arr(c), arr(o), &mut buf), &buf, c)
                            })
                            .collect(),
                    )
                    .map(|p| (PageCodec::Xbzrle, p)),
                    None => rle_page(page).map(|p| (PageCodec::Rle, p)),
                }
            }
            Method::Dedup => chunked(
                page.chunks(CHUNK)
                    .map(|c| {
                        let h = superfasthash::hash(c);
                        let set = (h % dsets) as usize;
                        match model.dsets[set].find(|(hh, cc)| *hh == h && cc == c) {
                            Some((way, _)) => (
                                HDR_DEDUP_REF,
                                ((set * 2 + way) as u32).to_le_bytes().to_vec(),
                            ),
                            None => (HDR_OVERFLOW, c.to_vec()),
                        }
                    })
                    .collect(),
            )
            .map(|p| (PageCodec::Dedup, p)),
            // Compressed pages are checked by round trip only.
            Method::Lz4 | Method::Zstd(_) => None,
        };
        push(&mut out, page, coded);
    }
    for ((&index, page), &codec) in pages.iter().zip(data.chunks(PAGE)).zip(&out.codecs) {
        match method {
            Method::Xbzrle => {
                let set = (index % xsets) as usize;
                model.xsets[set].touch(|(tag, _)| *tag == index, (index, page.to_vec()));
            }
            Method::Dedup if codec != PageCodec::Zero => {
                for c in page.chunks(CHUNK) {
                    let h = superfasthash::hash(c);
                    model.dsets[(h % dsets) as usize]
                        .touch(|(hh, cc)| *hh == h && cc == c, (h, c.to_vec()));
                }
            }
            _ => {}
        }
    }
    out
}

fn method_strategy() -> impl Strategy<Value = Method> {
    prop_oneof![
        Just(Method::None),
        Just(Method::Rle),
        Just(Method::Xbzrle),
        Just(Method::Dedup),
        Just(Method::Lz4),
        Just(Method::Zstd(1)),
        Just(Method::Zstd(3)),
        Just(Method::Zstd(9)),
    ]
}

fn sizes_strategy() -> impl Strategy<Value = CacheSizes> {
    (
        prop_oneof![Just(0u64), Just(4 * 4096), Just(1 << 20)],
        prop_oneof![Just(512u64), Just(4096), Just(1 << 20)],
    )
        .prop_map(|(xbzrle_bytes, dedup_bytes)| CacheSizes {
            xbzrle_bytes,
            dedup_bytes,
        })
}

/// Batches of (page index, kind, seed); indices overlap across and within batches.
type Batches = Vec<Vec<(u64, usize, u64)>>;

fn batches_strategy() -> impl Strategy<Value = Batches> {
    prop::collection::vec(
        prop::collection::vec((0u64..24, 0..KINDS.len(), any::<u64>()), 1..20),
        1..6,
    )
}

/// Runs the batches through encoder, reference and decoder.
fn check(methods: &[Method], sizes: CacheSizes, batches: &Batches) -> Result<(), TestCaseError> {
    let mut enc = StreamEncoder::new(sizes);
    let mut dec = StreamDecoder::new(sizes);
    let mut model = Model::new(sizes);
    let mut last: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut out = EncodedBatch::default();
    for (n, batch) in batches.iter().enumerate() {
        let method = methods[n % methods.len()];
        let pages: Vec<u64> = batch.iter().map(|b| b.0).collect();
        let mut data = Vec::new();
        for &(index, kind, seed) in batch {
            let page = make_page(KINDS[kind], seed, last.get(&index).map(|v| v.as_slice()));
            last.insert(index, page.clone());
            data.extend(page);
        }
        enc.encode(method, &pages, &data, &mut out).unwrap();
        let expected = reference_encode(&mut model, method, &pages, &data);
        for (i, (page, &codec)) in data.chunks(PAGE).zip(&out.codecs).enumerate() {
            let zero = is_zero_page(page.try_into().unwrap());
            prop_assert_eq!(zero, codec == PageCodec::Zero);
            prop_assert!(out.lens[i] as usize <= PAGE);
            prop_assert_eq!(codec == PageCodec::Raw, out.lens[i] as usize == PAGE);
        }
        prop_assert!(out.codecs.iter().all(|&c| method.allows(c)));
        if !matches!(method, Method::Lz4 | Method::Zstd(_)) {
            prop_assert_eq!(&out.codecs, &expected.codecs);
            prop_assert_eq!(&out.lens, &expected.lens);
            prop_assert!(
                out.payload == expected.payload,
                "payload differs from the reference"
            );
        }
        let mut decoded = vec![0xeeu8; data.len()];
        dec.decode_batch(method, &pages, &out, &mut decoded)
            .unwrap();
        prop_assert!(
            decoded == data,
            "batch {} ({}) does not round-trip",
            n,
            method
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn one_method_per_stream(method in method_strategy(), sizes in sizes_strategy(), batches in batches_strategy()) {
        check(&[method], sizes, &batches)?;
    }

    /// A policy may switch methods between batches; each cache only sees its own method's batches.
    #[test]
    fn methods_switching(methods in prop::collection::vec(method_strategy(), 1..4), sizes in sizes_strategy(), batches in batches_strategy()) {
        check(&methods, sizes, &batches)?;
    }
}

#[test]
fn hits_happen_in_the_generated_sequences() {
    // Guard against a generator that never exercises the caches.
    let sizes = CacheSizes {
        xbzrle_bytes: 1 << 20,
        dedup_bytes: 1 << 20,
    };
    let mut enc = StreamEncoder::new(sizes);
    let mut out = EncodedBatch::default();
    let mut last: HashMap<u64, Vec<u8>> = HashMap::new();
    let (mut xhits, mut dhits) = (0, 0);
    for round in 0..4u64 {
        for method in [Method::Xbzrle, Method::Dedup] {
            let pages: Vec<u64> = (0..16).collect();
            let mut data = Vec::new();
            for &p in &pages {
                let kind = KINDS[((p + round) % KINDS.len() as u64) as usize];
                let page = make_page(kind, p * 31 + round, last.get(&p).map(|v| v.as_slice()));
                last.insert(p, page.clone());
                data.extend(page);
            }
            enc.encode(method, &pages, &data, &mut out).unwrap();
            xhits += out
                .codecs
                .iter()
                .filter(|&&c| c == PageCodec::Xbzrle)
                .count();
            dhits += out
                .codecs
                .iter()
                .filter(|&&c| c == PageCodec::Dedup)
                .count();
        }
    }
    assert!(
        xhits > 0 && dhits > 0,
        "xbzrle hits {xhits}, dedup pages {dhits}"
    );
}
