//! The chunked codecs on the GPU, end to end (pages up, kernels, payload
//! down, cache updates), against ferry-codec's CPU encoder on the same
//! batches: best (constant pages), worst (random) and mixed (zero, text,
//! random, small integers) sets of 1024 pages. xbzrle and dedup alternate two
//! versions of the set, as the CPU codec benchmark does, so every batch is a
//! re-send against the cache.
//!
//! Run on a machine with an NVIDIA GPU: `cargo bench -p ferry-codec-cuda`.
//! Elsewhere it says why and measures nothing.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use ferry_codec::{CacheSizes, EncodedBatch, Method, StreamEncoder, PAGE};
use ferry_codec_cuda::{CudaGpu, GpuEncoder};

const PAGES: usize = 1024;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn data_sets() -> Vec<(&'static str, Vec<u8>)> {
    let mut best = vec![0u8; PAGES * PAGE];
    for (i, page) in best.chunks_exact_mut(PAGE).enumerate() {
        page.fill((i as u8).wrapping_mul(37) | 1);
    }
    let worst: Vec<u8> = (0..PAGES * PAGE / 8)
        .flat_map(|i| mix(i as u64).to_le_bytes())
        .collect();
    let mut mixed = vec![0u8; PAGES * PAGE];
    for (i, page) in mixed.chunks_exact_mut(PAGE).enumerate() {
        for (j, b) in page.iter_mut().enumerate() {
            let r = mix((i * PAGE + j) as u64);
            *b = match i % 4 {
                0 => 0,
                1 => b"the ferry migrates pages "[j % 25],
                2 => r as u8,
                _ => {
                    if j % 4 == 0 {
                        (r % 16) as u8
                    } else {
                        0
                    }
                }
            };
        }
    }
    vec![("best", best), ("worst", worst), ("mixed", mixed)]
}

/// A few bytes changed in every non-zero page.
fn modified(data: &[u8]) -> Vec<u8> {
    let mut out = data.to_vec();
    for (i, page) in out.chunks_exact_mut(PAGE).enumerate() {
        if page.iter().any(|&b| b != 0) {
            for k in 0..8 {
                let at = (mix((i * 8 + k) as u64) % PAGE as u64) as usize;
                page[at] = page[at].wrapping_add(1);
            }
        }
    }
    out
}

fn main() {
    let gpu = match CudaGpu::open() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("SKIPPED: the CUDA backend cannot run here: {e}");
            return;
        }
    };
    println!("GPU: {}", gpu.name());
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .configure_from_args();
    let pages: Vec<u64> = (0..PAGES as u64).collect();
    for (set, a) in data_sets() {
        let b = modified(&a);
        let mut group = c.benchmark_group(format!("gpu-{set}"));
        group.throughput(Throughput::Bytes(a.len() as u64));
        for (name, method) in [
            ("none", Method::None),
            ("rle", Method::Rle),
            ("xbzrle", Method::Xbzrle),
            ("dedup", Method::Dedup),
        ] {
            let sizes = CacheSizes::default();
            let mut on_gpu =
                GpuEncoder::new(gpu.device().expect("stream"), sizes).expect("encoder");
            let mut on_cpu = StreamEncoder::new(sizes);
            let (mut g, mut k) = (EncodedBatch::default(), EncodedBatch::default());
            let versions: [&[u8]; 2] = [&a, &b];
            for v in versions.iter().cycle().take(4) {
                on_gpu.encode(method, &pages, v, &mut g).expect("gpu");
                on_cpu.encode(method, &pages, v, &mut k).expect("cpu");
                assert!(
                    g.payload == k.payload && g.codecs == k.codecs,
                    "{set}/{name}: GPU and CPU differ"
                );
            }
            println!(
                "ratio {set} {name} {:.3}",
                a.len() as f64 / g.payload.len().max(1) as f64
            );
            let mut turn = 0;
            group.bench_function(BenchmarkId::new("cuda", name), |bench| {
                bench.iter(|| {
                    turn += 1;
                    on_gpu
                        .encode(method, &pages, black_box(versions[turn % 2]), &mut g)
                        .expect("gpu");
                    black_box(g.payload.len())
                })
            });
            let mut turn = 0;
            group.bench_function(BenchmarkId::new("cpu", name), |bench| {
                bench.iter(|| {
                    turn += 1;
                    on_cpu
                        .encode(method, &pages, black_box(versions[turn % 2]), &mut k)
                        .expect("cpu");
                    black_box(k.payload.len())
                })
            });
            if let Some(t) = on_gpu.device().shortest_batch() {
                println!("shortest GPU batch {set} {name}: {t:?} (what sleep-before-sync sleeps)");
            }
        }
        group.finish();
    }
    c.final_summary();
}
