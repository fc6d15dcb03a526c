//! What the encoder needs from a GPU: zeroed buffers, copies, kernel
//! launches in order on one stream, and a wait.

use crate::GpuError;

/// The kernels of `kernels.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Which chunks are zero (method none).
    ZeroChunks,
    /// xbzrle cache lookup, one thread per page.
    XbzLookup,
    /// GM-RLE or XBZRLE, one thread per chunk.
    RleChunks,
    /// dedup hash and lookup, one thread per chunk.
    DedupChunks,
    /// Page codec and size, one thread per page.
    PageSizes,
    /// Prefix sum of the page sizes.
    ScanOffsets,
    /// Batch payload, one thread per chunk.
    Pack,
    /// xbzrle cache update, one thread per set.
    XbzTouch,
    /// dedup cache update, one thread per set.
    DedupTouch,
}

impl Kernel {
    /// Every kernel.
    pub const ALL: [Kernel; 9] = [
        Kernel::ZeroChunks,
        Kernel::XbzLookup,
        Kernel::RleChunks,
        Kernel::DedupChunks,
        Kernel::PageSizes,
        Kernel::ScanOffsets,
        Kernel::Pack,
        Kernel::XbzTouch,
        Kernel::DedupTouch,
    ];

    /// The kernel's name in `kernels.cu`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::ZeroChunks => "zero_chunks",
            Kernel::XbzLookup => "xbz_lookup",
            Kernel::RleChunks => "rle_chunks",
            Kernel::DedupChunks => "dedup_chunks",
            Kernel::PageSizes => "page_sizes",
            Kernel::ScanOffsets => "scan_offsets",
            Kernel::Pack => "pack",
            Kernel::XbzTouch => "xbz_touch",
            Kernel::DedupTouch => "dedup_touch",
        }
    }
}

/// One kernel argument, in the kernel's parameter order.
pub enum Arg<'a, B> {
    /// A device buffer (the kernel sees a pointer to its start).
    Buf(&'a B),
    /// A 32-bit integer.
    U32(u32),
    /// A 64-bit integer.
    U64(u64),
}

/// A GPU with one in-order stream.
pub trait Device {
    /// A device buffer.
    type Buf;
    /// A zeroed buffer of `bytes` bytes (at least 1), 8-byte aligned.
    fn alloc(&self, bytes: usize) -> Result<Self::Buf, GpuError>;
    /// Queues a copy of `src` to the start of `dst`; `src` may be reused at once.
    fn upload(&self, src: &[u8], dst: &mut Self::Buf) -> Result<(), GpuError>;
    /// As `upload`, for a batch's pages (at most a full batch): the CUDA
    /// device stages them in pinned memory, so the copy is a plain DMA.
    fn upload_pages(&self, src: &[u8], dst: &mut Self::Buf) -> Result<(), GpuError> {
        self.upload(src, dst)
    }
    /// Queues `kernel` with `threads` threads (each checks its index).
    fn launch(
        &self,
        kernel: Kernel,
        threads: u32,
        args: &[Arg<'_, Self::Buf>],
    ) -> Result<(), GpuError>;
    /// Waits for everything queued, then copies the first `dst.len()` bytes
    /// of `src` into `dst`.
    fn fetch(&self, src: &Self::Buf, dst: &mut [u8]) -> Result<(), GpuError>;
}
