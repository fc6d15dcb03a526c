//! The CUDA backend on a real GPU against the CPU codecs, on the same
//! batches as the emulation tests. Without a GPU (driver, NVRTC or device
//! missing) each test says so and passes without checking anything.

mod common;

use std::sync::Arc;

use common::{batch, pooled, resends, same_as_cpu, Rng};
use ferry_codec::{CacheSizes, Method, PAGE};
use ferry_codec_cuda::CudaGpu;

fn gpu() -> Option<Arc<CudaGpu>> {
    match CudaGpu::open() {
        Ok(gpu) => {
            eprintln!("running on {}", gpu.name());
            Some(gpu)
        }
        Err(e) => {
            eprintln!("SKIPPED: the CUDA backend cannot run here: {e}");
            None
        }
    }
}

#[test]
fn cuda_matches_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(0xc0da);
    let mut batches = Vec::new();
    for n in [1, 17, 1024] {
        for method in [Method::None, Method::Rle] {
            let (p, d) = batch(&mut rng, n, 1 << 20);
            batches.push((method, p, d));
        }
    }
    batches.extend(resends(&mut rng, 8, 1024, 3000));
    batches.extend(pooled(&mut rng, 4, 1024, 500));
    let dev = gpu.device().expect("stream");
    same_as_cpu(dev, CacheSizes::default(), &batches);
    let small = CacheSizes {
        xbzrle_bytes: 16 * PAGE as u64,
        dedup_bytes: 16 * 256,
    };
    let mut evicting = resends(&mut rng, 10, 64, 40);
    evicting.extend(pooled(&mut rng, 10, 64, 40));
    same_as_cpu(gpu.device().expect("stream"), small, &evicting);
}
