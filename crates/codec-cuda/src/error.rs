//! Why the GPU backend cannot run, or failed.

use ferry_codec::CodecError;

/// Errors of the GPU codec backend.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// libcuda (the driver) could not be loaded: no NVIDIA driver here.
    #[error("no CUDA driver (libcuda) on this machine")]
    NoDriver,
    /// libnvrtc could not be loaded: the kernels cannot be compiled.
    #[error("no NVRTC (libnvrtc) on this machine; it compiles the codec kernels")]
    NoNvrtc,
    /// The driver loaded but reports no GPU.
    #[error("the CUDA driver reports no GPU")]
    NoDevice,
    /// A CUDA driver call failed.
    #[error("CUDA {what}: {detail}")]
    Driver {
        /// What was being done.
        what: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// NVRTC refused the kernel source.
    #[error("NVRTC could not compile the codec kernels: {0}")]
    Compile(String),
    /// The batch or the cache sizes are invalid (as the CPU codecs would say).
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The GPU's results do not describe a valid batch (a kernel bug).
    #[error("the GPU returned an inconsistent batch: {0}")]
    Inconsistent(String),
    /// The method is not one the GPU runs (lz4 and zstd stay on the CPU).
    #[error("{0} does not run on the GPU")]
    NotOnGpu(ferry_codec::Method),
}
