//! Encode/decode throughput and compression ratio of every method on
//! synthetic page sets (best, worst, mixed) and, when FERRY_GUEST_PAGES names a
//! raw page dump, on real guest pages.
//!
//! Quick run: `cargo bench -p ferry-codec -- --warm-up-time 1 --measurement-time 2`.
//! Each data set is a batch of 1024 pages. Stateless methods encode that batch
//! again and again. xbzrle and dedup measure the steady state of a page set
//! that is re-sent with a few bytes changed per non-zero page: the batch
//! alternates between version A and version B, so every encode is a re-send
//! against the cached other version (with an empty cache xbzrle would be rle
//! and dedup would be none). The ratio lines (`ratio <set> <method> <x>`) feed
//! bench/results/codecs.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use ferry_codec::{CacheSizes, EncodedBatch, Method, StreamDecoder, StreamEncoder, PAGE};

const PAGES: usize = 1024;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn random_page(rng: &mut Rng, page: &mut [u8]) {
    for w in page.chunks_exact_mut(8) {
        w.copy_from_slice(&rng.next().to_le_bytes());
    }
}

fn text_page(rng: &mut Rng, page: &mut [u8]) {
    const WORDS: [&str; 16] = [
        "the ",
        "virtual ",
        "machine ",
        "migrates ",
        "while ",
        "its ",
        "pages ",
        "are ",
        "dirtied; ",
        "ferry ",
        "copies ",
        "memory ",
        "to ",
        "a ",
        "remote ",
        "host.\n",
    ];
    let mut at = 0;
    while at < page.len() {
        let w = WORDS[(rng.next() % 16) as usize].as_bytes();
        let n = w.len().min(page.len() - at);
        page[at..at + n].copy_from_slice(&w[..n]);
        at += n;
    }
}

fn small_int_page(rng: &mut Rng, page: &mut [u8]) {
    for w in page.chunks_exact_mut(4) {
        w.copy_from_slice(&((rng.next() % 4096) as u32).to_le_bytes());
    }
}

/// The synthetic data sets, 1024 pages each.
fn data_sets() -> Vec<(&'static str, Vec<u8>)> {
    let mut rng = Rng(0x00c0_ffee);
    let mut best = vec![0u8; PAGES * PAGE];
    for (i, page) in best.chunks_exact_mut(PAGE).enumerate() {
        page.fill((i as u8).wrapping_mul(37) | 1);
    }
    let mut worst = vec![0u8; PAGES * PAGE];
    random_page(&mut rng, &mut worst);
    let mut mixed = vec![0u8; PAGES * PAGE];
    for (i, page) in mixed.chunks_exact_mut(PAGE).enumerate() {
        match i % 4 {
            0 => {}
            1 => text_page(&mut rng, page),
            2 => random_page(&mut rng, page),
            _ => small_int_page(&mut rng, page),
        }
    }
    vec![("best", best), ("worst", worst), ("mixed", mixed)]
}

/// Up to 1024 pages of a raw page dump named by FERRY_GUEST_PAGES.
fn guest_pages() -> Option<Vec<u8>> {
    let Some(path) = std::env::var_os("FERRY_GUEST_PAGES") else {
        println!("note: FERRY_GUEST_PAGES is not set; skipping the real-guest data set");
        return None;
    };
    match std::fs::read(&path) {
        Ok(mut data) => {
            let pages = (data.len() / PAGE).min(PAGES);
            data.truncate(pages * PAGE);
            if pages == 0 {
                println!("note: {path:?} holds no whole page; skipping the guest data set");
                return None;
            }
            Some(data)
        }
        Err(e) => {
            println!("note: cannot read {path:?} ({e}); skipping the guest data set");
            None
        }
    }
}

/// Version B of a data set: a few bytes changed in every non-zero page.
fn modified(data: &[u8]) -> Vec<u8> {
    let mut rng = Rng(7);
    let mut out = data.to_vec();
    for page in out.chunks_exact_mut(PAGE) {
        if page.iter().all(|&b| b == 0) {
            continue;
        }
        for _ in 0..8 {
            let at = (rng.next() % PAGE as u64) as usize;
            page[at] = page[at].wrapping_add(1 + (rng.next() % 255) as u8);
        }
    }
    out
}

const METHODS: [(&str, Method); 7] = [
    ("none", Method::None),
    ("rle", Method::Rle),
    ("xbzrle", Method::Xbzrle),
    ("dedup", Method::Dedup),
    ("lz4", Method::Lz4),
    ("zstd-1", Method::Zstd(1)),
    ("zstd-3", Method::Zstd(3)),
];

fn bench_set(c: &mut Criterion, set: &str, a: &[u8]) {
    let pages: Vec<u64> = (0..(a.len() / PAGE) as u64).collect();
    let b = modified(a);
    let mut group = c.benchmark_group(set);
    group.throughput(Throughput::Bytes(a.len() as u64));
    group.sample_size(20);
    group.warm_up_time(Duration::from_secs(1));
    for (name, method) in METHODS {
        let stateful = matches!(method, Method::Xbzrle | Method::Dedup);
        let sizes = CacheSizes::default();
        let mut enc = StreamEncoder::new(sizes);
        let mut dec = StreamDecoder::new(sizes);
        let mut batch = EncodedBatch::default();
        let mut back = vec![0u8; a.len()];
        // The versions sent in turn, and their encodings in the steady state.
        let versions: Vec<&[u8]> = if stateful { vec![a, &b] } else { vec![a] };
        if stateful {
            // Four rounds bring both caches to a state that repeats every two batches.
            for v in [a, &b, a, &b] {
                enc.encode(method, &pages, v, &mut batch).unwrap();
                dec.decode_batch(method, &pages, &batch, &mut back).unwrap();
                assert!(back == v);
            }
        }
        let mut encoded = Vec::new();
        for v in &versions {
            enc.encode(method, &pages, v, &mut batch).unwrap();
            encoded.push(batch.clone());
        }
        if stateful {
            // The decoder decodes the same alternation; check it once.
            for (v, e) in versions.iter().zip(&encoded) {
                dec.decode_batch(method, &pages, e, &mut back).unwrap();
                assert!(back == *v, "{set}/{name} does not round-trip");
            }
        } else {
            dec.decode_batch(method, &pages, &encoded[0], &mut back)
                .unwrap();
            assert!(back == a, "{set}/{name} does not round-trip");
        }
        let sent: usize = encoded.iter().map(|e| e.payload.len()).sum();
        let ratio = (versions.len() * a.len()) as f64 / sent as f64;
        println!("ratio {set} {name} {ratio:.3}");

        let mut turn = 0;
        group.bench_function(BenchmarkId::new("encode", name), |bench| {
            bench.iter(|| {
                let v = versions[turn % versions.len()];
                turn += 1;
                enc.encode(method, &pages, black_box(v), &mut batch)
                    .unwrap();
                black_box(batch.payload.len())
            })
        });
        let mut turn = 0;
        group.bench_function(BenchmarkId::new("decode", name), |bench| {
            bench.iter(|| {
                let e = &encoded[turn % encoded.len()];
                turn += 1;
                dec.decode_batch(method, &pages, black_box(e), &mut back)
                    .unwrap();
                black_box(back[0])
            })
        });
    }
    group.finish();
}

fn codecs(c: &mut Criterion) {
    for (set, data) in data_sets() {
        bench_set(c, set, &data);
    }
    if let Some(data) = guest_pages() {
        bench_set(c, "guest", &data);
    }
}

// criterion_group! defines an undocumented pub function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::codecs);
}
use group::benches;
criterion_main!(benches);
