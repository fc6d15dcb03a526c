//! Errors of the codecs; hostile input always ends here, never in a panic.

use crate::method::{Method, PageCodec};

/// Why one chunk of a chunked page could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// A chunk header with bits or a length this method does not define.
    #[error("bad chunk header {0:#06x}")]
    BadHeader(u16),
    /// A zero-run marker (0x00) is the last byte, its count is missing.
    #[error("zero-run marker without a count")]
    Truncated,
    /// The chunk payload expands to more than 256 bytes.
    #[error("chunk payload expands past 256 bytes")]
    Overrun,
    /// The chunk payload expands to fewer than 256 bytes.
    #[error("chunk payload expands to {0} bytes, not 256")]
    Short(usize),
}

/// Errors of [`crate::StreamEncoder`], [`crate::StreamDecoder`] and the id parsers.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// A batch of more than [`crate::sizes::MAX_BATCH_PAGES`] pages.
    #[error("batch of {0} pages, at most {max} allowed", max = crate::sizes::MAX_BATCH_PAGES)]
    BatchTooLarge(usize),
    /// The page data is not pages.len() * 4096 bytes.
    #[error("batch data is {actual} bytes, expected {expected}")]
    DataLength {
        /// pages.len() * 4096.
        expected: usize,
        /// What was given.
        actual: usize,
    },
    /// codecs, lens and pages of a batch differ in length.
    #[error("batch metadata mismatch: {pages} pages, {codecs} codecs, {lens} lengths")]
    MetaLength {
        /// Page indices given.
        pages: usize,
        /// Codecs given.
        codecs: usize,
        /// Lengths given.
        lens: usize,
    },
    /// The page lengths do not add up to the payload length.
    #[error("page lengths add up to {expected} bytes, payload is {actual}")]
    PayloadLength {
        /// Sum of the page lengths.
        expected: u64,
        /// Payload bytes given.
        actual: usize,
    },
    /// A page codec id that does not exist.
    #[error("unknown page codec id {0}")]
    BadCodecId(u8),
    /// A method id that does not exist.
    #[error("unknown method id {0:#04x}")]
    BadMethodId(u8),
    /// A method name that does not parse.
    #[error(
        "unknown method {0:?}: expected none, rle, xbzrle, dedup, lz4, zstd or zstd:LEVEL (1..=19)"
    )]
    BadMethodName(String),
    /// A zstd level outside 1..=19.
    #[error("zstd level {0} outside 1..=19")]
    BadZstdLevel(i32),
    /// A page codec that the batch's method never produces.
    #[error("page {page}: codec {codec:?} cannot occur in a {method} batch")]
    CodecNotAllowed {
        /// Position of the page in the batch.
        page: usize,
        /// Its codec.
        codec: PageCodec,
        /// The batch method.
        method: Method,
    },
    /// A page payload whose length does not fit its codec.
    #[error("page {page}: {codec:?} payload of {len} bytes")]
    PageLength {
        /// Position of the page in the batch.
        page: usize,
        /// Its codec.
        codec: PageCodec,
        /// Its payload length.
        len: u32,
    },
    /// The chunk headers of a chunked page do not add up to its payload length.
    #[error("page {page}: chunk headers describe {expected} bytes, payload is {actual}")]
    ChunkedLength {
        /// Position of the page in the batch.
        page: usize,
        /// 32 + the chunk payload lengths, as far as they could be read.
        expected: usize,
        /// Payload length of the page.
        actual: usize,
    },
    /// A chunk that does not decode.
    #[error("page {page} chunk {chunk}: {source}")]
    Chunk {
        /// Position of the page in the batch.
        page: usize,
        /// Chunk within the page.
        chunk: usize,
        /// What is wrong with it.
        source: ChunkError,
    },
    /// An Xbzrle page whose index is not in the decoder's page cache.
    #[error("page {page}: xbzrle delta for page index {index} which is not cached")]
    XbzrleMiss {
        /// Position of the page in the batch.
        page: usize,
        /// Its page index.
        index: u64,
    },
    /// A dedup reference to a cache slot that is out of range or empty.
    #[error("page {page} chunk {chunk}: dedup reference {index} is out of range or empty")]
    DedupIndex {
        /// Position of the page in the batch.
        page: usize,
        /// Chunk within the page.
        chunk: usize,
        /// The reference.
        index: u32,
    },
    /// An lz4 page that does not decompress to 4096 bytes.
    #[error("page {page}: bad lz4 block: {reason}")]
    Lz4 {
        /// Position of the page in the batch.
        page: usize,
        /// What lz4 said.
        reason: String,
    },
    /// A zstd page that does not decompress to 4096 bytes.
    #[error("page {page}: bad zstd frame: {reason}")]
    Zstd {
        /// Position of the page in the batch.
        page: usize,
        /// What zstd said.
        reason: String,
    },
    /// zstd could not set up a (de)compression context.
    #[error("zstd context: {0}")]
    ZstdContext(#[source] std::io::Error),
    /// A cache size whose geometry cannot be allocated or addressed.
    #[error("{what} cache of {bytes} bytes cannot be allocated")]
    CacheSize {
        /// "xbzrle" or "dedup".
        what: &'static str,
        /// The size asked for.
        bytes: u64,
    },
}
