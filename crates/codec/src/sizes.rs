//! The units every codec works in: pages, their 256-byte chunks, batches.

/// Bytes in a guest page.
pub const PAGE: usize = 4096;
/// Bytes in a chunk of the chunked formats (rle, xbzrle, dedup).
pub const CHUNK: usize = 256;
/// Chunks in a page.
pub const CHUNKS_PER_PAGE: usize = PAGE / CHUNK;
/// Most pages in one batch; larger batches are refused by encoder and decoder.
pub const MAX_BATCH_PAGES: usize = 1024;
