//! ferry's chunked page codecs (zero, rle, xbzrle, dedup) on a CUDA GPU.
//!
//! The kernels (`kernels.cu`) are compiled at run time by NVRTC and run one
//! thread per 256-byte chunk: each writes its chunk header and payload into a
//! slot of its own, a per-page pass sums the sizes (falling back to Raw), a
//! prefix sum places the pages, and a pack pass writes the batch payload. The
//! xbzrle and dedup caches live in GPU memory and are updated after the batch
//! is coded, one thread per cache set, in batch order, so the output and the
//! cache states are byte-identical with ferry-codec's CPU [`StreamEncoder`]
//! (docs/codecs.md).
//!
//! The orchestration ([`GpuEncoder`]) is generic over a [`Device`]: the CUDA
//! driver ([`CudaDevice`]) in ferry, and a host build of the same kernel
//! source in the tests, which is how the byte-for-byte equality is checked on
//! machines without a GPU.
//!
//! [`StreamEncoder`]: ferry_codec::StreamEncoder

mod cuda;
mod device;
mod encoder;
mod error;
mod nvrtc;

pub use cuda::{CudaDevice, CudaGpu};
pub use device::{Arg, Device, Kernel};
pub use encoder::GpuEncoder;
pub use error::GpuError;

/// The kernel source, compiled by NVRTC at run time (and by the host
/// emulation tests as C++).
pub const KERNELS_CU: &str = include_str!("kernels.cu");
