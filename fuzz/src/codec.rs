//! The codec check every codec target runs. Two decoders start alike
//! (primed with honest batches, which must round-trip); a hostile batch
//! then goes to the first. Refused, it must leave that decoder exactly as
//! it was: a last honest batch decodes to its pages in both. Accepted, the
//! second decoder takes it too and must decode it the same (the two stay
//! alike, whatever the batch did to their caches), and what it decoded to
//! must survive an honest encoder and decoder.

use ferry_codec::{CacheSizes, EncodedBatch, Method, PageCodec, StreamDecoder, StreamEncoder};

use crate::Input;

/// Small caches, so that sets fill, collide and evict within one input.
pub const CACHES: CacheSizes = CacheSizes {
    xbzrle_bytes: 16 * 4096,
    dedup_bytes: 64 * 256,
};

/// Page indices a target draws from (a few, so the caches hit).
fn index(input: &mut Input) -> u64 {
    u64::from(input.u8() % 24)
}

/// An honest batch of up to `max` pages drawn from `input`: indices, data.
pub fn honest_batch(input: &mut Input, max: usize) -> (Vec<u64>, Vec<u8>) {
    let n = usize::from(input.u8()) % (max + 1);
    let mut pages = Vec::with_capacity(n);
    let mut data = Vec::with_capacity(n * 4096);
    for _ in 0..n {
        pages.push(index(input));
        data.extend(input.page());
    }
    (pages, data)
}

/// Encodes and decodes an honest batch on `enc` and every decoder; each
/// must give the data back.
pub fn honest_round(
    method: Method,
    enc: &mut StreamEncoder,
    decs: &mut [&mut StreamDecoder],
    pages: &[u64],
    data: &[u8],
) {
    let mut batch = EncodedBatch::default();
    enc.encode(method, pages, data, &mut batch)
        .expect("an honest batch encodes");
    for d in decs.iter_mut() {
        let mut out = vec![0u8; data.len()];
        d.decode_batch(method, pages, &batch, &mut out)
            .expect("an honest batch decodes");
        assert!(out == data, "an honest batch decoded to other bytes");
    }
}

/// The codec a hostile page claims: mostly one its method may carry, at
/// times any byte (which the frame parser would refuse, but the decoder
/// must refuse too).
fn hostile_codec(method: Method, b: u8) -> Option<PageCodec> {
    const ALL: [PageCodec; 7] = [
        PageCodec::Raw,
        PageCodec::Zero,
        PageCodec::Rle,
        PageCodec::Xbzrle,
        PageCodec::Dedup,
        PageCodec::Lz4,
        PageCodec::Zstd,
    ];
    if b >= 0xf0 {
        return PageCodec::try_from(b - 0xf0).ok();
    }
    let allowed: Vec<PageCodec> = ALL.into_iter().filter(|c| method.allows(*c)).collect();
    Some(allowed[usize::from(b) % allowed.len()])
}

/// Decodes `batch` with `d`; the pages, or None when refused.
fn decode_into(
    d: &mut StreamDecoder,
    method: Method,
    pages: &[u64],
    batch: &EncodedBatch,
) -> Option<Vec<u8>> {
    let mut out = vec![0u8; pages.len() * 4096];
    d.decode_batch(method, pages, batch, &mut out)
        .ok()
        .map(|()| out)
}

/// The lockstep check for `method` on one input.
pub fn lockstep(method: Method, bytes: &[u8]) {
    let mut input = Input::new(bytes);
    let mut enc = StreamEncoder::new(CACHES);
    let mut d1 = StreamDecoder::new(CACHES);
    let mut d2 = StreamDecoder::new(CACHES);
    // Prime: a few honest batches, so the caches hold something.
    for _ in 0..(input.u8() % 4) {
        let (pages, data) = honest_batch(&mut input, 4);
        honest_round(method, &mut enc, &mut [&mut d1, &mut d2], &pages, &data);
    }
    // The hostile batch: pages, then per page a codec and a payload.
    let n = usize::from(input.u8() % 9);
    let mut pages = Vec::new();
    let mut hostile = EncodedBatch::default();
    for _ in 0..n {
        pages.push(index(&mut input));
        let Some(c) = hostile_codec(method, input.u8()) else {
            return;
        };
        hostile.codecs.push(c);
        let p = input.chunk();
        hostile.lens.push(p.len() as u32);
        hostile.payload.extend_from_slice(p);
    }
    let accepted = match decode_into(&mut d1, method, &pages, &hostile) {
        Some(out) => {
            // Deterministic: a second decoder in the same state takes it
            // the same way (the two stay alike).
            let again = decode_into(&mut d2, method, &pages, &hostile);
            assert!(
                again.as_ref() == Some(&out),
                "the same batch decoded two ways"
            );
            // What it decoded to is pages like any other: an honest
            // encoder and decoder carry them unchanged.
            let mut e = StreamEncoder::new(CACHES);
            let mut d = StreamDecoder::new(CACHES);
            honest_round(method, &mut e, &mut [&mut d], &pages, &out);
            true
        }
        None => false,
    };
    // The last honest batch: every page index the caches may hold, so any
    // divergence between d1 and d2 shows.
    let mut pages: Vec<u64> = (0..24).collect();
    pages.truncate(8 + usize::from(input.u8() % 17));
    let mut data = Vec::new();
    for _ in &pages {
        data.extend(input.page());
    }
    let mut batch = EncodedBatch::default();
    enc.encode(method, &pages, &data, &mut batch)
        .expect("an honest batch encodes");
    let r1 = decode_into(&mut d1, method, &pages, &batch);
    let r2 = decode_into(&mut d2, method, &pages, &batch);
    assert!(r1 == r2, "two decoders that took the same batches disagree");
    if !accepted {
        // A refused batch left d1 exactly as it was: still the mirror of
        // the encoder, as d2 is.
        assert!(
            r1.as_deref() == Some(&data[..]),
            "a refused batch changed the decoder"
        );
    }
}
