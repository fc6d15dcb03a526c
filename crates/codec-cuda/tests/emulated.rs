//! The GPU encoder, run on a host build of the same kernel source, against
//! ferry-codec's CPU encoder: byte-identical batches, batch after batch,
//! with the caches evolving (so their GPU state must match the CPU's too).

mod common;

use common::{batch, emu, page, pooled, resends, Rng};
use ferry_codec::{CacheSizes, EncodedBatch, Method, PageCodec, PAGE};
use ferry_codec_cuda::{GpuEncoder, GpuError};

/// The comparison on the host build of the kernels (skipped, saying why,
/// without a C++ compiler).
fn same_as_cpu(sizes: CacheSizes, batches: &[(Method, Vec<u64>, Vec<u8>)]) {
    if let Some(dev) = emu() {
        common::same_as_cpu(dev, sizes, batches);
    }
}

#[test]
fn none_and_rle_match_the_cpu() {
    let mut rng = Rng(0x5eed);
    let mut batches = Vec::new();
    for n in [1, 2, 17, 128, 1024] {
        for method in [Method::None, Method::Rle] {
            let (p, d) = batch(&mut rng, n, 1 << 20);
            batches.push((method, p, d));
        }
    }
    same_as_cpu(CacheSizes::default(), &batches);
}

#[test]
fn xbzrle_matches_the_cpu_with_evictions_and_repeats() {
    let mut rng = Rng(42);
    let small = CacheSizes {
        xbzrle_bytes: 16 * PAGE as u64, // 8 sets of 2
        ..CacheSizes::default()
    };
    same_as_cpu(small, &resends(&mut rng, 12, 64, 40));
    let tiny = CacheSizes {
        xbzrle_bytes: 100, // still one set of two ways
        ..CacheSizes::default()
    };
    same_as_cpu(tiny, &resends(&mut rng, 6, 9, 5));
    same_as_cpu(CacheSizes::default(), &resends(&mut rng, 4, 1024, 3000));
}

#[test]
fn dedup_matches_the_cpu_with_evictions() {
    let mut rng = Rng(7);
    same_as_cpu(CacheSizes::default(), &pooled(&mut rng, 6, 256, 64));
    let small = CacheSizes {
        dedup_bytes: 16 * 256, // 8 sets of 2
        ..CacheSizes::default()
    };
    same_as_cpu(small, &pooled(&mut rng, 8, 64, 40));
    same_as_cpu(CacheSizes::default(), &pooled(&mut rng, 2, 1024, 500));
}

#[test]
fn switching_methods_keeps_each_cache_to_its_own() {
    let mut rng = Rng(99);
    let small = CacheSizes {
        xbzrle_bytes: 32 * PAGE as u64,
        dedup_bytes: 64 * 256,
    };
    let mut batches = resends(&mut rng, 8, 32, 24);
    for (i, b) in pooled(&mut rng, 8, 32, 30).into_iter().enumerate() {
        batches.insert(2 * i + 1, b);
    }
    for (i, b) in batches.iter_mut().enumerate() {
        if i % 5 == 4 {
            b.0 = Method::Rle;
        }
    }
    same_as_cpu(small, &batches);
}

#[test]
fn the_documented_page_vectors() {
    let Some(dev) = emu() else { return };
    let mut gpu = GpuEncoder::new(dev, CacheSizes::default()).expect("encoder");
    let mut out = EncodedBatch::default();
    // 4096 x 07 coded Rle: sixteen headers 03 00, then sixteen times 07 00 FE.
    gpu.encode(Method::Rle, &[1], &[7u8; PAGE], &mut out)
        .unwrap();
    let mut want: Vec<u8> = [3u8, 0].repeat(16);
    want.extend([7u8, 0, 0xfe].repeat(16));
    assert_eq!((out.codecs[0], out.payload.clone()), (PageCodec::Rle, want));
    // The same page again through xbzrle: a miss (Rle), then a hit, 64 bytes.
    gpu.encode(Method::Xbzrle, &[1], &[7u8; PAGE], &mut out)
        .unwrap();
    assert_eq!(out.codecs[0], PageCodec::Rle);
    gpu.encode(Method::Xbzrle, &[1], &[7u8; PAGE], &mut out)
        .unwrap();
    let mut want: Vec<u8> = [2u8, 0].repeat(16);
    want.extend([0u8, 0xff].repeat(16));
    assert_eq!(
        (out.codecs[0], out.payload.clone()),
        (PageCodec::Xbzrle, want)
    );
    // A zero page is Zero whatever the method; random bytes go Raw.
    let mut rng = Rng(1);
    let noise = page(&mut rng, 1);
    for method in [Method::None, Method::Rle, Method::Xbzrle, Method::Dedup] {
        let data = [vec![0u8; PAGE], noise.clone()].concat();
        gpu.encode(method, &[2, 3], &data, &mut out).unwrap();
        assert_eq!(out.codecs, [PageCodec::Zero, PageCodec::Raw], "{method}");
        assert_eq!(out.lens, [0, PAGE as u32]);
        assert!(out.payload == noise);
    }
    // A page whose 16 chunks all hit in the dedup cache: 96 bytes.
    let chunky: Vec<u8> = (0..PAGE).map(|i| (i % 256) as u8 ^ 0x5a).collect();
    gpu.encode(Method::Dedup, &[4], &chunky, &mut out).unwrap();
    // Its chunks are all alike, but a batch is coded against the cache as it
    // was before the batch: no hit yet, all verbatim, so Raw.
    assert_eq!(out.codecs[0], PageCodec::Raw);
    gpu.encode(Method::Dedup, &[4], &chunky, &mut out).unwrap();
    assert_eq!((out.codecs[0], out.lens[0]), (PageCodec::Dedup, 96));
    assert!(out.payload[..32].chunks(2).all(|h| h == [4, 0x40]));
}

#[test]
fn refusals() {
    let Some(dev) = emu() else { return };
    let mut gpu = GpuEncoder::new(dev, CacheSizes::default()).expect("encoder");
    let mut out = EncodedBatch::default();
    assert!(matches!(
        gpu.encode(Method::Lz4, &[1], &[1u8; PAGE], &mut out),
        Err(GpuError::NotOnGpu(Method::Lz4))
    ));
    assert!(matches!(
        gpu.encode(Method::Rle, &[1, 2], &[1u8; PAGE], &mut out),
        Err(GpuError::Codec(_))
    ));
    let too_many = vec![0u64; 1025];
    let data = vec![0u8; 1025 * PAGE];
    assert!(matches!(
        gpu.encode(Method::Rle, &too_many, &data, &mut out),
        Err(GpuError::Codec(_))
    ));
    let huge = CacheSizes {
        dedup_bytes: u64::MAX,
        ..CacheSizes::default()
    };
    let mut gpu = GpuEncoder::new(emu().unwrap(), huge).expect("encoder");
    assert!(matches!(
        gpu.encode(Method::Dedup, &[1], &[1u8; PAGE], &mut out),
        Err(GpuError::Codec(_))
    ));
    gpu.encode(Method::Rle, &[], &[], &mut out).unwrap();
    assert!(out.is_empty());
}
