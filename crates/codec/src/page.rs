//! Views of batches as pages and of pages as chunks, without copies or panics.

use crate::sizes::{CHUNK, PAGE};

/// True when every byte of `page` is zero.
///
/// ORs 64-byte blocks without an early exit inside a block, which the compiler
/// vectorises; a non-zero page usually stops within the first block.
pub fn is_zero_page(page: &[u8; PAGE]) -> bool {
    page.chunks_exact(64)
        .all(|block| block.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

/// The pages of a batch buffer (its length is checked by the callers).
pub(crate) fn pages(data: &[u8]) -> impl Iterator<Item = &[u8; PAGE]> {
    // chunks_exact yields exactly PAGE bytes, so the conversion never filters.
    data.chunks_exact(PAGE).filter_map(|p| p.try_into().ok())
}

/// The pages of a batch output buffer.
pub(crate) fn pages_mut(data: &mut [u8]) -> impl Iterator<Item = &mut [u8; PAGE]> {
    data.chunks_exact_mut(PAGE)
        .filter_map(|p| p.try_into().ok())
}

/// The chunks of a page.
pub(crate) fn chunks(page: &[u8; PAGE]) -> impl Iterator<Item = &[u8; CHUNK]> {
    page.chunks_exact(CHUNK).filter_map(|c| c.try_into().ok())
}

/// The chunks of a page being written.
pub(crate) fn chunks_mut(page: &mut [u8; PAGE]) -> impl Iterator<Item = &mut [u8; CHUNK]> {
    page.chunks_exact_mut(CHUNK)
        .filter_map(|c| c.try_into().ok())
}

/// Stand-in for an impossible out-of-range chunk, so lookups need no panic path.
static ZERO_CHUNK: [u8; CHUNK] = [0; CHUNK];

/// Chunk `i` (0..16) of a page.
pub(crate) fn chunk_at(page: &[u8; PAGE], i: usize) -> &[u8; CHUNK] {
    page.get(i * CHUNK..(i + 1) * CHUNK)
        .and_then(|c| c.try_into().ok())
        .unwrap_or(&ZERO_CHUNK)
}
