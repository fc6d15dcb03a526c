//! Which backend runs the migration codecs: the CPU, or CUDA where a GPU is
//! found (the CPU otherwise, saying why).

use std::sync::Arc;

use ferry_codec::{CacheSizes, EncodedBatch, Method, StreamEncoder};
use ferry_codec_cuda::{CudaDevice, CudaGpu, GpuEncoder};
use ferry_migration::{Backend, BatchEncoder, VmOpError};

/// The CUDA backend when GPU 0 opens and the kernels compile; otherwise the
/// CPU one, with a note saying what is missing.
pub fn cuda() -> Backend {
    match CudaGpu::open() {
        Ok(gpu) => Backend {
            name: "cuda".into(),
            note: Some(format!(
                "{}: none/rle/xbzrle/dedup on the GPU, lz4/zstd on the CPU",
                gpu.name()
            )),
            make: Arc::new(move |sizes| Box::new(CudaBatchEncoder::new(gpu.clone(), sizes))),
        },
        Err(e) => Backend {
            note: Some(format!(
                "the CUDA backend cannot run: {e}; the CPU codecs ran"
            )),
            ..Backend::cpu()
        },
    }
}

/// One shard's encoder: the chunked codecs on its own GPU stream (opened on
/// first use), lz4 and zstd on the CPU.
struct CudaBatchEncoder {
    gpu: Arc<CudaGpu>,
    sizes: CacheSizes,
    on_gpu: Option<GpuEncoder<CudaDevice>>,
    on_cpu: StreamEncoder,
}

impl CudaBatchEncoder {
    fn new(gpu: Arc<CudaGpu>, sizes: CacheSizes) -> Self {
        CudaBatchEncoder {
            gpu,
            sizes,
            on_gpu: None,
            on_cpu: StreamEncoder::new(sizes),
        }
    }
}

impl BatchEncoder for CudaBatchEncoder {
    fn encode(
        &mut self,
        method: Method,
        pages: &[u64],
        data: &[u8],
        out: &mut EncodedBatch,
    ) -> Result<(), VmOpError> {
        if matches!(method, Method::Lz4 | Method::Zstd(_)) {
            return Ok(self.on_cpu.encode(method, pages, data, out)?);
        }
        let gpu = match &mut self.on_gpu {
            Some(gpu) => gpu,
            None => {
                let dev = self.gpu.device()?;
                self.on_gpu.insert(GpuEncoder::new(dev, self.sizes)?)
            }
        };
        gpu.encode(method, pages, data, out)
            .map_err(|e| format!("GPU encoder: {e}").into())
    }
}
