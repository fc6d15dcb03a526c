//! The frame checksum's costs: a page's CRC-32C, and combining a frame head's
//! CRC with its data's (the batch path checksums data while copying it and
//! combines at write: once per frame, so once per postcopy demand answer).
//! `cargo bench -p ferry-migration --bench checksum`

use std::hint::black_box;

use criterion::{criterion_main, Criterion, Throughput};
use ferry_migration::fuzzing::{combine, crc32c};

fn checksum(c: &mut Criterion) {
    let page: Vec<u8> = (0u32..4096)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let mut g = c.benchmark_group("checksum");
    g.throughput(Throughput::Bytes(4096));
    g.bench_function("crc32c_page", |b| b.iter(|| crc32c(black_box(&page))));
    g.finish();
    let mut g = c.benchmark_group("combine");
    for pages in [1usize, 17, 128, 1024] {
        g.bench_function(format!("{pages}_pages"), |b| {
            b.iter(|| combine(black_box(0x1234_5678), black_box(0x9abc_def0), pages * 4096))
        });
    }
    g.finish();
}

// criterion_group! defines an undocumented pub function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::checksum);
}
criterion_main!(group::benches);
