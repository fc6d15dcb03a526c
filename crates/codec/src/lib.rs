//! Page codecs for ferry's migration traffic.
//!
//! Pages travel in batches of up to [`MAX_BATCH_PAGES`] pages. A [`StreamEncoder`]
//! codes a batch with one [`Method`] into an [`EncodedBatch`] (one [`PageCodec`] and
//! one payload length per page, payloads concatenated); a [`StreamDecoder`] on the
//! other end mirrors it, including the xbzrle and dedup caches.
//!
//! The chunked formats (rle, xbzrle, dedup) code each 256-byte chunk independently
//! so that a GPU backend can give one thread per chunk and produce the same bytes;
//! `docs/codecs.md` is the byte-level contract, and the pure per-chunk functions
//! ([`rle`], [`zrle`], [`xbzrle`], [`dedup`], [`superfasthash`]) are public so
//! such a backend can be tested against them.

mod chunked;
pub mod dedup;
mod error;
mod method;
mod page;
mod parse;
mod prefetch;
pub mod rle;
mod sets;
mod sizes;
mod stream;
pub mod superfasthash;
pub mod xbzrle;
pub mod zrle;

pub use chunked::{CHUNK_HEADERS, HDR_DEDUP_REF, HDR_LEN_MASK, HDR_OVERFLOW};
pub use error::{ChunkError, CodecError};
pub use method::{CacheSizes, Method, PageCodec, ZSTD_DEFAULT_LEVEL, ZSTD_LEVELS};
pub use page::is_zero_page;
pub use stream::{check_batch, EncodedBatch, StreamDecoder, StreamEncoder};

pub use sizes::{CHUNK, CHUNKS_PER_PAGE, MAX_BATCH_PAGES, PAGE};
